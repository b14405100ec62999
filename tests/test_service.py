"""The gRPC sidecar over real sockets: data paths, leases in shared memory, auth, health,
reflection, sessions, every kind of bad input, and a graceful stop.

Every test talks to a real ``create_server`` (Unix socket and ``127.0.0.1:0``) in front of a real
``TieredStore`` (shared-memory HOST slab, LMDB disk tier in ``tmp_path``) with ``grpc.aio``
channels. The tenant is always decided by the bearer token: alice and bob share nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service_fixtures import (
    ALICE,
    ALICE_TOKEN,
    ALL_RPCS,
    BOB,
    HASH_RPCS,
    LEASE_RPCS,
    NAMESPACE_RPCS,
    TOKENS,
    Served,
    aiter_of,
    bearer,
    code_of,
    commit_request,
    get_blocks,
    invoke,
    mapped_slab,
    payload,
    put_chunks,
    read_extents,
    request_for,
    serve,
    serving,
    short_socket_dir,
    store_config,
    wire_namespace,
    write_extents,
)

from conftest import BLOCK_BYTES, TINY_LAYOUT, keys
from tierkv import KVLayout, Namespace, StoreClosedError, TieredStore, block_hashes
from tierkv.service.config import ServiceConfig
from tierkv.service.server import TierKVServer
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

Code = grpc.StatusCode
MiB = 1 << 20
# 4 layers x 2 x 16 tokens x 4 heads x 64 dims x fp16 = 64 KiB a block: MiB-sized streams.
BIG_LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)
BIG_BLOCK = BIG_LAYOUT.bytes_per_block
NS = wire_namespace()


@pytest_asyncio.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    """A server with 64 tiny blocks of HOST and 1024 of disk; tokens for alice and bob."""
    async with serving(tmp_path / "store")as handle:
        yield handle


@pytest_asyncio.fixture
async def small(tmp_path: Path) -> AsyncIterator[Served]:
    """A server with only 8 tiny blocks of HOST (eviction to disk is easy to cause)."""
    async with serving(tmp_path / "store", host_blocks=8)as handle:
        yield handle


@pytest_asyncio.fixture
async def big(tmp_path: Path) -> AsyncIterator[Served]:
    """A server with 8 MiB of HOST in 64 KiB pages and 32 MiB of disk (64 KiB blocks)."""
    async with serving(tmp_path / "store", host_bytes=8 * MiB, page_bytes=64 * 1024,
                         disk_bytes=32 * MiB)as handle:
        yield handle


async def put(stub: pb_grpc.TierKVStub, hashes: list[bytes], data: bytes,
              namespace: pb.Namespace = NS, metadata: Any = ALICE, **header: Any) -> int:
    response = await stub.Put(aiter_of(put_chunks(namespace, hashes, data, **header)),
                              metadata=metadata)
    return int(response.count)


async def lookup(stub: pb_grpc.TierKVStub, hashes: list[bytes], namespace: pb.Namespace = NS,
                 metadata: Any = ALICE, **fields: Any) -> pb.LookupResponse:
    return await stub.Lookup(pb.LookupRequest(namespace=namespace, hashes=hashes, **fields),
                             metadata=metadata)


async def stats(stub: pb_grpc.TierKVStub) -> pb.StatsResponse:
    return await stub.Stats(pb.StatsRequest(), metadata=ALICE)


def tier(response: pb.StatsResponse, name: str) -> pb.TierStats:
    return next(t for t in response.tiers if t.tier == name)


async def expect(code: Code | set[Code], call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    """Await ``call``; it must fail with ``code`` (or one of them)."""
    codes = code if isinstance(code, set) else {code}
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call
    assert failure.value.code() in codes, (failure.value.code(), failure.value.details())
    return failure.value


async def drain(call: Any) -> list[Any]:
    return [message async for message in call]


def test_the_helpers_cover_every_rpc() -> None:
    assert set(ALL_RPCS) == {
        "Describe", "Lookup", "Pin", "Unpin", "Delete", "Stats", "Put", "Get", "Acquire",
        "Release", "Allocate", "Commit", "Abort", "SaveSession", "ResumeSession",
        "DeleteSession", "ListSessions",
    }


# --- the stream data path ------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
async def test_put_then_get_round_trips_megabytes_bit_exact(big: Served, unix: bool) -> None:
    stub = big.stub(unix)
    namespace = wire_namespace(BIG_LAYOUT)
    hashes = keys(48, salt="big")
    data = payload(48, seed=7, layout=BIG_LAYOUT)  # 3 MiB
    chunks = put_chunks(namespace, hashes, data, sizes=[MiB])
    assert [len(c.data) for c in chunks] == [MiB, MiB, MiB]
    response = await stub.Put(aiter_of(chunks), metadata=ALICE)
    assert response.count == 48

    num_blocks, got, sizes = await get_blocks(stub, namespace, hashes)
    assert num_blocks == 48
    assert got == data
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    assert max(sizes) <= describe.max_chunk_bytes <= 4 * MiB
    assert sizes == [MiB] * 3  # whole chunks of max_chunk_bytes
    # Again: a put of blocks already stored stores nothing new.
    assert (await stub.Put(aiter_of(chunks), metadata=ALICE)).count == 0


@pytest.mark.asyncio
async def test_put_with_odd_and_empty_chunks_round_trips(served: Served) -> None:
    stub = served.stub()
    hashes = keys(40, salt="odd")
    data = payload(40, seed=3)
    chunks = put_chunks(NS, hashes, data, sizes=[1, 7, 333, 1000, 5003, 2])
    # Empty messages anywhere after the header are harmless.
    chunks.insert(3, pb.PutChunk())
    chunks.append(pb.PutChunk(data=b""))
    assert await put_raw(stub, chunks) == 40
    num_blocks, got, _ = await get_blocks(stub, NS, hashes)
    assert (num_blocks, got) == (40, data)
    # The header may also come alone, with every byte in later messages.
    more = keys(3, salt="alone")
    chunks = [pb.PutChunk(header=pb.PutHeader(namespace=NS, hashes=more)),
              pb.PutChunk(data=payload(3, seed=4))]
    assert await put_raw(stub, chunks) == 3
    assert (await get_blocks(stub, NS, more))[1] == payload(3, seed=4)


async def put_raw(stub: pb_grpc.TierKVStub, chunks: list[pb.PutChunk], metadata: Any = ALICE
                  ) -> int:
    return int((await stub.Put(aiter_of(chunks), metadata=metadata)).count)


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "fp8", "int8", "int4"])
async def test_every_dtype_round_trips(served: Served, dtype: str) -> None:
    stub = served.stub()
    layout = KVLayout(2, 2, 8, 4, dtype)
    namespace = wire_namespace(layout, model_id=f"m-{dtype}")
    hashes = keys(5, salt=dtype)
    data = payload(5, seed=11, layout=layout)
    assert await put(stub, hashes, data, namespace) == 5
    assert await get_blocks(stub, namespace, hashes) == (5, data, [len(data)])


@pytest.mark.asyncio
async def test_get_returns_the_leading_cached_run(served: Served) -> None:
    stub = served.stub()
    chain = keys(10, salt="chain")
    data = payload(10, seed=5)
    assert await put(stub, chain[:6], data[: 6 * BLOCK_BYTES]) == 6
    await stub.Delete(pb.BlocksRequest(namespace=NS, hashes=[chain[2]]), metadata=ALICE)

    num_blocks, got, _ = await get_blocks(stub, NS, chain)
    assert num_blocks == 2
    assert got == data[: 2 * BLOCK_BYTES]
    assert await get_blocks(stub, NS, chain[2:]) == (0, b"", [0])
    assert await get_blocks(stub, NS, []) == (0, b"", [0])
    num_blocks, got, _ = await get_blocks(stub, NS, chain[3:])
    assert (num_blocks, got) == (3, data[3 * BLOCK_BYTES : 6 * BLOCK_BYTES])
    # An empty Put stores nothing and is fine.
    assert await put(stub, [], b"") == 0


@pytest.mark.asyncio
async def test_put_is_idempotent_and_counts_new_blocks(served: Served) -> None:
    stub = served.stub()
    hashes = keys(6, salt="idem")
    data = payload(6, seed=1)
    assert await put(stub, hashes[:4], data[: 4 * BLOCK_BYTES]) == 4
    assert await put(stub, hashes, data) == 2
    # The bytes stored first win: a put never rewrites a block.
    other = payload(6, seed=2)
    assert await put(stub, hashes, other) == 0
    assert (await get_blocks(stub, NS, hashes))[1] == data


@pytest.mark.asyncio
async def test_lookup_counts_tiers_prefetches_and_pins(small: Served) -> None:
    stub = small.stub()
    first, second, third = keys(8, salt="a"), keys(8, salt="b"), keys(8, salt="c")
    assert await put(stub, first, payload(8, 1)) == 8
    assert await put(stub, second, payload(8, 2)) == 8  # HOST holds 8: first goes to disk

    both = await lookup(stub, first + second)
    assert (both.num_cached, both.num_gpu, both.num_host, both.num_disk) == (16, 0, 8, 8)
    assert both.num_pinned == 0
    assert (await lookup(stub, first)).num_disk == 8
    # Over 64 hashes a lookup runs on a worker thread; it must count the same way.
    many = await lookup(stub, first + second + keys(100, salt="absent"))
    assert (many.num_cached, many.num_host, many.num_disk) == (16, 8, 8)
    assert (await lookup(stub, keys(3, salt="absent") + first)).num_cached == 0

    fetched = await lookup(stub, first, prefetch=True)
    assert (fetched.num_cached, fetched.num_host, fetched.num_disk) == (8, 8, 0)
    assert (await get_blocks(stub, NS, first))[1] == payload(8, 1)

    pinned = await lookup(stub, first, pin_ttl_s=30.0)
    assert pinned.num_pinned == 8
    assert (await stats(stub)).num_pinned == 8
    # HOST is full of pinned blocks: a put that needs room has none.
    await expect(Code.RESOURCE_EXHAUSTED, put(stub, third, payload(8, 3)))
    assert (await lookup(stub, third)).num_cached == 0
    unpinned = await stub.Unpin(pb.BlocksRequest(namespace=NS, hashes=first), metadata=ALICE)
    assert unpinned.count == 8
    assert await put(stub, third, payload(8, 3)) == 8

    # A pin with a TTL ends by itself.
    assert (await lookup(stub, third, pin_ttl_s=0.2)).num_pinned == 8
    await asyncio.sleep(0.4)
    assert await put(stub, first, payload(8, 1)) == 8


@pytest.mark.asyncio
async def test_pin_unpin_delete_and_stats(served: Served) -> None:
    stub = served.stub()
    chain = keys(6, salt="pin")
    data = payload(6, seed=9)
    before = await stats(stub)
    assert await put(stub, chain[:4], data[: 4 * BLOCK_BYTES]) == 4
    after_put = await stats(stub)
    assert after_put.puts == before.puts + 1
    host = tier(after_put, "host")
    assert host.num_blocks == 4 and host.used_bytes == 4 * BLOCK_BYTES
    assert host.capacity_bytes == 64 * BLOCK_BYTES
    assert {t.tier for t in after_put.tiers} == {"host", "disk"}
    assert after_put.num_namespaces == 1

    # Pin covers the leading stored run only.
    assert (await stub.Pin(pb.PinRequest(namespace=NS, hashes=chain), metadata=ALICE)).count == 4
    assert (await stub.Pin(pb.PinRequest(namespace=NS, hashes=chain[:2], ttl_s=60),
                           metadata=ALICE)).count == 2
    assert (await stats(stub)).num_pinned == 4
    assert (await stub.Unpin(pb.BlocksRequest(namespace=NS, hashes=chain),
                             metadata=ALICE)).count == 4
    assert (await stub.Unpin(pb.BlocksRequest(namespace=NS, hashes=chain[:2]),
                             metadata=ALICE)).count == 2
    assert (await stats(stub)).num_pinned == 0
    assert (await stub.Unpin(pb.BlocksRequest(namespace=NS, hashes=chain),
                             metadata=ALICE)).count == 0

    await get_blocks(stub, NS, chain)
    after_get = await stats(stub)
    assert after_get.gets == after_put.gets + 1

    deleted = await stub.Delete(pb.BlocksRequest(namespace=NS, hashes=chain), metadata=ALICE)
    assert deleted.count == 4
    assert (await lookup(stub, chain)).num_cached == 0
    assert (await get_blocks(stub, NS, chain))[0] == 0
    assert tier(await stats(stub), "host").num_blocks == 0
    assert (await stub.Delete(pb.BlocksRequest(namespace=NS, hashes=chain),
                              metadata=ALICE)).count == 0
    # A deleted block can be stored again, with new bytes.
    assert await put(stub, chain[:1], payload(1, seed=99)) == 1
    assert (await get_blocks(stub, NS, chain[:1]))[1] == payload(1, seed=99)


# --- the shared-memory lease path ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_describe_tells_a_same_host_client_how_to_map_the_slab(served: Served) -> None:
    stub = served.stub(unix=True)
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    assert describe.shm_name == served.store.host_shm_name
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


# --- authentication and tenants ------------------------------------------------------------------

BAD_CREDENTIALS = {
    "none": (),
    "wrong-token": bearer("w" * 32),
    "empty-token": bearer(""),
    "prefix-of-token": bearer(ALICE_TOKEN[:-1]),
    "no-bearer-prefix": (("authorization", ALICE_TOKEN),),
    "basic-scheme": (("authorization", f"Basic {ALICE_TOKEN}"),),
    "token-in-other-key": (("x-token", f"Bearer {ALICE_TOKEN}"),),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("credentials", BAD_CREDENTIALS.values(), ids=BAD_CREDENTIALS.keys())
async def test_every_call_without_a_valid_token_is_unauthenticated(
    served: Served, credentials: Any
) -> None:
    stub = served.stub()
    hashes = keys(2, salt="auth")
    await put(stub, hashes, payload(2))
    before = await stats(stub)
    for rpc in ALL_RPCS:
        request = request_for(rpc, NS, hashes)
        assert await code_of(stub, rpc, request, credentials) == Code.UNAUTHENTICATED, rpc
    after = await stats(stub)
    assert after == before
    assert (await lookup(stub, hashes)).num_cached == 2
    assert not (await stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE)).sessions


@pytest.mark.asyncio
async def test_tenants_do_not_see_each_others_blocks(served: Served) -> None:
    stub = served.stub()
    hashes = keys(4, salt="shared")
    alice_data, bob_data = payload(4, seed=41), payload(4, seed=42)
    assert await put(stub, hashes, alice_data, metadata=ALICE) == 4

    assert (await lookup(stub, hashes, metadata=BOB)).num_cached == 0
    assert (await get_blocks(stub, NS, hashes, BOB))[0] == 0
    assert (await stub.Pin(pb.PinRequest(namespace=NS, hashes=hashes), metadata=BOB)).count == 0
    assert (await stub.Delete(pb.BlocksRequest(namespace=NS, hashes=hashes),
                              metadata=BOB)).count == 0
    acquired = await stub.Acquire(pb.AcquireRequest(namespace=NS, hashes=hashes), metadata=BOB)
    assert acquired.num_blocks == 0
    await stub.Release(pb.LeaseRequest(lease_id=acquired.lease_id), metadata=BOB)

    # Bob stores his own bytes under the same namespace and hashes; each reads his own.
    assert await put(stub, hashes, bob_data, metadata=BOB) == 4
    assert (await get_blocks(stub, NS, hashes, ALICE))[1] == alice_data
    assert (await get_blocks(stub, NS, hashes, BOB))[1] == bob_data
    assert (await stub.Delete(pb.BlocksRequest(namespace=NS, hashes=hashes),
                              metadata=BOB)).count == 4
    assert (await get_blocks(stub, NS, hashes, ALICE)) == (4, alice_data, [len(alice_data)])


@pytest.mark.asyncio
async def test_another_tenants_lease_id_is_not_found(served: Served) -> None:
    stub = served.stub(unix=True)
    hashes = keys(3, salt="alice-lease")
    write = await stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=hashes), metadata=ALICE)
    for rpc in LEASE_RPCS:
        await expect(Code.NOT_FOUND, invoke(stub, rpc, pb.LeaseRequest(lease_id=write.lease_id),
                                            BOB))
    assert (await lookup(stub, hashes, metadata=ALICE)).num_cached == 0
    # Alice's lease is untouched by bob's attempts.
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    data = payload(3, seed=51)
    with mapped_slab(describe.shm_name) as slab:
        for index, extents in zip(write.write_indices, write.blocks, strict=True):
            write_extents(slab, extents, data[index * BLOCK_BYTES : (index + 1) * BLOCK_BYTES])
    assert (await stub.Commit(commit_request(write, data), metadata=ALICE)).count == 3

    read = await stub.Acquire(pb.AcquireRequest(namespace=NS, hashes=hashes), metadata=ALICE)
    assert read.num_blocks == 3
    await expect(Code.NOT_FOUND,
                 stub.Release(pb.LeaseRequest(lease_id=read.lease_id), metadata=BOB))
    await stub.Release(pb.LeaseRequest(lease_id=read.lease_id), metadata=ALICE)
    # Once finished, the id is still nobody else's: NOT_FOUND for bob, not FAILED_PRECONDITION.
    await expect(Code.NOT_FOUND,
                 stub.Commit(pb.LeaseRequest(lease_id=write.lease_id), metadata=BOB))


# --- health and reflection -----------------------------------------------------------------------


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
    return int(response.status)


@pytest.mark.asyncio
async def test_health_is_serving_with_a_store(served: Served) -> None:
    channel = served.channel()
    assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    assert await health_status(channel, "tierkv.v1.TierKV") == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.asyncio
async def test_a_server_without_a_store_is_not_serving_until_attached(tmp_path: Path) -> None:
    socket_dir = short_socket_dir()
    config = ServiceConfig(listen=(f"unix://{socket_dir}/s.sock", "127.0.0.1:0"),
                           tokens=dict(TOKENS))
    server = TierKVServer(config)
    port = server.bind()
    await server.start()
    store: TieredStore | None = None
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert await health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await health_status(channel, "tierkv.v1.TierKV") == (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )
        stub = pb_grpc.TierKVStub(channel)
        for rpc in ALL_RPCS:
            request = request_for(rpc, NS, keys(2))
            assert await code_of(stub, rpc, request, ALICE) == Code.UNAVAILABLE, rpc
            # Credentials are still checked first.
            assert await code_of(stub, rpc, request, ()) == Code.UNAUTHENTICATED, rpc

        (tmp_path / "store").mkdir()
        store = TieredStore(store_config(tmp_path / "store"))
        await server.attach(store)
        assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        assert await put(stub, keys(2), payload(2)) == 2
        assert (await get_blocks(stub, NS, keys(2)))[1] == payload(2)
        describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
        assert describe.shm_name == store.host_shm_name
    finally:
        await channel.close()
        await server.stop()
        if store is not None:
            with pytest.raises(StoreClosedError):  # stop() closed it
                store.stats()
        shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.mark.asyncio
async def test_reflection_lists_the_service(served: Served) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(served.channel())
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = [r async for r in stub.ServerReflectionInfo(aiter_of([request]))]
    names = {s.name for s in responses[0].list_services_response.service}
    assert "tierkv.v1.TierKV" in names
    assert "grpc.health.v1.Health" in names
    # And the file describing it is served too (a stock client can then call it).
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="tierkv.v1.TierKV")
    responses = [r async for r in stub.ServerReflectionInfo(aiter_of([request]))]
    assert responses[0].file_descriptor_response.file_descriptor_proto


# --- sessions ------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_session_save_resume_list_delete(served: Served) -> None:
    stub = served.stub()
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    tokens = list(range(1000, 1042))  # 10 whole blocks of 4 tokens, and 2 more
    hashes = block_hashes(tokens, TINY_LAYOUT.block_size, describe.hash_seed)
    assert len(hashes) == 10
    await put(stub, list(hashes[:6]), payload(6, seed=61),
              write_policy=pb.WRITE_POLICY_WRITE_THROUGH, priority=pb.PRIORITY_SESSION)

    saved = await stub.SaveSession(
        pb.SaveSessionRequest(namespace=NS, session_id="chat-1", token_ids=tokens),
        metadata=ALICE)
    assert saved.num_tokens == 42
    started = time.time()

    resumed = await stub.ResumeSession(pb.SessionRequest(session_id="chat-1"), metadata=ALICE)
    assert list(resumed.token_ids) == tokens
    assert resumed.num_cached_tokens == 24
    assert resumed.namespace == NS

    listed = await stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE)
    assert [(s.session_id, s.model_id, s.num_tokens) for s in listed.sessions] == [
        ("chat-1", "test-model", 42)
    ]
    assert abs(listed.sessions[0].last_use_unix_s - started) < 60

    # Saving again replaces the session.
    await stub.SaveSession(pb.SaveSessionRequest(namespace=NS, session_id="chat-1",
                                                 token_ids=tokens[:8]), metadata=ALICE)
    resumed = await stub.ResumeSession(pb.SessionRequest(session_id="chat-1"), metadata=ALICE)
    assert (list(resumed.token_ids), resumed.num_cached_tokens) == (tokens[:8], 8)

    # Bob sees none of it.
    assert not (await stub.ListSessions(pb.ListSessionsRequest(), metadata=BOB)).sessions
    await expect(Code.NOT_FOUND,
                 stub.ResumeSession(pb.SessionRequest(session_id="chat-1"), metadata=BOB))
    assert not (await stub.DeleteSession(pb.SessionRequest(session_id="chat-1"),
                                         metadata=BOB)).deleted

    assert (await stub.DeleteSession(pb.SessionRequest(session_id="chat-1"),
                                     metadata=ALICE)).deleted
    assert not (await stub.DeleteSession(pb.SessionRequest(session_id="chat-1"),
                                         metadata=ALICE)).deleted
    await expect(Code.NOT_FOUND,
                 stub.ResumeSession(pb.SessionRequest(session_id="chat-1"), metadata=ALICE))
    assert not (await stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE)).sessions


@pytest.mark.asyncio
async def test_a_session_with_a_ttl_expires(served: Served) -> None:
    stub = served.stub()
    await stub.SaveSession(pb.SaveSessionRequest(namespace=NS, session_id="brief",
                                                 token_ids=[1, 2, 3], ttl_s=0.2), metadata=ALICE)
    assert len((await stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE)).sessions) == 1
    await asyncio.sleep(0.5)
    await expect(Code.NOT_FOUND,
                 stub.ResumeSession(pb.SessionRequest(session_id="brief"), metadata=ALICE))
    assert not (await stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE)).sessions


# --- bad input -----------------------------------------------------------------------------------


@dataclass
class Bench:
    """A server holding 4 blocks of ``stored``; ``fresh`` hashes are stored nowhere."""

    served: Served
    stub: pb_grpc.TierKVStub
    stored: list[bytes]
    fresh: list[bytes]


@pytest_asyncio.fixture
async def bench(served: Served) -> Bench:
    stub = served.stub()
    stored, fresh = keys(4, salt="stored"), keys(4, salt="fresh")
    await put(stub, stored, payload(4, seed=71))
    return Bench(served, stub, stored, fresh)


def comparable(response: pb.StatsResponse) -> pb.StatsResponse:
    """Stats without read counters (the checks read) and the namespace count (a valid
    namespace in a refused call is registered: that stores no block)."""
    copy = pb.StatsResponse()
    copy.CopyFrom(response)
    copy.num_namespaces = copy.gets = 0
    for tier_stats in copy.tiers:
        tier_stats.hits = tier_stats.misses = 0
    return copy


@contextlib.asynccontextmanager
async def unchanged(bench: Bench, what: str = "") -> AsyncIterator[None]:
    """The server is up afterwards and nothing became visible: stats, lookups, sessions."""
    stub = bench.stub
    before = comparable(await stats(stub))
    yield
    await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    assert (await lookup(stub, bench.fresh)).num_cached == 0, what
    assert (await lookup(stub, bench.stored)).num_cached == 4, what
    assert (await get_blocks(stub, NS, bench.stored))[1] == payload(4, seed=71), what
    assert not (await stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE)).sessions, what
    assert comparable(await stats(stub)) == before, what


def brief(request: Any) -> str:
    """A short description of a request (printing a million hashes takes seconds)."""
    messages = request if isinstance(request, list) else [request]
    return f"{type(messages[0]).__name__ if messages else 'no messages'} x{len(messages)} " + (
        f"({sum(m.ByteSize() for m in messages)} B)"
    )


async def expect_code(bench: Bench, codes: set[Code], rpc: str, request: Any,
                      metadata: Any = ALICE) -> None:
    async with unchanged(bench, f"{rpc} {brief(request)}"):
        code = await code_of(bench.stub, rpc, request, metadata)
    assert code in codes, (rpc, code, brief(request))


INVALID = {Code.INVALID_ARGUMENT}


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [0, 1, 31, 33, 64])
@pytest.mark.parametrize("rpc", HASH_RPCS)
async def test_a_hash_of_the_wrong_length_is_invalid(bench: Bench, rpc: str, size: int) -> None:
    hashes = [*bench.fresh[:2], b"\x01" * size, bench.fresh[3]]
    await expect_code(bench, INVALID, rpc, request_for(rpc, NS, hashes))
    hashes = [b"\x02" * size]  # alone (Lookup's inline path too)
    await expect_code(bench, INVALID, rpc, request_for(rpc, NS, hashes))


@pytest.mark.asyncio
@pytest.mark.parametrize("rpc", HASH_RPCS)
async def test_a_million_hashes_exceed_the_message_limit(bench: Bench, rpc: str) -> None:
    request = request_for(rpc, NS, [bench.fresh[0]] * 10**6, block_bytes=0)
    await expect_code(bench, {Code.RESOURCE_EXHAUSTED}, rpc, request)


@pytest.mark.asyncio
@pytest.mark.parametrize("rpc", HASH_RPCS)
async def test_more_hashes_than_max_hashes_per_call_are_invalid(bench: Bench, rpc: str) -> None:
    # 70000 hashes are 2.4 MB: under the message limit, over max_hashes_per_call (65536).
    request = request_for(rpc, NS, [bench.fresh[0]] * 70000, block_bytes=0)
    await expect_code(bench, INVALID, rpc, request)


BAD_TTLS = [-1.0, -1e-9, math.nan, math.inf, -math.inf, 1e300]


@pytest.mark.asyncio
async def test_a_lower_max_hashes_per_call_holds_for_every_lookup(tmp_path: Path) -> None:
    """Short lookups are answered on the event loop; the limit holds there too."""
    async with serving(tmp_path / "store", max_hashes_per_call=16) as served:
        stub = served.stub()
        hashes = keys(17, salt="limit")
        await put(stub, hashes[:4], payload(4, seed=97))  # the namespace is known from here on
        assert (await lookup(stub, hashes[:16])).num_cached == 4
        await expect(Code.INVALID_ARGUMENT, lookup(stub, hashes))


@pytest.mark.asyncio
@pytest.mark.parametrize("ttl", BAD_TTLS, ids=str)
async def test_bad_ttls_are_invalid(bench: Bench, ttl: float) -> None:
    cases = [
        ("Lookup", {"pin_ttl_s": ttl}, bench.stored),
        ("Pin", {"ttl_s": ttl}, bench.stored),
        ("Acquire", {"lease_ttl_s": ttl}, bench.stored),
        ("Allocate", {"lease_ttl_s": ttl}, bench.fresh),
        ("SaveSession", {"ttl_s": ttl}, []),
    ]
    for rpc, fields, hashes in cases:
        await expect_code(bench, INVALID, rpc, request_for(rpc, NS, hashes, **fields))
    assert (await stats(bench.stub)).num_pinned == 0


@pytest.mark.asyncio
async def test_ttls_over_their_limits_are_invalid(bench: Bench) -> None:
    month = 30 * 24 * 3600.0
    cases = [
        ("Lookup", {"pin_ttl_s": month + 1}, bench.stored),
        ("Pin", {"ttl_s": month + 1}, bench.stored),
        ("Acquire", {"lease_ttl_s": 601.0}, bench.stored),
        ("Allocate", {"lease_ttl_s": 601.0}, bench.fresh),
        ("SaveSession", {"ttl_s": month + 1}, []),
    ]
    for rpc, fields, hashes in cases:
        await expect_code(bench, INVALID, rpc, request_for(rpc, NS, hashes, **fields))


@pytest.mark.asyncio
async def test_a_refused_lookup_moves_nothing(small: Served) -> None:
    """Lookup(prefetch, bad pin_ttl_s) is refused, so it must not prefetch either: bad input
    changes nothing (the store's rule), and the blocks stay where they were."""
    stub = small.stub()
    on_disk = keys(4, salt="cold")
    await put(stub, on_disk, payload(4, 81))
    await put(stub, keys(8, salt="hot"), payload(8, 82))
    assert (await lookup(stub, on_disk)).num_disk == 4
    before = await stats(stub)
    await expect(Code.INVALID_ARGUMENT, lookup(stub, on_disk, prefetch=True, pin_ttl_s=-1.0))
    where = await lookup(stub, on_disk)
    assert (where.num_host, where.num_disk) == (0, 4), "a refused Lookup prefetched its blocks"
    assert await stats(stub) == before


@pytest.mark.asyncio
async def test_unknown_sessions_are_not_found(bench: Bench) -> None:
    for rpc in ("ResumeSession",):
        await expect_code(bench, {Code.NOT_FOUND}, rpc, pb.SessionRequest(session_id="nope"))
    response = await bench.stub.DeleteSession(pb.SessionRequest(session_id="nope"), metadata=ALICE)
    assert not response.deleted


@pytest.mark.asyncio
@pytest.mark.parametrize("session_id", ["", "x" * 257, "é" * 129, "a\x00b"],
                         ids=["empty", "257-bytes", "258-utf8-bytes", "nul"])
async def test_bad_session_ids_are_invalid(bench: Bench, session_id: str) -> None:
    for rpc in ("SaveSession", "ResumeSession", "DeleteSession"):
        await expect_code(bench, INVALID, rpc, request_for(rpc, NS, session_id=session_id))


@pytest.mark.asyncio
async def test_random_lease_ids_are_not_found(bench: Bench) -> None:
    for lease_id in (b"", bytes(16), os.urandom(16), os.urandom(40)):
        for rpc in LEASE_RPCS:
            await expect_code(bench, {Code.NOT_FOUND}, rpc, pb.LeaseRequest(lease_id=lease_id))


@pytest.mark.asyncio
async def test_a_lease_of_the_other_kind_is_not_found(bench: Bench) -> None:
    stub = bench.stub
    async with unchanged(bench):
        read = await stub.Acquire(pb.AcquireRequest(namespace=NS, hashes=bench.stored),
                                  metadata=ALICE)
        write = await stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=bench.fresh),
                                    metadata=ALICE)
        for rpc in ("Commit", "Abort"):
            await expect(Code.NOT_FOUND, invoke(stub, rpc, pb.LeaseRequest(lease_id=read.lease_id)))
        await expect(Code.NOT_FOUND,
                     stub.Release(pb.LeaseRequest(lease_id=write.lease_id), metadata=ALICE))
        await stub.Release(pb.LeaseRequest(lease_id=read.lease_id), metadata=ALICE)
        await stub.Abort(pb.LeaseRequest(lease_id=write.lease_id), metadata=ALICE)


