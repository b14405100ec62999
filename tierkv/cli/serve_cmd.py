"""``tierkv serve``: the sidecar. One per node: the store plus its gRPC service.

Embedded defaults: a HOST tier in shared memory, a DISK tier under the user's cache directory, a
GPU tier when CUDA is present; listeners on a Unix socket and 127.0.0.1:50051. Settings come from
defaults < a TOML file (``--config``) < ``TIERKV_<NAME>`` environment variables < flags: the
schema is ``tierkv.cli.settings``; ``--print-config`` prints the result and exits.

The listeners start at once with health NOT_SERVING; the store opens (recovering its disk index)
and then the service turns SERVING and prints one JSON line on stdout. On SIGTERM or SIGINT it
turns NOT_SERVING, drains in-flight calls, flushes HOST-only blocks to disk and exits 0.

Logs go to stderr (``--log-format text|json``, ``tierkv.logs``), one line per event: ``start``,
``recovery``, ``ready``, ``stats`` (every ``--stats-interval-s``), ``eviction_storm`` and
``eviction_storm_end`` (``EvictionStormWatch``), ``reload``, ``reload_failed`` and
``reload_ignored`` (SIGHUP), ``shutdown``, ``stopped``.

SIGHUP reloads the tokens file, ``admin_tenants``, ``tenant_weights``, ``tenant_bytes`` and
``tenant_caps`` (``read_reload``: the ``--config`` file re-read too) without a restart: new calls are checked
against the new tokens, the next eviction follows the new shares, nothing is evicted by the
reload itself; a file or setting that is wrong refuses the whole reload in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tierkv.cli.settings import (
    DESCRIPTION,
    Resolved,
    add_arguments,
    resolve_args,
    unknown_variables,
)
from tierkv.config import (
    DiskCorruptAction,
    DiskTierConfig,
    Eviction,
    GpuTierConfig,
    HostTierConfig,
    RemoteTierConfig,
    StoreConfig,
    TenantShares,
    Tier,
    WritePolicy,
)
from tierkv.errors import ConfigError, StoreClosedError
from tierkv.keys import DEFAULT_TENANT
from tierkv.logs import log_event, setup_logging
from tierkv.service.config import EventsConfig, ServiceConfig, TlsConfig, load_tokens
from tierkv.sizes import format_size, parse_size

if TYPE_CHECKING:
    from tierkv.service.events import EventPublisher
    from tierkv.service.server import TierKVServer
    from tierkv.store import EventLog, StoreStats, TieredStore

log = logging.getLogger("tierkv.serve")

N = TypeVar("N", int, float)
TIER_BY_LABEL = {tier.label: tier for tier in Tier}

SAMPLE_INTERVAL_S = 1.0
"""How often the serve loop reads the store's stats to look for eviction storms."""


def register(subparsers: Any) -> None:
    """Add ``serve`` to the command line."""
    # Whole flag names only: a prefix (--host-byte) that works today would turn into an error
    # in a deployment file the day a flag sharing it is added.
    parser = subparsers.add_parser("serve", help="run the KV-cache sidecar on this node",
                                   description=DESCRIPTION, allow_abbrev=False)
    add_arguments(parser)
    parser.set_defaults(func=run)


def _settings(args: argparse.Namespace | Resolved) -> Resolved:
    return args if isinstance(args, Resolved) else resolve_args(args, os.environ)


def build_config(args: argparse.Namespace | Resolved) -> StoreConfig:
    """The store configuration of parsed ``serve`` arguments (resolved against the environment
    and ``--config``) or of resolved settings; a ``ConfigError`` names the setting and source."""
    settings = _settings(args)
    with settings.explaining():
        page_bytes = settings["page_bytes"]
        host = HostTierConfig(settings["host_bytes"], page_bytes)
        gpu = GpuTierConfig(settings["gpu_bytes"], page_bytes, settings["gpu_device"])
        disk = None
        if not settings["no_disk"]:
            disk = DiskTierConfig(Path(settings["disk_path"]), settings["disk_bytes"],
                                  on_corrupt=DiskCorruptAction(settings["disk_on_corrupt"]))
        return StoreConfig(host=host, gpu=gpu, disk=disk, remote=_remote_config(settings),
                           write_policy=WritePolicy(settings["write_policy"]),
                           eviction=Eviction(settings["eviction"]),
                           verify_commit=settings["verify_commit"],
                           tenants=tenant_shares(settings))


