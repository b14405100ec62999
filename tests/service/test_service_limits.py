"""Resources a client could make the server hold without bound (issue 7, points 8-11 and 13).

Each test drives a real server (``service_fixtures.serving``) the way a hostile client would:
streams that never speak, calls that are refused by the thousand, namespaces named by one
tenant until the limit, tokens no one can type.
"""

from __future__ import annotations

import asyncio
import gc
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.harness import ALICE_TOKEN, TOKENS, Served, serving
from tests.support.service_fixtures import ALICE, BOB, code_of, invoke, payload, put_chunks, wire_namespace
from tests.support.tiny_blocks import BLOCK_BYTES, keys
from tierkv.codec import RawPutChunk
from tierkv.errors import ConfigError, TierKVError
from tierkv.service.auth import Authenticator
from tierkv.service.config import ServiceConfig, load_tokens
from tierkv.wire import tierkv_pb2 as pb

Code = grpc.StatusCode
NS = wire_namespace()


async def put(served: Served, model_id: str, metadata: Any = ALICE, n: int = 2) -> grpc.StatusCode:
    namespace = wire_namespace(model_id=model_id)
    return await code_of(served.stub(), "Put", put_chunks(namespace, keys(n), payload(n)),
                         metadata)


async def num_namespaces(served: Served) -> int:
    """Every tenant's (the store's own stats: over gRPC Alice sees only hers)."""
    return served.store.stats().num_namespaces


# --- 8: a Put stream that never sends its header -----------------------------------------------


@pytest.mark.asyncio
async def test_a_put_stream_that_sends_nothing_is_dropped(tmp_path: Path) -> None:
    async def silent() -> AsyncIterator[pb.PutChunk]:
        await asyncio.sleep(3600)
        yield pb.PutChunk()  # never reached

    async with serving(tmp_path, put_idle_timeout_s=0.3) as served:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await served.stub().Put(silent(), metadata=ALICE, timeout=30)
        assert failure.value.code() == Code.DEADLINE_EXCEEDED, failure.value.details()
        assert time.monotonic() - started < 10
        response = await served.stub().Stats(pb.StatsRequest(), metadata=ALICE)
        assert response.num_leases == 0 and response.num_namespaces == 0


# --- 9: refused calls keep nothing alive -------------------------------------------------------


def _servicer_garbage(garbage: list[Any]) -> list[str]:
    """What of the server's own objects only the cyclic collector could free."""
    found = []
    for item in garbage:
        if isinstance(item, types.FrameType):
            path = item.f_code.co_filename
            if "/service/" in path or "/tierkv/" in path:
                found.append(f"frame {item.f_code.co_name} ({Path(path).name})")
        elif isinstance(item, RawPutChunk | TierKVError | pb.PutHeader):
            found.append(type(item).__name__)
    return found


