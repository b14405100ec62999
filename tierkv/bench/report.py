"""Benchmark results: rows of (metric, ours, baseline, ratio, target), printed, saved, plotted."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from tierkv.layout import KVLayout

GB = 1e9
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Row:
    """One measured figure against its baseline.

    ``higher_is_better`` says which way the target points (GB/s: up; milliseconds: down).
    ``target_ratio`` is ours/baseline for throughputs, and for latencies the absolute limit in
    the row's unit (then ``baseline`` may be None).
    """

    metric: str
    unit: str
    ours: float
    baseline: float | None
    baseline_name: str
    target: str
    met: bool
    samples: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        """ours / baseline."""
        if self.baseline is None or self.baseline == 0:
            return None
        return self.ours / self.baseline


def median_of(fn: Callable[[], float], repeats: int) -> tuple[float, list[float]]:
    """Median and samples of ``repeats`` calls of ``fn`` (each returns one figure)."""
    samples = [fn() for _ in range(repeats)]
    return statistics.median(samples), samples


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def total_s(fn: Callable[[T], object], items: Iterable[T]) -> float:
    """Seconds ``fn`` takes over all ``items``, one timed call each."""
    return sum(timed(functools.partial(fn, item)) for item in items)


def random_blocks(layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """``num_blocks`` blocks of fixed pseudo-random bits in ``layout``'s dtype."""
    generator = torch.Generator().manual_seed(1234)
    raw = torch.randint(-(2**15), 2**15, (num_blocks, *layout.block_shape), dtype=torch.int32,
                        generator=generator)
    return raw.to(torch.int16).view(layout.torch_dtype)


def fresh_hashes(num: int) -> list[bytes]:
    """``num`` block hashes never used before (so every put really stores)."""
    return [hashlib.sha256(os.urandom(16)).digest() for _ in range(num)]


def format_table(rows: list[Row]) -> str:
    """A plain-text table of the rows."""
    header = f"{'metric':<44} {'ours':>12} {'baseline':>12} {'ratio':>7}  {'target':<18} met"
    lines = [header, "-" * len(header)]
    for row in rows:
        baseline = f"{row.baseline:12.3f}" if row.baseline is not None else f"{'-':>12}"
        ratio = f"{row.ratio:7.2f}" if row.ratio is not None else f"{'-':>7}"
        lines.append(
            f"{row.metric + ' (' + row.unit + ')':<44} {row.ours:12.3f} {baseline} {ratio}  "
            f"{row.target:<18} {'yes' if row.met else 'NO'}"
        )
    return "\n".join(lines)


def save_json(rows: list[Row], path: Path, extra: dict[str, Any]) -> None:
    """Write the rows and the machine they ran on as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        **extra,
        "rows": [{**asdict(row), "ratio": row.ratio} for row in rows],
    }
    path.write_text(json.dumps(data, indent=2))


def save_plot(rows: list[Row], path: Path, title: str) -> None:
    """One bar per row with a baseline: how many times better than the baseline tierkv is
    (throughput ratio, or baseline time / our time), with the target ratio marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plotted = [row for row in rows if row.ratio is not None]
    speedups = [_speedup(row) for row in plotted]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(plotted) + 1.6))
    positions = list(range(len(plotted)))
    colors = ["tab:green" if row.met else "tab:red" for row in plotted]
    # Bars grow from 1x on a log axis: 0.7x and 1.4x look as far from parity, and ratios near
    # 1x stay readable beside 15x ones.
    ax.barh(positions, [speedup - 1.0 for speedup in speedups], left=1.0, color=colors)
    ax.set_xscale("log")
    for position, row, speedup in zip(positions, plotted, speedups, strict=True):
        target = _target_ratio(row.target)
        if target is not None:
            ax.plot([target, target], [position - 0.4, position + 0.4], color="black")
        ax.text(max(speedup, 1.0), position, f" {speedup:.2f}x", va="center")  # past the bar
    ax.axvline(1.0, color="grey", linestyle=":")
    ax.set_yticks(positions, [f"{row.metric}\nvs {row.baseline_name}" for row in plotted])
    ax.invert_yaxis()
    ax.set_xlabel("times the baseline, log scale (higher is better; black tick: target)")
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_curves(series: dict[str, list[tuple[float, float]]], path: Path, title: str, *,
                xlabel: str, ylabel: str) -> None:
    """One line per named series of (x, y) points, both axes logarithmic, each point labelled
    with its y value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in series.items():
        xs, ys = [x for x, _ in points], [y for _, y in points]
        ax.plot(xs, ys, marker="o", label=name)
        for x, y in points:
            ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 5),
                        ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    xs = sorted({x for points in series.values() for x, _ in points})
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _speedup(row: Row) -> float:
    """Throughput rows: ours / baseline; time rows (ms): baseline / ours."""
    assert row.baseline is not None
    return row.ours / row.baseline if row.unit != "ms" else row.baseline / row.ours


def _target_ratio(target: str) -> float | None:
    """The ratio in a target such as ">= 0.8x" or "<= 1.0x time" (as a speedup)."""
    text = target.replace("time", "").strip()
    if not text.endswith("x") or text[:2] not in (">=", "<="):
        return None
    value = float(text[2:-1])
    return value if text.startswith(">=") else 1 / value


def draw_bar_groups(ax: Any, rows: list[dict[str, Any]], series: list[tuple[str, str, str]]
                    ) -> None:
    """On matplotlib's ``ax``: for each row a group of bars, one per ``(key, label, color)``
    of ``series`` (the row's ``key`` value, written above its bar), labelled by the row's
    ``length`` in tokens."""
    width = 0.8 / len(series)
    for k, (key, label, color) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))]
        values = [r[key] for r in rows]
        ax.bar(xs, values, width, label=label, color=color)
        for x, value in zip(xs, values, strict=True):
            ax.text(x, value, f"{value:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), [f"{r['length']} tokens" for r in rows])


def save_figure(fig: Any, ax: Any, path: Path, title: str, ylabel: str, *,
                legend_beside: bool = False) -> None:
    """Label matplotlib's ``ax`` (its legend too: ``legend_beside``, right of the axes, where
    curves would fill them), and write ``fig`` to ``path`` as a PNG."""
    import matplotlib.pyplot as plt

    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend_beside:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