def tenant_shares(settings: Resolved) -> TenantShares:
    """``tenant_weights``, ``tenant_bytes`` and ``tenant_caps`` (weight 1 for each tenant of
    ``tokens_file`` when no weights are given; each must name a tenant a caller can be); a
    ``ConfigError`` names the setting."""
    weights = _tenant_numbers(settings, "tenant_weights", float)
    caps = _tenant_numbers(settings, "tenant_caps", float)
    sizes = _tenant_sizes(settings)
    if settings["tokens_file"]:
        path = Path(settings["tokens_file"])
        tenants = set(load_tokens(path).values())
        if not weights:
            weights = dict.fromkeys(sorted(tenants), 1.0)
        where = f"a tenant of the tokens file {path}"
    else:
        tenants, where = {DEFAULT_TENANT}, "the one tenant without a tokens_file"
    for name, named in (("tenant_weights", weights),
                        ("tenant_bytes", {tenant for tenant, _ in sizes}),
                        ("tenant_caps", caps)):
        for tenant in named:
            if tenant not in tenants:
                raise settings.error(name, f"{tenant!r} is not {where}: its share would be "
                                     "room no caller can use")
    return TenantShares(weights, caps, sizes)


def _tenant_sizes(settings: Resolved) -> dict[tuple[str, Tier], int]:
    """``tenant_bytes``: ``TENANT:TIER=SIZE`` items."""
    found: dict[tuple[str, Tier], int] = {}
    for item in settings["tenant_bytes"]:
        named, sep, size = item.partition("=")
        tenant, colon, label = named.rpartition(":")
        tier = TIER_BY_LABEL.get(label)
        if not sep or not colon or not tenant or tier is None:
            raise settings.error("tenant_bytes", f"{item!r} is not TENANT:TIER=SIZE with TIER "
                                 "gpu, host or disk")
        try:
            found[tenant, tier] = parse_size(size, "tenant_bytes")
        except ConfigError as exc:
            raise settings.error("tenant_bytes", f"{item!r}: {exc}") from None
    return found


def _tenant_numbers(settings: Resolved, name: str, kind: type[N]) -> dict[str, N]:
    """The ``TENANT=NUMBER`` items of setting ``name``, each number read by ``kind``."""
    found: dict[str, N] = {}
    for item in settings[name]:
        tenant, sep, number = item.partition("=")
        try:
            if not sep or not tenant:
                raise ValueError
            found[tenant] = kind(number)
        except ValueError:
            raise settings.error(name, f"{item!r} is not TENANT=NUMBER") from None
    return found


RELOADED_SETTINGS = ("tokens_file", "tenant_weights", "tenant_bytes", "tenant_caps",
                     "admin_tenants")
"""What a SIGHUP reloads; every other setting takes a restart."""


@dataclass(frozen=True)
class Reload:
    """What a SIGHUP reloads (``read_reload``): the tokens file's tokens, the admin tenants and
    the tenants' shares; ``ignored``: other settings that changed, which need a restart."""

    tokens: dict[str, str]
    admin_tenants: tuple[str, ...]
    shares: TenantShares
    ignored: tuple[str, ...]


def read_reload(args: argparse.Namespace, started: Resolved,
                environ: Mapping[str, str]) -> Reload:
    """The settings of a reload: ``args`` resolved again against ``environ`` (the process's,
    as at start), the ``--config`` file and the tokens file re-read, compared with the settings
    the server ``started`` with.
    A ``ConfigError`` naming the setting and its file for anything invalid: the reload is
    then refused whole, and the server goes on with what it had."""
    settings = resolve_args(args, environ)
    with settings.explaining():
        if bool(settings["tokens_file"]) != bool(started["tokens_file"]):
            raise settings.error("tokens_file", "a reload cannot turn tokens on or off "
                                 "(calls with and without tokens are different tenants): "
                                 "restart the server")
        tokens = load_tokens(Path(settings["tokens_file"])) if settings["tokens_file"] else {}
        shares = tenant_shares(settings)
    ignored = tuple(name for name in settings.values
                    if name not in RELOADED_SETTINGS and settings[name] != started[name])
    return Reload(tokens, tuple(settings["admin_tenants"]), shares, ignored)


