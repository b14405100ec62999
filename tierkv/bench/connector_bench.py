"""``tierkv bench connector``: the vLLM connector's worker moving a prompt's blocks between
vLLM's paged KV cache and a sidecar, against torch moving the same pages in one process.

Notes:
1. The real worker (``tierkv.integrations.vllm.worker.WorkerSide``) is driven without an
   engine, as vLLM calls it: ``register`` with per-layer caches ``[B, H, N, C]`` (the 156M
   bench model's layout: 8 layers x 4 KV heads x 64-wide heads, fp16, 16-token blocks; the
   cache holds ``cache_blocks`` blocks), then one step's ``StepMetadata`` of one request whose
   ``prompt_tokens`` tokens sit in vLLM blocks at random, distinct ids.
2. *save*: ``save`` (the gather out of vLLM's blocks, and the put queued for the saver thread),
   timed until the saver has the put acknowledged (``flush``).
   Every round saves fresh hashes, so that every put stores (the previous round's blocks are
   deleted outside the timing). Baseline: ``torch.index_select`` of the same pages, one per
   layer, into a reused contiguous buffer.
3. *load*: ``start_load`` then ``wait_for_layer`` of every layer (the fetch from the sidecar,
   then one scatter per layer), of blocks stored once before the rounds. Baseline:
   ``index_copy_`` of the same pages, one per layer, from a reused contiguous buffer.
4. The sidecar is a ``tierkv serve`` subprocess on this host (the worker's clients use its
   shared memory) without a DISK tier, so that no write-back competes for the cores; torch
   runs ``torch_threads`` threads in this process (the worker and the baselines alike).
   Figures are medians of ``repeats`` rounds after ``warmup`` rounds, the four timings
   interleaved within each round; bit-exactness of both paths is checked once, outside the
   timing. Info rows time the client's ``put`` and ``get_into`` alone, of a contiguous
   ``[n, L, H, N, C]`` staging tensor, against the same baselines (the part of the gap that is
   the client's).
5. The worker's index operations see each page as a row of 16-byte elements (``complex128``:
   torch copies the bytes unchanged, and moves 16-byte elements several times faster than
   fp16 ones). The baselines use vLLM's tensors as they are; info rows time them on the same
   16-byte rows, so that the part of the figures that is this view (open to the baseline too)
   shows.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tierkv.bench.report import GB, Row, fresh_hashes
from tierkv.bench.servers import tierkv_server
from tierkv.client import Client
from tierkv.config import MiB
from tierkv.integrations.vllm.geometry import BlockGeometry
from tierkv.integrations.vllm.scheduler import BlockOp, StepMetadata
from tierkv.integrations.vllm.settings import ConnectorSettings
from tierkv.integrations.vllm.worker import WorkerSide
from tierkv.keys import Namespace
from tierkv.layout import DType, KVLayout

Progress = Callable[[str], None]

TARGET_RATIO = 0.7  # the target: connector >= 0.7x the in-process copy
GROUPS = ("save", "load")
_SAVE_TIMEOUT_S = 60.0
BENCH_LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_size=16,
                        dtype=DType.FP16)
"""The 156M bench model's KV (``tierkv.bench.models.BENCH_156M``) in 16-token blocks."""


@dataclass(frozen=True, slots=True)
class ConnectorBenchConfig:
    """What to measure and how much (notes 1 and 4)."""

    work_dir: Path
    prompt_tokens: int = 4096
    cache_blocks: int = 2048
    layout: KVLayout = BENCH_LAYOUT
    repeats: int = 5
    warmup: int = 2
    torch_threads: int = 2
    seed: int = 13

    @property
    def num_blocks(self) -> int:
        """The prompt's blocks."""
        return self.prompt_tokens // self.layout.block_size

    @property
    def prompt_bytes(self) -> int:
        """The bytes one save or load moves."""
        return self.num_blocks * self.layout.bytes_per_block


def quick_config(work_dir: Path, repeats: int = 3) -> ConnectorBenchConfig:
    """A smoke run: a 1K-token prompt in a cache of 512 blocks."""
    return ConnectorBenchConfig(work_dir, prompt_tokens=1024, cache_blocks=512,
                                repeats=min(repeats, 3), warmup=1)