@pytest.mark.asyncio
async def test_commit_after_expiry_fails_and_stores_nothing(bench: Bench) -> None:
    stub = bench.stub
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    async with unchanged(bench):
        lease = await stub.Allocate(
            pb.AllocateRequest(namespace=NS, hashes=bench.fresh, lease_ttl_s=0.3), metadata=ALICE)
        assert 0 < lease.expires_in_s <= 0.3
        with mapped_slab(describe.shm_name) as slab:
            for index, extents in zip(lease.write_indices, lease.blocks, strict=True):
                data = payload(4, seed=5)[index * BLOCK_BYTES : (index + 1) * BLOCK_BYTES]
                write_extents(slab, extents, data)
        await asyncio.sleep(0.6)
        for rpc in ("Commit", "Abort"):
            await expect(Code.FAILED_PRECONDITION,
                         invoke(stub, rpc, pb.LeaseRequest(lease_id=lease.lease_id)))
        # Another client still gets NOT_FOUND for it.
        await expect(Code.NOT_FOUND,
                     stub.Commit(pb.LeaseRequest(lease_id=lease.lease_id), metadata=BOB))

        read = await stub.Acquire(
            pb.AcquireRequest(namespace=NS, hashes=bench.stored, lease_ttl_s=0.3), metadata=ALICE)
        await asyncio.sleep(0.6)
        await expect(Code.FAILED_PRECONDITION,
                     stub.Release(pb.LeaseRequest(lease_id=read.lease_id), metadata=ALICE))


