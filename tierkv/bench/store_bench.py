"""``tierkv bench store``: the embedded store against memcpy, raw disk I/O and plain cbor2.

Every figure is measured beside its baseline in the same run, on the same bytes: 2 MiB blocks
(one Llama-3-8B fp16 block), batches of 32. Throughputs are medians over ``repeats`` runs.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import shutil
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import cbor2
import numpy as np
import torch

from tierkv.bench.report import GB, Row, fresh_hashes, median_of, random_blocks, timed, total_s
from tierkv.bench.utilisation_bench import bench_disk_overhead, bench_utilisation
from tierkv.config import (
    DiskTierConfig,
    Eviction,
    HostTierConfig,
    StoreConfig,
    TenantShares,
    Tier,
    WritePolicy,
)
from tierkv.hashing import block_hashes, none_hash
from tierkv.keys import BlockHash, Namespace
from tierkv.layout import PRESETS, KVLayout
from tierkv.store import EventLog, TieredStore
from tierkv.types import PutDetail

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class StoreBenchConfig:
    """What to measure and how much."""

    work_dir: Path
    batch_blocks: int = 32
    num_batches: int = 8
    num_disk_batches: int = 4
    repeats: int = 5
    lookup_blocks: int = 8192
    hash_tokens: int = 131072
    index_blocks: int = 1_000_000
    eviction: Eviction = Eviction.LRU  # of the stores the host and leases rows measure








def bench_host(cfg: StoreBenchConfig, progress: Progress) -> list[Row]:
    """HOST put / get_into / get against numpy.copyto of the same bytes."""
    layout = PRESETS["llama-3-8b"].layout()
    batch_bytes = cfg.batch_blocks * layout.bytes_per_block
    total_bytes = batch_bytes * cfg.num_batches
    source = random_blocks(layout, cfg.batch_blocks)
    source_np = source.view(torch.uint8).reshape(-1).numpy()
    namespace = Namespace("bench", layout)
    config = StoreConfig(host=HostTierConfig(total_bytes + batch_bytes, 256 * 1024),
                         eviction=cfg.eviction)
    baseline_dst = np.zeros(total_bytes, np.uint8)  # pre-faulted, like the slab
    out = torch.empty_like(source)
    out_np = out.view(torch.uint8).reshape(-1).numpy()
    with TieredStore(config) as store:
        store.register(namespace)
        batches: list[list[bytes]] = []

        def put_round() -> float:
            if batches:
                store.delete(namespace, [h for batch in batches for h in batch])
                batches.clear()
            batches.extend(fresh_hashes(cfg.batch_blocks) for _ in range(cfg.num_batches))
            seconds = total_s(lambda b: store.put(namespace, b, source), batches)
            progress("host put")
            return total_bytes / seconds / GB

        def copy_round() -> float:
            seconds = total_s(
                lambda i: np.copyto(baseline_dst[i * batch_bytes:(i + 1) * batch_bytes], source_np),
                range(cfg.num_batches),
            )
            return total_bytes / seconds / GB

        def get_into_round() -> float:
            seconds = total_s(lambda b: store.get_into(namespace, b, out), batches)
            progress("host get")
            return total_bytes / seconds / GB

        def get_round() -> float:
            seconds = total_s(lambda b: store.get(namespace, b), batches)
            return total_bytes / seconds / GB

        def copy_back_round() -> float:
            seconds = total_s(
                lambda i: np.copyto(out_np, baseline_dst[i * batch_bytes:(i + 1) * batch_bytes]),
                range(cfg.num_batches),
            )
            return total_bytes / seconds / GB

        put_gbs, put_samples = median_of(put_round, cfg.repeats)
        copy_gbs, _ = median_of(copy_round, cfg.repeats)
        get_gbs, get_samples = median_of(get_into_round, cfg.repeats)
        fresh_gbs, fresh_samples = median_of(get_round, cfg.repeats)
        back_gbs, _ = median_of(copy_back_round, cfg.repeats)
        for batch in batches:  # every get must have been bit-exact
            assert torch.equal(store.get(namespace, batch).view(torch.uint8),
                               source.view(torch.uint8))
    return [
        Row("HOST put", "GB/s", put_gbs, copy_gbs, "numpy.copyto", ">= 0.8x",
            put_gbs >= 0.8 * copy_gbs, put_samples),
        Row("HOST get_into (reused buffer)", "GB/s", get_gbs, back_gbs, "numpy.copyto",
            ">= 0.8x", get_gbs >= 0.8 * back_gbs, get_samples),
        Row("HOST get (new tensor each call)", "GB/s", fresh_gbs, back_gbs, "numpy.copyto",
            "(info)", True, fresh_samples),
    ]


def bench_disk(cfg: StoreBenchConfig, progress: Progress) -> list[Row]:
    """DISK write_through put vs write+fsync; DISK get (warm) vs reading the file."""
    layout = PRESETS["llama-3-8b"].layout()
    batch_bytes = cfg.batch_blocks * layout.bytes_per_block
    total_bytes = batch_bytes * cfg.num_disk_batches
    source = random_blocks(layout, cfg.batch_blocks)
    source_np = source.view(torch.uint8).reshape(-1).numpy()
    namespace = Namespace("bench", layout)
    disk_dir = cfg.work_dir / "store-disk"
    raw_dir = cfg.work_dir / "raw-files"
    shutil.rmtree(disk_dir, ignore_errors=True)
    raw_dir.mkdir(parents=True, exist_ok=True)
    config = StoreConfig(
        host=HostTierConfig(batch_bytes * 2, 256 * 1024),
        disk=DiskTierConfig(disk_dir, total_bytes * 3),
        promote_on_read=False,
    )
    out = torch.empty_like(source)
    out_np = out.view(torch.uint8).reshape(-1).numpy()
    files = [raw_dir / f"batch-{i}.bin" for i in range(cfg.num_disk_batches)]
    with TieredStore(config) as store:
        store.register(namespace)
        batches: list[list[bytes]] = []

        def put_round() -> float:
            if batches:
                store.delete(namespace, [h for batch in batches for h in batch])
                batches.clear()
            batches.extend(fresh_hashes(cfg.batch_blocks) for _ in range(cfg.num_disk_batches))
            seconds = total_s(
                lambda b: store.put(namespace, b, source, write_policy=WritePolicy.WRITE_THROUGH),
                batches,
            )
            progress("disk put")
            return total_bytes / seconds / GB

        def write_round() -> float:
            def write(path: Path) -> None:
                with path.open("wb") as f:
                    f.write(source_np.data)
                    f.flush()
                    os.fsync(f.fileno())
            return total_bytes / total_s(write, files) / GB

        def get_round() -> float:
            seconds = total_s(lambda b: store.get_into(namespace, b, out), batches)
            progress("disk get")
            return total_bytes / seconds / GB

        def read_round() -> float:
            def read(path: Path) -> None:
                with path.open("rb", buffering=0) as f:
                    f.readinto(out_np.data)
            return total_bytes / total_s(read, files) / GB

        put_gbs, put_samples = median_of(put_round, cfg.repeats)
        write_gbs, _ = median_of(write_round, cfg.repeats)
        # Serve the gets from DISK only: drop the HOST copies the puts made.
        for batch in batches:
            store.delete(namespace, batch)
            store.put(namespace, batch, source, tier=Tier.DISK)
        assert store.stats().tiers[Tier.HOST].num_blocks == 0
        get_round()  # warm the page cache, as the file baseline is warm from its writes
        get_gbs, get_samples = median_of(get_round, cfg.repeats)
        read_gbs, _ = median_of(read_round, cfg.repeats)
        assert store.get_into(namespace, batches[0], out) == cfg.batch_blocks
        assert torch.equal(out.view(torch.uint8), source.view(torch.uint8))
    shutil.rmtree(disk_dir, ignore_errors=True)
    shutil.rmtree(raw_dir, ignore_errors=True)
    return [
        Row("DISK put write_through", "GB/s", put_gbs, write_gbs, "write+fsync", ">= 0.5x",
            put_gbs >= 0.5 * write_gbs, put_samples),
        Row("DISK get (page cache warm)", "GB/s", get_gbs, read_gbs, "file readinto",
            ">= 0.8x", get_gbs >= 0.8 * read_gbs, get_samples),  # issue 13
    ]


def bench_lookup(cfg: StoreBenchConfig, progress: Progress) -> list[Row]:
    """``lookup`` of a fully cached 8,192-block chain (a 128K-token prompt)."""
    layout = KVLayout(1, 1, 8)
    namespace = Namespace("bench-lookup", layout)
    hashes = block_hashes(list(range(cfg.lookup_blocks * layout.block_size)))
    config = StoreConfig(host=HostTierConfig(cfg.lookup_blocks * layout.bytes_per_block * 2, 512))
    blocks = torch.zeros((1024, *layout.block_shape), dtype=layout.torch_dtype)
    with TieredStore(config) as store:
        store.register(namespace)
        for start in range(0, len(hashes), 1024):
            chunk = hashes[start:start + 1024]
            store.put(namespace, chunk, blocks[: len(chunk)])
        assert store.lookup(namespace, hashes) == cfg.lookup_blocks

        def one() -> float:
            return timed(lambda: store.lookup(namespace, hashes)) * 1e3

        lookup_ms, samples = median_of(one, 50)
    progress("lookup")
    return [Row(f"lookup of {cfg.lookup_blocks} hashes", "ms", lookup_ms, None, "-",
                "<= 2 ms", lookup_ms <= 2.0, samples)]


def bench_lease_bookkeeping(cfg: StoreBenchConfig, progress: Progress) -> list[Row]:
    """The store's own work per block of a same-host client's lease calls, bytes aside: 256
    one-page blocks a call (a 4K-token prompt's blocks), Allocate + Commit with the client's
    checksums, then Acquire + Release of the same blocks; microseconds a block, the median of
    40 calls after 5 to warm up."""
    layout = KVLayout(1, 1, 8)  # 512 B blocks: one 4 KiB page each, the copy costs nothing
    namespace = Namespace("bench-leases", layout)
    num_blocks = 256
    with TieredStore(_lease_config(num_blocks, cfg.eviction)) as store:
        store.register(namespace)
        write_us, read_us = _lease_calls(store, namespace, num_blocks)
    progress("lease bookkeeping")
    write, read = float(np.median(write_us)), float(np.median(read_us))
    return [
        Row(f"Allocate + Commit, per block ({num_blocks} a call)", "us", write, None, "-",
            "<= 3 us", write <= 3.0, write_us),
        Row(f"Acquire + Release, per block ({num_blocks} a call)", "us", read, None, "-",
            "(info)", True, read_us),
    ]


_LEASE_CALLS = 45


def _lease_config(num_blocks: int, eviction: Eviction = Eviction.LRU) -> StoreConfig:
    page_bytes = 4096
    host_bytes = 2 * num_blocks * _LEASE_CALLS * page_bytes  # no eviction in the way
    return StoreConfig(host=HostTierConfig(host_bytes, page_bytes), presence_slots=1 << 20,
                       eviction=eviction)


def _lease_calls(store: TieredStore, namespace: Namespace, num_blocks: int,
                 detail: PutDetail | None = None) -> tuple[list[float], list[float]]:
    """``bench_lease_bookkeeping``'s calls: microseconds a block of each write and each read,
    the first 5 calls left out."""
    write_us: list[float] = []
    read_us: list[float] = []
    for _ in range(_LEASE_CALLS):
        hashes = fresh_hashes(num_blocks)
        started = time.perf_counter()
        lease = store.sidecar.allocate(namespace, hashes, slab_id=store.sidecar.host_slab_id, detail=detail)
        # (Recorded, not checked: no read of these bytes follows.)
        store.sidecar.commit(lease.lease_id, checksums=[0] * len(lease.write_indices))
        written = time.perf_counter()
        reading = store.sidecar.acquire(namespace, hashes, slab_id=store.sidecar.host_slab_id)
        store.sidecar.release(reading.lease_id)
        done = time.perf_counter()
        write_us.append((written - started) / num_blocks * 1e6)
        read_us.append((done - written) / num_blocks * 1e6)
    return write_us[5:], read_us[5:]


def bench_events(cfg: StoreBenchConfig, progress: Progress) -> list[Row]:
    """What KV events cost the hot path: ``bench_lease_bookkeeping``'s calls on a store with
    no event log, against one whose log a publisher drains onto an ipc socket that a
    subscriber reads (token ids given with every put), alternating, ``repeats`` rounds each;
    microseconds a block (medians of the rounds' medians)."""
    from tierkv.service.config import EventsConfig
    from tierkv.service.events import EventPublisher

    layout = KVLayout(1, 1, 8, block_size=16)
    namespace = Namespace("bench-events", layout)
    num_blocks = 256
    detail = PutDetail(tuple(range(num_blocks * layout.block_size)))
    rounds: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(cfg.repeats):
        for with_events in (False, True):
            log = EventLog() if with_events else None
            with TieredStore(_lease_config(num_blocks), events=log) as store:
                store.register(namespace)
                if log is None:
                    write_us, read_us = _lease_calls(store, namespace, num_blocks, detail)
                else:
                    socket_dir = Path(tempfile.mkdtemp(prefix="tkv-ev-", dir="/tmp"))
                    publisher = EventPublisher(EventsConfig(f"ipc://{socket_dir}/events"),
                                               store, log)
                    publisher.start()
                    with _draining(publisher.endpoint):
                        write_us, read_us = _lease_calls(store, namespace, num_blocks, detail)
                    publisher.close()
                    shutil.rmtree(socket_dir, ignore_errors=True)
            rounds[with_events].append((float(np.median(write_us)), float(np.median(read_us))))
        progress("events")
    rows: list[Row] = []
    for index, what in enumerate(("Allocate + Commit", "Acquire + Release")):
        off = [sample[index] for sample in rounds[False]]
        on = [sample[index] for sample in rounds[True]]
        value, base = float(np.median(on)), float(np.median(off))
        rows.append(Row(f"{what} per block, KV events on (token ids)", "us", value, base,
                        "events off", "(info)", True, on))
        if index == 0:  # a 2 MiB block's copy into HOST alone takes ~200 us here
            cost = value - base
            rows.append(Row("KV events' cost per block written", "us", cost, None, "-",
                            "<= 1 us", cost <= 1.0, [a - b for a, b in zip(on, off, strict=True)]))
    return rows


@contextlib.contextmanager
def _draining(endpoint: str) -> Iterator[None]:
    """A subscriber on its own thread reading every batch published on ``endpoint``."""
    import zmq

    stop = threading.Event()
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)

    def read() -> None:
        while not stop.is_set():
            if sub.poll(20):
                sub.recv_multipart()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield
    finally:
        stop.set()
        reader.join()
        context.destroy(linger=0)


def bench_eviction_by_tenants(cfg: StoreBenchConfig, progress: Progress) -> list[Row]:
    """The cost of a put that evicts, as tenants grow: HOST of 4,096 one-page blocks held by
    T tenants, then one more tenant, guaranteed half of HOST, puts 16 blocks a call, 1,920 in
    all, each evicting one block of a tenant over its share. Microseconds per block put, the
    median of the calls after a warm-up; the baseline is the same with one tenant holding
    everything: flat means no scan of tenants or blocks per victim."""
    layout = KVLayout(1, 1, 8)  # 512 B blocks: one page each, the copy costs nothing
    num_blocks, per_call, num_calls = 4096, 16, 120
    figures: dict[int, tuple[float, list[float]]] = {}
    for num_tenants in (1, 10, 100, 1000):
        tenants = [f"t{i}" for i in range(num_tenants)]
        # The writer is guaranteed half of HOST, the holders the other half between them:
        # every block it puts (fewer than its half) takes a victim from a holder over its share.
        weights = {**dict.fromkeys(tenants, 1.0), "writer": float(num_tenants)}
        config = StoreConfig(host=HostTierConfig(num_blocks * 512, 512),
                             tenants=TenantShares(weights))
        data = torch.zeros((per_call, *layout.block_shape), dtype=layout.torch_dtype)
        with TieredStore(config) as store:
            for index in range(num_blocks):  # the holders: one block each in turn
                namespace = Namespace("bench-evict", layout, tenant=tenants[index % num_tenants])
                if index < num_tenants:
                    store.register(namespace)
                store.put(namespace, fresh_hashes(1), data[:1])
            writer = Namespace("bench-evict", layout, tenant="writer")
            store.register(writer)
            samples = []
            for _ in range(num_calls):
                hashes = fresh_hashes(per_call)
                started = time.perf_counter()
                store.put(writer, hashes, data)
                samples.append((time.perf_counter() - started) / per_call * 1e6)
            evicted = {t.tenant: t.evicted_by_others for t in store.tenant_stats()}
            assert sum(evicted.values()) == per_call * num_calls  # every victim another's
        samples = samples[10:]
        figures[num_tenants] = (float(np.median(samples)), samples)
        progress(f"eviction with {num_tenants} tenants")
    one = figures[1][0]
    return [Row(f"put that evicts, per block, {n} tenant(s) holding HOST", "us", us, one,
                "1 tenant", "(info) flat", True, samples)
            for n, (us, samples) in figures.items()]


def reference_block_hashes(tokens: list[int], block_size: int, seed: str) -> list[bytes]:
    """The straightforward per-block cbor2 implementation (the baseline)."""
    parent = bytes(none_hash(seed, algorithm="sha256_cbor"))
    result = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        payload = cbor2.dumps((parent, tuple(tokens[start:start + block_size]), None),
                              canonical=True)
        parent = hashlib.sha256(payload).digest()
        result.append(parent)
    return result


def bench_hashing(cfg: StoreBenchConfig, progress: Progress) -> list[Row]:
    """``block_hashes`` (sha256_cbor) of 128K tokens against the straightforward cbor2 loop."""
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 128256, cfg.hash_tokens).tolist()

    def ours_fn() -> list[BlockHash]:
        return block_hashes(tokens, seed="0", algorithm="sha256_cbor")

    assert [bytes(h) for h in ours_fn()] == reference_block_hashes(tokens, 16, "0")
    ours, samples = median_of(lambda: timed(ours_fn) * 1e3, cfg.repeats)
    base, _ = median_of(
        lambda: timed(lambda: reference_block_hashes(tokens, 16, "0")) * 1e3, cfg.repeats
    )
    progress("hashing")
    return [Row(f"block_hashes of {cfg.hash_tokens} tokens", "ms", ours, base,
                "cbor2 per block", "<= 1.0x time", ours <= base, samples)]


