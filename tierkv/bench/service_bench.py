"""``tierkv bench service``: the sidecar through the client SDK against memcpy and a real Redis.

Both servers run beside the benchmark on this machine: ``tierkv serve`` as a subprocess (its own
interpreter, as in production: no GIL shared with the client) listening on a Unix socket and on
127.0.0.1, and ``redis-server`` (``scripts/redis-server``, installed from Debian's packages when
missing) on a free loopback port, with redis-py as its client. Every figure is measured beside
its baseline in the same run, rounds of the two interleaved, on the same bytes: 2 MiB blocks
(one Llama-3-8B fp16 block), batches of 32, throughputs the median over ``repeats`` rounds.

Redis is given the easy side of every comparison: its 32 GETs / SETs of a batch go in one
pipeline, and a GET is done once redis-py hands back its ``bytes`` (no copy into a tensor),
while ``get_into`` has copied the blocks into the caller's buffer.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierkv.bench.report import GB, Row, fresh_hashes, random_blocks, timed, total_s
from tierkv.bench.servers import Servers, ServiceBenchConfig, running_servers
from tierkv.client import Client
from tierkv.config import MiB
from tierkv.errors import ConfigError
from tierkv.hashing import block_hashes
from tierkv.keys import Namespace
from tierkv.layout import PRESETS, KVLayout

Progress = Callable[[str], None]



def _interleaved(fns: Sequence[Callable[[], float]], repeats: int,
                 progress: Progress | None = None, label: str = "") -> list[list[float]]:
    """``repeats`` rounds of each of ``fns``, in turn (so drifts hit every figure alike)."""
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples, strict=True):
            out.append(fn())
        if progress is not None:
            progress(label)
    return samples


def _med(samples: list[float]) -> float:
    return statistics.median(samples)


def _redis(servers: Servers, *, unix: bool) -> Any:
    import redis

    if unix:
        return redis.Redis(unix_socket_path=servers.redis_socket, socket_timeout=60)
    return redis.Redis(host="127.0.0.1", port=servers.redis_port, socket_timeout=60)


@dataclass(slots=True)
class _Bulk:
    """The bytes of the bulk benchmarks: batch ``i`` is blocks ``i .. i + batch_blocks`` of one
    random tensor, so every batch (and every block in it) differs from the others."""

    layout: KVLayout
    namespace: Namespace
    source: torch.Tensor
    batch_blocks: int

    @classmethod
    def make(cls, batch_blocks: int, num_batches: int) -> _Bulk:
        layout = PRESETS["llama-3-8b"].layout()
        source = random_blocks(layout, batch_blocks + num_batches)
        return cls(layout, Namespace("bench-service", layout), source, batch_blocks)

    @property
    def batch_bytes(self) -> int:
        return self.batch_blocks * self.layout.bytes_per_block

    def batch(self, index: int) -> torch.Tensor:
        return self.source[index : index + self.batch_blocks]

    def batch_np(self, index: int) -> np.ndarray:
        return self.batch(index).view(torch.uint8).reshape(-1).numpy()

    def block_views(self, index: int) -> list[memoryview]:
        """The batch's blocks as zero-copy buffers (what redis-py sends)."""
        flat = self.batch_np(index).data
        size = self.layout.bytes_per_block
        return [flat[i * size : (i + 1) * size] for i in range(self.batch_blocks)]


def _redis_keys(num: int) -> list[bytes]:
    return [b"bench:" + os.urandom(12).hex().encode() for _ in range(num)]


def _redis_set(client: Any, keys: Sequence[bytes], values: Sequence[memoryview]) -> None:
    pipe = client.pipeline(transaction=False)
    for key, value in zip(keys, values, strict=True):
        pipe.set(key, value)
    pipe.execute()


def _redis_get(client: Any, keys: Sequence[bytes]) -> list[bytes]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    values: list[bytes] = pipe.execute()
    return values


