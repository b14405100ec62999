"""Attacks on the Prometheus endpoint and the RPC counting (a review's tests).

What a client can do to the endpoint (hold connections open, send model ids that could break
the exposition), whether counts stay exact under concurrency and for every way a call ends,
whether the counting wrapper changes what a client sees, and what a scrape gets before a store is
attached or after it closed.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from tests.service.test_metrics import requests_by, scrape, tokens_by
from tests.support.harness import BackgroundServer, free_port, serve, serving
from tests.support.rpc_calls import BIG_LAYOUT, NS, Code, put
from tests.support.service_fixtures import (
    ALICE,
    ALL_RPCS,
    ALLOWED_ERRORS,
    payload,
    put_chunks,
    request_for,
    wire_namespace,
)
from tests.support.tiny_blocks import keys
from tierkv import ConfigError, TieredStore
from tierkv.service.config import ServiceConfig
from tierkv.service.metrics_http import ScrapeServer
from tierkv.service.server import TierKVServer
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

WAIT_S = 30.0  # a bound on waits for something that must happen, never a timing assertion


def _metrics_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tierkv-metrics")]


def _closed_by_peer(connection: socket.socket) -> bool:
    """Whether the server closed ``connection`` (EOF or reset) within ``WAIT_S``."""
    connection.settimeout(WAIT_S)
    try:
        return connection.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# --- holding connections open -------------------------------------------------------------


@pytest.mark.asyncio
async def test_idle_connections_do_not_block_scrapes_and_end_with_the_server(
    tmp_path: Path,
) -> None:
    """prometheus_client's server gave each connection a thread that waited for a request
    forever, and stopping it left those threads and sockets behind."""
    served = await serve(tmp_path / "store", metrics_port=free_port())
    port = served.server.metrics_port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
    try:
        assert requests_by(await asyncio.to_thread(scrape, port)) == {}
    finally:
        await served.close()
    try:
        closed = await asyncio.gather(*(asyncio.to_thread(_closed_by_peer, c) for c in idle))
        assert all(closed)
        assert _metrics_threads() == []
    finally:
        for connection in idle:
            connection.close()


def test_connections_past_the_bound_are_refused_and_idle_ones_time_out() -> None:
    registry = CollectorRegistry()
    server = ScrapeServer("127.0.0.1", 0, registry, read_timeout_s=0.2, max_connections=2)
    server.start()
    connections = [socket.create_connection(("127.0.0.1", server.server_port))
                   for _ in range(2)]
    try:
        deadline_s = time.monotonic() + WAIT_S
        while server.num_open_connections < 2 and time.monotonic() < deadline_s:
            time.sleep(0.01)
        assert server.num_open_connections == 2
        with socket.create_connection(("127.0.0.1", server.server_port)) as third:
            assert _closed_by_peer(third)  # every slot is taken
        assert all(_closed_by_peer(c) for c in connections)  # they sent nothing in time
        scrape(server.server_port)  # the slots are free again
    finally:
        for connection in connections:
            connection.close()
        server.close()
    assert server.num_open_connections == 0 and _metrics_threads() == []


@pytest.mark.asyncio
async def test_an_unresolvable_metrics_host_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--metrics-host ''"):
        await serve(tmp_path / "store", metrics_port=free_port(), metrics_host="")


@pytest.mark.asyncio
async def test_a_new_server_takes_over_a_stopped_servers_port_with_fresh_counts(
    tmp_path: Path,
) -> None:
    port = free_port()
    async with serving(tmp_path / "a", metrics_port=port) as first:
        await first.stub().Describe(pb.DescribeRequest(), metadata=ALICE)
        assert requests_by(await asyncio.to_thread(scrape, port)) == {("Describe", "OK"): 1}
    async with serving(tmp_path / "b", metrics_port=port) as second:
        assert second.server.metrics_port == port
        assert requests_by(await asyncio.to_thread(scrape, port)) == {}


# --- how calls end ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_put_cut_by_its_deadline_counts_as_deadline_exceeded(tmp_path: Path) -> None:
    """The handler sees a stream cut by its deadline as a short stream and answers
    INVALID_ARGUMENT, which nobody receives; the client got DEADLINE_EXCEEDED."""
    async with serving(tmp_path / "store", metrics_port=free_port(),
                       host_bytes=16 << 20) as served:
        stub = served.stub()
        spec = wire_namespace(BIG_LAYOUT, model_id="slow")
        sent_first = asyncio.Event()

        async def stalled() -> Any:
            chunks = put_chunks(spec, keys(4, salt="slow"), payload(4, layout=BIG_LAYOUT),
                                sizes=(4096,))
            yield chunks[0]
            sent_first.set()
            await asyncio.sleep(3600)

        call = stub.Put(stalled(), metadata=ALICE, timeout=0.5)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call
        assert failed.value.code() == Code.DEADLINE_EXCEEDED and sent_first.is_set()
        port = served.server.metrics_port
        deadline_s = time.monotonic() + WAIT_S
        while True:
            found = requests_by(await asyncio.to_thread(scrape, port))
            if found or time.monotonic() > deadline_s:
                break
            await asyncio.sleep(0.05)
        assert found == {("Put", "DEADLINE_EXCEEDED"): 1}


@pytest.mark.asyncio
async def test_tokens_count_the_blocks_served_only(tmp_path: Path) -> None:
    """An Acquire of a partial prefix counts its leased blocks; a Get cancelled after its
    first message, a Get of nothing stored and a refused Acquire count none."""
    async with serving(tmp_path / "store", metrics_port=free_port(),
                       host_bytes=64 << 20) as served:
        stub = served.stub()
        spec = wire_namespace(BIG_LAYOUT, model_id="m")
        # 16 MiB: more than the flow-control windows take, so the Get is still sending when
        # the client cancels it.
        stored = keys(256, salt="m")
        assert await put(stub, stored, payload(256, layout=BIG_LAYOUT), spec) == 256
        lease = await stub.Acquire(pb.AcquireRequest(
            namespace=spec, hashes=stored[:3] + keys(5, salt="absent")), metadata=ALICE)
        assert lease.num_blocks == 3
        await stub.Release(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE)
        call = stub.Get(pb.BlocksRequest(namespace=spec, hashes=stored), metadata=ALICE)
        assert (await call.read()).num_blocks == 256
        call.cancel()
        chunks = [c async for c in stub.Get(pb.BlocksRequest(
            namespace=spec, hashes=keys(2, salt="absent")), metadata=ALICE)]
        assert chunks[0].num_blocks == 0
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Acquire(pb.AcquireRequest(namespace=spec, hashes=[b"short"]),
                               metadata=ALICE)
        port = served.server.metrics_port
        deadline_s = time.monotonic() + WAIT_S
        while ("Get", "CANCELLED") not in (found := requests_by(
                await asyncio.to_thread(scrape, port))) and time.monotonic() < deadline_s:
            await asyncio.sleep(0.05)
        assert found[("Get", "CANCELLED")] == 1
        assert tokens_by(await asyncio.to_thread(scrape, port)) == {
            ("alice", "m"): 3 * BIG_LAYOUT.block_size}


# --- concurrency and hostile labels -------------------------------------------------------


def test_counts_are_exact_under_many_clients_and_concurrent_scrapes(tmp_path: Path) -> None:
    server = BackgroundServer(tmp_path / "store", metrics_port=free_port())
    try:
        port = server.served.server.metrics_port
        num_threads, num_calls = 8, 25

        def client() -> None:
            with grpc.insecure_channel(server.tcp_target) as channel:
                stub = pb_grpc.TierKVStub(channel)
                for _ in range(num_calls):
                    stub.Describe(pb.DescribeRequest(), metadata=ALICE)

        threads = [threading.Thread(target=client) for _ in range(num_threads)]
        for thread in threads:
            thread.start()
        seen = []
        while any(thread.is_alive() for thread in threads):
            seen.append(requests_by(scrape(port)).get(("Describe", "OK"), 0))
        for thread in threads:
            thread.join()
        assert seen == sorted(seen)  # a counter never goes back
        assert requests_by(scrape(port)) == {("Describe", "OK"): num_threads * num_calls}
    finally:
        server.close()


HOSTILE_MODEL_IDS = ('a"b', "back\\slash", "new\nline", "cr\rx", "tab\tx", '\\"\n', "a}b{c=x,",
                     "ü🦙\u2028\u0085", "x" * 256, " ", "# HELP")


def test_model_ids_that_could_break_the_exposition_come_back_exactly(tmp_path: Path) -> None:
    server = BackgroundServer(tmp_path / "store", metrics_port=free_port())
    try:
        with grpc.insecure_channel(server.tcp_target) as channel:
            stub = pb_grpc.TierKVStub(channel)
            for index, model_id in enumerate(HOSTILE_MODEL_IDS):
                spec = wire_namespace(model_id=model_id)
                hashes = keys(1, salt=f"hostile-{index}")
                stub.Put(iter(put_chunks(spec, hashes, payload(1))), metadata=ALICE)
                lease = stub.Acquire(pb.AcquireRequest(namespace=spec, hashes=hashes),
                                     metadata=ALICE)
                stub.Release(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE)
        tokens = tokens_by(scrape(server.served.server.metrics_port))
        assert set(tokens) == {("alice", model_id) for model_id in HOSTILE_MODEL_IDS}
    finally:
        server.close()


# --- the wrapper changes nothing a client sees --------------------------------------------


async def _answers(stub: pb_grpc.TierKVStub, channel: grpc.aio.Channel) -> list[Any]:
    """(rpc, case, code, details, trailing metadata) of refused calls of every RPC: no token,
    bytes that do not parse, a hash of the wrong length."""
    out: list[Any] = []
    for rpc in ALL_RPCS:
        method = pb.DESCRIPTOR.services_by_name["TierKV"].methods_by_name[rpc]
        path = f"/tierkv.v1.TierKV/{rpc}"
        kind = {(False, False): channel.unary_unary, (True, False): channel.stream_unary,
                (False, True): channel.unary_stream, (True, True): channel.stream_stream}[
            method.client_streaming, method.server_streaming]
        garbage = [b"\xff\xff\xff"] if method.client_streaming else b"\xff\xff\xff"
        cases: list[tuple[str, Any]] = [
            ("no token", lambda r=rpc: _invoke(stub, r, request_for(r), ())),
            ("garbage", lambda k=kind, p=path, g=garbage: _raw(k(p), g)),
            ("bad hash", lambda r=rpc: _invoke(stub, r, request_for(r, NS, [b"abc"]), ALICE)),
        ]
        for case, call in cases:
            out.append((rpc, case, *(await call())))
    return out


async def _invoke(stub: pb_grpc.TierKVStub, rpc: str, request: Any, metadata: Any) -> Any:
    call: Any
    if rpc == "Put":
        call = stub.Put(iter(request), metadata=metadata)
    else:
        call = getattr(stub, rpc)(request, metadata=metadata)
    return await _ending(call)


async def _raw(callable_: Any, request: Any) -> Any:
    call = callable_(iter(request) if isinstance(request, list) else request, metadata=ALICE)
    return await _ending(call)


async def _ending(call: Any) -> tuple[Any, str, Any]:
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError:
        pass
    return await call.code(), await call.details(), tuple(await call.trailing_metadata() or ())


@pytest.mark.asyncio
async def test_refused_calls_are_answered_alike_with_metrics_on_and_off(tmp_path: Path) -> None:
    answers = []
    for name, port in (("off", 0), ("on", free_port())):
        async with serving(tmp_path / name, metrics_port=port) as served:
            channel = served.channel()
            answers.append(await _answers(pb_grpc.TierKVStub(channel), channel))
    off, on = answers
    assert on == off
    assert {code for _, _, code, _, _ in on} <= ALLOWED_ERRORS | {Code.OK}


# --- before attach, after close -----------------------------------------------------------


@pytest.mark.asyncio
async def test_a_scrape_before_attach_and_after_the_store_closed_answers(tmp_path: Path) -> None:
    from tests.support.harness import short_socket_dir, store_config

    socket_dir = short_socket_dir()
    config = ServiceConfig(listen=(f"unix://{socket_dir}/s.sock",), metrics_port=free_port())
    server = TierKVServer(config)
    server.bind()
    await server.start()
    store = None
    try:
        before = await asyncio.to_thread(scrape, server.metrics_port)
        assert "tierkv_rpc_requests" in before.family_names
        assert "tierkv_tier_used_bytes" not in before.family_names
        store = TieredStore(store_config(tmp_path / "store"))
        await server.attach(store)
        attached = await asyncio.to_thread(scrape, server.metrics_port)
        assert "tierkv_tier_used_bytes" in attached.family_names
        store.close()
        closed = await asyncio.to_thread(scrape, server.metrics_port)
        assert "tierkv_tier_used_bytes" not in closed.family_names
        assert "tierkv_rpc_requests" in closed.family_names
    finally:
        await server.stop(close_store=False)
        if store is not None:
            store.close()


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on TCP ``port`` (Linux's /proc/net)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                found.add(address)
    return found


@pytest.mark.asyncio
async def test_the_endpoint_listens_on_metrics_host_only(tmp_path: Path) -> None:
    async with serving(tmp_path / "store", metrics_port=free_port()) as served:
        port = served.server.metrics_port
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, little-endian