def _index_bytes_per_block(num_blocks: int, with_tokens: bool) -> float:
    """Python memory the index holds per block at ``num_blocks`` blocks (keys included);
    ``with_tokens``: every put gives its token ids (16 a block) to a store whose KV events
    publish them, so each block keeps them (``tierkv.store.tokens``)."""
    layout = KVLayout(1, 1, 2)  # 128-byte blocks: the slab stays small, the index is the point
    namespace = Namespace("bench-index", layout)
    config = StoreConfig(host=HostTierConfig(num_blocks * layout.bytes_per_block,
                                             layout.bytes_per_block))
    batch = 16384
    blocks = torch.zeros((batch, *layout.block_shape), dtype=layout.torch_dtype)
    events = EventLog(max_pending=2 * batch) if with_tokens else None
    rng = np.random.default_rng(3)
    with TieredStore(config, events=events) as store:
        store.register(namespace)
        gc.collect()
        tracemalloc.start()
        before, _ = tracemalloc.get_traced_memory()
        for start in range(0, num_blocks, batch):
            count = min(batch, num_blocks - start)
            detail = PutDetail(tuple(rng.integers(0, 128_256, count * layout.block_size)
                                     .tolist())) if with_tokens else None
            store.put(namespace, fresh_hashes(count), blocks[:count], detail=detail)
            del detail  # the put's own token ids: gone once it returns
            if events is not None:
                events.take()  # what a publisher does: the records are not the index
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert store.stats().tiers[Tier.HOST].num_blocks == num_blocks
    return (after - before) / num_blocks