class _BulkRounds:
    """Timed rounds over ``num_batches`` batches: ``get_into`` and ``put`` through one client,
    pipelined GET and SET through one redis-py connection. Each returns GB/s."""

    def __init__(self, client: Client, rds: Any, bulk: _Bulk, num_batches: int) -> None:
        self.client, self.rds, self.bulk = client, rds, bulk
        self.indices = range(num_batches)
        self.total_bytes = bulk.batch_bytes * num_batches
        self.out = torch.empty_like(bulk.batch(0))
        namespace, batch_blocks = bulk.namespace, bulk.batch_blocks
        # What the gets read: stored once, untimed.
        self.get_hashes = [fresh_hashes(batch_blocks) for _ in self.indices]
        self.get_keys = [_redis_keys(batch_blocks) for _ in self.indices]
        for i in self.indices:
            client.put(namespace, self.get_hashes[i], bulk.batch(i))
            _redis_set(rds, self.get_keys[i], bulk.block_views(i))
        # What the last put round wrote (deleted, untimed, before the next one).
        self.put_hashes: list[list[bytes]] = []
        self.put_keys: list[list[bytes]] = []

    def gbs(self, fn: Callable[[int], object]) -> float:
        return self.total_bytes / total_s(fn, self.indices) / GB

    def get(self) -> float:
        namespace, out = self.bulk.namespace, self.out
        return self.gbs(lambda i: self.client.get_into(namespace, self.get_hashes[i], out))

    def redis_get(self) -> float:
        return self.gbs(lambda i: _redis_get(self.rds, self.get_keys[i]))

    def put(self) -> float:
        namespace, batch_blocks = self.bulk.namespace, self.bulk.batch_blocks
        if self.put_hashes:
            self.client.delete(namespace, [h for batch in self.put_hashes for h in batch])
        self.put_hashes = [fresh_hashes(batch_blocks) for _ in self.indices]
        return self.gbs(
            lambda i: self.client.put(namespace, self.put_hashes[i], self.bulk.batch(i))
        )

    def redis_set(self) -> float:
        if self.put_keys:
            self.rds.delete(*[k for keys in self.put_keys for k in keys])
        self.put_keys = [_redis_keys(self.bulk.batch_blocks) for _ in self.indices]
        return self.gbs(
            lambda i: _redis_set(self.rds, self.put_keys[i], self.bulk.block_views(i))
        )

    def verify_and_clean(self) -> None:
        """Bit-exactness (untimed) of every batch, got and put, on both servers; then delete."""
        bulk, namespace, out = self.bulk, self.bulk.namespace, self.out
        for i in self.indices:
            expected = bulk.batch(i).view(torch.uint8)
            assert self.client.get_into(namespace, self.get_hashes[i], out) == bulk.batch_blocks
            assert torch.equal(out.view(torch.uint8), expected), f"get_into of batch {i}"
            if self.put_hashes:
                got = self.client.get(namespace, self.put_hashes[i])
                assert torch.equal(got.view(torch.uint8), expected), f"put of batch {i}"
            assert b"".join(_redis_get(self.rds, self.get_keys[i])) == expected.numpy().tobytes()
        self.client.delete(namespace, [h for b in self.get_hashes + self.put_hashes for h in b])
        self.rds.flushdb()


# --- the benchmarks ----------------------------------------------------------------------------


