"""Put streams that are oversize, cancelled, stalled or stopped half way store nothing and leak
no pages.

Every test talks to a real ``create_server`` (Unix socket and ``127.0.0.1:0``) in front of a real
``TieredStore`` (shared-memory HOST slab, LMDB disk tier in ``tmp_path``) with ``grpc.aio``
channels. The tenant is always decided by the bearer token: alice and bob share nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.harness import Served, serving
from tests.support.rpc_calls import (
    NS,
    Bench,
    Code,
    expect,
    lookup,
    put,
    stats,
    tier,
    unchanged,
)
from tests.support.service_fixtures import ALICE, aiter_of, payload, put_chunks, wire_namespace
from tests.support.tiny_blocks import BLOCK_BYTES, keys
from tierkv.config import MiB
from tierkv.wire import tierkv_pb2 as pb


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
    # The waiting allocation then makes its room (evicting 4 held blocks) and gets its lease a
    # moment later, to abort it: no lease before that is not yet the answer. (A cancel that
    # came before the allocation began leaves nothing to wait for but the store's own bound
    # on waiting for room, 5 s.)
    deadline = time.monotonic() + 7
    while time.monotonic() < deadline:
        now = await stats(stub)
        if tier(now, "host").evictions == 4 and now.num_leases == 0:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # a lease granted just after its room was made is aborted by now
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
