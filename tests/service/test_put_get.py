"""The Put and Get streams of the gRPC service: round trips, chunking, idempotence, lookups,
pins, deletes and stats.

Every test talks to a real ``create_server`` (Unix socket and ``127.0.0.1:0``) in front of a real
``TieredStore`` (shared-memory HOST slab, LMDB disk tier in ``tmp_path``) with ``grpc.aio``
channels. The tenant is always decided by the bearer token: alice and bob share nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.support.harness import Served, serving
from tests.support.rpc_calls import (
    BIG_LAYOUT,
    NS,
    Code,
    expect,
    lookup,
    put,
    put_raw,
    stats,
    tier,
)
from tests.support.service_fixtures import (
    ALICE,
    ALL_RPCS,
    aiter_of,
    get_blocks,
    payload,
    put_chunks,
    wire_namespace,
)
from tests.support.tiny_blocks import BLOCK_BYTES, keys
from tierkv import KVLayout
from tierkv.config import MiB
from tierkv.wire import tierkv_pb2 as pb


@pytest_asyncio.fixture
async def big(tmp_path: Path) -> AsyncIterator[Served]:
    """A server with 8 MiB of HOST in 64 KiB pages and 32 MiB of disk (64 KiB blocks)."""
    async with serving(tmp_path / "store", host_bytes=8 * MiB, page_bytes=64 * 1024,
                         disk_bytes=32 * MiB)as handle:
        yield handle


def test_the_helpers_cover_every_rpc() -> None:
    assert set(ALL_RPCS) == {
        "Describe", "Lookup", "Pin", "Unpin", "Delete", "Stats", "Put", "Get", "Acquire",
        "Release", "Allocate", "Commit", "Abort", "SaveSession", "ResumeSession",
        "DeleteSession", "ListSessions", "Clear", "Publish",
    }


# --- the stream data path ----------------------------------------------------------------------


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
