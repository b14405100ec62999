"""The Prometheus endpoint of a real server, scraped over HTTP after a known workload.

Every figure is checked exactly: RPC counts per method and status code against what the
server's recording servicer saw, the store's figures against ``TieredStore.stats()``, and the
prefill tokens saved against the blocks each Get and Acquire served. The helpers at the top
(``scrape``, ``Scraped``) serve the other metrics tests too.
"""

from __future__ import annotations

import asyncio
import collections
import math
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.support.client_harness import AnyClient, LiveServer, ServerFactory, ns
from tests.support.harness import BOB_TOKEN, free_port, serve, serving
from tests.support.rpc_calls import NS, Code, expect, put
from tests.support.service_fixtures import ALICE, bearer, get_blocks, payload, wire_namespace
from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, blocks, keys
from tierkv import ConfigError, KVLayout, Tier
from tierkv.service.config import ServiceConfig
from tierkv.service.metrics import DURATION_BUCKETS_S, MAX_TOKEN_SERIES, OTHER_MODEL
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


def sync_stub(target: str) -> tuple[grpc.Channel, pb_grpc.TierKVStub]:
    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.TierKVStub(channel)


# --- the whole endpoint after a client workload ----------------------------------------------


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


# --- prefill tokens saved ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_tokens_saved_use_the_block_size_count_rank_0_only_and_bound_the_models(
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
        # One block each of MAX_TOKEN_SERIES + 6 more models.
        num_models = MAX_TOKEN_SERIES + 6
        for index in range(num_models):
            spec = wire_namespace(model_id=f"model-{index}")
            assert await put(stub, keys(1, salt=str(index)), payload(1), spec) == 1
            assert (await get_blocks(stub, spec, keys(1, salt=str(index))))[0] == 1
        tokens = tokens_by(await asyncio.to_thread(scrape, port))
    assert tokens.pop(("alice", "m16")) == 2 * 16
    num_own = MAX_TOKEN_SERIES - 1  # m16 holds the first series
    assert tokens == {
        **{("alice", f"model-{i}"): TINY_TOKENS for i in range(num_own)},
        ("alice", OTHER_MODEL): (num_models - num_own) * TINY_TOKENS,
    }


# --- status codes of every way a call can end --------------------------------------------


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


# --- the endpoint's life ------------------------------------------------------------------


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
