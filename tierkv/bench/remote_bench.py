"""``tierkv bench remote``: the REMOTE tier on a real Redis Cluster, through two sidecars, against
redis-py on the same cluster, side by side in one run.

The bench starts its own 3-master cluster (``scripts/redis-cluster``, loopback ports, 4 GiB and
``allkeys-lru`` a node) and two ``tierkv serve`` subprocesses pointed at it:

* sidecar A, the writer: ``--write-policy write_through`` with a DISK tier (write-through puts
  reach REMOTE only through it);
* sidecar B, the reader: ``--no-disk``, a HOST tier large enough for everything it reads.

Rows, 2 MiB blocks (one Llama-3-8B fp16 block), batches of 32 (64 MiB), medians over rounds:

1. ``get_into`` through B of blocks only REMOTE holds: A put them (write_through) and its
   queue drained; A keeps its own copies (a delete would delete REMOTE's too), which B never
   sees. Every round reads a batch B never read, so each is a REMOTE fetch, verify and HOST
   fill, then the copy out (checked: B's ``remote.hits`` grows by the batch, the bytes are
   the put ones). Once with the shared-memory client (Unix socket), once with the stream
   client (TCP). Baseline: redis-py pipelined ``GET`` (``RedisCluster.pipeline()``) of the
   same keys, i.e. the same records.
2. ``put`` with write_through through A, timed until acknowledged and until landed in REMOTE
   (A's stats: queue empty, ``written`` and ``bytes_written`` grown by the batch). A's put
   also writes its LMDB disk before it is acknowledged. Baseline: redis-py pipelined ``SET``
   of records of the same size (real records, fresh keys of the same key format).
3. ``lookup`` of an 8,192-block chain only REMOTE holds (tiny blocks), through B; for scale,
   the same lookup through A, which holds it all locally. Baseline: redis-py pipelined
   ``EXISTS`` of the 8,192 keys.

Throughputs count the blocks' payload bytes (a record is ~140 bytes more, both sides alike).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierkv.bench.report import GB, Row, fresh_hashes, random_blocks, timed
from tierkv.bench.servers import redis_cluster, tierkv_server
from tierkv.client import Client
from tierkv.config import MiB, WritePolicy
from tierkv.errors import ConfigError, ServiceUnavailableError
from tierkv.hashing import block_hashes
from tierkv.keys import Namespace
from tierkv.layout import PRESETS, KVLayout
from tierkv.tiers.records import encode_record
from tierkv.tiers.remote_keys import remote_key
from tierkv.types import RemoteStats

Progress = Callable[[str], None]
_POLL_S = 0.002  # stats polls while waiting for records to land in REMOTE
_LAND_TIMEOUT_S = 120.0
_STREAM_BATCHES = 4  # puts back to back in the stream row (256 MiB: C's HOST is 512 MiB)
_CONNECT_TIMEOUT_S = 30.0
_LOOKUP_CHUNK = 1024


@dataclass(frozen=True, slots=True)
class RemoteBenchConfig:
    """What to measure and how much."""

    work_dir: Path
    batch_blocks: int = 32
    repeats: int = 5
    lookup_blocks: int = 8192
    lookup_calls: int = 200
    baseline_every: int = 4  # one redis-py EXISTS baseline call every this many lookups
    node_maxmemory: str = "4gb"


@dataclass(frozen=True, slots=True)
class Rig:
    """Where the cluster and the two sidecars answer."""

    url: str
    ports: tuple[int, ...]
    a_unix: str  # A: write_through, with a disk (the writer)
    b_unix: str  # B: no disk (the reader)
    b_tcp: str
    c_unix: str  # C: write_through to REMOTE only (no disk)

    def cluster_client(self) -> Any:
        """redis-py's own cluster client, seeded with every node."""
        import redis
        from redis.cluster import ClusterNode

        nodes = [ClusterNode("127.0.0.1", port)  # type: ignore[no-untyped-call]
                 for port in self.ports]
        return redis.RedisCluster(startup_nodes=nodes, socket_timeout=60)


def _host_bytes_b(cfg: RemoteBenchConfig) -> int:
    """B's HOST: every batch the get rounds read (never evicted), with room to spare."""
    block = PRESETS["llama-3-8b"].layout().bytes_per_block
    return 2 * (cfg.repeats + 1) * cfg.batch_blocks * block + 256 * MiB


