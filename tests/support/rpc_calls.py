"""Helpers of the raw-RPC service tests: calls with alice's token, expected failures, and the
``Bench`` that checks a refused call changed nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from tests.support.harness import Served
from tests.support.service_fixtures import (
    ALICE,
    aiter_of,
    code_of,
    get_blocks,
    payload,
    put_chunks,
    wire_namespace,
)
from tierkv import KVLayout
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

Code = grpc.StatusCode

# 4 layers x 2 x 16 tokens x 4 heads x 64 dims x fp16 = 64 KiB a block: MiB-sized streams.
BIG_LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)
BIG_BLOCK = BIG_LAYOUT.bytes_per_block
NS = wire_namespace()


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


async def put_raw(stub: pb_grpc.TierKVStub, chunks: list[pb.PutChunk], metadata: Any = ALICE
                  ) -> int:
    return int((await stub.Put(aiter_of(chunks), metadata=metadata)).count)


@dataclass
class Bench:
    """A server holding 4 blocks of ``stored``; ``fresh`` hashes are stored nowhere."""

    served: Served
    stub: pb_grpc.TierKVStub
    stored: list[bytes]
    fresh: list[bytes]


def comparable(response: pb.StatsResponse) -> pb.StatsResponse:
    """Stats without read counters (the checks read), the namespace count (a valid
    namespace in a refused call is registered: that stores no block) and the count of leases
    that expired (a refused call may reap some)."""
    copy = pb.StatsResponse()
    copy.CopyFrom(response)
    copy.num_namespaces = copy.gets = copy.leases_expired = 0
    for tier_stats in copy.tiers:
        tier_stats.hits = tier_stats.misses = 0
    for tenant_stats in copy.tenants:
        tenant_stats.hits = tenant_stats.misses = 0
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