def num_steps(cfg: ConnectorBenchConfig) -> int:
    """Progress steps: the sidecar and setup, then one per round."""
    return 1 + cfg.warmup + cfg.repeats


# --- the engine's side ----------------------------------------------------------------------


def layer_names(layout: KVLayout) -> tuple[str, ...]:
    """vLLM's attention layer names, in model order."""
    return tuple(f"model.layers.{i}.self_attn.attn" for i in range(layout.num_layers))


def make_caches(cfg: ConnectorBenchConfig, *, fill: bool) -> list[torch.Tensor]:
    """vLLM's per-layer caches ``[B, H, N, C]`` (random bits, or zeros), every page touched."""
    layout = cfg.layout
    shape = (cfg.cache_blocks, layout.num_kv_heads, layout.block_size, 2 * layout.head_dim)
    generator = torch.Generator().manual_seed(cfg.seed)
    layers = []
    for _ in range(layout.num_layers):
        if fill:
            raw = torch.randint(-(2**15), 2**15, shape, dtype=torch.int32, generator=generator)
            layers.append(raw.to(torch.int16).view(layout.torch_dtype))
        else:
            layers.append(torch.zeros(shape, dtype=layout.torch_dtype))
    return layers


def random_ids(cfg: ConnectorBenchConfig, salt: int) -> list[int]:
    """The prompt's vLLM block ids: distinct, scattered over the cache."""
    generator = torch.Generator().manual_seed(cfg.seed + salt)
    return torch.randperm(cfg.cache_blocks, generator=generator)[: cfg.num_blocks].tolist()


def _wait_saved(worker: WorkerSide, expected: int) -> None:
    """Until the saver thread has put ``expected`` blocks in all (its ``flush``)."""
    if not worker.flush(_SAVE_TIMEOUT_S) or worker.counters.blocks_saved != expected:
        raise RuntimeError(f"bench connector: {expected - worker.counters.blocks_saved} blocks "
                           "were not saved")