@contextlib.contextmanager
def running_rig(cfg: RemoteBenchConfig) -> Iterator[Rig]:
    """The cluster and both sidecars, stopped at the end (also on errors and Ctrl-C)."""
    cluster_args = ["--maxmemory", cfg.node_maxmemory, "--maxmemory-policy", "allkeys-lru"]
    with redis_cluster(cfg.work_dir / "cluster", 3, cluster_args) as (url, ports), \
            tierkv_server(cfg.work_dir / "a", 512 * MiB, disk_bytes=2048 * MiB,
                          extra_flags=["--remote", url, "--write-policy", "write_through"]
                          ) as (a_unix, _), \
            tierkv_server(cfg.work_dir / "b", _host_bytes_b(cfg),
                          extra_flags=["--remote", url, "--no-disk"]) as (b_unix, b_tcp), \
            tierkv_server(cfg.work_dir / "c", 512 * MiB,
                          extra_flags=["--remote", url, "--no-disk", "--write-policy",
                                       "write_through"]) as (c_unix, _):
        for target in (a_unix, b_unix, c_unix):
            with Client(target) as client:
                deadline = time.monotonic() + _CONNECT_TIMEOUT_S
                while not _remote_stats(client).connected:
                    if time.monotonic() > deadline:
                        raise ServiceUnavailableError(f"sidecar {target} did not connect to the "
                                                      f"cluster {url} in {_CONNECT_TIMEOUT_S} s")
                    time.sleep(0.05)
        yield Rig(url, tuple(ports), a_unix, b_unix, b_tcp, c_unix)


# --- helpers -----------------------------------------------------------------------------------


def _remote_stats(client: Client) -> RemoteStats:
    remote = client.stats().remote
    if remote is None:
        raise ServiceUnavailableError("the sidecar runs without a REMOTE tier")
    return remote


def _record_bytes(layout: KVLayout) -> int:
    """The size of one block's record (what REMOTE stores under its key)."""
    return len(encode_record(bytes(48), layout.fingerprint,
                             np.zeros(layout.bytes_per_block, np.uint8))[0])


def put_landed(client: Client, namespace: Namespace, hashes: Sequence[bytes],
               blocks: torch.Tensor, record_bytes: int) -> tuple[float, float]:
    """``put`` with write_through; seconds until it was acknowledged and until its records
    landed in REMOTE (the sidecar's queue empty, ``written`` and ``bytes_written`` grown by the
    batch). Records dropped or not stored (``queue_drops``, ``write_failures``) are an error:
    the figure would not be one."""
    before = _remote_stats(client)
    started = time.perf_counter()
    client.put(namespace, hashes, blocks, write_policy=WritePolicy.WRITE_THROUGH)
    acked = time.perf_counter() - started
    while True:
        now = _remote_stats(client)
        lost = (now.queue_drops - before.queue_drops) + (now.write_failures -
                                                          before.write_failures)
        if lost:
            raise ServiceUnavailableError(f"REMOTE did not store {lost} of {len(hashes)} "
                                          f"records: {now}")
        if now.queued_bytes == 0 and now.written >= before.written + len(hashes):
            landed = time.perf_counter() - started
            break
        if time.perf_counter() - started > _LAND_TIMEOUT_S:
            raise ServiceUnavailableError(f"{len(hashes)} records did not land in REMOTE in "
                                          f"{_LAND_TIMEOUT_S:.0f} s: {now}")
        time.sleep(_POLL_S)
    stored = now.bytes_written - before.bytes_written
    if stored < len(hashes) * record_bytes:
        raise ServiceUnavailableError(f"REMOTE stored {stored} of {len(hashes) * record_bytes} "
                                      f"bytes: {now}")
    return acked, landed


def stream_landed(client: Client, namespace: Namespace, batches: Sequence[torch.Tensor]) -> float:
    """Seconds to put ``batches`` back to back (write_through, fresh hashes) until every record
    has landed in REMOTE: the sidecar's REMOTE writes overlap the next puts, as they do under
    a steady stream of puts. Lost records are an error, as in ``put_landed``."""
    before = _remote_stats(client)
    total = sum(len(batch) for batch in batches)
    put_hashes = []
    started = time.perf_counter()
    for batch in batches:
        hashes = fresh_hashes(len(batch))
        client.put(namespace, hashes, batch, write_policy=WritePolicy.WRITE_THROUGH)
        put_hashes.append(hashes)
    while True:
        now = _remote_stats(client)
        if (now.queue_drops - before.queue_drops) + (now.write_failures - before.write_failures):
            raise ServiceUnavailableError(f"REMOTE lost records of the stream: {now}")
        if now.queued_bytes == 0 and now.written >= before.written + total:
            seconds = time.perf_counter() - started
            break
        if time.perf_counter() - started > _LAND_TIMEOUT_S:
            raise ServiceUnavailableError(f"the stream did not land in REMOTE: {now}")
        time.sleep(_POLL_S)
    for hashes in put_hashes:
        client.delete(namespace, hashes)  # untimed: HOST stays free for the next rounds
    return seconds