@pytest.mark.asyncio
async def test_another_tenants_lease_changes_nothing(bench: Bench) -> None:
    stub = bench.stub
    async with unchanged(bench):
        lease = await stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=bench.fresh),
                                    metadata=ALICE)
        for rpc in LEASE_RPCS:
            await expect(Code.NOT_FOUND, invoke(stub, rpc, pb.LeaseRequest(lease_id=lease.lease_id),
                                                BOB))
        await stub.Abort(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE)


@pytest.mark.asyncio
async def test_wrong_payload_sizes_are_invalid(bench: Bench) -> None:
    data = payload(4, seed=91)
    cases = {
        "one byte short": data[:-1],
        "one block short": data[:-BLOCK_BYTES],
        "one byte over": data + b"\x00",
        "one block over": data + data[:BLOCK_BYTES],
        "nothing": b"",
    }
    for what, body in cases.items():
        for sizes in ([MiB], [7, 100]):
            chunks = put_chunks(NS, bench.fresh, body, sizes=sizes)
            async with unchanged(bench, what):
                await expect(Code.INVALID_ARGUMENT, bench.stub.Put(aiter_of(chunks), metadata=ALICE))


@pytest.mark.asyncio
async def test_put_streams_with_bad_headers_are_invalid(bench: Bench) -> None:
    data = payload(4, seed=92)
    good = put_chunks(NS, bench.fresh, data, sizes=[1000])
    header = good[0].header
    cases = {
        "empty stream": [],
        "no header at all": [pb.PutChunk(data=data)],
        "header in the second message": [pb.PutChunk(data=data[:10]),
                                         pb.PutChunk(header=header, data=data[10:])],
        "a second header": [*good[:2], pb.PutChunk(header=header), *good[2:]],
        "a second header, empty": [*good[:2], pb.PutChunk(header=pb.PutHeader()), *good[2:]],
        "a header repeated at the end": [*good, pb.PutChunk(header=header)],
    }
    for what, chunks in cases.items():
        async with unchanged(bench, what):
            await expect(Code.INVALID_ARGUMENT, bench.stub.Put(aiter_of(chunks), metadata=ALICE))


