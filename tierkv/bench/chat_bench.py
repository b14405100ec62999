"""``tierkv bench chat``: time to first token of a chat's next turn after a long history, with the
history's KV recomputed, restored through a sidecar, or restored from an in-process store.

Notes:
1. One prompt per history length ``L``: ``L`` random token ids of history, then
   ``next_turn_tokens`` of the new user message. The timed figure is the wall time from the
   prompt to the logits of the first new token (greedy), three ways, interleaved in each repeat:
   *recompute* (one forward over the whole prompt: what a chat without a cache pays), *sidecar*
   (``restore_kv`` through a ``tierkv serve`` subprocess on this host, shared-memory client, then
   a forward over the new tokens) and *in-process* (the same from a ``TieredStore`` in this
   process: the floor of any restore).
2. The history's KV comes from the first recompute of its prompt (a chat saved it at the end of
   the turn before): its first ``L`` tokens are saved ``write_through`` to both stores outside the
   timing. Each restore lands in one landing buffer per store that is reused across turns, as a
   chat application would keep one.
3. The model runs in fp32 (``DTYPE_REASON``): the weights of the saved bf16 benchmark model are
   loaded as fp32. Logits are computed for the last position only (``logits_to_keep=1``) in every
   mode, so no mode pays for a vocabulary projection of the whole prompt.
4. Once per length, outside the timing, the next-token logits of each restore are compared with
   the recompute's (``tolerance``; fp32: 1e-4), and the restored length must be the whole history.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tierkv.bench.models import BENCH_156M, TINY, LlamaShape, build_llama
from tierkv.bench.report import Row
from tierkv.bench.servers import tierkv_server
from tierkv.config import DiskTierConfig, HostTierConfig, MiB, StoreConfig
from tierkv.keys import Namespace

Progress = Callable[[str], None]

MODES = ("recompute", "sidecar", "in_process")
"""The three ways to the first token (note 1): the keys of ``ChatCurve.ms``."""

SPEEDUP_MIN = 10.0  # the sidecar restore >= 10x faster than recompute ...
SPEEDUP_LENGTH = 4096  # ... after a 4K history
SIDECAR_VS_IN_PROCESS_MAX = 1.25  # the sidecar restore <= 1.25x the in-process one

DTYPE_REASON = (
    "fp32: on this CPU the bf16 prefill is no faster than fp32 (measured 1K tokens of the 156M "
    "model: 3.3-4.6 s bf16, 4.2-4.6 s fp32), the logits check is exact to 1e-4 only in fp32, "
    "and fp32 KV is twice the bytes of bf16, so the restores move more: the speedups are not "
    "flattered"
)


@dataclass(frozen=True, slots=True)
class ChatBenchConfig:
    """What to run (note 1)."""

    work_dir: Path
    model_dir: Path
    shape: LlamaShape = BENCH_156M
    dtype: str = "float32"
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    next_turn_tokens: int = 32
    repeats: int = 3
    block_size: int = 16
    tolerance: float = 1e-4
    seed: int = 11

    def store_bytes(self, bytes_per_token: int) -> int:
        """What each store is given: every history's KV twice over, at least 256 MiB."""
        return max(256 * MiB, 2 * sum(self.lengths) * bytes_per_token)


def default_config(work_dir: Path, model_dir: Path, *, lengths: tuple[int, ...] | None = None,
                   repeats: int = 3) -> ChatBenchConfig:
    """The benchmark of the issue: the 156M model, histories of 1K to 8K tokens."""
    return ChatBenchConfig(work_dir, model_dir, lengths=lengths or (1024, 2048, 4096, 8192),
                           repeats=repeats)


def quick_config(work_dir: Path, model_dir: Path, *, repeats: int = 3) -> ChatBenchConfig:
    """A smoke run: the tiny test model, histories of 64 to 256 tokens."""
    return ChatBenchConfig(work_dir, model_dir, shape=TINY, lengths=(64, 128, 256),
                           next_turn_tokens=8, repeats=repeats)