def _keys(namespace: Namespace, hashes: Sequence[bytes]) -> list[bytes]:
    """The Redis keys of ``hashes`` (the sidecars run without tokens: tenant "default")."""
    ns_id = bytes(namespace.with_tenant("default").id)
    return [remote_key(ns_id + h) for h in hashes]


def _pipelined(rds: Any, command: str, keys: Sequence[bytes],
               values: Sequence[Any] | None = None) -> list[Any]:
    """redis-py's cluster pipeline of one ``command`` per key, executed."""
    pipe = rds.pipeline()
    for i, key in enumerate(keys):
        getattr(pipe, command)(key, *(() if values is None else (values[i],)))
    answers: list[Any] = pipe.execute()
    return answers


def _percentile(samples: Sequence[float], percent: float) -> float:
    return float(np.percentile(np.asarray(samples), percent))


@dataclass(slots=True)
class _Blocks:
    """Batch ``i`` is blocks ``i .. i + batch_blocks`` of one random tensor."""

    layout: KVLayout
    namespace: Namespace
    source: torch.Tensor
    batch_blocks: int

    @classmethod
    def make(cls, name: str, batch_blocks: int, num_batches: int) -> _Blocks:
        layout = PRESETS["llama-3-8b"].layout()
        if layout.bytes_per_block != 2 * MiB:
            raise ConfigError(f"bench remote: expected 2 MiB blocks, got {layout}")
        return cls(layout, Namespace(name, layout), random_blocks(layout, batch_blocks +
                                                                  num_batches), batch_blocks)

    @property
    def batch_bytes(self) -> int:
        return self.batch_blocks * self.layout.bytes_per_block

    def batch(self, index: int) -> torch.Tensor:
        return self.source[index : index + self.batch_blocks]


# --- the benchmarks ----------------------------------------------------------------------------


def bench_get(cfg: RemoteBenchConfig, rig: Rig, progress: Progress) -> list[Row]:
    """REMOTE-only blocks through B into the caller's buffer vs redis-py pipelined GET."""
    num_rounds = cfg.repeats + 1  # round 0: the warm-up
    blocks = _Blocks.make("bench-remote-get", cfg.batch_blocks, 2 * num_rounds)
    namespace, record_bytes = blocks.namespace, _record_bytes(blocks.layout)
    paths = ("shm", "stream")
    hashes = {path: [fresh_hashes(cfg.batch_blocks) for _ in range(num_rounds)] for path in paths}
    first = {"shm": 0, "stream": num_rounds}  # batch number of each path's round 0
    with Client(rig.a_unix, use_shm=True) as writer:
        for path in paths:
            for r, batch_hashes in enumerate(hashes[path]):
                put_landed(writer, namespace, batch_hashes, blocks.batch(first[path] + r),
                           record_bytes)
    progress("get: staged in REMOTE")
    keys = [_keys(namespace, batch) for batch in hashes["shm"]]
    out = torch.empty_like(blocks.batch(0))
    samples: dict[str, list[float]] = {"shm": [], "stream": [], "redis": []}
    with Client(rig.b_unix, use_shm=True) as shm, Client(rig.b_tcp, use_shm=False) as stream, \
            contextlib.closing(rig.cluster_client()) as rds:
        if not shm.uses_shared_memory or stream.uses_shared_memory:
            raise ServiceUnavailableError("bench remote: the clients did not take their paths")
        clients = {"shm": shm, "stream": stream}
        if rds.exists(*keys[0][:1]) != 1:
            raise ServiceUnavailableError("bench remote: REMOTE lost the staged records")

        def tierkv_round(path: str, r: int) -> float:
            client, batch_hashes = clients[path], hashes[path][r]
            hits = _remote_stats(client).hits
            got: list[int] = []
            seconds = timed(lambda: got.append(client.get_into(namespace, batch_hashes, out)))
            # Untimed: it came from REMOTE, whole and bit-exact.
            filled = _remote_stats(client).hits - hits
            if got[0] != cfg.batch_blocks or filled != cfg.batch_blocks:
                raise ServiceUnavailableError(f"bench remote: B read {got[0]} blocks, "
                                              f"{filled} from REMOTE, of {cfg.batch_blocks}")
            assert torch.equal(out.view(torch.uint8),
                               blocks.batch(first[path] + r).view(torch.uint8))
            return blocks.batch_bytes / seconds / GB

        def redis_round(r: int) -> float:
            values: list[list[bytes]] = []
            seconds = timed(lambda: values.append(_pipelined(rds, "get", keys[r])))
            assert all(len(value) == record_bytes for value in values[0])
            return blocks.batch_bytes / seconds / GB

        for r in range(num_rounds):
            figures = {"redis": redis_round(r), "shm": tierkv_round("shm", r),
                       "stream": tierkv_round("stream", r)}
            if r:
                for name, figure in figures.items():
                    samples[name].append(figure)
            progress("get")
    shm_gbs, stream_gbs = statistics.median(samples["shm"]), statistics.median(samples["stream"])
    base = statistics.median(samples["redis"])
    baseline = "redis-py cluster pipelined GET"
    return [
        Row("REMOTE-only get_into via B, shm", "GB/s", shm_gbs, base, baseline, ">= 0.8x",
            shm_gbs >= 0.8 * base, samples["shm"]),
        Row("REMOTE-only get_into via B, stream", "GB/s", stream_gbs, base, baseline,
            "(info)", True, samples["stream"]),
    ]