@pytest.mark.asyncio
async def test_oversize_messages_are_resource_exhausted(bench: Bench) -> None:
    stub = bench.stub
    five = 5 * MiB
    async with unchanged(bench, "5 MiB chunk"):
        chunks = [pb.PutChunk(header=pb.PutHeader(namespace=NS, hashes=[bench.fresh[0]] * 10240),
                              data=bytes(five))]
        await expect(Code.RESOURCE_EXHAUSTED, stub.Put(aiter_of(chunks), metadata=ALICE))
    async with unchanged(bench, "5 MiB chunk after a good header"):
        hashes = keys(10240, salt="five")
        chunks = [pb.PutChunk(header=pb.PutHeader(namespace=NS, hashes=hashes)),
                  pb.PutChunk(data=bytes(five))]
        await expect(Code.RESOURCE_EXHAUSTED, stub.Put(aiter_of(chunks), metadata=ALICE))
    async with unchanged(bench, "5 MiB model id"):
        await expect(Code.RESOURCE_EXHAUSTED,
                     lookup(stub, bench.fresh, wire_namespace(model_id="m" * five)))
    async with unchanged(bench, "5 MiB session"):
        request = pb.SaveSessionRequest(namespace=NS, session_id="big",
                                        token_ids=[2**32 - 1] * (MiB + 10))
        await expect(Code.RESOURCE_EXHAUSTED, stub.SaveSession(request, metadata=ALICE))


