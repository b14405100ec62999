"""Big requests, a graceful stop, and more of the gRPC server's own settings.

Every test talks to a real ``create_server`` (Unix socket and ``127.0.0.1:0``) in front of a real
``TieredStore`` (shared-memory HOST slab, LMDB disk tier in ``tmp_path``) with ``grpc.aio``
channels. The tenant is always decided by the bearer token: alice and bob share nothing.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch

from tests.support.harness import Served, serve, serving, store_config
from tests.support.rpc_calls import (
    BIG_LAYOUT,
    NS,
    Code,
    expect,
    lookup,
    put,
    stats,
    tier,
)
from tests.support.service_fixtures import ALICE, bearer, get_blocks, payload, put_chunks, wire_namespace
from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, keys
from tierkv import KVLayout, Namespace, StoreClosedError, TieredStore
from tierkv.config import MiB
from tierkv.wire import tierkv_pb2 as pb

# --- big requests that must not exhaust the server ---------------------------------------------


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


# --- graceful stop -----------------------------------------------------------------------------


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



# --- more of the server's own settings ---------------------------------------------------------


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
