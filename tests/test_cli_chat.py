"""``tierkv demo chat`` and ``tierkv bench chat --quick`` as a user runs them: real processes, a
real ``tierkv serve``, the tiny random-weight Llama built once for the module. Structure and
correctness only (hits, rows, logits checks): no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.bench.models import TINY, build_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test model, saved once for every test here."""
    return build_llama(tmp_path_factory.mktemp("models") / "llama-tiny", TINY)


def _tierkv(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("TIERKV_")}
    env["TQDM_DISABLE"] = "1"
    result = subprocess.run([sys.executable, "-m", "tierkv", *args], capture_output=True,
                            text=True, timeout=timeout_s, env=env, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def test_bench_chat_quick_writes_rows_curves_and_a_plot(tmp_path: Path,
                                                        tiny_model_dir: Path) -> None:
    out_json, out_png = tmp_path / "chat.json", tmp_path / "chat.png"
    result = _tierkv("bench", "chat", "--quick", "--repeats", "1", "--model-dir",
                     str(tiny_model_dir), "--work-dir", str(tmp_path), "--json", str(out_json),
                     "--plot", str(out_png))
    assert "recomp/sidecar" in result.stdout
    data = json.loads(out_json.read_text())
    lengths = [64, 128, 256]
    assert [curve["length"] for curve in data["curves"]] == lengths
    for curve in data["curves"]:
        assert set(curve["ms"]) == {"recompute", "sidecar", "in_process"}
        assert all(ms > 0 for ms in curve["ms"].values())
        # The whole history came back from both stores, and gave the recompute's logits.
        assert curve["num_cached"] == {"sidecar": curve["length"], "in_process": curve["length"]}
        assert all(diff <= 1e-4 for diff in curve["max_logit_diff"].values())
        assert curve["correct"] is True
    assert [row["metric"] for row in data["rows"]] == [
        f"TTFT after {n}: sidecar vs {baseline}" for n in lengths
        for baseline in ("recompute", "in-process")
    ]
    assert all(row["ratio"] > 0 for row in data["rows"])
    assert data["sidecar"]["uses_shared_memory"] is True
    assert data["config"]["dtype"] == "float32"
    assert len(data["targets"]) == 4
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
