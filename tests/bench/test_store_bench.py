"""``tierkv bench store``'s lease bookkeeping rows run end to end (no figure is asserted: the
machine is shared; BENCHMARKS.md holds the medians)."""

from __future__ import annotations

from pathlib import Path

from tierkv.bench.store_bench import StoreBenchConfig, run_store_bench


def test_the_lease_bookkeeping_rows_measure_both_calls(tmp_path: Path) -> None:
    steps: list[str] = []
    rows = run_store_bench(StoreBenchConfig(tmp_path), ["leases"], steps.append)
    assert [row.metric for row in rows] == ["Allocate + Commit, per block (256 a call)",
                                            "Acquire + Release, per block (256 a call)"]
    assert all(row.unit == "us" and row.ours > 0 and len(row.samples) == 40 for row in rows)
    assert steps[0] == "lease bookkeeping"