@pytest.mark.asyncio
async def test_a_put_cancelled_half_way_stores_nothing(bench: Bench) -> None:
    stub = bench.stub
    hashes = keys(32, salt="cancel")
    data = payload(32, seed=93)
    sent = asyncio.Event()
    never = asyncio.Event()

    async def half_then_hang() -> AsyncIterator[pb.PutChunk]:
        chunks = put_chunks(NS, hashes, data, sizes=[BLOCK_BYTES * 4])
        for chunk in chunks[: len(chunks) // 2]:
            yield chunk
        sent.set()
        await never.wait()

    async with unchanged(bench):
        call = stub.Put(half_then_hang(), metadata=ALICE)
        await asyncio.wait_for(sent.wait(), 5)
        await asyncio.sleep(0.3)  # let the server take in the first half
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.2)
        assert (await lookup(stub, hashes)).num_cached == 0
    # The same blocks go in whole afterwards.
    assert await put(stub, hashes, data) == 32


@pytest.mark.asyncio
async def test_a_put_cancelled_while_its_pages_are_found_leaks_no_lease(small: Served) -> None:
    """The stream's write lease never expires, so a Put cancelled while the server is still
    making room (here: waiting for a read lease on every page) must abort the lease it gets."""
    stub = small.stub()
    held = keys(8, salt="held")
    await put(stub, held, payload(8, seed=95))
    read = await stub.Acquire(pb.AcquireRequest(namespace=NS, hashes=held), metadata=ALICE)
    assert read.num_blocks == 8  # every HOST page is being read: nothing can be evicted
    hashes = keys(4, salt="late")
    header_sent = asyncio.Event()
    never = asyncio.Event()

    async def header_then_hang() -> AsyncIterator[pb.PutChunk]:
        yield put_chunks(NS, hashes, payload(4, seed=96), sizes=[BLOCK_BYTES])[0]
        header_sent.set()
        await never.wait()

    call = stub.Put(header_then_hang(), metadata=ALICE)
    await asyncio.wait_for(header_sent.wait(), 5)
    await asyncio.sleep(0.3)  # the server is now waiting for room
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await stub.Release(pb.LeaseRequest(lease_id=read.lease_id), metadata=ALICE)  # room appears
    deadline = time.monotonic() + 10
    while (await stats(stub)).num_leases and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert (await stats(stub)).num_leases == 0
    assert (await lookup(stub, hashes)).num_cached == 0
    assert tier(await stats(stub), "host").used_bytes <= 8 * BLOCK_BYTES