def _remote_label(config: StoreConfig) -> str | None:
    """The REMOTE tier's seed nodes for logs (never its password), or None."""
    remote = config.remote
    if remote is None:
        return None
    scheme = "rediss" if remote.tls else "redis"
    return f"{scheme}://" + ",".join(endpoint.label for endpoint in remote.endpoints)


def _remote_config(settings: Resolved) -> RemoteTierConfig | None:
    if not settings["remote"]:
        return None
    password = None
    if settings["remote_password_file"]:
        path = Path(settings["remote_password_file"])
        try:
            password = path.read_text().strip("\r\n")
        except OSError as exc:
            raise ConfigError(f"remote_password_file: cannot read {path}: {exc}") from exc
    tls_paths = {name: Path(settings[f"remote_{name}"]) if settings[f"remote_{name}"] else None
                 for name in ("tls_ca", "tls_cert", "tls_key")}
    return RemoteTierConfig.from_url(
        settings["remote"], password=password, tls_ca_path=tls_paths["tls_ca"],
        tls_cert_path=tls_paths["tls_cert"], tls_key_path=tls_paths["tls_key"],
        ttl_s=settings["remote_ttl_s"], timeout_s=settings["remote_timeout_s"],
        queue_bytes=settings["remote_queue_bytes"],
        tenant_write_bytes=settings["remote_tenant_write_bytes"],
        tenant_write_interval_s=settings["remote_tenant_write_interval_s"],
        tenant_ttl_s=_tenant_numbers(settings, "remote_tenant_ttl_s", int),
    )


def build_service_config(args: argparse.Namespace | Resolved) -> ServiceConfig:
    """The service configuration of parsed ``serve`` arguments or of resolved settings (the
    tokens file and the TLS files are read and checked here)."""
    settings = _settings(args)
    with settings.explaining():
        tls = None
        if settings["tls_cert"]:
            tls = TlsConfig(Path(settings["tls_cert"]), Path(settings["tls_key"]))
        tokens = load_tokens(Path(settings["tokens_file"])) if settings["tokens_file"] else {}
        return ServiceConfig(
            listen=settings["listen"], tokens=tokens, tls=tls,
            hash_seed=settings["hash_seed"], hash_algo=settings["hash_algo"],
            put_idle_timeout_s=settings["put_idle_timeout_s"],
            max_namespaces_per_tenant=settings["max_namespaces_per_tenant"],
            metrics_port=settings["metrics_port"], metrics_host=settings["metrics_host"],
            admin_tenants=settings["admin_tenants"], events=_events_config(settings),
        )


def _events_config(settings: Resolved) -> EventsConfig | None:
    if not settings["events_endpoint"]:
        return None
    return EventsConfig(
        settings["events_endpoint"], settings["events_replay_endpoint"],
        mode=settings["events_mode"], ownership=settings["events_ownership"] or None,
        topic=settings["events_topic"], node=settings["events_node"],
        token_ids=settings["events_token_ids"] == "on", hash_form=settings["events_hash_form"],
        interval_s=settings["events_interval_s"], heartbeat_s=settings["events_heartbeat_s"],
        ring_batches=settings["events_ring_batches"],
    )


def _remove_stale_socket(path: Path) -> None:
    """A socket file left by a killed server would make the bind fail."""
    import socket

    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
    else:
        raise ConfigError(f"--listen: another server is listening on {path}")
    finally:
        probe.close()


