"""Benchmark results: rows of (metric, ours, baseline, ratio, target), printed, saved, plotted."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


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
    """A bar chart of ours vs baseline for every row that has a baseline in the same unit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plotted = [row for row in rows if row.baseline is not None]
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(plotted) + 1.5))
    labels = [f"{row.metric} ({row.unit})" for row in plotted]
    positions = range(len(plotted))
    ax.barh([p + 0.2 for p in positions], [row.ours for row in plotted], 0.4, label="tierkv")
    ax.barh([p - 0.2 for p in positions], [row.baseline or 0 for row in plotted], 0.4,
            label="baseline")
    ax.set_yticks(list(positions), labels)
    ax.invert_yaxis()
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
