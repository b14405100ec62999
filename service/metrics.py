"""The Prometheus endpoint: what the store holds, what every RPC answered, and the prefill
tokens the cache saved. ``ServerMetrics(config)`` owns one registry per server, served on
``metrics_host:metrics_port`` (0: no endpoint, no recording); families are prefixed ``tierkv_``.
RPC counters are written only on the server's event loop; store figures are read at scrape time.
Design: docs/design/operations.md#metrics
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import inspect
import socket
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tierkv.errors import ConfigError, StoreClosedError
from tierkv.service.calls import CALLER_TENANT
from tierkv.service.config import ServiceConfig
from tierkv.service.convert import num_copied_from
from tierkv.service.metrics_http import ScrapeServer
from tierkv.store import StoreStats, TieredStore, received_blocks
from tierkv.types import TenantTierStats
from tierkv.wire.limits import MAX_CARRIED_RELEASES

if TYPE_CHECKING:
    from tierkv.service.events import EventPublisher

# Upper bounds of the RPC latency buckets: 50 us (a lookup answered on the loop) to 10 s (a
# large Put over a slow link); +Inf follows.
DURATION_BUCKETS_S = (
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
    500e-3, 1.0, 2.5, 5.0, 10.0,
)
MAX_MODEL_SERIES_PER_TENANT = 32
"""Models of one tenant with a series of their own in ``tierkv_prefill_tokens_saved``; past
it the tenant's other models count as ``OTHER_MODEL``. Per tenant, so that one tenant's models
never push another's into it (tenants are bounded by the tokens file)."""
# Read leases whose tokens wait for their Release; past it the oldest are forgotten (uncounted:
# a lease never released is one whose client died before it finished copying).
MAX_PENDING_LEASES = 65536
OTHER_MODEL = "other"
# proto3's 0 for Namespace.block_size (KVLayout's default, as tierkv.wire reads it).
DEFAULT_BLOCK_SIZE = 16

_OK, _CANCELLED, _UNKNOWN, _DEADLINE_EXCEEDED, _FAILED_PRECONDITION = 0, 1, 2, 4, 9
# A Release that counts its lease's tokens: OK, or refused because the lease had expired (the
# client's copy was checked all the same). Not another caller's Release of the lease.
_RELEASE_COUNTED = (_OK, _FAILED_PRECONDITION)
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_NUM_CODES = max(_CODE_NAMES) + 1
# As prometheus_client writes its own histograms' bounds ("5e-05", "0.001", "1.0").
_BUCKET_LABELS = [*(repr(float(bound)) for bound in DURATION_BUCKETS_S), "+Inf"]


class MethodStats:
    """One RPC method's calls by status code and its latency histogram (not cumulative:
    ``num_in_bucket[i]`` counts durations in ``(bound[i-1], bound[i]]``, the last one past
    every bound)."""

    __slots__ = ("num_by_code", "num_in_bucket", "sum_s")

    def __init__(self) -> None:
        self.num_by_code = [0] * _NUM_CODES
        self.num_in_bucket = [0] * (len(DURATION_BUCKETS_S) + 1)
        self.sum_s = 0.0

    def observe(self, duration_s: float, code: int) -> None:
        """Count one call that ended with ``code`` (a status code's number) after
        ``duration_s``."""
        self.num_by_code[code if 0 <= code < _NUM_CODES else _UNKNOWN] += 1
        self.num_in_bucket[bisect.bisect_left(DURATION_BUCKETS_S, duration_s)] += 1
        self.sum_s += duration_s


def _code_number(code: Any) -> int:
    """``context.code()`` as a number: grpc.aio keeps an int (0 until a code is set); a
    ``grpc.StatusCode`` is accepted too."""
    if type(code) is int:
        return code
    if isinstance(code, grpc.StatusCode):
        return int(code.value[0])
    return _OK if code is None else _UNKNOWN