def bench_put(cfg: RemoteBenchConfig, rig: Rig, progress: Progress) -> list[Row]:
    """write_through puts through A until landed in REMOTE vs redis-py pipelined SET."""
    num_rounds = cfg.repeats + 1
    blocks = _Blocks.make("bench-remote-put", cfg.batch_blocks, num_rounds)
    namespace, layout = blocks.namespace, blocks.layout
    ns_id, record_bytes = bytes(namespace.with_tenant("default").id), _record_bytes(layout)
    acked_s: list[float] = []
    landed_s: list[float] = []
    only_s: list[float] = []
    stream_s: list[float] = []
    redis_s: list[float] = []
    with Client(rig.a_unix, use_shm=True) as client, \
            Client(rig.c_unix, use_shm=True) as remote_only, \
            contextlib.closing(rig.cluster_client()) as rds:
        for r in range(num_rounds):
            batch = blocks.batch(r)
            hashes = fresh_hashes(cfg.batch_blocks)
            acked, landed = put_landed(client, namespace, hashes, batch, record_bytes)
            client.delete(namespace, hashes)  # untimed (REMOTE's copies too): A's disk stays small
            hashes = fresh_hashes(cfg.batch_blocks)
            _, only = put_landed(remote_only, namespace, hashes, batch, record_bytes)
            remote_only.delete(namespace, hashes)
            stream = [blocks.batch((r + k) % num_rounds) for k in range(_STREAM_BATCHES)]
            streamed = stream_landed(remote_only, namespace, stream)
            other = fresh_hashes(cfg.batch_blocks)  # the same records, under fresh keys
            flat = batch.contiguous().view(torch.uint8).reshape(cfg.batch_blocks, -1).numpy()
            records = [encode_record(ns_id + h, layout.fingerprint, flat[i])[0]
                       for i, h in enumerate(other)]
            keys = _keys(namespace, other)
            seconds = timed(functools.partial(_pipelined, rds, "set", keys, records))
            _pipelined(rds, "delete", keys)
            if r:
                acked_s.append(blocks.batch_bytes / acked / GB)
                landed_s.append(blocks.batch_bytes / landed / GB)
                only_s.append(blocks.batch_bytes / only / GB)
                stream_s.append(_STREAM_BATCHES * blocks.batch_bytes / streamed / GB)
                redis_s.append(blocks.batch_bytes / seconds / GB)
            progress("put")
    landed_gbs, acked_gbs = statistics.median(landed_s), statistics.median(acked_s)
    only_gbs = statistics.median(only_s)
    base = statistics.median(redis_s)
    baseline = "redis-py cluster pipelined SET"
    return [
        Row("write_through put, no disk, landed in REMOTE", "GB/s", only_gbs, base, baseline,
            ">= 0.8x", only_gbs >= 0.8 * base, only_s),
        Row(f"same, a stream of {_STREAM_BATCHES} puts until landed", "GB/s",
            statistics.median(stream_s), base, baseline, "(info)", True, stream_s),
        Row("write_through put, with disk, landed in REMOTE", "GB/s", landed_gbs, base,
            baseline, "(info: +LMDB)", True, landed_s),
        Row("write_through put, acknowledged", "GB/s", acked_gbs, base, baseline,
            "(info: +LMDB)", True, acked_s),
    ]