def bench_local(cfg: ServiceBenchConfig, servers: Servers, progress: Progress) -> list[Row]:
    """Same host: ``get_into`` / ``put`` through the shared-memory slab vs the same copies in
    one process (a ``torch`` ``copy_`` on all its threads, the issue 13 baseline, and a
    single-threaded ``numpy.copyto``) and redis-py pipelines (Redis over its Unix socket, its
    fastest same-host transport). The in-process copies move the same batches between the
    caller's tensors and a pre-faulted buffer as large as the slab's working set, so that both
    sides read or write memory the same distance away."""
    bulk = _Bulk.make(cfg.batch_blocks, cfg.num_batches)
    batch_bytes = bulk.batch_bytes
    copy_dst = np.zeros(batch_bytes * cfg.num_batches, np.uint8)  # pre-faulted, like the slab
    slab_like = torch.from_numpy(copy_dst)
    threads = torch.get_num_threads()
    with Client(servers.unix_target, use_shm=True) as client, \
            contextlib.closing(_redis(servers, unix=True)) as rds:
        assert client.uses_shared_memory
        rounds = _BulkRounds(client, rds, bulk, cfg.num_batches)
        out_np = rounds.out.view(torch.uint8).reshape(-1).numpy()
        out_flat = rounds.out.view(torch.uint8).reshape(-1)

        def region(i: int) -> slice:
            return slice(i * batch_bytes, (i + 1) * batch_bytes)

        def copy_round() -> float:  # what put does: the caller's blocks into the slab
            return rounds.gbs(lambda i: np.copyto(copy_dst[region(i)], bulk.batch_np(i)))

        def copy_back_round() -> float:  # what get_into does: the slab into the caller's buffer
            return rounds.gbs(lambda i: np.copyto(out_np, copy_dst[region(i)]))

        def torch_round() -> float:
            return rounds.gbs(lambda i: slab_like[region(i)].copy_(
                bulk.batch(i).view(torch.uint8).reshape(-1)))

        def torch_back_round() -> float:
            return rounds.gbs(lambda i: out_flat.copy_(slab_like[region(i)]))

        # Warm-up (untimed): the client's first touch of its mapping of the slab pages (and of
        # the baselines' buffers and connections).
        for fn in (rounds.put, rounds.get, copy_round, copy_back_round, torch_round,
                   torch_back_round, rounds.redis_set, rounds.redis_get):
            fn()
        progress("same-host warm-up")
        get_s, torch_back_s, copy_back_s, redis_get_s = _interleaved(
            [rounds.get, torch_back_round, copy_back_round, rounds.redis_get], cfg.repeats,
            progress, "same-host get")
        put_s, torch_s, copy_s, redis_set_s = _interleaved(
            [rounds.put, torch_round, copy_round, rounds.redis_set], cfg.repeats, progress,
            "same-host put")
        rounds.verify_and_clean()
    get_gbs, put_gbs = _med(get_s), _med(put_s)
    torch_back_gbs, torch_gbs = _med(torch_back_s), _med(torch_s)
    copy_back_gbs, copy_gbs = _med(copy_back_s), _med(copy_s)
    rget_gbs, rset_gbs = _med(redis_get_s), _med(redis_set_s)
    torch_name = f"torch copy_ ({threads} threads)"
    return [
        Row("shm get_into vs torch copy_", "GB/s", get_gbs, torch_back_gbs, torch_name,
            ">= 0.8x", get_gbs >= 0.8 * torch_back_gbs, get_s),
        Row("shm get_into vs numpy.copyto", "GB/s", get_gbs, copy_back_gbs,
            "numpy.copyto", ">= 0.6x", get_gbs >= 0.6 * copy_back_gbs, get_s),
        Row("shm get_into vs redis GET, unix", "GB/s", get_gbs, rget_gbs,
            "redis-py pipelined GET (unix)", ">= 5.0x", get_gbs >= 5.0 * rget_gbs, get_s),
        Row("shm put vs torch copy_", "GB/s", put_gbs, torch_gbs, torch_name, ">= 0.7x",
            put_gbs >= 0.7 * torch_gbs, put_s),
        Row("shm put vs numpy.copyto", "GB/s", put_gbs, copy_gbs, "numpy.copyto", ">= 0.5x",
            put_gbs >= 0.5 * copy_gbs, put_s),
        Row("shm put vs redis SET, unix", "GB/s", put_gbs, rset_gbs,
            "redis-py pipelined SET (unix)", ">= 2.0x", put_gbs >= 2.0 * rset_gbs, put_s),
    ]