def _rows(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` (each block contiguous) as ``[n, bytes / 16]`` of 16-byte elements."""
    return blocks.view(blocks.shape[0], -1).view(torch.complex128)


# --- rounds ---------------------------------------------------------------------------------


@dataclass
class _Bench:
    """The two workers (one saves out of ``source``, one loads into ``dest``), a client for
    setup and checks, and the reused buffers of the baselines."""

    cfg: ConnectorBenchConfig
    namespace: Namespace
    client: Client
    saver: WorkerSide
    loader: WorkerSide
    source: list[torch.Tensor]
    dest: list[torch.Tensor]
    save_ids: list[int]
    load_ids: list[int]
    stored_ids: list[int]  # the source's blocks that ``load_hashes`` hold
    load_hashes: list[bytes]
    buffer: torch.Tensor  # [L, n, H, N, C]: the baselines' reused buffer
    staging: torch.Tensor  # [n, L, H, N, C]: the info rows' contiguous blocks
    last_saved: list[bytes]
    saved_total: int = 0

    def save(self) -> float:
        if self.last_saved:
            self.client.delete(self.namespace, self.last_saved)
        hashes = fresh_hashes(self.cfg.num_blocks)
        self.last_saved = hashes
        step = StepMetadata((self.namespace,), saves=[BlockOp("r", tuple(hashes),
                                                            tuple(self.save_ids))])
        start = time.perf_counter()
        self.saver.save(step)
        self.saved_total += len(hashes)
        _wait_saved(self.saver, self.saved_total)
        return time.perf_counter() - start

    def gather_baseline(self) -> float:
        ids = torch.tensor(self.save_ids, dtype=torch.long)
        start = time.perf_counter()
        for index, layer in enumerate(self.source):
            torch.index_select(layer, 0, ids, out=self.buffer[index])
        return time.perf_counter() - start

    def gather_rows(self) -> float:
        """The baseline on 16-byte rows (what the worker's index operations see, note 5)."""
        ids = torch.tensor(self.save_ids, dtype=torch.long)
        out = _rows(self.buffer.view(self.buffer.shape[0] * self.buffer.shape[1], -1))
        rows = out.view(self.cfg.layout.num_layers, self.cfg.num_blocks, -1)
        start = time.perf_counter()
        for index, layer in enumerate(self.source):
            torch.index_select(_rows(layer), 0, ids, out=rows[index])
        return time.perf_counter() - start

    def scatter_rows(self) -> float:
        ids = torch.tensor(self.load_ids, dtype=torch.long)
        start = time.perf_counter()
        for index, layer in enumerate(self.dest):
            _rows(layer).index_copy_(0, ids, _rows(self.buffer[index]))
        return time.perf_counter() - start

    def load(self) -> float:
        step = StepMetadata((self.namespace,), loads=[BlockOp("q", tuple(self.load_hashes),
                                                            tuple(self.load_ids))])
        start = time.perf_counter()
        self.loader.start_load(step)
        for name in layer_names(self.cfg.layout):
            self.loader.wait_for_layer(name)
        seconds = time.perf_counter() - start
        errors = self.loader.take_load_errors()
        if errors:
            raise RuntimeError(f"bench connector: {len(errors)} blocks failed to load")
        return seconds

    def scatter_baseline(self) -> float:
        ids = torch.tensor(self.load_ids, dtype=torch.long)
        start = time.perf_counter()
        for index, layer in enumerate(self.dest):
            layer.index_copy_(0, ids, self.buffer[index])
        return time.perf_counter() - start

    def put_only(self) -> float:
        hashes = fresh_hashes(self.cfg.num_blocks)
        start = time.perf_counter()
        self.client.put(self.namespace, hashes, self._blocks())
        seconds = time.perf_counter() - start
        self.client.delete(self.namespace, hashes)
        return seconds

    def get_only(self) -> float:
        start = time.perf_counter()
        count = self.client.get_into(self.namespace, self.load_hashes, self._blocks())
        seconds = time.perf_counter() - start
        if count != self.cfg.num_blocks:
            raise RuntimeError(f"bench connector: get_into found {count} blocks")
        return seconds

    def _blocks(self) -> torch.Tensor:
        return self.staging.view((self.cfg.num_blocks, *self.cfg.layout.block_shape))

    def expected_blocks(self, ids: list[int]) -> torch.Tensor:
        """``[n, L, H, N, C]``: what the blocks at vLLM ids ``ids`` of ``source`` hold."""
        index = torch.tensor(ids, dtype=torch.long)
        return torch.stack([layer.index_select(0, index) for layer in self.source], dim=1)

    def check(self) -> None:
        """Both paths bit-exact (outside the timing)."""
        self.save()
        got = self.client.get(self.namespace, self.last_saved)
        want = self.expected_blocks(self.save_ids)
        if not torch.equal(got.reshape(-1).view(torch.int16), want.reshape(-1).view(torch.int16)):
            raise RuntimeError("bench connector: the saved blocks differ from vLLM's")
        for layer in self.dest:
            layer.zero_()
        self.load()
        index = torch.tensor(self.load_ids, dtype=torch.long)
        loaded = torch.stack([layer.index_select(0, index) for layer in self.dest], dim=1)
        if not torch.equal(loaded.view(torch.int16),
                           self.expected_blocks(self.stored_ids).view(torch.int16)):
            raise RuntimeError("bench connector: the loaded blocks differ from the stored ones")


@contextlib.contextmanager
def _bench(cfg: ConnectorBenchConfig, target: str) -> Iterator[_Bench]:
    layout = cfg.layout
    names = layer_names(layout)
    geometry = BlockGeometry(names, layout.block_size, layout.block_size, layout)
    namespace = Namespace("vllm:bench-connector", layout)
    settings = ConnectorSettings(address=target, save_queue_bytes=4 * cfg.prompt_bytes)
    source, dest = make_caches(cfg, fill=True), make_caches(cfg, fill=False)
    n = cfg.num_blocks
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(Client(target))
        saver = WorkerSide(settings, geometry, tp_rank=0)
        stack.callback(saver.close)
        loader = WorkerSide(settings, geometry, tp_rank=0)
        stack.callback(loader.close)
        saver.register(dict(zip(names, source, strict=True)))
        loader.register(dict(zip(names, dest, strict=True)))
        bench = _Bench(
            cfg, namespace, client, saver, loader, source, dest,
            save_ids=random_ids(cfg, 1), load_ids=random_ids(cfg, 3),
            stored_ids=random_ids(cfg, 2), load_hashes=fresh_hashes(n),
            buffer=torch.zeros((layout.num_layers, n, layout.num_kv_heads, layout.block_size,
                                2 * layout.head_dim), dtype=layout.torch_dtype),
            staging=torch.zeros((n, layout.num_layers, layout.num_kv_heads, layout.block_size,
                                 2 * layout.head_dim), dtype=layout.torch_dtype),
            last_saved=[],
        )
        # The blocks every load reads: those of vLLM ids ``stored_ids`` of the source.
        stored = bench.expected_blocks(bench.stored_ids).contiguous()
        client.put(namespace, bench.load_hashes, stored.view((n, *layout.block_shape)))
        yield bench


@dataclass(frozen=True, slots=True)
class ConnectorResult:
    """The rows, every figure's samples (GB/s, by name), and how busy the machine was just
    before the rounds (other processes' share of its CPUs; None where unknown): two torch
    threads that share two cores with another process wait for each other a time slice at a
    time, which slows the worker and the baselines alike and makes the ratios meaningless."""

    rows: list[Row]
    samples: dict[str, list[float]]
    busy_before: float | None


def busy_fraction(seconds: float = 1.0) -> float | None:
    """The share of the machine's CPU time not idle over ``seconds`` (Linux)."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
        return values[3] + values[4], sum(values)  # idle + iowait, all

    try:
        idle0, total0 = read()
        time.sleep(seconds)
        idle1, total1 = read()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def run_connector_bench(cfg: ConnectorBenchConfig, only: list[str], progress: Progress
                        ) -> ConnectorResult:
    """Measure (notes)."""
    groups = [g for g in GROUPS if not only or g in only]
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.torch_threads)
    try:
        host_bytes = max(256 * MiB, 8 * cfg.prompt_bytes)
        with tierkv_server(cfg.work_dir, host_bytes, extra_flags=["--no-disk"]) as (unix, _), \
                _bench(cfg, unix) as bench:
            progress("sidecar up")
            fns: dict[str, Callable[[], float]] = {}
            if "save" in groups:
                fns |= {"save": bench.save, "gather": bench.gather_baseline,
                        "put": bench.put_only, "gather_rows": bench.gather_rows}
            if "load" in groups:
                fns |= {"load": bench.load, "scatter": bench.scatter_baseline,
                        "get": bench.get_only, "scatter_rows": bench.scatter_rows}
            samples: dict[str, list[float]] = {name: [] for name in fns}
            busy = busy_fraction()
            for round_ in range(cfg.warmup + cfg.repeats):
                for name, fn in fns.items():
                    seconds = fn()
                    if round_ >= cfg.warmup:
                        samples[name].append(cfg.prompt_bytes / seconds / GB)
                progress(f"round {round_ + 1}")
            bench.check()
    finally:
        torch.set_num_threads(threads)
    return ConnectorResult(rows_of(cfg, samples), samples, busy)


def rows_of(cfg: ConnectorBenchConfig, samples: dict[str, list[float]]) -> list[Row]:
    """The table: the two targets, then what explains them (info rows)."""
    tokens = f"{cfg.prompt_tokens // 1024}K" if cfg.prompt_tokens % 1024 == 0 else \
        str(cfg.prompt_tokens)
    med = {name: statistics.median(values) for name, values in samples.items()}
    rows = []
    for ours, base, metric, base_name in (
        ("save", "gather", f"save: gather + put ({tokens} prompt)", "index_select"),
        ("load", "scatter", f"load: get + scatter ({tokens} prompt)", "index_copy_"),
    ):
        if ours not in med:
            continue
        rows.append(Row(metric, "GB/s", med[ours], med[base], f"{base_name} (in-process)",
                        f">= {TARGET_RATIO}x", med[ours] >= TARGET_RATIO * med[base],
                        samples[ours]))
    for ours, base, metric, base_name in (
        ("put", "gather", "client put alone (contiguous)", "index_select"),
        ("get", "scatter", "client get_into alone (contiguous)", "index_copy_"),
        ("gather_rows", "gather", "index_select on 16-byte rows", "index_select"),
        ("scatter_rows", "scatter", "index_copy_ on 16-byte rows", "index_copy_"),
    ):
        if ours in med:
            rows.append(Row(metric, "GB/s", med[ours], med[base], f"{base_name} (in-process)",
                            "(info)", True, samples[ours]))
    return rows