REFUSED: dict[str, Callable[[Served], Awaitable[grpc.StatusCode]]] = {
    "Put over max_put_bytes": lambda s: code_of(
        s.stub(), "Put", put_chunks(NS, keys(8, salt="big"), payload(8))),
    "Put over HOST": lambda s: code_of(
        s.stub(), "Put", put_chunks(NS, keys(100, salt="host"), bytes(100 * BLOCK_BYTES))),
    "Put header with too many hashes": lambda s: code_of(
        s.stub(), "Put", [pb.PutChunk(header=pb.PutHeader(namespace=NS, hashes=keys(70)))]),
    "Put stream cut short": lambda s: code_of(
        s.stub(), "Put", put_chunks(NS, keys(2, salt="short"), payload(1))),
    "Lookup with a bad pin TTL": lambda s: code_of(
        s.stub(), "Lookup", pb.LookupRequest(namespace=NS, hashes=keys(2), pin_ttl_s=-1.0)),
    "Get of a bad hash": lambda s: code_of(
        s.stub(), "Get", pb.BlocksRequest(namespace=NS, hashes=[b"short"])),
    "Commit of an unknown lease": lambda s: code_of(
        s.stub(), "Commit", pb.LeaseRequest(lease_id=bytes(16))),
    "Lookup with a wrong token": lambda s: code_of(
        s.stub(), "Lookup", pb.LookupRequest(namespace=NS, hashes=keys(2)),
        (("authorization", "Bearer " + "x" * 32),)),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", REFUSED.keys())
async def test_refused_calls_leave_nothing_for_the_cyclic_collector(
    tmp_path: Path, kind: str
) -> None:
    # Refused Puts used to stay alive in reference cycles (an abort raised in an except block,
    # a future and the frame awaiting it): 1,500 of them grew a server by 390 MiB.
    call = REFUSED[kind]
    async with serving(tmp_path, max_put_bytes=4 * BLOCK_BYTES, max_hashes_per_call=64) as served:
        code = await call(served)  # warm-up: first-call caches are not leaks
        assert code not in (Code.OK, Code.UNKNOWN, Code.INTERNAL), code
        gc.collect()
        gc.disable()
        try:
            for _ in range(10):
                assert await call(served) == code
            await asyncio.sleep(0.2)  # the handlers finish after their status went out
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            found = _servicer_garbage(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert not found, f"{kind}: kept in reference cycles: {sorted(set(found))}"


@pytest.mark.asyncio
async def test_refused_calls_keep_their_status_and_message(tmp_path: Path) -> None:
    async with serving(tmp_path, max_put_bytes=4 * BLOCK_BYTES) as served:
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await invoke(served.stub(), "Put", put_chunks(NS, keys(8), payload(8)))
        assert failure.value.code() == Code.RESOURCE_EXHAUSTED
        assert "split it" in (failure.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await invoke(served.stub(), "Stats", pb.StatsRequest(), metadata=())
        assert failure.value.code() == Code.UNAUTHENTICATED
        assert "bearer token" in (failure.value.details() or "")


# --- 11: namespaces: read-only calls create none, limits are per tenant, empty ones go ---------


@pytest.mark.asyncio
async def test_read_only_calls_never_register_a_namespace(tmp_path: Path) -> None:
    async with serving(tmp_path) as served:
        stub = served.stub()
        for i in range(20):
            namespace = wire_namespace(model_id=f"looked-up-{i}")
            blocks_request = pb.BlocksRequest(namespace=namespace, hashes=keys(2))
            lookup = await stub.Lookup(pb.LookupRequest(namespace=namespace, hashes=keys(2),
                                                        pin_ttl_s=60.0), metadata=ALICE)
            assert lookup.num_cached == 0 and lookup.num_pinned == 0
            assert (await stub.Pin(pb.PinRequest(namespace=namespace, hashes=keys(2)),
                                   metadata=ALICE)).count == 0
            assert (await stub.Unpin(blocks_request, metadata=ALICE)).count == 0
            assert (await stub.Delete(blocks_request, metadata=ALICE)).count == 0
            chunks = [chunk async for chunk in stub.Get(blocks_request, metadata=ALICE)]
            assert [(c.num_blocks, c.data) for c in chunks] == [(0, b"")]
        assert await num_namespaces(served) == 0


@pytest.mark.asyncio
async def test_one_tenant_cannot_take_the_namespaces_of_others(tmp_path: Path) -> None:
    async with serving(tmp_path, max_namespaces=6, max_namespaces_per_tenant=3) as served:
        for i in range(3):
            assert await put(served, f"alice-{i}") == Code.OK
        # Alice's share is full of namespaces that hold blocks: her next model is refused ...
        assert await put(served, "alice-3") == Code.RESOURCE_EXHAUSTED
        # ... and Bob is not affected.
        for i in range(3):
            assert await put(served, f"bob-{i}", BOB) == Code.OK
        assert await num_namespaces(served) == 6

        # Once one of Alice's namespaces is empty, it makes room for her next model.
        emptied = pb.BlocksRequest(namespace=wire_namespace(model_id="alice-0"), hashes=keys(2))
        assert (await served.stub().Delete(emptied, metadata=ALICE)).count == 2
        assert await put(served, "alice-3") == Code.OK
        assert await num_namespaces(served) == 6
        lookup = await served.stub().Lookup(
            pb.LookupRequest(namespace=wire_namespace(model_id="alice-3"), hashes=keys(2)),
            metadata=ALICE)
        assert lookup.num_cached == 2
        # Her share is full again; the removed namespace holds nothing any more.
        assert await put(served, "alice-0") == Code.RESOURCE_EXHAUSTED
        assert (await served.stub().Delete(emptied, metadata=ALICE)).count == 0


@pytest.mark.asyncio
async def test_a_removed_namespace_stays_removed_after_a_restart(tmp_path: Path) -> None:
    async with serving(tmp_path, max_namespaces_per_tenant=1) as served:
        assert await put(served, "first") == Code.OK
        emptied = pb.BlocksRequest(namespace=wire_namespace(model_id="first"), hashes=keys(2))
        assert (await served.stub().Delete(emptied, metadata=ALICE)).count == 2
        assert await put(served, "second") == Code.OK
    async with serving(tmp_path, max_namespaces_per_tenant=1) as served:
        assert await num_namespaces(served) == 1
        assert await put(served, "third") == Code.RESOURCE_EXHAUSTED  # "second" holds blocks


def test_the_per_tenant_limit_is_within_the_server_limit() -> None:
    with pytest.raises(ConfigError, match="--max-namespaces-per-tenant"):
        ServiceConfig(max_namespaces=4, max_namespaces_per_tenant=5)
    with pytest.raises(ConfigError, match="--max-namespaces-per-tenant"):
        ServiceConfig(max_namespaces_per_tenant=0)


# --- 13: tokens --------------------------------------------------------------------------------


@pytest.mark.parametrize("line", ["tökén-tökén-tökén-tökén alice", "a\u00a0" * 10 + " alice"])
def test_a_tokens_file_with_a_non_ascii_token_is_refused_at_start(
    tmp_path: Path, line: str
) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# tenants\n{'v' * 32} bob\n{line}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"{path}:3"):
        load_tokens(path)


def test_a_tokens_file_that_is_not_utf8_is_refused_at_start(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_bytes(b"\xff\xfe" + b"w" * 32 + b" alice\n")
    with pytest.raises(ConfigError, match="--tokens-file"):
        load_tokens(path)


def test_a_non_ascii_token_is_refused_in_the_config() -> None:
    with pytest.raises(ConfigError, match="printable ASCII"):
        ServiceConfig(tokens={"ü" * 20: "alice"})


@pytest.mark.parametrize("offered", [
    "Bearer " + "ü" * 32, "Bearer \udcff" + "t" * 31, b"Bearer \xff" + b"t" * 31,
    "Bearer " + ALICE_TOKEN[:-1] + "\u0000", "Bearer", "",
])
def test_no_offered_token_makes_authentication_raise(offered: str | bytes) -> None:
    # gRPC's own clients refuse to send metadata that is not printable ASCII; other clients
    # (or a future gRPC) may, and the server must then answer UNAUTHENTICATED, not UNKNOWN.
    assert Authenticator(TOKENS).tenant_of((("authorization", offered),)) is None
    assert Authenticator(TOKENS).tenant_of((("authorization", f"Bearer {ALICE_TOKEN}"),)) == "alice"