# The server's modules (grpc health and reflection with them) are imported when serving only:
# measured here, importing them up front added 35-75 ms (2-5%) to every `tierkv --help`.


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM (or, with ``--print-config``, print the settings)."""
    settings = _settings(args)
    config = build_config(settings)
    service_config = build_service_config(settings)
    if settings["stats_interval_s"] < 0:
        raise settings.error("stats_interval_s", "must be 0 (no stats events) or positive")
    if args.print_config:
        print(settings.to_toml(), end="", flush=True)
        return 0
    setup_logging(settings["log_level"], settings["log_format"])
    for name in unknown_variables(os.environ):
        log.warning("%s is not a tierkv serve setting: ignored (see tierkv serve --help)", name)
    with settings.explaining():
        for address in service_config.listen:
            if address.startswith("unix://"):
                _remove_stale_socket(Path(address.removeprefix("unix://")))
    from tierkv import __version__
    from tierkv.service.allocator import tune_for_bulk_messages

    log_event(log, logging.INFO, "start", f"tierkv {__version__} starting (pid {os.getpid()})",
              version=__version__, pid=os.getpid(), listen=list(service_config.listen),
              config_file=str(settings.config_path) if settings.config_path else None,
              host_bytes=config.host.capacity_bytes, gpu_bytes=config.gpu.capacity_bytes,
              disk_path=str(config.disk.path) if config.disk else None,
              disk_bytes=config.disk.capacity_bytes if config.disk else 0,
              write_policy=config.write_policy.value, remote=_remote_label(config),
              tokens=bool(service_config.tokens),
              tls=service_config.tls is not None, metrics_port=service_config.metrics_port)
    tune_for_bulk_messages()
    asyncio.run(_serve(settings, config, service_config, args))
    return 0


def show_progress(stream: Any) -> bool:
    """Whether long start-up work draws a progress bar on ``stream``: only on a terminal (in a
    log file or a pipe a bar is a screenful of carriage returns)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


async def _open_store(settings: Resolved, config: StoreConfig,
                      events: EventLog | None = None) -> TieredStore:
    from tierkv.store import TieredStore

    start_s = time.monotonic()
    with settings.explaining():
        store = await asyncio.to_thread(TieredStore, config,
                                        show_progress=show_progress(sys.stderr), events=events)
    if config.disk is not None:
        duration_s = round(time.monotonic() - start_s, 3)
        # At start every checksum failure counted is a record recovery found bad and dropped.
        num_bad_records = store.stats().checksum_failures
        log_event(log, logging.INFO, "recovery",
                  f"recovered {store.num_recovered_blocks} blocks from {config.disk.path} in "
                  f"{duration_s} s ({num_bad_records} bad records dropped)",
                  num_recovered_blocks=store.num_recovered_blocks,
                  num_bad_records=num_bad_records, duration_s=duration_s,
                  disk_path=str(config.disk.path))
    return store


async def _serve(settings: Resolved, config: StoreConfig, service_config: ServiceConfig,
                 args: argparse.Namespace) -> None:
    from tierkv.service.server import TierKVServer

    server = TierKVServer(service_config)
    port = server.bind()
    await server.start()
    stop = asyncio.Event()
    reasons: list[str] = []
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, _on_signal, signal.Signals(signum).name, reasons, stop)
    # Until the store is open a reload has nothing to apply its shares to (and SIGHUP's
    # default would end the process): it is refused, and said so.
    loop.add_signal_handler(signal.SIGHUP, log_event, log, logging.ERROR, "reload_failed",
                            "reload refused: the store is still opening; send SIGHUP again "
                            "once the server is ready")
    events = None
    if service_config.events is not None:
        from tierkv.store import EventLog

        events = EventLog(service_config.events.max_pending,
                          keep_tokens=service_config.events.token_ids)
    try:
        store = await _open_store(settings, config, events)
    except BaseException:
        # Stopped here, on the loop: left to the collector, grpc's server schedules its
        # shutdown on a closed loop (tracebacks after the error line) and the metrics
        # endpoint's thread is left running.
        await server.stop(close_store=False)
        raise
    publisher = None
    if service_config.events is not None and events is not None:
        try:
            publisher = _start_publisher(service_config.events, store, events)
        except BaseException:
            await server.stop(close_store=False)
            await asyncio.to_thread(store.close, False)
            raise
        server.metrics.attach_events(publisher)
    await server.attach(store)
    loop.add_signal_handler(signal.SIGHUP, _on_reload, args, settings, server, store)
    tiers = {t.label: format_size(s.capacity_bytes) for t, s in store.stats().tiers.items()}
    ready = {
        "ready": True,
        "listen": list(service_config.listen),
        "port": port,
        "metrics_port": service_config.metrics_port,
        "tiers": tiers,
        "disk_path": str(config.disk.path) if config.disk else None,
        "recovered_blocks": store.num_recovered_blocks,
        "host_shm_name": store.sidecar.host_shm_name,
        "page_bytes": config.host.page_bytes,
        "remote": _remote_label(config),
        "events_endpoint": publisher.endpoint if publisher is not None else None,
        "events_replay_endpoint": publisher.replay_endpoint if publisher is not None else None,
    }
    print(json.dumps(ready), flush=True)
    log_event(log, logging.INFO, "ready", f"serving on {', '.join(service_config.listen)}",
              **{key: value for key, value in ready.items() if key != "ready"})
    await _watch(store, settings["stats_interval_s"], stop)
    reason = reasons[0] if reasons else "stop"
    log_event(log, logging.INFO, "shutdown",
              f"{reason}: draining calls, flushing host blocks to disk", reason=reason)
    start_s = time.monotonic()
    await server.stop(close_store=False)
    try:
        num_flushed_blocks = await asyncio.to_thread(store.flush)
    finally:
        if publisher is not None:  # the flush's events too, while the store can restate
            await asyncio.to_thread(publisher.close)
        await asyncio.to_thread(store.close, False)  # flushed just above
    duration_s = round(time.monotonic() - start_s, 3)
    log_event(log, logging.INFO, "stopped",
              f"stopped: {num_flushed_blocks} blocks flushed to disk in {duration_s} s",
              num_flushed_blocks=num_flushed_blocks, duration_s=duration_s, reason=reason)


