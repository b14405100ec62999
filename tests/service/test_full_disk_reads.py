"""Reads while the disk is full (issue 23): every acknowledged block comes back, exact, through
the shared-memory and the stream path alike, and the hits a server counts are the blocks its
clients received.

The scenario as a user hit it, on a real tmpfs: ``write_through`` puts until the filesystem is
full, then ``write_back`` puts that overflow HOST (their demotions fail: the disk is full), then
every acknowledged block is read back through a real server: by same-host clients (shared
memory), by stream clients, and by the vLLM connector's worker, into an engine's pages.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.support.harness import ALICE_TOKEN, BackgroundServer, free_port, tokens_saved
from tests.support.tiny_blocks import keys, same_bytes
from tierkv import CapacityError, Client, KVLayout, Namespace, WritePolicy
from tierkv.integrations.vllm.geometry import BlockGeometry
from tierkv.integrations.vllm.scheduler import BlockOp, StepMetadata
from tierkv.integrations.vllm.settings import ConnectorSettings
from tierkv.integrations.vllm.worker import WorkerSide

# 16 KiB blocks, as in the report.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=8)
NAMESPACE = Namespace("full-disk-model", LAYOUT)
HOST_BYTES = 2 << 20
TMPFS_MIB = 6
BATCH = 64


@pytest.fixture
def small_tmpfs(tmpfs: Callable[[int], Path]) -> Path:
    return tmpfs(TMPFS_MIB)


def data_for(num_blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *LAYOUT.block_shape), generator=generator).to(LAYOUT.torch_dtype)


def fill_until_full(client: Client) -> tuple[list[bytes], torch.Tensor, int]:
    """``write_through`` puts until the filesystem is full, then ``write_back`` puts of twice
    HOST's size; returns the acknowledged blocks and how many ``write_back`` ones there were."""
    hashes = keys(4000, salt="through")
    data = data_for(len(hashes), 1)
    acknowledged = 0
    with pytest.raises(CapacityError, match="full"):
        for start in range(0, len(hashes), 8):
            client.put(NAMESPACE, hashes[start : start + 8], data[start : start + 8],
                       write_policy=WritePolicy.WRITE_THROUGH)
            acknowledged = start + 8
    assert acknowledged > 100
    overflow = 2 * HOST_BYTES // LAYOUT.bytes_per_block
    extra = keys(overflow, salt="back")
    extra_data = data_for(overflow, 2)
    for start in range(0, overflow, 8):
        client.put(NAMESPACE, extra[start : start + 8], extra_data[start : start + 8],
                   write_policy=WritePolicy.WRITE_BACK)
    return hashes[:acknowledged], data[:acknowledged], overflow


def read_all(client: Client, hashes: list[bytes], data: torch.Tensor) -> int:
    """Read every block back, ``BATCH`` at a time; how many came back (each checked exact)."""
    num_got = 0
    out = torch.empty((BATCH, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)
    for start in range(0, len(hashes), BATCH):
        batch = hashes[start : start + BATCH]
        got = client.get_into(NAMESPACE, batch, out[: len(batch)])
        for i in range(got):
            assert same_bytes(out[i], data[start + i]), f"block {start + i}: wrong bytes"
        num_got += got
    return num_got


def test_every_acknowledged_block_is_read_back_while_the_disk_is_full(small_tmpfs: Path) -> None:
    server = BackgroundServer(small_tmpfs, host_bytes=HOST_BYTES, disk_bytes=1 << 30,
                              page_bytes=4096, tokens={ALICE_TOKEN: "alice"},
                              metrics_port=free_port())
    try:
        with Client(server.unix_target, token=ALICE_TOKEN) as writer:
            hashes, data, num_write_back = fill_until_full(writer)
        assert server.store.stats().failed_demotions > 0  # the overflow could not reach the disk
        failed_after_sweep: list[int] = []
        port = server.served.server.metrics_port
        for use_shm in (None, None, False, False):  # shared memory twice, the stream twice
            with Client(server.unix_target, token=ALICE_TOKEN, use_shm=use_shm) as reader:
                hits_before = sum(t.hits for t in reader.stats().tiers.values())
                tokens_before = tokens_saved(port, NAMESPACE.model_id)
                assert read_all(reader, hashes, data) == len(hashes), f"use_shm={use_shm}"
                hits = sum(t.hits for t in reader.stats().tiers.values()) - hits_before
                tokens = tokens_saved(port, NAMESPACE.model_id)
            assert hits == len(hashes), f"use_shm={use_shm}: {hits} hits counted"
            assert tokens - tokens_before == len(hashes) * LAYOUT.block_size
            failed_after_sweep.append(server.store.stats().failed_demotions)
        # One failure per block at most: a block whose demotion failed is passed over by the
        # promotions of later reads (it grew by ~the sweep's size each sweep before).
        assert failed_after_sweep[-1] <= num_write_back, failed_after_sweep
        check_connector_loads(server, hashes, data)
    finally:
        server.close()


def check_connector_loads(server: BackgroundServer, hashes: list[bytes], data: torch.Tensor) -> None:
    """The vLLM connector's worker loads DISK blocks into an engine's pages through the same
    full HOST: every block arrives, exact, none is a load error."""
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.num_layers))
    geometry = BlockGeometry(names, LAYOUT.block_size, LAYOUT.block_size, LAYOUT)
    shape = (BATCH, LAYOUT.num_kv_heads, LAYOUT.block_size, 2 * LAYOUT.head_dim)
    caches = {name: torch.zeros(shape, dtype=LAYOUT.torch_dtype) for name in names}
    worker = WorkerSide(ConnectorSettings(address=server.unix_target, token=ALICE_TOKEN),
                        geometry, tp_rank=0)
    try:
        worker.register(caches)
        chunk = hashes[-BATCH:]  # the oldest write_through blocks are on DISK only by now
        ids = list(range(BATCH))[::-1]
        worker.start_load(StepMetadata((NAMESPACE,), loads=[BlockOp("r", tuple(chunk), tuple(ids))]))
        for name in names:
            worker.wait_for_layer(name)
        assert worker.take_load_errors() == set()
    finally:
        worker.close()
    for i, block_id in enumerate(ids):  # a tierkv block is every layer's page, in layer order
        loaded = torch.cat([caches[name][block_id].reshape(-1) for name in names])
        expected = data[len(hashes) - BATCH + i].reshape(-1)
        assert torch.equal(loaded.view(torch.int16), expected.view(torch.int16)), i
