"""Stray writers in the HOST slab while the server copies blocks: a hit is still exact.

Any process that can map the slab can write into it. The checksums turn such writes into misses
only if every copy of a block is checked where its bytes land: a disk record read into HOST
pages keeps the record's verified checksum (not a hash of the pages taken afterwards), a HOST
block copied to disk is checked on the record's own copy, and a write-through commit checks the
record it writes, not only the pages before. An adversarial run found each of those gaps with
the races below; these tests keep them shut. Real ``tierkv serve`` processes, a scribbler
process writing over the whole slab, then a restart on the same disk: every hit must be exact.
"""

from __future__ import annotations

import hashlib
import subprocess
import time

import grpc
import numpy as np
import pytest
import torch

from tests.support import child_env, helper_command
from tests.support.harness import Sidecar, SidecarFactory, stream_client
from tests.support.service_fixtures import mapped_slab
from tierkv import KVLayout, Namespace, WritePolicy
from tierkv.checksums import checksum
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc
from tierkv.wire.namespaces import namespace_to

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)  # 16 KiB blocks
NAMESPACE = Namespace("stray-model", LAYOUT)
BLOCK_BYTES = LAYOUT.bytes_per_block


def key(i: int) -> bytes:
    return hashlib.sha256(f"stray-{i}".encode()).digest()


def content(i: int) -> torch.Tensor:
    raw = torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(i))
    return raw.view(LAYOUT.torch_dtype).reshape(LAYOUT.block_shape)


def wrong_hits(sidecar: Sidecar, indices: range | list[int]) -> tuple[int, int]:
    """(hits, wrong hits) of blocks ``indices``, each read alone through a stream client."""
    hits = wrong = 0
    with stream_client(sidecar, timeout_s=30) as client:
        for i in indices:
            got = client.get(NAMESPACE, [key(i)])
            if len(got):
                hits += 1
                wrong += not torch.equal(got[0].view(torch.uint8), content(i).view(torch.uint8))
    return hits, wrong


def restarted(sidecar_factory: SidecarFactory, sidecar: Sidecar, flags: tuple[str, ...]
              ) -> Sidecar:
    sidecar.terminate()  # a graceful stop flushes HOST-only blocks to disk: more copies checked
    return sidecar_factory(*flags, disk_path=sidecar.disk_path, socket_dir=sidecar.socket_dir)


@pytest.mark.slow
def test_blocks_copied_between_disk_and_host_under_a_stray_writer_are_exact_or_missed(
    sidecar_factory: SidecarFactory,
) -> None:
    flags = ("--host-bytes", "256KiB", "--page-bytes", "4KiB", "--disk-bytes", "64MiB")
    sidecar = sidecar_factory(*flags)
    num_blocks = 64  # four times HOST: puts demote, gets promote
    with stream_client(sidecar, timeout_s=30) as client:
        for i in range(num_blocks):
            client.put(NAMESPACE, [key(i)], content(i).unsqueeze(0))
        for i in range(num_blocks):
            client.get(NAMESPACE, [key(i)])
        shm_name = client.describe().shm_name
        scribbler = subprocess.Popen(helper_command("slab_scribbler", shm_name), env=child_env())
        try:
            time.sleep(0.5)  # (the scribbler's start)
            for round_ in range(16):
                for i in range(num_blocks):
                    client.get(NAMESPACE, [key(i)])  # disk reads promote into HOST
                if round_ % 4 == 1 and round_ < 12:  # puts demote HOST blocks to disk
                    for i in range(num_blocks, num_blocks + 16):
                        client.put(NAMESPACE, [key(i)], content(i).unsqueeze(0),
                                   write_policy=WritePolicy.WRITE_BACK)
        finally:
            scribbler.kill()
            scribbler.wait()
        time.sleep(1.0)  # the last round's background promotions land (no timing is asserted)
    everything = range(num_blocks + 16)
    assert wrong_hits(sidecar, everything)[1] == 0
    sidecar = restarted(sidecar_factory, sidecar, flags)
    assert wrong_hits(sidecar, everything)[1] == 0


@pytest.mark.slow
def test_a_write_through_commit_whose_pages_change_under_it_writes_no_wrong_record(
    sidecar_factory: SidecarFactory,
) -> None:
    """The writer verified at commit changes its own pages while the commit runs: the disk
    record must be the verified bytes or nothing."""
    flags = ("--host-bytes", "4MiB", "--page-bytes", "4KiB", "--disk-bytes", "64MiB")
    sidecar = sidecar_factory(*flags)
    metadata = (("x-tierkv-client", "toggler"),)
    acknowledged: list[int] = []
    with grpc.insecure_channel(sidecar.unix_target) as channel:
        stub = pb_grpc.TierKVStub(channel)  # type: ignore[no-untyped-call]
        describe = stub.Describe(pb.DescribeRequest(), metadata=metadata)
        with mapped_slab(describe.shm_name) as mapping:
            slab = np.frombuffer(mapping, np.uint8)
            for i in range(40):
                good = content(i).view(torch.uint8).reshape(-1).numpy()
                lease = stub.Allocate(pb.AllocateRequest(
                    namespace=namespace_to(NAMESPACE), hashes=[key(i)],
                    slab_id=describe.slab_id, write_policy=pb.WRITE_POLICY_WRITE_THROUGH,
                ), metadata=metadata)
                pieces = []  # (the block's pages in the slab, its right bytes)
                start = 0
                for extent in lease.blocks[0].extents:
                    pieces.append((slab[extent.offset : extent.offset + extent.length],
                                   good[start : start + extent.length]))
                    start += extent.length
                for view, right in pieces:
                    view[:] = right
                commit = stub.Commit.future(pb.LeaseRequest(lease_id=lease.lease_id,
                                                            checksums=[checksum(good)]),
                                            metadata=metadata)
                while not commit.done():  # the pages flip between wrong and right bytes
                    for view, right in pieces:
                        view[:] = 0xEE
                        view[:] = right
                try:
                    commit.result()
                    acknowledged.append(i)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.DATA_LOSS, exc
            del slab, pieces, view  # the mapping closes only once no view of it is left
    sidecar = restarted(sidecar_factory, sidecar, flags)
    hits, wrong = wrong_hits(sidecar, acknowledged)
    assert wrong == 0 and hits == len(acknowledged)  # write_through: every acknowledged block