def _start_publisher(config: EventsConfig, store: TieredStore, events: EventLog
                     ) -> EventPublisher:
    """Bind the KV-event sockets and start publishing (``ConfigError`` naming the endpoint for
    one that cannot be bound)."""
    import zmq

    from tierkv.service.events import EventPublisher

    publisher = EventPublisher(config, store, events)
    try:
        publisher.start()
    except zmq.ZMQError as exc:
        raise ConfigError(
            f"--events-endpoint {config.endpoint} / --events-replay-endpoint "
            f"{config.replay_endpoint}: cannot bind ({exc})") from None
    log_event(log, logging.INFO, "events", f"publishing KV events on {publisher.endpoint} "
              f"(replay: {publisher.replay_endpoint})", endpoint=publisher.endpoint,
              replay_endpoint=publisher.replay_endpoint, topic=config.topic,
              token_ids=config.token_ids)
    return publisher


def _on_reload(args: argparse.Namespace, started: Resolved, server: TierKVServer,
               store: TieredStore) -> None:
    """SIGHUP: re-read the tokens file and the tenants' shares and adopt them, or refuse the
    reload whole with one ``reload_failed`` line that names the file (on the event loop: the
    files are small, and calls must not see the tokens and shares change apart)."""
    try:
        reload = read_reload(args, started, os.environ)
        store.set_tenant_shares(reload.shares)  # first: shares that do not fit are refused
    except (ConfigError, StoreClosedError) as exc:  # (closed: a SIGHUP while stopping)
        log_event(log, logging.ERROR, "reload_failed",
                  f"reload refused, serving on with the settings in force: {exc}",
                  error=str(exc))
        return
    server.set_access(reload.tokens, reload.admin_tenants)
    tenants = sorted(set(reload.tokens.values()))
    log_event(log, logging.INFO, "reload",
              f"reloaded: {len(reload.tokens)} tokens of {len(tenants)} tenants, shares "
              f"{reload.shares.weights or 'none'}", num_tokens=len(reload.tokens),
              tenants=tenants, weights=reload.shares.weights, caps=reload.shares.caps,
              admin_tenants=list(reload.admin_tenants))
    if reload.ignored:
        log_event(log, logging.WARNING, "reload_ignored",
                  f"changed but not reloaded (they take a restart): {', '.join(reload.ignored)}",
                  settings=list(reload.ignored))


def _on_signal(name: str, reasons: list[str], stop: asyncio.Event) -> None:
    reasons.append(name)
    stop.set()


