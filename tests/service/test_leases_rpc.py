"""The shared-memory lease path of the gRPC service: Describe, Allocate/Commit, Acquire/Release,
Abort, and leases that belong to their client.

Every test talks to a real ``create_server`` (Unix socket and ``127.0.0.1:0``) in front of a real
``TieredStore`` (shared-memory HOST slab, LMDB disk tier in ``tmp_path``) with ``grpc.aio``
channels. The tenant is always decided by the bearer token: alice and bob share nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.harness import Served
from tests.support.rpc_calls import (
    NS,
    Code,
    expect,
    lookup,
    put,
    stats,
    tier,
)
from tests.support.service_fixtures import (
    ALICE,
    LEASE_RPCS,
    commit_request,
    get_blocks,
    invoke,
    mapped_slab,
    payload,
    read_extents,
    write_extents,
)
from tests.support.tiny_blocks import BLOCK_BYTES, keys
from tierkv.config import MiB
from tierkv.wire import tierkv_pb2 as pb

# --- the shared-memory lease path --------------------------------------------------------------


@pytest.mark.asyncio
async def test_describe_tells_a_same_host_client_how_to_map_the_slab(served: Served) -> None:
    stub = served.stub(unix=True)
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    assert describe.shm_name == served.store.sidecar.host_shm_name
    assert os.path.exists(f"/dev/shm/{describe.shm_name}")
    assert describe.shm_size_bytes == 64 * BLOCK_BYTES
    assert describe.page_bytes == served.store.config.host.page_bytes
    assert describe.host_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert describe.max_hashes_per_call == 65536
    assert describe.max_chunk_bytes == MiB
    assert describe.hash_seed == served.server.config.hash_seed
    assert describe.version


@pytest.mark.asyncio
async def test_allocate_write_commit_then_get(served: Served) -> None:
    stub = served.stub(unix=True)
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    hashes = keys(6, salt="lease-w")
    data = payload(6, seed=21)
    block = [data[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES] for i in range(6)]
    # Blocks 1 and 4 are stored already: the lease asks for the other four only.
    assert await put(stub, [hashes[1], hashes[4]], block[1] + block[4]) == 2

    lease = await stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=hashes), metadata=ALICE)
    assert len(lease.lease_id) >= 16
    assert list(lease.write_indices) == [0, 2, 3, 5]
    assert lease.num_blocks == 4 == len(lease.blocks)
    assert 0 < lease.expires_in_s <= 600
    for extents in lease.blocks:
        assert sum(e.length for e in extents.extents) == BLOCK_BYTES
        assert all(e.offset + e.length <= describe.shm_size_bytes for e in extents.extents)
    assert (await stats(stub)).num_leases == 1
    # Not visible before the commit.
    assert (await lookup(stub, hashes)).num_cached == 0

    with mapped_slab(describe.shm_name) as slab:
        for index, extents in zip(lease.write_indices, lease.blocks, strict=True):
            write_extents(slab, extents, block[index])
    committed = await stub.Commit(commit_request(lease, data), metadata=ALICE)
    assert committed.count == 4
    assert (await stats(stub)).num_leases == 0
    assert await get_blocks(stub, NS, hashes) == (6, data, [len(data)])

    # A second commit of the same lease is refused, and changes nothing.
    await expect(Code.FAILED_PRECONDITION,
                 stub.Commit(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE))
    await expect(Code.FAILED_PRECONDITION,
                 stub.Abort(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE))
    assert (await get_blocks(stub, NS, hashes))[1] == data


@pytest.mark.asyncio
async def test_allocate_write_through_commit_is_on_disk(served: Served) -> None:
    stub = served.stub(unix=True)
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    hashes = keys(3, salt="lease-wt")
    data = payload(3, seed=22)
    lease = await stub.Allocate(
        pb.AllocateRequest(namespace=NS, hashes=hashes,
                           write_policy=pb.WRITE_POLICY_WRITE_THROUGH,
                           priority=pb.PRIORITY_SESSION),
        metadata=ALICE,
    )
    with mapped_slab(describe.shm_name) as slab:
        for index, extents in zip(lease.write_indices, lease.blocks, strict=True):
            write_extents(slab, extents, data[index * BLOCK_BYTES : (index + 1) * BLOCK_BYTES])
    await stub.Commit(commit_request(lease, data), metadata=ALICE)
    assert tier(await stats(stub), "disk").num_blocks == 3
    assert (await get_blocks(stub, NS, hashes))[1] == data


@pytest.mark.asyncio
async def test_acquire_read_release(small: Served) -> None:
    stub = small.stub(unix=True)
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    on_disk, in_host = keys(8, salt="acq-d"), keys(8, salt="acq-h")
    await put(stub, on_disk, payload(8, 31))
    await put(stub, in_host, payload(8, 32))  # pushes on_disk out of HOST

    for hashes, seed in ((in_host, 32), (on_disk[:4], 31)):
        lease = await stub.Acquire(pb.AcquireRequest(namespace=NS, hashes=hashes + keys(2)),
                                   metadata=ALICE)
        assert lease.num_blocks == len(hashes) == len(lease.blocks)
        assert not lease.write_indices
        with mapped_slab(describe.shm_name) as slab:
            got = b"".join(read_extents(slab, extents) for extents in lease.blocks)
        assert got == payload(8, seed)[: len(got)] and len(got) == len(hashes) * BLOCK_BYTES
        assert (await stats(stub)).num_leases == 1
        await stub.Release(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE)
        assert (await stats(stub)).num_leases == 0
        await expect(Code.FAILED_PRECONDITION,
                     stub.Release(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE))

    # Nothing cached: an empty lease, still released like any other.
    empty = await stub.Acquire(pb.AcquireRequest(namespace=NS, hashes=keys(3, salt="none")),
                               metadata=ALICE)
    assert empty.num_blocks == 0 and not empty.blocks
    await stub.Release(pb.LeaseRequest(lease_id=empty.lease_id), metadata=ALICE)


@pytest.mark.asyncio
async def test_abort_leaves_nothing_visible(served: Served) -> None:
    stub = served.stub(unix=True)
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    hashes = keys(5, salt="abort")
    before = await stats(stub)
    lease = await stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=hashes), metadata=ALICE)
    with mapped_slab(describe.shm_name) as slab:
        for extents in lease.blocks:
            write_extents(slab, extents, b"\xab" * BLOCK_BYTES)
    assert tier(await stats(stub), "host").used_bytes > tier(before, "host").used_bytes
    await stub.Abort(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE)

    assert (await lookup(stub, hashes)).num_cached == 0
    assert (await get_blocks(stub, NS, hashes))[0] == 0
    after = await stats(stub)
    assert tier(after, "host").used_bytes == tier(before, "host").used_bytes
    assert after.num_leases == 0
    await expect(Code.FAILED_PRECONDITION,
                 stub.Commit(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE))
    assert (await lookup(stub, hashes)).num_cached == 0


@pytest.mark.asyncio
async def test_a_lease_belongs_to_its_client(served: Served) -> None:
    stub = served.stub()
    one = (*ALICE, ("x-tierkv-client", "client-1"))
    two = (*ALICE, ("x-tierkv-client", "client-2"))
    hashes = keys(2, salt="owner")
    lease = await stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=hashes), metadata=one)
    for rpc in LEASE_RPCS:
        await expect(Code.NOT_FOUND, invoke(stub, rpc, pb.LeaseRequest(lease_id=lease.lease_id),
                                            two))
    await stub.Abort(pb.LeaseRequest(lease_id=lease.lease_id), metadata=one)