@pytest.mark.asyncio
async def test_a_put_that_stalls_is_dropped_and_gives_its_pages_back(tmp_path: Path) -> None:
    """A client that stops sending without ending the stream must not hold leased HOST pages:
    after ``put_idle_timeout_s`` the call ends DEADLINE_EXCEEDED and nothing is stored."""
    never = asyncio.Event()
    hashes = keys(8, salt="stall")

    async def half_then_stall() -> AsyncIterator[pb.PutChunk]:
        chunks = put_chunks(NS, hashes, payload(8, seed=98), sizes=[BLOCK_BYTES * 2])
        for chunk in chunks[:2]:
            yield chunk
        await never.wait()

    async with serving(tmp_path / "store", put_idle_timeout_s=0.5) as served:
        stub = served.stub()
        before = await stats(stub)
        started = time.monotonic()
        error = await expect(Code.DEADLINE_EXCEEDED, stub.Put(half_then_stall(), metadata=ALICE))
        never.set()  # the stalled request stream may end now
        assert 0.4 < time.monotonic() - started < 10, "dropped after the idle timeout"
        assert "nothing of it is stored" in (error.details() or "")
        assert (await lookup(stub, hashes)).num_cached == 0
        after = await stats(stub)
        assert after.num_leases == 0
        assert tier(after, "host").used_bytes == tier(before, "host").used_bytes
        # A stream that keeps sending, however slowly, is not cut off.
        async def slow() -> AsyncIterator[pb.PutChunk]:
            for chunk in put_chunks(NS, hashes, payload(8, seed=98), sizes=[BLOCK_BYTES]):
                await asyncio.sleep(0.1)
                yield chunk

        assert (await stub.Put(slow(), metadata=ALICE)).count == 8