def bench_lookup(cfg: RemoteBenchConfig, rig: Rig, progress: Progress) -> list[Row]:
    """``lookup`` of a chain only REMOTE holds, through B (and, for scale, through A, which
    holds it locally) vs redis-py pipelined EXISTS of its keys."""
    layout = KVLayout(1, 1, 8)  # tiny blocks: only their count matters here
    namespace = Namespace("bench-remote-lookup", layout)
    hashes = block_hashes(list(range(cfg.lookup_blocks * layout.block_size)))
    zeros = torch.zeros((_LOOKUP_CHUNK, *layout.block_shape), dtype=layout.torch_dtype)
    record_bytes = _record_bytes(layout)
    keys = _keys(namespace, hashes)
    with Client(rig.a_unix) as a, Client(rig.b_unix) as b, \
            contextlib.closing(rig.cluster_client()) as rds:
        for start in range(0, len(hashes), _LOOKUP_CHUNK):
            chunk = hashes[start : start + _LOOKUP_CHUNK]
            put_landed(a, namespace, chunk, zeros[: len(chunk)], record_bytes)
        progress("lookup: staged in REMOTE")
        before = _remote_stats(b)
        for client in (a, b):
            if client.lookup(namespace, hashes) != cfg.lookup_blocks:
                raise ServiceUnavailableError("bench remote: the chain is not all found")
        if sum(_pipelined(rds, "exists", keys)) != cfg.lookup_blocks:
            raise ServiceUnavailableError("bench remote: REMOTE does not hold the chain")
        for _ in range(5):  # warm-up
            a.lookup(namespace, hashes)
            b.lookup(namespace, hashes)
        remote_ms: list[float] = []
        local_ms: list[float] = []
        redis_ms: list[float] = []
        quarters = {cfg.lookup_calls * k // 4 for k in range(1, 5)}
        for call in range(cfg.lookup_calls):
            remote_ms.append(timed(lambda: b.lookup(namespace, hashes)) * 1e3)
            local_ms.append(timed(lambda: a.lookup(namespace, hashes)) * 1e3)
            if call % cfg.baseline_every == 0:
                redis_ms.append(timed(lambda: _pipelined(rds, "exists", keys)) * 1e3)
                gc.collect()  # untimed: the pipeline's garbage, not in the next timed call
            if call + 1 in quarters:
                progress("lookup")
        after = _remote_stats(b)
        if after.lookups - before.lookups < cfg.lookup_calls or after.hits != before.hits:
            raise ServiceUnavailableError(f"bench remote: B's lookups did not all ask REMOTE: "
                                          f"{before} -> {after}")
        a.delete(namespace, hashes)
    base50 = _percentile(redis_ms, 50)
    p50, p90 = _percentile(remote_ms, 50), _percentile(remote_ms, 90)
    baseline = f"redis-py pipelined EXISTS x{cfg.lookup_blocks}"
    n = cfg.lookup_blocks
    return [
        Row(f"REMOTE-only lookup {n} via B, p50", "ms", p50, base50, baseline, "<= 15 ms",
            p50 <= 15.0, remote_ms),
        Row(f"REMOTE-only lookup {n} via B, p90", "ms", p90, _percentile(redis_ms, 90),
            baseline, "(info)", True, sorted(remote_ms)[-max(1, len(remote_ms) // 10):]),
        Row(f"all-local lookup {n} via A, p50", "ms", _percentile(local_ms, 50), base50,
            baseline, "(info: scale)", True, local_ms),
    ]


BENCHES: dict[str, Callable[[RemoteBenchConfig, Rig, Progress], list[Row]]] = {
    "get": bench_get,
    "put": bench_put,
    "lookup": bench_lookup,
}


def num_steps(cfg: RemoteBenchConfig, only: Sequence[str]) -> int:
    """How many times the benchmarks call ``progress`` (for a progress bar)."""
    per_group = {"get": 1 + (cfg.repeats + 1), "put": cfg.repeats + 1, "lookup": 1 + 4}
    selected = [name for name in BENCHES if not only or name in only]
    return 1 + sum(per_group[name] + 1 for name in selected)


def run_remote_bench(cfg: RemoteBenchConfig, only: Sequence[str],
                     progress: Progress) -> list[Row]:
    """Start the cluster and both sidecars, run the selected benchmarks (all when ``only`` is
    empty), stop them."""
    if importlib.util.find_spec("redis") is None:
        raise ConfigError("bench remote: redis-py is missing (pip install -e '.[dev]')")
    rows: list[Row] = []
    started = time.perf_counter()
    with running_rig(cfg) as rig:
        progress(f"cluster and sidecars up in {time.perf_counter() - started:.1f}s")
        for name, bench in BENCHES.items():
            if not only or name in only:
                started = time.perf_counter()
                rows.extend(bench(cfg, rig, progress))
                progress(f"{name} done in {time.perf_counter() - started:.1f}s")
    return rows
