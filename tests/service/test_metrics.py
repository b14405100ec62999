"""The Prometheus endpoint of a real server, scraped over HTTP after a known workload.

Every figure is checked exactly: RPC counts per method and status code against what the
server's recording servicer saw, the store's figures against ``TieredStore.stats()``, and the
prefill tokens saved against the blocks each Get and Acquire served. The helpers at the top
(``scrape``, ``Scraped``) serve the other metrics tests too.

What a client can do to the endpoint (hold connections open, send model ids that could break
the exposition), counts that stay exact under concurrency and for every way a call ends, a
counting wrapper that changes nothing a client sees, and what a scrape gets before a store is
attached or after it closed.
"""

from __future__ import annotations

import asyncio
import collections
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.support.client_harness import AnyClient, LiveServer, ServerFactory, ns
from tests.support.harness import BOB_TOKEN, BackgroundServer, free_port, serve, serving
from tests.support.rpc_calls import BIG_LAYOUT, NS, Code, expect, put
from tests.support.service_fixtures import (
    ALICE,
    ALL_RPCS,
    ALLOWED_ERRORS,
    BOB,
    bearer,
    get_blocks,
    payload,
    put_chunks,
    request_for,
    wire_namespace,
)
from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, blocks, keys
from tierkv import ConfigError, KVLayout, Tier, TieredStore
from tierkv.service.config import ServiceConfig
from tierkv.service.metrics import DURATION_BUCKETS_S, MAX_MODEL_SERIES_PER_TENANT, OTHER_MODEL
from tierkv.service.metrics_http import ScrapeServer
from tierkv.service.server import TierKVServer
from tierkv.service.servicer import TierKVServicer
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

TINY_TOKENS = TINY_LAYOUT.block_size


@dataclass(frozen=True)
class Scraped:
    """One scrape: every sample by ``(sample name, sorted labels)``, and the family names."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    family_names: frozenset[str]

    def value(self, name: str, **labels: str) -> float:
        """The sample ``name{labels}``; AssertionError when it was not exported."""
        key = (name, tuple(sorted(labels.items())))
        assert key in self.samples, f"no sample {name}{labels}"
        return self.samples[key]

    def series(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Every sample named ``name``, by its labels."""
        return {labels: value for (sample, labels), value in self.samples.items()
                if sample == name}


def parse(text: str) -> Scraped:
    """A Prometheus text exposition, parsed by ``prometheus_client``'s own parser."""
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        for sample in family.samples:
            assert isinstance(sample, Sample)
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return Scraped(samples, frozenset(names))