def bench_remote(cfg: ServiceBenchConfig, servers: Servers, progress: Progress) -> list[Row]:
    """The remote path: chunked Get / Put streams over TCP 127.0.0.1 vs Redis over TCP."""
    bulk = _Bulk.make(cfg.batch_blocks, cfg.num_stream_batches)
    with Client(servers.tcp_target, use_shm=False) as client, \
            contextlib.closing(_redis(servers, unix=False)) as rds:
        assert not client.uses_shared_memory
        rounds = _BulkRounds(client, rds, bulk, cfg.num_stream_batches)
        for fn in (rounds.put, rounds.get, rounds.redis_set, rounds.redis_get):  # warm-up
            fn()
        progress("remote warm-up")
        get_s, redis_get_s = _interleaved([rounds.get, rounds.redis_get], cfg.repeats, progress,
                                          "remote get")
        put_s, redis_set_s = _interleaved([rounds.put, rounds.redis_set], cfg.repeats, progress,
                                          "remote put")
        rounds.verify_and_clean()
    get_gbs, put_gbs = _med(get_s), _med(put_s)
    rget_gbs, rset_gbs = _med(redis_get_s), _med(redis_set_s)
    return [
        Row("TCP stream get_into vs redis GET", "GB/s", get_gbs, rget_gbs,
            "redis-py pipelined GET (TCP)", ">= 1.0x", get_gbs >= rget_gbs, get_s),
        Row("TCP stream put vs redis SET", "GB/s", put_gbs, rset_gbs,
            "redis-py pipelined SET (TCP)", ">= 1.0x", put_gbs >= rset_gbs, put_s),
    ]