@pytest.mark.asyncio
async def test_a_put_that_stops_half_way_stores_nothing(bench: Bench) -> None:
    """The client half-closes after part of the bytes: INVALID_ARGUMENT, nothing visible."""
    hashes = keys(32, salt="stop")
    data = payload(32, seed=94)
    chunks = put_chunks(NS, hashes, data, sizes=[BLOCK_BYTES * 4])
    async with unchanged(bench):
        await expect(Code.INVALID_ARGUMENT,
                     bench.stub.Put(aiter_of(chunks[: len(chunks) // 2]), metadata=ALICE))
        assert (await lookup(bench.stub, hashes)).num_cached == 0


BAD_NAMESPACES = {
    "empty model_id": wire_namespace(model_id=""),
    "257-char model_id": wire_namespace(model_id="m" * 257),
    "0 layers": wire_namespace(num_layers=0),
    "0 heads": wire_namespace(num_kv_heads=0),
    "0 head_dim": wire_namespace(head_dim=0),
    "100000 heads": wire_namespace(num_kv_heads=100000),
    "2**32-1 layers": wire_namespace(num_layers=2**32 - 1),
    "huge head_dim": wire_namespace(head_dim=10**9),
    "huge block_size": wire_namespace(block_size=2**31),
    "unknown dtype": wire_namespace(dtype="fp12"),
    "dtype with spaces": wire_namespace(dtype=" fp16 "),
    "int4 with odd head_dim": wire_namespace(head_dim=7, dtype="int4"),
    "tp_rank == tp_size": wire_namespace(tp_rank=2, tp_size=2),
    "tp_rank > tp_size": wire_namespace(tp_rank=5, tp_size=2),
    "tp_rank with tp_size 0": wire_namespace(tp_rank=1, tp_size=0),
    "max tp_rank": wire_namespace(tp_rank=2**32 - 1, tp_size=2**32 - 1),
    "no namespace": pb.Namespace(),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("rpc", NAMESPACE_RPCS)
async def test_bad_namespaces_are_invalid(bench: Bench, rpc: str) -> None:
    for what, namespace in BAD_NAMESPACES.items():
        request = request_for(rpc, namespace, bench.fresh[:2])
        async with unchanged(bench, what):
            code = await code_of(bench.stub, rpc, request)
        assert code == Code.INVALID_ARGUMENT, (what, code)
    # A good namespace in the same call shape works (the cases above fail for their namespace).
    assert await code_of(bench.stub, rpc, request_for(rpc, NS, [])) == Code.OK


HUGE_GEOMETRIES = {
    # Every field within its bound; a block of 2**47 bytes.
    "petabyte block": wire_namespace(num_layers=1024, num_kv_heads=1024, head_dim=4096,
                                     block_size=4096, dtype="fp32"),
    # One block of 64 KiB, twice the whole 32 KiB HOST budget.
    "block over HOST": wire_namespace(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("rpc", ("Put", "Acquire", "Allocate", "SaveSession"))
@pytest.mark.parametrize("geometry", HUGE_GEOMETRIES.values(), ids=HUGE_GEOMETRIES.keys())
async def test_a_block_that_does_not_fit_host_is_refused(
    bench: Bench, rpc: str, geometry: pb.Namespace
) -> None:
    request = request_for(rpc, geometry, bench.fresh[:2], block_bytes=0)
    await expect_code(bench, {Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED}, rpc, request)


@pytest.mark.asyncio
@pytest.mark.parametrize("rpc", ("Lookup", "Pin", "Unpin", "Delete", "Get"))
@pytest.mark.parametrize("geometry", HUGE_GEOMETRIES.values(), ids=HUGE_GEOMETRIES.keys())
async def test_reads_of_a_namespace_that_cannot_hold_blocks_are_misses(
    bench: Bench, rpc: str, geometry: pb.Namespace
) -> None:
    # Read-only calls never register a namespace: one nobody stored into holds nothing.
    request = request_for(rpc, geometry, bench.fresh[:2], block_bytes=0)
    await expect_code(bench, {Code.OK}, rpc, request)


@pytest.mark.asyncio
@pytest.mark.parametrize("value", [5, 7, -1, 2**31 - 1, -(2**31)])
async def test_unknown_enum_values_are_invalid(bench: Bench, value: int) -> None:
    data = payload(4, seed=95)
    for field in ("write_policy", "priority"):
        chunks = put_chunks(NS, bench.fresh, data, **{field: value})
        async with unchanged(bench, f"Put {field}={value}"):
            await expect(Code.INVALID_ARGUMENT, bench.stub.Put(aiter_of(chunks), metadata=ALICE))
        request = pb.AllocateRequest(namespace=NS, hashes=bench.fresh, **{field: value})
        await expect_code(bench, INVALID, "Allocate", request)


@pytest.mark.asyncio
async def test_every_known_enum_value_is_accepted(served: Served) -> None:
    stub = served.stub()
    for policy in (0, 1, 2):
        for priority in (0, 1, 2, 3, 4):
            hashes = keys(1, salt=f"enum-{policy}-{priority}")
            assert await put(stub, hashes, payload(1), write_policy=policy, priority=priority) == 1
            hashes = keys(1, salt=f"enum-lease-{policy}-{priority}")
            lease = await stub.Allocate(pb.AllocateRequest(
                namespace=NS, hashes=hashes, write_policy=policy, priority=priority),
                metadata=ALICE)
            await stub.Abort(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE)


@pytest.mark.asyncio
async def test_no_room_is_resource_exhausted_and_stores_nothing(bench: Bench) -> None:
    stub = bench.stub
    # 64 blocks of HOST: 4 stored and pinned, so 61 new ones cannot all fit.
    await stub.Pin(pb.PinRequest(namespace=NS, hashes=bench.stored), metadata=ALICE)
    try:
        hashes = keys(61, salt="full")
        async with unchanged(bench):
            await expect(Code.RESOURCE_EXHAUSTED, put(stub, hashes, payload(61)))
            await expect(Code.RESOURCE_EXHAUSTED,
                         stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=hashes),
                                       metadata=ALICE))
            assert (await lookup(stub, hashes)).num_cached == 0
    finally:
        await stub.Unpin(pb.BlocksRequest(namespace=NS, hashes=bench.stored), metadata=ALICE)


@pytest.mark.asyncio
async def test_long_values_in_bad_requests_keep_their_status(bench: Bench) -> None:
    """A bad value the client made long (a 100 KB lease id, a 100 KB dtype) must still get its
    own code, NOT_FOUND / INVALID_ARGUMENT: the server must not echo it whole into the status
    message, which the client's transport refuses as oversize metadata (then RESOURCE_EXHAUSTED
    "received metadata size exceeds hard limit"; between 8 and 16 KiB at random)."""
    stub = bench.stub
    for rpc in LEASE_RPCS:
        error = await expect({Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED},
                             invoke(stub, rpc, pb.LeaseRequest(lease_id=b"\x07" * 100_000)))
        assert error.code() == Code.NOT_FOUND, (rpc, error.details())
    error = await expect({Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED},
                         lookup(stub, bench.fresh, wire_namespace(dtype="q" * 100_000)))
    assert error.code() == Code.INVALID_ARGUMENT, error.details()


@pytest.mark.asyncio
async def test_undecodable_requests_are_invalid_argument(bench: Bench) -> None:
    """Bytes that are not the request message (corrupt wire format; a string field that is not
    UTF-8, which a C++ or Go client can send) are malformed input: INVALID_ARGUMENT, never
    UNKNOWN."""
    channel = bench.served.channel()
    bad_utf8 = pb.LookupRequest(namespace=wire_namespace(model_id="ABCD"),
                                hashes=bench.fresh).SerializeToString().replace(b"ABCD", b"\xff\xfe\xfd\xfc")
    bad_session = pb.SessionRequest(session_id="ABCD").SerializeToString().replace(
        b"ABCD", b"\xc3\x28\xa0\xa1")
    cases = [("Lookup", bad_utf8), ("ResumeSession", bad_session)]
    cases += [(rpc, b"\xff\xff\xff\xff") for rpc in ALL_RPCS if rpc not in ("Put", "Get")]
    header = pb.PutChunk(header=pb.PutHeader(namespace=NS, hashes=bench.fresh[:1]))
    put_cases = {  # Put: a corrupt first message, or a corrupt one after a good header
        "Put:corrupt-first": [b"\xff\xff\xff\xff"],
        "Put:corrupt-second": [header.SerializeToString(), b"\xff\xff\xff\xff"],
    }
    codes: dict[str, str] = {}

    async def code(label: str, start: Callable[[], Awaitable[Any]]) -> None:
        # An aio call starts when it is made: make it inside, after the "before" stats.
        async with unchanged(bench, label):
            try:
                await start()
                codes[label] = "OK"
            except grpc.aio.AioRpcError as exc:
                codes[label] = exc.code().name

    for index, (rpc, raw) in enumerate(cases):
        label = f"{rpc}:{'bad-utf8' if index < 2 else 'corrupt'}"
        unary_call = channel.unary_unary(f"/tierkv.v1.TierKV/{rpc}")
        await code(label, functools.partial(unary_call, raw, metadata=ALICE))
    for label, messages in put_cases.items():
        put_call = channel.stream_unary("/tierkv.v1.TierKV/Put")
        await code(label, functools.partial(put_call, aiter_of(messages), metadata=ALICE))
    get_call = channel.unary_stream("/tierkv.v1.TierKV/Get")
    await code("Get:corrupt", lambda: drain(get_call(b"\xff\xff\xff\xff", metadata=ALICE)))
    wrong = {label: code for label, code in codes.items() if code != "INVALID_ARGUMENT"}
    assert not wrong, f"undecodable requests answered {wrong}"


# --- big requests that must not exhaust the server ------------------------------------------------


@pytest_asyncio.fixture
async def roomy(tmp_path: Path) -> AsyncIterator[Served]:
    """64 MiB of HOST in 256 KiB pages and 128 MiB of disk: blocks of up to 32 MiB fit."""
    async with serving(tmp_path / "store", host_bytes=64 * MiB, page_bytes=256 * 1024,
                         disk_bytes=128 * MiB)as handle:
        yield handle


@pytest.mark.asyncio
async def test_a_get_of_many_hashes_of_big_blocks_answers(roomy: Served) -> None:
    """Get sizes its buffer by the blocks that are cached, not by the hashes asked for: 65536
    hashes (2.2 MB, under every limit) of a 32 MiB-block namespace that fits every tier must
    answer with the cached run, not try to allocate 2 TiB (UNKNOWN, RuntimeError)."""
    stub = roomy.stub()
    namespace = wire_namespace(KVLayout(1, 1, 4096, 2048), model_id="long-context")
    block = KVLayout(1, 1, 4096, 2048).bytes_per_block
    assert block == 32 * MiB
    head = keys(1, salt="head")
    data = bytes(range(256)) * (block // 256)
    assert await put(stub, head, data, namespace) == 1
    for count in (2, 1000, 65536):
        hashes = head + keys(count - 1, salt="tail")
        try:
            num_blocks, got, _ = await get_blocks(stub, namespace, hashes)
        except grpc.aio.AioRpcError as exc:
            pytest.fail(f"Get of {count} hashes: {exc.code()} {exc.details()}")
        assert num_blocks == 1 and got == data, count
    await stub.Describe(pb.DescribeRequest(), metadata=ALICE)


# --- graceful stop -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_stop_lets_an_in_flight_put_finish_then_flushes_and_closes(tmp_path: Path) -> None:
    root = tmp_path / "store"
    handle = await serve(root, host_bytes=16 * MiB, page_bytes=64 * 1024, disk_bytes=32 * MiB,
                         grace_s=20.0)
    namespace = wire_namespace(BIG_LAYOUT)
    hashes = keys(128, salt="slow")
    data = payload(128, seed=101, layout=BIG_LAYOUT)  # 8 MiB
    started = asyncio.Event()

    async def slowly() -> AsyncIterator[pb.PutChunk]:
        for index, chunk in enumerate(put_chunks(namespace, hashes, data, sizes=[MiB])):
            yield chunk
            if index == 1:
                started.set()
            await asyncio.sleep(0.05)

    stopped = False
    try:
        stub = handle.stub()
        call = stub.Put(slowly(), metadata=ALICE)
        await asyncio.wait_for(started.wait(), 10)
        stopping = asyncio.create_task(handle.server.stop())
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:  # rejected cleanly is acceptable; nothing else
            assert exc.code() in {Code.UNAVAILABLE, Code.CANCELLED}, (exc.code(), exc.details())
            response = None
        await asyncio.wait_for(stopping, 30)
        stopped = True
        with pytest.raises(StoreClosedError):
            handle.store.stats()
        await expect({Code.UNAVAILABLE, Code.CANCELLED},
                     stub.Describe(pb.DescribeRequest(), metadata=ALICE, timeout=2))
    finally:
        for channel in handle.channels:
            await channel.close()
        if not stopped:
            await handle.server.stop()
        handle.store.close(flush=False)
        shutil.rmtree(handle.socket_dir, ignore_errors=True)

    # The closed store flushed HOST to disk: a new store on the same files serves the put.
    reopened = TieredStore(store_config(root, host_bytes=16 * MiB, page_bytes=64 * 1024,
                                        disk_bytes=32 * MiB))
    try:
        ns = Namespace("test-model", BIG_LAYOUT, tenant="alice")
        reopened.register(ns)
        if response is not None:
            assert response.count == 128
            assert reopened.lookup(ns, hashes) == 128
            got = reopened.get(ns, hashes)
            assert bytes(got.contiguous().view(torch.uint8).reshape(-1).numpy()) == data
        else:
            assert reopened.lookup(ns, hashes) in (0, 128)
    finally:
        reopened.close(flush=False)



# --- more of the server's own settings -----------------------------------------------------------


@pytest.mark.asyncio
async def test_without_tokens_every_caller_shares_the_default_tenant(tmp_path: Path) -> None:
    async with serving(tmp_path / "store", tokens={}) as handle:
        stub = handle.stub()
        hashes = keys(2, salt="open")
        assert await put(stub, hashes, payload(2), metadata=()) == 2
        # Any token, or none, is the same caller when the server needs none.
        assert (await lookup(stub, hashes, metadata=bearer("anything" * 4))).num_cached == 2
        assert (await get_blocks(stub, NS, hashes, ()))[1] == payload(2)
        handle.store.register(Namespace("test-model", TINY_LAYOUT, tenant="default"))
        assert handle.store.lookup(Namespace("test-model", TINY_LAYOUT, tenant="default"),
                                   hashes) == 2


@pytest.mark.asyncio
async def test_expired_leases_are_reaped_without_any_call(tmp_path: Path) -> None:
    async with serving(tmp_path / "store", lease_reap_interval_s=0.1) as handle:
        stub = handle.stub()
        hashes = keys(4, salt="reap")
        await stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=hashes, lease_ttl_s=0.2),
                            metadata=ALICE)
        used = tier(await stats(stub), "host").used_bytes
        assert used == 4 * BLOCK_BYTES and (await stats(stub)).num_leases == 1
        await asyncio.sleep(0.8)
        after = await stats(stub)  # Stats itself reaps nothing
        assert after.num_leases == 0
        assert tier(after, "host").used_bytes == 0


@pytest.mark.asyncio
async def test_a_put_over_max_put_bytes_is_refused_before_its_bytes(tmp_path: Path) -> None:
    async with serving(tmp_path / "store", max_put_bytes=16 * BLOCK_BYTES) as handle:
        stub = handle.stub()
        hashes = keys(17, salt="too-big")
        never = asyncio.Event()

        async def header_then_wait() -> AsyncIterator[pb.PutChunk]:
            yield pb.PutChunk(header=pb.PutHeader(namespace=NS, hashes=hashes))
            await never.wait()  # the answer must come without the bytes

        # "too large" is RESOURCE_EXHAUSTED in the proto's rules; INVALID_ARGUMENT ("split it")
        # is what max_hashes_per_call answers, so either is accepted here.
        await asyncio.wait_for(
            expect({Code.RESOURCE_EXHAUSTED, Code.INVALID_ARGUMENT},
                   stub.Put(header_then_wait(), metadata=ALICE)),
            10,
        )
        assert (await lookup(stub, hashes)).num_cached == 0
        assert await put(stub, hashes[:16], payload(16)) == 16


@pytest.mark.asyncio
async def test_concurrent_clients_read_back_exactly_what_was_stored(served: Served) -> None:
    shared = keys(4, salt="shared-by-all")
    shared_data = payload(4, seed=300)

    async def client(number: int) -> None:
        stub = served.stub(unix=number % 2 == 1)
        mine = keys(4, salt=f"client-{number}")
        data = payload(4, seed=number)
        for round_ in range(8):
            await put(stub, mine, data)
            await put(stub, shared, shared_data)
            num_blocks, got, _ = await get_blocks(stub, NS, shared + mine)
            assert (num_blocks, got) == (8, shared_data + data), (number, round_)
            found = await lookup(stub, mine, prefetch=round_ % 2 == 0)
            assert found.num_cached == 4
            if round_ % 3 == 2:
                await stub.Delete(pb.BlocksRequest(namespace=NS, hashes=mine), metadata=ALICE)

    await asyncio.gather(*(client(n) for n in range(8)))
    await served.stub().Describe(pb.DescribeRequest(), metadata=ALICE)
