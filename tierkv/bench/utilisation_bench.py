"""``tierkv bench store`` utilisation rows (issue 14): how much of what HOST and DISK use is KV.

For each layout of the issue's table, 8 blocks are put into a fresh ``TieredStore`` with the
default pages and ``stats()`` gives ``stored_bytes / used_bytes``. Then a mix of three of them
churns through a HOST that evicts (batches of 1-32 blocks of random models), and the rows give
the utilisation at the end and the copies a batch needs (runs of adjacent slab bytes among the
extents a read lease hands out: one copy moves one run). Last, LMDB's own bytes per KV byte
on DISK for three block sizes (``bench_disk_overhead``).
"""

from __future__ import annotations

import random
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path

import lmdb
import torch

from tierkv.bench.report import Row, fresh_hashes
from tierkv.config import (
    DiskTierConfig,
    GpuTierConfig,
    HostTierConfig,
    MiB,
    StoreConfig,
    Tier,
    WritePolicy,
)
from tierkv.keys import Namespace
from tierkv.layout import KVLayout
from tierkv.store import TieredStore

Progress = Callable[[str], None]

LAYOUTS = {  # the table: (layers, KV heads, head_dim), fp16, 16-token blocks
    "2x2x64 (test models)": (2, 2, 64),
    "8x4x64 (156M bench model)": (8, 4, 64),
    "24x2x64 (Qwen2.5-0.5B shape)": (24, 2, 64),
    "28x4x128 (Qwen2.5-7B shape)": (28, 4, 128),
    "32x8x128 (Llama-3-8B)": (32, 8, 128),
}
MIXED = ("8x4x64 (156M bench model)", "24x2x64 (Qwen2.5-0.5B shape)",
         "28x4x128 (Qwen2.5-7B shape)")
TARGET = 0.97


def _layout(name: str) -> KVLayout:
    layers, heads, head_dim = LAYOUTS[name]
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=16)


def _store(host_bytes: int) -> TieredStore:
    return TieredStore(StoreConfig(host=HostTierConfig(host_bytes), gpu=GpuTierConfig(0),
                                   presence_slots=0))


def _put(store: TieredStore, namespace: Namespace, count: int) -> list[bytes]:
    layout = namespace.layout
    hashes = fresh_hashes(count)
    store.put(namespace, hashes, torch.zeros((count, *layout.block_shape),
                                             dtype=layout.torch_dtype))
    return hashes


def _utilisation(store: TieredStore) -> float:
    host = store.stats().tiers[Tier.HOST]
    return host.utilisation or 0.0


def _copies(store: TieredStore, namespace: Namespace, hashes: list[bytes]) -> int:
    """Runs of adjacent slab bytes among the extents of a read lease of ``hashes``."""
    lease = store.sidecar.acquire(namespace, hashes)
    try:
        runs, end = 0, -1
        for extents in lease.blocks:
            for offset, length in extents:
                runs += offset != end
                end = offset + length
        return runs
    finally:
        store.sidecar.release(lease.lease_id)


def bench_utilisation(progress: Progress, seed: int = 1) -> list[Row]:
    """One row per layout, then the churned mix: utilisation, and the copies a batch needs
    (the runs of adjacent slab bytes its blocks take: its extents) as median and p90, with the
    mean blocks per batch and copies over blocks (1.0: one copy a block) beside them."""
    rows: list[Row] = []
    for name in LAYOUTS:
        with _store(256 * MiB) as store:
            namespace = Namespace(f"util-{name.split()[0]}", _layout(name))
            store.register(namespace)
            _put(store, namespace, 8)
            value = _utilisation(store)
        rows.append(Row(f"HOST utilisation, {name}", "ratio", value, None, "-",
                        f">= {TARGET}", value >= TARGET, [value]))
    progress("utilisation per layout")
    rng = random.Random(seed)
    with _store(256 * MiB) as store:
        namespaces = [Namespace(f"mix-{name.split()[0]}", _layout(name)) for name in MIXED]
        for namespace in namespaces:
            store.register(namespace)
        copies: list[float] = []
        blocks: list[float] = []
        for step in range(600):
            namespace = rng.choice(namespaces)
            num_blocks = rng.choice((1, 4, 16, 32))
            hashes = _put(store, namespace, num_blocks)
            if step >= 200:  # once HOST is full and evicting
                copies.append(_copies(store, namespace, hashes))
                blocks.append(num_blocks)
        value = _utilisation(store)
    progress("utilisation, mixed")
    mix = "3 models mixed, evicting"
    p90 = statistics.quantiles(copies, n=10, method="inclusive")[-1]
    return [*rows,
            Row(f"HOST utilisation, {mix}", "ratio", value, None, "-",
                f">= {TARGET}", value >= TARGET, [value]),
            Row(f"copies per batch, {mix}", "copies", statistics.median(copies), None, "-",
                "(info)", True, copies),
            Row(f"copies per batch p90, {mix}", "copies, p90", p90, None, "-", "(info)", True,
                copies),
            Row(f"blocks per batch, {mix}", "blocks, mean", statistics.mean(blocks), None, "-",
                "(info)", True, blocks),
            # One copy a block would be 1.0: what the batch's extents save, or cost.
            Row(f"copies per batch / blocks per batch, {mix}", "copies/block",
                sum(copies) / sum(blocks), None, "-", "(info)", True, [])]


def bench_disk_overhead(work_dir: Path, progress: Progress) -> list[Row]:
    """LMDB's own bytes per KV byte on DISK (issue 14: under 3% for blocks of 64 KiB or more):
    256 blocks of each size written through to a fresh disk tier, then the pages LMDB holds
    (``last_pgno`` x page size, read after the store closed: B-trees, free pages and all) over
    the KV bytes. A record is stored as a body that fills whole overflow pages and a head (the
    header and the payload's first bytes) in a leaf page (``tierkv.tiers.records.split_record``);
    stored as one value, a payload of whole 4 KiB pages took one page more (1.069 at 64 KiB)."""
    rows: list[Row] = []
    for layers, label in ((8, "64 KiB"), (16, "128 KiB"), (256, "2 MiB")):
        layout = KVLayout(num_layers=layers, num_kv_heads=1, head_dim=128, block_size=16)
        path = work_dir / f"lmdb-overhead-{layers}"
        shutil.rmtree(path, ignore_errors=True)
        config = StoreConfig(host=HostTierConfig(64 * MiB), gpu=GpuTierConfig(0),
                             disk=DiskTierConfig(path, 1024 * MiB),
                             write_policy=WritePolicy.WRITE_THROUGH, presence_slots=0)
        num_blocks = 256
        with TieredStore(config) as store:
            namespace = Namespace(f"lmdb-{label}", layout)
            store.register(namespace)
            for _ in range(num_blocks // 16):
                _put(store, namespace, 16)
        with lmdb.open(str(path), readonly=True, lock=False, subdir=True) as env:
            used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        shutil.rmtree(path, ignore_errors=True)
        ratio = used / (num_blocks * layout.bytes_per_block)
        rows.append(Row(f"DISK bytes per KV byte, {label} blocks", "ratio", ratio, None, "-",
                        "<= 1.03", ratio <= 1.03, [ratio]))
    progress("LMDB overhead")
    return rows