def num_steps(cfg: ChatBenchConfig) -> int:
    """Progress steps of a run: the model, the sidecar, the warm-up, one per length and repeat."""
    return 3 + len(cfg.lengths) * cfg.repeats


# --- measuring ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Turn:
    """One timed next turn: seconds, the last position's logits, tokens restored."""

    seconds: float
    logits: torch.Tensor
    num_cached: int


class _Runner:
    """The model, its namespace and the two stores (with a landing buffer each, note 2)."""

    def __init__(self, model: Any, namespace: Namespace, stores: dict[str, Any],
                 max_blocks: int) -> None:
        self.model = model
        self.namespace = namespace
        self.stores = stores
        layout = namespace.layout
        self.buffers = {mode: torch.empty((max_blocks, *layout.block_shape),
                                          dtype=layout.torch_dtype) for mode in stores}

    def recompute(self, prompt: list[int]) -> tuple[_Turn, Any]:
        """A full prefill; returns the turn and its cache."""
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        out.logits[0, -1].argmax()
        seconds = time.perf_counter() - start
        return _Turn(seconds, out.logits[0, -1].clone(), 0), out.past_key_values

    def restored(self, mode: str, prompt: list[int]) -> _Turn:
        """Restore the cached prefix from ``mode``'s store, prefill the rest."""
        from tierkv.integrations.transformers import restore_kv

        start = time.perf_counter()
        cache, num_cached = restore_kv(self.stores[mode], self.namespace, prompt,
                                       out=self.buffers[mode])
        ids = torch.tensor([prompt[num_cached:]])
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        out.logits[0, -1].argmax()
        seconds = time.perf_counter() - start
        return _Turn(seconds, out.logits[0, -1].clone(), num_cached)

    def save_history(self, history: list[int], cache: Any) -> None:
        """The history's blocks into both stores, ``write_through`` (note 2)."""
        from tierkv.integrations.transformers import save_kv

        for store in self.stores.values():
            save_kv(store, self.namespace, history, cache)


@dataclass(frozen=True, slots=True)
class ChatCurve:
    """The figures of one history length: medians (ms), samples, and the correctness check."""

    length: int
    ms: dict[str, float]
    samples_ms: dict[str, list[float]]
    num_cached: dict[str, int]
    max_logit_diff: dict[str, float]
    correct: bool

    @property
    def speedup(self) -> float:
        """recompute / sidecar."""
        return self.ms["recompute"] / self.ms["sidecar"]

    @property
    def sidecar_vs_in_process(self) -> float:
        """sidecar / in-process."""
        return self.ms["sidecar"] / self.ms["in_process"]


def make_prompt(cfg: ChatBenchConfig, length: int) -> list[int]:
    """``length`` tokens of history and the next turn's message, random ids (seeded)."""
    rnd = random.Random(f"{cfg.seed}-{length}")
    return [rnd.randrange(100, cfg.shape.vocab_size)
            for _ in range(length + cfg.next_turn_tokens)]


def _measure(cfg: ChatBenchConfig, runner: _Runner, length: int,
             step: Progress) -> ChatCurve:
    prompt = make_prompt(cfg, length)
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    last: dict[str, _Turn] = {}
    for repeat in range(cfg.repeats):
        turn, cache = runner.recompute(prompt)
        if repeat == 0:
            runner.save_history(prompt[:length], cache)
        del cache
        last["recompute"] = turn
        for mode in ("sidecar", "in_process"):
            last[mode] = runner.restored(mode, prompt)
        for mode in MODES:
            samples[mode].append(1000 * last[mode].seconds)
        step(f"{length} tokens, repeat {repeat + 1}")
    reference = last["recompute"].logits
    diffs = {mode: float((last[mode].logits - reference).abs().max())
             for mode in ("sidecar", "in_process")}
    cached = {mode: last[mode].num_cached for mode in ("sidecar", "in_process")}
    correct = (all(diff <= cfg.tolerance for diff in diffs.values())
               and all(n == length for n in cached.values()))
    return ChatCurve(length, {mode: statistics.median(v) for mode, v in samples.items()},
                     samples, cached, diffs, correct)