def bench_lookup(cfg: ServiceBenchConfig, servers: Servers, progress: Progress) -> list[Row]:
    """``lookup`` of a fully cached chain (a 128K-token prompt) over the Unix socket; the
    baseline is Redis answering ``EXISTS`` of as many keys in one call."""
    layout = KVLayout(1, 1, 8)
    namespace = Namespace("bench-service-lookup", layout)
    hashes = block_hashes(list(range(cfg.lookup_blocks * layout.block_size)))
    blocks = torch.zeros((1024, *layout.block_shape), dtype=layout.torch_dtype)
    keys = [b"lookup:" + bytes(h) for h in hashes]
    with Client(servers.unix_target) as client, \
            contextlib.closing(_redis(servers, unix=True)) as rds:
        for start in range(0, len(hashes), 1024):
            chunk = hashes[start:start + 1024]
            client.put(namespace, chunk, blocks[: len(chunk)])
            rds.mset(dict.fromkeys(keys[start:start + 1024], b"1"))
        assert client.lookup(namespace, hashes) == cfg.lookup_blocks
        assert rds.exists(*keys) == cfg.lookup_blocks
        for _ in range(10):  # warm-up
            client.lookup(namespace, hashes)
            rds.exists(*keys)
        ours: list[float] = []
        theirs: list[float] = []
        for call in range(cfg.lookup_calls):
            ours.append(timed(lambda: client.lookup(namespace, hashes)) * 1e3)
            theirs.append(timed(lambda: rds.exists(*keys)) * 1e3)
            if call + 1 in _quarters(cfg.lookup_calls):
                progress("lookup")
        client.delete(namespace, hashes)
        rds.flushdb()
    p50, p99 = _percentile(ours, 50), _percentile(ours, 99)
    base50, base99 = _percentile(theirs, 50), _percentile(theirs, 99)
    baseline = f"redis EXISTS of {cfg.lookup_blocks} keys (unix)"
    return [
        Row(f"lookup {cfg.lookup_blocks} p50 vs redis EXISTS, unix", "ms", p50, base50, baseline,
            "<= 5 ms", p50 <= 5.0, ours),
        Row(f"lookup {cfg.lookup_blocks} p99 vs redis EXISTS, unix", "ms", p99, base99, baseline,
            "(info)", True, sorted(ours)[-max(1, len(ours) // 100):]),
    ]


def _quarters(num_calls: int) -> set[int]:
    """After which calls the lookup benchmark reports progress."""
    return {num_calls * k // 4 for k in range(1, 5)} - {0}


def _percentile(samples: Sequence[float], percent: float) -> float:
    return float(np.percentile(np.asarray(samples), percent))


def bench_calls(cfg: ServiceBenchConfig, servers: Servers, progress: Progress) -> list[Row]:
    """Small calls, one client, one after another: ``lookup`` of one hash by a same-host client
    (answered from the shared presence table, no call) vs redis-py ``GET`` of a small key (Redis
    over its Unix socket too). For scale, the same lookup forced over RPC (``lookup_detail``)
    and the server's gRPC health ``Check`` (a call that does nothing: the gRPC floor)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    layout = KVLayout(1, 1, 8)
    namespace = Namespace("bench-service-calls", layout)
    hashes = fresh_hashes(1)
    with Client(servers.unix_target) as client, \
            contextlib.closing(_redis(servers, unix=True)) as rds, \
            grpc.insecure_channel(servers.unix_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        client.put(namespace, hashes, torch.zeros((1, *layout.block_shape),
                                                  dtype=layout.torch_dtype))
        rds.set(b"small", b"x" * 64)
        check = health_pb2.HealthCheckRequest()

        def rate(call: Callable[[], object]) -> Callable[[], float]:
            def one_round() -> float:
                started = time.perf_counter()
                for _ in range(cfg.small_calls):
                    call()
                return cfg.small_calls / (time.perf_counter() - started)
            return one_round

        rounds = [rate(lambda: client.lookup(namespace, hashes)),
                  rate(lambda: rds.get(b"small")), rate(lambda: health.Check(check)),
                  rate(lambda: client.lookup_detail(namespace, hashes))]
        assert client.lookup(namespace, hashes) == 1
        assert rds.get(b"small") == b"x" * 64
        assert health.Check(check).status == health_pb2.HealthCheckResponse.SERVING
        for one_round in rounds:  # warm-up
            one_round()
        our_s, redis_s, floor_s, rpc_s = _interleaved(rounds, cfg.repeats, progress,
                                                      "small calls")
        client.delete(namespace, hashes)
        rds.flushdb()
    ours, base, floor, rpc = _med(our_s), _med(redis_s), _med(floor_s), _med(rpc_s)
    return [
        Row("lookup 1 hash vs redis GET, unix", "calls/s", ours, base,
            "redis-py GET of a small key (unix)", ">= 1.0x", ours >= base, our_s),
        Row("lookup 1 hash over RPC vs redis GET, unix", "calls/s", rpc, base,
            "redis-py GET of a small key (unix)", "(info: no shm)", True, rpc_s),
        Row("gRPC Health.Check vs redis GET, unix", "calls/s", floor, base,
            "redis-py GET of a small key (unix)", "(info: gRPC floor)", True, floor_s),
    ]


BENCHES: dict[str, Callable[[ServiceBenchConfig, Servers, Progress], list[Row]]] = {
    "local": bench_local,
    "remote": bench_remote,
    "lookup": bench_lookup,
    "calls": bench_calls,
}


def num_steps(cfg: ServiceBenchConfig, only: Sequence[str]) -> int:
    """How many times the benchmarks call ``progress`` (for a progress bar)."""
    per_group = {
        "local": 1 + 2 * cfg.repeats, "remote": 1 + 2 * cfg.repeats,
        "lookup": len(_quarters(cfg.lookup_calls)), "calls": cfg.repeats,
    }
    selected = [name for name in BENCHES if not only or name in only]
    return 1 + sum(per_group[name] + 1 for name in selected)


def host_bytes_for(cfg: ServiceBenchConfig) -> int:
    """A HOST budget that holds every working set at once, with room to spare."""
    block = PRESETS["llama-3-8b"].layout().bytes_per_block
    bulk = 2 * (cfg.num_batches + cfg.num_stream_batches) * cfg.batch_blocks * block
    return bulk + 256 * MiB


def run_service_bench(cfg: ServiceBenchConfig, only: Sequence[str],
                      progress: Progress) -> list[Row]:
    """Start both servers, run the selected benchmarks (all when ``only`` is empty), stop them."""
    if importlib.util.find_spec("redis") is None:
        raise ConfigError("bench service: redis-py is missing (pip install -e '.[dev]')")
    rows: list[Row] = []
    started = time.perf_counter()
    with running_servers(cfg, host_bytes_for(cfg)) as servers:
        progress(f"servers up in {time.perf_counter() - started:.1f}s")
        for name, bench in BENCHES.items():
            if not only or name in only:
                started = time.perf_counter()
                rows.extend(bench(cfg, servers, progress))
                progress(f"{name} done in {time.perf_counter() - started:.1f}s")
    shutil.rmtree(cfg.work_dir / "tierkv" / "disk", ignore_errors=True)
    return rows