def scrape(port: int, host: str = "127.0.0.1") -> Scraped:
    """GET /metrics on ``host:port`` (blocking; from async code, run it in a thread)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return parse(response.read().decode("utf-8"))


def requests_by(scraped: Scraped) -> dict[tuple[str, str], float]:
    """``(method, code) -> calls`` of the nonzero ``tierkv_rpc_requests_total`` series."""
    return {(dict(labels)["method"], dict(labels)["code"]): value
            for labels, value in scraped.series("tierkv_rpc_requests_total").items() if value}


def tokens_by(scraped: Scraped) -> dict[tuple[str, str], float]:
    """``(tenant, model) -> tokens`` of ``tierkv_prefill_tokens_saved_total``."""
    return {(dict(labels)["tenant"], dict(labels)["model"]): value
            for labels, value in scraped.series("tierkv_prefill_tokens_saved_total").items()}


def check_histograms(scraped: Scraped, expected_calls: Mapping[str, int]) -> None:
    """Each called method's histogram: cumulative buckets at the fixed bounds and ``+Inf``,
    the last and ``_count`` equal to its calls."""
    for method, num_calls in expected_calls.items():
        by_bound = {float(dict(labels)["le"]): value for labels, value in
                    scraped.series("tierkv_rpc_duration_seconds_bucket").items()
                    if dict(labels)["method"] == method}
        assert sorted(by_bound) == [*DURATION_BUCKETS_S, math.inf], method
        buckets = [by_bound[bound] for bound in sorted(by_bound)]
        assert buckets == sorted(buckets), method
        assert buckets[-1] == num_calls, method
        assert scraped.value("tierkv_rpc_duration_seconds_count", method=method) == num_calls
        assert scraped.value("tierkv_rpc_duration_seconds_sum", method=method) > 0


def check_store_figures(scraped: Scraped, server: LiveServer) -> None:
    """The store families equal ``stats()`` (nothing ran between the scrape and this)."""
    stats = server.store.stats()
    for tier, tier_stats in stats.tiers.items():
        label = tier.label
        assert scraped.value("tierkv_tier_capacity_bytes", tier=label) == tier_stats.capacity_bytes
        assert scraped.value("tierkv_tier_used_bytes", tier=label) == tier_stats.used_bytes
        assert scraped.value("tierkv_tier_blocks", tier=label) == tier_stats.num_blocks
        for field in ("hits", "misses", "evictions", "promotions_in", "demotions_in"):
            assert scraped.value(f"tierkv_tier_{field}_total", tier=label) == getattr(
                tier_stats, field), (field, label)
    for name, value in (
        ("tierkv_promotions_total", stats.promotions), ("tierkv_demotions_total", stats.demotions),
        ("tierkv_failed_demotions_total", stats.failed_demotions),
        ("tierkv_checksum_failures_total", stats.checksum_failures),
        ("tierkv_store_puts_total", stats.puts), ("tierkv_store_gets_total", stats.gets),
        ("tierkv_namespaces", stats.num_namespaces), ("tierkv_pinned_blocks", stats.num_pinned),
        ("tierkv_leases_active", stats.num_leases),
        ("tierkv_leases_expired_total", stats.leases_expired),
        ("tierkv_sessions", stats.num_sessions),
    ):
        assert scraped.value(name) == value, name
    assert {(dict(labels)["from"], dict(labels)["to"]): value for labels, value in
            scraped.series("tierkv_bytes_moved_total").items()} == {
        (source.label, destination.label): num_bytes
        for (source, destination), num_bytes in stats.bytes_moved.items()}
    tenants = server.store.tenant_stats()
    assert tenants, "no tenant rows"
    for tenant in tenants:  # the tenant families, one series per (tenant, tier)
        labels = {"tenant": tenant.tenant, "tier": tenant.tier.label}
        for name, field in (("share_bytes", "share_bytes"), ("cap_bytes", "cap_bytes"),
                            ("used_bytes", "used_bytes"), ("blocks", "num_blocks"),
                            ("hits_total", "hits"), ("misses_total", "misses"),
                            ("evictions_total", "evictions"),
                            ("evicted_by_others_total", "evicted_by_others")):
            assert scraped.value(f"tierkv_tenant_{name}", **labels) == getattr(tenant, field), (
                name, labels)
    assert len(scraped.series("tierkv_tenant_used_bytes")) == len(tenants)


def sync_stub(target: str) -> tuple[grpc.Channel, pb_grpc.TierKVStub]:
    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.TierKVStub(channel)


# --- the whole endpoint after a client workload ------------------------------------------------


def test_every_call_is_counted_once_with_its_final_code_and_the_store_figures_match(
    make_server: ServerFactory, open_client: Callable[..., AnyClient]
) -> None:
    server = make_server(metrics_port=free_port())
    port = server.served.server.metrics_port
    assert port == server.served.server.config.metrics_port
    before = scrape(port)
    assert requests_by(before) == {} and tokens_by(before) == {}

    alice_shm, alice_stream = open_client(server, "shm"), open_client(server, "stream")
    namespace, hashes, data = ns("model-a"), keys(8, salt="a"), blocks(8, seed=3)
    assert alice_shm.put(namespace, hashes, data) == 8
    assert alice_shm.get(namespace, hashes).shape[0] == 8  # Acquire: 8 blocks
    assert alice_stream.get(namespace, hashes).shape[0] == 8  # Get: 8 blocks
    assert alice_stream.get(namespace, keys(3, salt="nowhere")).shape[0] == 0  # a miss
    assert alice_shm.save_session(namespace, "chat-1", list(range(32))) == 32
    bob = open_client(server, "stream", token=BOB_TOKEN)
    assert bob.get(namespace, hashes).shape[0] == 0  # bob's namespace is not alice's
    assert bob.put(namespace, hashes[:2], data[:2]) == 2
    assert bob.get(namespace, hashes).shape[0] == 2
    channel, stub = sync_stub(server.tcp_target)
    with channel:
        with pytest.raises(grpc.RpcError) as refused:
            stub.Describe(pb.DescribeRequest(), metadata=bearer("x" * 32))
        assert refused.value.code() == Code.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as invalid:
            stub.Lookup(pb.LookupRequest(namespace=NS, hashes=[b"abc"]), metadata=ALICE)
        assert invalid.value.code() == Code.INVALID_ARGUMENT

    scraped = scrape(port)
    calls = collections.Counter(method for _, method in server.spy.calls)
    errors = {("Describe", "UNAUTHENTICATED"): 1, ("Lookup", "INVALID_ARGUMENT"): 1}
    expected = {(method, "OK"): num_calls - sum(n for (m, _), n in errors.items() if m == method)
                for method, num_calls in calls.items()}
    expected.update(errors)
    assert requests_by(scraped) == {key: n for key, n in expected.items() if n}
    assert calls["Acquire"] >= 1 and calls["Get"] >= 4  # both data paths were taken
    check_histograms(scraped, calls)
    # alice: 8 blocks by Acquire and 8 by Get; bob: 2 by Get; misses serve nothing.
    assert tokens_by(scraped) == {("alice", "model-a"): 16 * TINY_TOKENS,
                                  ("bob", "model-a"): 2 * TINY_TOKENS}
    check_store_figures(scraped, server)
    assert scraped.value("tierkv_tier_blocks", tier="host") == 10
    assert scraped.value("tierkv_tier_capacity_bytes", tier="host") == 64 * BLOCK_BYTES
    assert scraped.value("tierkv_sessions") == 1 and scraped.value("tierkv_leases_active") == 0
    assert scraped.value("tierkv_tier_hits_total", tier="host") >= 18
    assert scraped.value("tierkv_tenant_blocks", tenant="bob", tier="host") == 2


def test_evictions_and_bytes_moved_follow_the_store(
    make_server: ServerFactory, open_client: Callable[..., AnyClient]
) -> None:
    """A HOST tier of 8 blocks given 12: 4 are demoted to disk (evictions, demotions, bytes
    moved host->disk); reading them back promotes them."""
    server = make_server(host_bytes=8 * BLOCK_BYTES, metrics_port=free_port())
    client = open_client(server, "stream")
    namespace, hashes = ns("model-e"), keys(12, salt="e")
    for start in range(0, 12, 4):
        assert client.put(namespace, hashes[start:start + 4], blocks(4, seed=start)) == 4
    server.store.flush()
    assert client.get(namespace, hashes[:4]).shape[0] == 4
    scraped = scrape(server.served.server.metrics_port)
    check_store_figures(scraped, server)
    assert scraped.value("tierkv_tier_evictions_total", tier="host") >= 4
    assert scraped.value("tierkv_bytes_moved_total", **{"from": "host", "to": "disk"}) >= (
        4 * BLOCK_BYTES)
    assert scraped.value("tierkv_tier_hits_total", tier="disk") >= 1
    assert tokens_by(scraped) == {("alice", "model-e"): 4 * TINY_TOKENS}
    assert server.store.stats().tiers[Tier.HOST].used_bytes <= 8 * BLOCK_BYTES


# --- prefill tokens saved ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_tokens_saved_use_the_block_size_count_rank_0_only_and_bound_each_tenants_models(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path / "store", metrics_port=free_port()) as served:
        stub = served.stub()
        port = served.server.metrics_port
        # block_size 0 on the wire means 16 tokens a block.
        layout_16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)
        spec_16 = wire_namespace(layout_16, model_id="m16", block_size=0)
        assert await put(stub, keys(2, salt="16"), payload(2, layout=layout_16), spec_16) == 2
        assert (await get_blocks(stub, spec_16, keys(2, salt="16")))[0] == 2
        # Rank 1 reads its shard of tokens rank 0 counts: not counted again.
        rank_1 = wire_namespace(model_id="m16", tp_rank=1, tp_size=2)
        assert await put(stub, keys(1, salt="r1"), payload(1), rank_1) == 1
        assert (await get_blocks(stub, rank_1, keys(1, salt="r1")))[0] == 1
        # One block each of MAX_MODEL_SERIES_PER_TENANT + 6 more models.
        num_models = MAX_MODEL_SERIES_PER_TENANT + 6
        for index in range(num_models):
            spec = wire_namespace(model_id=f"model-{index}")
            assert await put(stub, keys(1, salt=str(index)), payload(1), spec) == 1
            assert (await get_blocks(stub, spec, keys(1, salt=str(index))))[0] == 1
        # Alice's models used up her series, not Bob's: his model has its own.
        bob_spec = wire_namespace(model_id="bob-model")
        assert await put(stub, keys(1, salt="bob"), payload(1), bob_spec, BOB) == 1
        assert (await get_blocks(stub, bob_spec, keys(1, salt="bob"), BOB))[0] == 1
        tokens = tokens_by(await asyncio.to_thread(scrape, port))
    assert tokens.pop(("alice", "m16")) == 2 * 16
    assert tokens.pop(("bob", "bob-model")) == TINY_TOKENS
    num_own = MAX_MODEL_SERIES_PER_TENANT - 1  # m16 holds her first series
    assert tokens == {
        **{("alice", f"model-{i}"): TINY_TOKENS for i in range(num_own)},
        ("alice", OTHER_MODEL): (num_models - num_own) * TINY_TOKENS,
    }


# --- status codes of every way a call can end --------------------------------------------------


class EndingServicer(TierKVServicer):
    """Describe raises, Stats aborts, ListSessions waits until cancelled, Get writes its one
    message with ``context.write`` (a coroutine, not an async generator)."""

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__(config)
        self.waiting = asyncio.Event()

    async def Describe(self, request: Any, context: Any) -> Any:
        raise RuntimeError("a bug in a handler")

    async def Stats(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.NOT_FOUND, "aborted on purpose")

    async def ListSessions(self, request: Any, context: Any) -> Any:
        self.waiting.set()
        await asyncio.sleep(3600)

    async def Get(self, request: Any, context: Any) -> Any:  # type: ignore[override]
        await context.write(pb.GetChunk(num_blocks=0))


async def wait_for_requests(port: int, expected: dict[tuple[str, str], float]) -> None:
    """Until the endpoint reports ``expected`` among its nonzero request counts (a cancelled
    call is counted when the server sees the cancellation, after the client moved on)."""
    deadline_s = time.monotonic() + 30
    while True:
        found = requests_by(await asyncio.to_thread(scrape, port))
        if expected.items() <= found.items() or time.monotonic() > deadline_s:
            assert expected.items() <= found.items(), found
            return
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_raised_aborted_cancelled_and_expired_calls_are_counted_with_their_code(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path / "store", servicer=EndingServicer,
                       metrics_port=free_port()) as served:
        servicer = served.server.servicer
        assert isinstance(servicer, EndingServicer)
        stub = served.stub()
        await expect(Code.UNKNOWN, stub.Describe(pb.DescribeRequest(), metadata=ALICE))
        await expect(Code.NOT_FOUND, stub.Stats(pb.StatsRequest(), metadata=ALICE))
        chunks = [chunk async for chunk in stub.Get(pb.BlocksRequest(namespace=NS),
                                                    metadata=ALICE)]
        assert chunks == [pb.GetChunk(num_blocks=0)]
        call = stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE)
        await servicer.waiting.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        servicer.waiting.clear()
        await expect(Code.DEADLINE_EXCEEDED,
                     stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE, timeout=0.2))
        await wait_for_requests(served.server.metrics_port, {
            ("Describe", "UNKNOWN"): 1, ("Stats", "NOT_FOUND"): 1, ("Get", "OK"): 1,
            ("ListSessions", "CANCELLED"): 1, ("ListSessions", "DEADLINE_EXCEEDED"): 1,
        })


# --- the endpoint's life -----------------------------------------------------------------------


def refused(port: int) -> bool:
    try:
        scrape(port)
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


@pytest.mark.asyncio
async def test_each_server_has_its_own_registry_and_its_endpoint_stops_with_it(
    tmp_path: Path,
) -> None:
    first = await serve(tmp_path / "a", metrics_port=free_port())
    second = await serve(tmp_path / "b", metrics_port=free_port())
    ports = (first.server.metrics_port, second.server.metrics_port)
    try:
        await first.stub().Describe(pb.DescribeRequest(), metadata=ALICE)
        scraped = [await asyncio.to_thread(scrape, port) for port in ports]
        assert requests_by(scraped[0]) == {("Describe", "OK"): 1}
        assert requests_by(scraped[1]) == {}
    finally:
        await first.close()
        await second.close()
    for port in ports:
        assert await asyncio.to_thread(refused, port)


@pytest.mark.asyncio
async def test_port_0_serves_no_metrics_and_a_busy_port_is_a_config_error(tmp_path: Path) -> None:
    async with serving(tmp_path / "off") as served:
        assert served.server.metrics_port == 0 and not served.server.metrics.enabled
        await served.stub().Describe(pb.DescribeRequest(), metadata=ALICE)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match="--metrics-port"):
            await serve(tmp_path / "busy", metrics_port=busy.getsockname()[1])


# --- what a client can do to the endpoint; counts under concurrency and every way a call ends ---


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


# --- holding connections open ------------------------------------------------------------------


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


# --- how calls end -----------------------------------------------------------------------------


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


# --- concurrency and hostile labels ------------------------------------------------------------


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


# --- the wrapper changes nothing a client sees -------------------------------------------------


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


# --- before attach, after close ----------------------------------------------------------------


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