def load_model(cfg: ChatBenchConfig) -> Any:
    """The benchmark model (built once into ``model_dir``), in ``cfg.dtype``, for inference."""
    from transformers import AutoModelForCausalLM

    build_llama(cfg.model_dir, cfg.shape)
    model: Any = AutoModelForCausalLM.from_pretrained(cfg.model_dir,
                                                      dtype=getattr(torch, cfg.dtype))
    model.eval()
    return model


@contextlib.contextmanager
def _stores(cfg: ChatBenchConfig, store_bytes: int) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """The sidecar's and the in-process store's ``BlockStore`` (and facts about the sidecar)."""
    from tierkv.client import Client
    from tierkv.store import TieredStore

    in_process = StoreConfig(
        host=HostTierConfig(store_bytes),
        disk=DiskTierConfig(cfg.work_dir / "in-process-disk", 2 * store_bytes),
    )
    with tierkv_server(cfg.work_dir, store_bytes, disk_bytes=2 * store_bytes) as (unix, _), \
            Client(unix) as client, TieredStore(in_process) as store:
        info = {"target": unix, "uses_shared_memory": client.uses_shared_memory,
                "host_bytes": store_bytes}
        yield {"sidecar": client, "in_process": store}, info


def run_chat_bench(cfg: ChatBenchConfig, progress: Progress | None = None
                   ) -> tuple[list[ChatCurve], dict[str, Any]]:
    """Measure every length (notes 1-4); returns the curves and facts about the run."""
    from tierkv.integrations.transformers import model_namespace

    step = progress or (lambda message: None)
    torch.manual_seed(cfg.seed)
    model = load_model(cfg)
    namespace = model_namespace(model, block_size=cfg.block_size)
    layout = namespace.layout
    step("model")
    max_blocks = max(cfg.lengths) // cfg.block_size + 1
    with torch.inference_mode(), _stores(cfg, cfg.store_bytes(layout.bytes_per_token)) as (
            stores, info):
        step("sidecar")
        runner = _Runner(model, namespace, stores, max_blocks)
        _warm_up(cfg, runner)
        step("warm-up")
        curves = [_measure(cfg, runner, length, step) for length in cfg.lengths]
    facts = {"sidecar": info, "torch_threads": torch.get_num_threads(),
             "kv_bytes_per_token": layout.bytes_per_token, "namespace": namespace.model_id}
    return curves, facts


def _warm_up(cfg: ChatBenchConfig, runner: _Runner) -> None:
    """One untimed turn of every mode on a short history of its own (first calls are slow:
    kernels, the client's slab mapping, the landing buffers' first touch)."""
    history = 4 * cfg.block_size
    rnd = random.Random(f"{cfg.seed}-warm-up")
    prompt = [rnd.randrange(100, cfg.shape.vocab_size)
              for _ in range(history + cfg.next_turn_tokens)]
    _, cache = runner.recompute(prompt)
    runner.save_history(prompt[:history], cache)
    for mode in ("sidecar", "in_process"):
        runner.restored(mode, prompt)
        runner.buffers[mode].fill_(0)  # touch every page of the landing buffer once


# --- report -------------------------------------------------------------------------------------