def bench_index_memory(cfg: StoreBenchConfig, progress: Progress) -> list[Row]:
    """Python memory the index holds per block at ``index_blocks`` blocks (keys included),
    and with each block's 16 token ids kept for KV events."""
    per_block = _index_bytes_per_block(cfg.index_blocks, False)
    with_tokens = _index_bytes_per_block(cfg.index_blocks, True)
    progress("index memory")
    return [Row(f"index memory at {cfg.index_blocks} blocks", "B/block", per_block, None, "-",
                "<= 300", per_block <= 300, [per_block]),
            Row(f"index memory at {cfg.index_blocks} blocks, token ids kept (16 a block)",
                "B/block", with_tokens, per_block, "without token ids",
                "<= +4 B a token +40 B", with_tokens <= per_block + 4 * 16 + 40, [with_tokens])]


BENCHES: dict[str, Callable[[StoreBenchConfig, Progress], list[Row]]] = {
    "host": bench_host,
    "disk": bench_disk,
    "lookup": bench_lookup,
    "leases": bench_lease_bookkeeping,
    "tenants": bench_eviction_by_tenants,
    "hashing": bench_hashing,
    "index": bench_index_memory,
    "events": bench_events,
    "utilisation": lambda cfg, progress: [*bench_utilisation(progress),
                                          *bench_disk_overhead(cfg.work_dir, progress)],
}


def run_store_bench(cfg: StoreBenchConfig, only: list[str], progress: Progress) -> list[Row]:
    """Run the selected benchmarks (all when ``only`` is empty) and return their rows."""
    rows: list[Row] = []
    for name, bench in BENCHES.items():
        if not only or name in only:
            started = time.perf_counter()
            rows.extend(bench(cfg, progress))
            progress(f"{name} done in {time.perf_counter() - started:.1f}s")
    return rows