def _failure_code(exc: BaseException, context: grpc.aio.ServicerContext) -> int:
    """The status a handler that raised ``exc`` ends with."""
    if isinstance(exc, grpc.aio.AbortError):  # context.abort set it
        return _code_number(context.code())
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        remaining_s = context.time_remaining()
        return _DEADLINE_EXCEEDED if remaining_s is not None and remaining_s <= 0 else _CANCELLED
    return _UNKNOWN  # what grpc answers for any other exception


def _final_code(context: grpc.aio.ServicerContext) -> int:
    """The status a handler that returned ends with: the code it set, or DEADLINE_EXCEEDED
    when the call's deadline passed meanwhile, which is what the client got. (A Put stream
    cut by its deadline looks to the handler like a stream that ended early: it answers
    INVALID_ARGUMENT for the missing bytes, and nobody receives that.)"""
    remaining_s = context.time_remaining()
    if remaining_s is not None and remaining_s <= 0:
        return _DEADLINE_EXCEEDED
    return _code_number(context.code())


class RpcRecorder:
    """Counts every call of the wrapped handlers and the prefill tokens they served.

    Written only from the server's event loop; ``collect`` (any thread) reads it."""

    def __init__(self, config: ServiceConfig) -> None:
        self._methods: dict[str, MethodStats] = {}
        self._tokens_saved: dict[tuple[str, str], int] = {}
        self._num_models: dict[str, int] = {}  # by tenant: models with a series of their own
        # Read leases granted, not yet released: lease id -> (tenant, model, block_size, blocks).
        self._pending_leases: dict[bytes, tuple[str, str, int, int]] = {}

    def wrap(self, method: str, server_streaming: bool, handler: Callable[..., Any]
             ) -> Callable[..., Any]:
        """``handler`` (a coroutine, or for ``server_streaming`` an async generator or a
        coroutine) counted under ``method``."""
        stats = self._methods.setdefault(method, MethodStats())
        # A stream-out handler may also be a coroutine that writes with context.write.
        if server_streaming and inspect.isasyncgenfunction(handler):
            return self._wrap_stream_out(method, stats, handler)
        return self._wrap_unary(method, stats, handler)

    def _wrap_unary(self, method: str, stats: MethodStats,
                    handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        acquires, releases = method == "Acquire", method == "Release"
        carries = method in ("Acquire", "Allocate")  # releases done before the call's own work

        async def counted(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start_s = time.perf_counter()
            try:
                response = await handler(request, context)
            except BaseException as exc:
                code = _failure_code(exc, context)
                stats.observe(time.perf_counter() - start_s, code)
                if releases and code in _RELEASE_COUNTED:
                    self._count_released(request)
                elif carries:
                    self._count_carried(request)
                raise
            code = _final_code(context)
            stats.observe(time.perf_counter() - start_s, code)
            if acquires and code == _OK and response is not None and response.num_blocks:
                self._lease_granted(request, response)
            elif releases and code in _RELEASE_COUNTED:
                self._count_released(request)
            if carries:
                self._count_carried(request)
            return response

        return counted

    def _wrap_stream_out(self, method: str, stats: MethodStats,
                         handler: Callable[..., AsyncGenerator[Any, None]]
                         ) -> Callable[..., AsyncIterator[Any]]:
        counts_tokens = method == "Get"

        async def counted(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start_s = time.perf_counter()
            num_blocks = -1
            try:
                # Closed here, not left to the collector: the handler's finally gives back
                # its buffer.
                async with contextlib.aclosing(handler(request, context)) as messages:
                    async for message in messages:
                        if counts_tokens and num_blocks < 0:
                            num_blocks = message.num_blocks
                        yield message
            except BaseException as exc:
                stats.observe(time.perf_counter() - start_s, _failure_code(exc, context))
                raise
            code = _final_code(context)
            stats.observe(time.perf_counter() - start_s, code)
            if counts_tokens and code == _OK and num_blocks > 0:
                self._count_tokens(request, num_blocks)

        return counted

    def _lease_granted(self, request: Any, response: Any) -> None:
        """Remember a read lease's tokens until its Release says how many blocks the client
        kept (decision 3)."""
        spec = request.namespace
        if spec.tp_rank != 0:
            return
        pending = self._pending_leases
        pending[response.lease_id] = (CALLER_TENANT.get(), spec.model_id,
                                      spec.block_size or DEFAULT_BLOCK_SIZE, response.num_blocks)
        while len(pending) > MAX_PENDING_LEASES:  # leases never released: their clients died
            del pending[next(iter(pending))]

    def _count_carried(self, request: Any) -> None:
        """The releases an Acquire or Allocate carried (the servicer does them before its own
        work; a failed call's client sends them again, and a lease counts once)."""
        releases = getattr(request, "releases", ())
        if len(releases) <= MAX_CARRIED_RELEASES:  # more: refused, none done
            for release in releases:
                self._count_released(release)

    def _count_released(self, request: Any) -> None:
        lease_id = getattr(request, "lease_id", None)  # (a malformed request has none)
        if not isinstance(lease_id, bytes):
            return
        granted = self._pending_leases.get(lease_id)
        if granted is None or granted[0] != CALLER_TENANT.get():  # not this caller's lease
            return
        del self._pending_leases[lease_id]
        tenant, model_id, block_size, num_leased = granted
        num_kept = received_blocks(num_leased, request.corrupt_indices,
                                   num_copied_from(request))
        if num_kept:
            self._add_tokens(tenant, model_id, num_kept * block_size)

    def _count_tokens(self, request: Any, num_blocks: int) -> None:
        spec = request.namespace
        if spec.tp_rank != 0:
            return
        self._add_tokens(CALLER_TENANT.get(), spec.model_id,
                         num_blocks * (spec.block_size or DEFAULT_BLOCK_SIZE))

    def _add_tokens(self, tenant: str, model_id: str, num_tokens: int) -> None:
        key = (tenant, model_id)
        tokens_saved = self._tokens_saved
        if key not in tokens_saved:
            num_models = self._num_models.get(tenant, 0)
            if num_models >= MAX_MODEL_SERIES_PER_TENANT:
                key = (tenant, OTHER_MODEL)
            else:
                self._num_models[tenant] = num_models + 1
        tokens_saved[key] = tokens_saved.get(key, 0) + num_tokens

    def collect(self) -> Iterator[Metric]:
        """The RPC families: requests by method and code (OK for every method, others once
        seen), latency histograms of the methods called, tokens saved."""
        requests = CounterMetricFamily(
            "tierkv_rpc_requests", "TierKV calls answered, by method and gRPC status code.",
            labels=("method", "code"))
        durations = HistogramMetricFamily(
            "tierkv_rpc_duration_seconds",
            "Time from a TierKV call's request to its status, in the server.", labels=("method",))
        for method, stats in sorted(self._methods.items()):
            by_code = list(stats.num_by_code)
            for code, num_calls in enumerate(by_code):
                if num_calls or code == _OK:
                    requests.add_metric((method, _CODE_NAMES.get(code, "UNKNOWN")), num_calls)
            in_bucket = list(stats.num_in_bucket)
            if sum(in_bucket):
                cumulative, buckets = 0, []
                for label, num_calls in zip(_BUCKET_LABELS, in_bucket, strict=True):
                    cumulative += num_calls
                    buckets.append((label, cumulative))
                durations.add_metric((method,), buckets, stats.sum_s)
        tokens = CounterMetricFamily(
            "tierkv_prefill_tokens_saved",
            "Prompt tokens whose K/V were served from the cache (Get, Acquire) instead of a "
            f"prefill; tensor-parallel rank 0 only; a tenant's models past its first "
            f"{MAX_MODEL_SERIES_PER_TENANT} count as '{OTHER_MODEL}'.", labels=("tenant", "model"))
        for (tenant, model), num_tokens in sorted(dict(self._tokens_saved).items()):
            tokens.add_metric((tenant, model), num_tokens)
        yield from (requests, durations, tokens)


class _RpcCollector(Collector):
    def __init__(self, recorder: RpcRecorder) -> None:
        self._recorder = recorder

    def collect(self) -> Iterable[Metric]:
        return self._recorder.collect()


class _EventsCollector(Collector):
    """The KV-event publisher's counters (``tierkv.service.events``)."""

    def __init__(self, publisher: EventPublisher) -> None:
        self._publisher = publisher

    def collect(self) -> Iterable[Metric]:
        counters = self._publisher.counters
        for name, value, text in (
            ("events_published", counters.events_published, "KV events published"),
            ("events_batches_published", counters.batches_published,
             "KV event batches published"),
            ("events_dropped", self._publisher.num_dropped,
             "store records dropped because the publisher fell behind (their namespaces "
             "were restated)"),
            ("events_batches_replayed", counters.batches_replayed,
             "KV event batches replayed to subscribers"),
            ("events_resyncs", counters.resyncs, "resync requests answered (each restates "
             "its topic, or every topic)"),
            ("events_bad_requests", counters.bad_requests,
             "malformed replay or resync requests"),
        ):
            family = CounterMetricFamily(f"tierkv_{name}", text)
            family.add_metric([], value)
            yield family
        from tierkv.service.events import model_name  # (zmq: only with a publisher)

        info = GaugeMetricFamily(
            "tierkv_events_endpoint_info",
            "where each namespace's KV events are published (value 1): in router mode, what "
            "to register with a router as one worker of one model",
            labels=["namespace", "tenant", "model", "block_size", "topic", "endpoint",
                    "replay_endpoint"])
        for where in self._publisher.endpoints():
            namespace = where.namespace
            info.add_metric([namespace.id.hex(), namespace.tenant, model_name(namespace.model_id),
                             str(namespace.layout.block_size), where.topic, where.endpoint,
                             where.replay_endpoint], 1)
        yield info


class StoreCollector(Collector):
    """The store's figures, read from ``stats()`` at each scrape (nothing before ``attach``
    or once the store is closed)."""

    def __init__(self) -> None:
        self.store: TieredStore | None = None

    def collect(self) -> Iterable[Metric]:
        """Every store family, from one consistent ``stats()`` snapshot."""
        store = self.store
        if store is None:
            return []
        try:
            stats = store.stats()
            tenants = store.tenant_stats()
        except StoreClosedError:
            return []
        return [*_tier_families(stats), *_store_families(stats), *_remote_families(stats),
                *_tenant_families(tenants)]


def _tier_families(stats: StoreStats) -> Iterator[Metric]:
    tiers = list(stats.tiers.values())
    for name, kind, text, field in (
        ("capacity_bytes", GaugeMetricFamily, "Bytes the tier may hold (its budget).",
         "capacity_bytes"),
        ("used_bytes", GaugeMetricFamily, "Bytes the tier holds, in-flight copies included.",
         "used_bytes"),
        ("blocks", GaugeMetricFamily, "Blocks with a copy in the tier.", "num_blocks"),
        ("stored_bytes", GaugeMetricFamily,
         "KV bytes of the blocks the tier holds (stored / used: its utilisation).",
         "stored_bytes"),
        ("hits", CounterMetricFamily, "Blocks read whose fastest copy was in the tier.", "hits"),
        ("misses", CounterMetricFamily,
         "Blocks read that the tier lacked (found lower down, or nowhere).", "misses"),
        ("evictions", CounterMetricFamily, "Blocks evicted from the tier.", "evictions"),
        ("promotions_in", CounterMetricFamily, "Blocks promoted into the tier.",
         "promotions_in"),
        ("demotions_in", CounterMetricFamily, "Blocks demoted into the tier.", "demotions_in"),
    ):
        family = kind(f"tierkv_tier_{name}", text, labels=("tier",))
        for tier in tiers:
            family.add_metric((tier.tier.label,), getattr(tier, field))
        yield family


def _tenant_families(tenants: Sequence[TenantTierStats]) -> Iterator[Metric]:
    """Each tenant's share of each tier (``TieredStore.tenant_stats``), labelled by tenant and
    tier: as many tenants as the tokens file names (or ``default``), never more."""
    for name, kind, text, field in (
        ("share_bytes", GaugeMetricFamily,
         "Bytes of the tier guaranteed to the tenant (no other tenant evicts within them).",
         "share_bytes"),
        ("cap_bytes", GaugeMetricFamily, "The most bytes of the tier the tenant may hold.",
         "cap_bytes"),
        ("used_bytes", GaugeMetricFamily,
         "Bytes of the tier the tenant holds (stored, read, reserved).", "used_bytes"),
        ("blocks", GaugeMetricFamily, "The tenant's blocks with a copy in the tier.",
         "num_blocks"),
        ("hits", CounterMetricFamily, "The tenant's blocks read whose fastest copy was here.",
         "hits"),
        ("misses", CounterMetricFamily, "The tenant's blocks read that the tier lacked.",
         "misses"),
        ("evictions", CounterMetricFamily, "The tenant's blocks evicted from the tier.",
         "evictions"),
        ("evicted_by_others", CounterMetricFamily,
         "The tenant's blocks evicted from the tier to make room for another tenant (only "
         "ever while it held more than its share).", "evicted_by_others"),
    ):
        family = kind(f"tierkv_tenant_{name}", text, labels=("tenant", "tier"))
        for tenant in tenants:
            family.add_metric((tenant.tenant, tenant.tier.label), getattr(tenant, field))
        yield family


def _store_families(stats: StoreStats) -> Iterator[Metric]:
    for name, kind, text, value in (
        ("promotions", CounterMetricFamily, "Blocks promoted to a faster tier.", stats.promotions),
        ("demotions", CounterMetricFamily, "Blocks demoted to a slower tier.", stats.demotions),
        ("failed_demotions", CounterMetricFamily,
         "Demotions that failed (the block was dropped).", stats.failed_demotions),
        ("checksum_failures", CounterMetricFamily,
         "Blocks whose bytes failed their checksum (dropped, served as misses).",
         stats.checksum_failures),
        ("store_puts", CounterMetricFamily, "Puts the store published (one per batch).",
         stats.puts),
        ("store_gets", CounterMetricFamily, "Reads of the store (one per batch: get, acquire).",
         stats.gets),
        ("namespaces", GaugeMetricFamily, "Namespaces registered.", stats.num_namespaces),
        ("pinned_blocks", GaugeMetricFamily, "Blocks pinned (leased or pinned with a TTL).",
         stats.num_pinned),
        ("leases_active", GaugeMetricFamily, "Shared-memory leases open now (read and write).",
         stats.num_leases),
        ("leases_expired", CounterMetricFamily,
         "Leases ended because their deadline passed or their client was gone.",
         stats.leases_expired),
        ("sessions", GaugeMetricFamily, "Chat sessions held, every tenant's.",
         stats.num_sessions),
    ):
        yield kind(f"tierkv_{name}", text, value=value)
    moved = CounterMetricFamily("tierkv_bytes_moved",
                                "Payload bytes copied between tiers (promotions, demotions).",
                                labels=("from", "to"))
    for (source, destination), num_bytes in sorted(stats.bytes_moved.items()):
        moved.add_metric((source.label, destination.label), num_bytes)
    yield moved


def _remote_families(stats: StoreStats) -> Iterator[Metric]:
    """The REMOTE tier's figures (none without one)."""
    remote = stats.remote
    if remote is None:
        return
    for name, kind, text, value in (
        ("connected", GaugeMetricFamily, "1 when the REMOTE tier's slot map is known.",
         int(remote.connected)),
        ("hits", CounterMetricFamily, "Blocks read from REMOTE into HOST.", remote.hits),
        ("misses", CounterMetricFamily,
         "Reads REMOTE did not complete (absent, node down, or a record failing its checks).",
         remote.misses),
        ("corrupt", CounterMetricFamily,
         "REMOTE records that failed their checks (served as misses).", remote.corrupt),
        ("lookups", CounterMetricFamily, "Lookups extended into REMOTE.", remote.lookups),
        ("errors", CounterMetricFamily, "REMOTE node calls that failed or timed out.",
         remote.errors),
        ("skipped", CounterMetricFamily,
         "Keys not asked of REMOTE because their node's breaker was open.", remote.skipped),
        ("read_bytes", CounterMetricFamily, "Bytes read from REMOTE.", remote.bytes_read),
        ("written_bytes", CounterMetricFamily, "Bytes written to REMOTE.", remote.bytes_written),
        ("written", CounterMetricFamily, "Records of write-through puts sent to REMOTE.",
         remote.written),
        ("demoted", CounterMetricFamily, "Records of DISK evictions sent to REMOTE.",
         remote.demoted),
        ("queue_drops", CounterMetricFamily,
         "Records dropped because the REMOTE write queue was full.", remote.queue_drops),
        ("write_failures", CounterMetricFamily,
         "Records sent to REMOTE that it did not store (node down or slow).",
         remote.write_failures),
        ("queued_bytes", GaugeMetricFamily, "Bytes waiting to be written to REMOTE.",
         remote.queued_bytes),
        ("budget_drops", CounterMetricFamily,
         "Records dropped because their tenant had written its REMOTE budget of the interval.",
         remote.budget_drops),
    ):
        yield kind(f"tierkv_remote_{name}", text, value=value)


class ServerMetrics:
    """One server's registry, its recorder and collectors, and its HTTP endpoint.

    ``enabled`` is ``config.metrics_port != 0``; when it is not, nothing is recorded (the
    servicer's handlers are registered unwrapped) and ``start`` serves nothing."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.enabled = config.metrics_port != 0
        self.registry = CollectorRegistry()
        self.recorder = RpcRecorder(config)
        self._store_collector = StoreCollector()
        self.registry.register(self._store_collector)
        self.registry.register(_RpcCollector(self.recorder))
        self._http: ScrapeServer | None = None
        self.port = 0

    def attach(self, store: TieredStore) -> None:
        """Report ``store``'s figures from the next scrape on."""
        self._store_collector.store = store

    def attach_events(self, publisher: EventPublisher) -> None:
        """Report ``publisher``'s figures (``tierkv_events_*``) from the next scrape on."""
        self.registry.register(_EventsCollector(publisher))

    def start(self) -> None:
        """Listen on ``metrics_host:metrics_port`` (``tierkv.service.metrics_http``: a thread of
        its own answers scrapes); ``port`` is then the bound port. ``ConfigError`` when the
        address cannot be bound."""
        if not self.enabled or self._http is not None:
            return
        host, port = self.config.metrics_host, self.config.metrics_port
        try:
            http = ScrapeServer(host, port, self.registry)
        except socket.gaierror as exc:
            raise ConfigError(
                f"--metrics-host {host!r}: cannot listen on it ({exc}); give an address of "
                "this machine (0.0.0.0: every interface)"
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"--metrics-port {port}: cannot listen on {host}:{port} ({exc}); pick another "
                "port or 0 for no metrics endpoint"
            ) from exc
        http.start()
        self._http = http
        self.port = int(http.server_port)

    async def stop(self) -> None:
        """Stop answering scrapes and end every open connection (off the loop: it waits for
        the server's poll and the connections' threads)."""
        http = self._http
        if http is None:
            return
        self._http = None
        await asyncio.to_thread(http.close)