def rows_of(curves: list[ChatCurve]) -> list[Row]:
    """Two rows per length: the sidecar against recompute and against the in-process floor."""
    rows = []
    for curve in curves:
        ms = curve.ms
        at_target = curve.length == SPEEDUP_LENGTH
        rows.append(Row(
            f"TTFT after {curve.length}: sidecar vs recompute", "ms", ms["sidecar"],
            ms["recompute"], "full recompute",
            f"<= {1 / SPEEDUP_MIN:g}x time" if at_target else "(info)",
            curve.speedup >= SPEEDUP_MIN if at_target else True, curve.samples_ms["sidecar"]))
        rows.append(Row(
            f"TTFT after {curve.length}: sidecar vs in-process", "ms", ms["sidecar"],
            ms["in_process"], "in-process TieredStore", f"<= {SIDECAR_VS_IN_PROCESS_MAX}x time",
            curve.sidecar_vs_in_process <= SIDECAR_VS_IN_PROCESS_MAX,
            curve.samples_ms["sidecar"]))
    return rows


def summarize(curves: list[ChatCurve]) -> list[dict[str, Any]]:
    """The issue's targets, each met or not over every length it covers."""
    at_target = [c for c in curves if c.length == SPEEDUP_LENGTH]
    speedups = [c.speedup for c in curves]
    return [
        {"target": f"sidecar >= {SPEEDUP_MIN:g}x faster than recompute after "
                   f"{SPEEDUP_LENGTH} tokens",
         "met": bool(at_target) and all(c.speedup >= SPEEDUP_MIN for c in at_target)},
        {"target": "the speedup over recompute grows with the history",
         "met": all(a < b for a, b in itertools.pairwise(speedups))},
        {"target": f"sidecar <= {SIDECAR_VS_IN_PROCESS_MAX}x the in-process restore, "
                   "every length",
         "met": all(c.sidecar_vs_in_process <= SIDECAR_VS_IN_PROCESS_MAX for c in curves)},
        {"target": "restored logits equal recompute's and the whole history hit, every length",
         "met": all(c.correct for c in curves)},
    ]


def exit_status(curves: list[ChatCurve]) -> int:
    """The command's exit status: 1 when a length failed its correctness check (note 4: the
    restored logits off, or the history not fully restored), else 0; timings never fail it."""
    return 0 if all(c.correct for c in curves) else 1


def curves_json(curves: list[ChatCurve]) -> list[dict[str, Any]]:
    """The curves as JSON objects, with their two ratios."""
    return [{**asdict(c), "recompute_vs_sidecar": c.speedup,
             "sidecar_vs_in_process": c.sidecar_vs_in_process} for c in curves]


def _yes(value: bool) -> str:
    return "yes" if value else "NO"


def format_curves(curves: list[ChatCurve], targets: list[dict[str, Any]]) -> str:
    """One line per history length: the three medians, the two ratios, the check; then the
    targets."""
    header = (f"{'history':>7} {'recompute':>10} {'sidecar':>9} {'in-proc':>9}  "
              f"{'recomp/sidecar':>14} {'sidecar/in-proc':>15}  {'cached':>6} "
              f"{'max|dlogit|':>11} {'ok':>3}")
    lines = ["time to first token of the next turn, ms (median)", header, "-" * len(header)]
    for c in curves:
        diff = max(c.max_logit_diff.values())
        lines.append(
            f"{c.length:>7} {c.ms['recompute']:>10.1f} {c.ms['sidecar']:>9.1f} "
            f"{c.ms['in_process']:>9.1f}  {c.speedup:>13.1f}x {c.sidecar_vs_in_process:>14.2f}x  "
            f"{min(c.num_cached.values()):>6} {diff:>11.2e} {_yes(c.correct):>3}")
    lines.append("")
    lines += [f"{_yes(t['met']):>3}  {t['target']}" for t in targets]
    return "\n".join(lines)


def plot_series(curves: list[ChatCurve]) -> dict[str, list[tuple[float, float]]]:
    """(history tokens, median ms) per mode, for ``report.save_curves``."""
    labels = {"recompute": "full recompute", "sidecar": "restored through the sidecar",
              "in_process": "restored from an in-process TieredStore"}
    return {labels[mode]: [(float(c.length), c.ms[mode]) for c in curves] for mode in MODES}