async def _watch(store: TieredStore, stats_interval_s: float, stop: asyncio.Event) -> None:
    """Until ``stop``: sample the store's stats every ``SAMPLE_INTERVAL_S`` for eviction storms
    and log a ``stats`` event every ``stats_interval_s`` (0: never)."""
    storms = EvictionStormWatch()
    next_stats_s = time.monotonic() + stats_interval_s
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_INTERVAL_S)
        if stop.is_set():
            return
        # Off the event loop: stats() takes the store lock, which a long flush may hold.
        stats = await asyncio.to_thread(store.stats)
        now_s = time.monotonic()
        storms.observe(now_s, stats)
        if stats_interval_s > 0 and now_s >= next_stats_s:
            next_stats_s = now_s + stats_interval_s
            log_event(log, logging.INFO, "stats", "store stats", **stats.as_dict())


@dataclass(slots=True)
class _Storm:
    start_s: float
    last_hot_s: float
    evictions_at_start: int


class EvictionStormWatch:
    """Finds eviction storms in samples of ``TieredStore.stats()`` and logs each one twice:
    ``eviction_storm`` (warning) when it starts and ``eviction_storm_end`` when it is over.

    The rule: a tier is in a storm while it evicted, over the last ``window_s``, more blocks
    than it holds and at least ``min_evictions``: it replaced everything it caches within
    ``window_s``, so little it holds lives long enough to be hit (the budget is too small for
    the working set, or a client streams through it). A storm is over once the rule has not
    held for ``quiet_s``; until then it is the same storm, so a storm that flickers costs two
    lines, not two a flicker. Samples come from the caller, with their time (``now_s``, any
    monotonic clock), so that tests need no waiting.
    """

    def __init__(self, window_s: float = 10.0, quiet_s: float = 60.0,
                 min_evictions: int = 100) -> None:
        self.window_s = window_s
        self.quiet_s = quiet_s
        self.min_evictions = min_evictions
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        self._storms: dict[str, _Storm] = {}

    def observe(self, now_s: float, stats: StoreStats) -> None:
        """Take one sample of every tier's eviction counter; log what starts or ends a storm."""
        for tier, tier_stats in stats.tiers.items():
            label = tier.label
            samples = self._samples.setdefault(label, deque())
            samples.append((now_s, tier_stats.evictions))
            while len(samples) > 1 and samples[1][0] <= now_s - self.window_s:
                samples.popleft()
            num_evictions = tier_stats.evictions - self._evictions_at(now_s - self.window_s,
                                                                      samples)
            hot = num_evictions >= self.min_evictions and num_evictions > tier_stats.num_blocks
            num_evictions = round(num_evictions)
            storm = self._storms.get(label)
            if hot and storm is None:
                self._storms[label] = _Storm(now_s, now_s, samples[0][1])
                log_event(log, logging.WARNING, "eviction_storm",
                          f"eviction storm in the {label} tier: {num_evictions} blocks evicted "
                          f"in {self.window_s:g} s, it holds {tier_stats.num_blocks}",
                          tier=label, num_evictions=num_evictions, window_s=self.window_s,
                          num_blocks=tier_stats.num_blocks,
                          capacity_bytes=tier_stats.capacity_bytes)
            elif hot and storm is not None:
                storm.last_hot_s = now_s
            elif storm is not None and now_s - storm.last_hot_s >= self.quiet_s:
                del self._storms[label]
                total = tier_stats.evictions - storm.evictions_at_start
                duration_s = round(storm.last_hot_s - storm.start_s, 3)
                log_event(log, logging.INFO, "eviction_storm_end",
                          f"eviction storm in the {label} tier over: {total} blocks evicted "
                          f"since it started", tier=label, num_evictions=total,
                          duration_s=duration_s)  # first to last sample that found it

    @staticmethod
    def _evictions_at(moment_s: float, samples: deque[tuple[float, int]]) -> float:
        """The eviction counter at ``moment_s``, between the samples around it (the oldest
        one is at or before it). A sample that came late (a stats() that waited out a long
        flush) must not make every eviction of the gap look like one window's."""
        oldest_s, oldest = samples[0]
        if len(samples) == 1 or oldest_s >= moment_s:
            return oldest
        next_s, following = samples[1]  # after moment_s: observe keeps it so
        return oldest + (following - oldest) * (moment_s - oldest_s) / (next_s - oldest_s)
