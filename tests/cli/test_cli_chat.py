"""``tierkv demo chat`` and ``tierkv bench chat --quick`` as a user runs them: real processes, a
real ``tierkv serve``, the tiny random-weight Llama built once for the module. Structure and
correctness only (hits, rows, logits checks): no timing is asserted."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import SidecarFactory
from tierkv.bench.chat_bench import ChatCurve
from tierkv.bench.chat_bench import exit_status as bench_exit_status
from tierkv.bench.models import TINY, build_llama
from tierkv.cli.demo_cmd import DemoTurn
from tierkv.cli.demo_cmd import exit_status as demo_exit_status
from tierkv.cli.main import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder (``--cache-dir``) that holds the built-in demo model, built once here."""
    root = tmp_path_factory.mktemp("cache")
    build_llama(root / "bench-models" / "llama-tiny", TINY)
    return root


@pytest.fixture
def tiny_model_dir(cache_dir: Path) -> Path:
    """The tiny test model (the demo's built-in one)."""
    return cache_dir / "bench-models" / "llama-tiny"


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


def _demo(cache_dir: Path, out: Path, *flags: str,
          capsys: pytest.CaptureFixture[str] | None = None) -> tuple[str, dict[str, Any]]:
    """``tierkv demo chat`` with ``flags``, in a new process, or in this one (``main``) when
    given ``capsys``: its stdout and its JSON."""
    argv = ["demo", "chat", "--cache-dir", str(cache_dir), "--turns", "3", "--max-new-tokens",
            "4", "--json", str(out), *flags]
    if capsys is None:
        stdout = _tierkv(*argv).stdout
    else:
        assert main(argv) == 0
        stdout = capsys.readouterr().out
    data: dict[str, Any] = json.loads(out.read_text())
    return stdout, data


def _check_turns(turns: list[dict[str, Any]], first_cached: int) -> None:
    """Every turn replied as without the cache; later turns restored the history before them."""
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert all(t["same_reply"] for t in turns), turns
    assert turns[0]["num_cached_tokens"] == first_cached
    for before, turn in itertools.pairwise(turns):
        # The last reply token is not in the cache yet; the rest of the history is, in blocks.
        history = before["num_prompt_tokens"] + 4 - 1
        assert turn["num_cached_tokens"] == history // 16 * 16 > 0, turns
    assert all(t["ttft_ms"] > 0 and t["ttft_no_cache_ms"] > 0 for t in turns)


def test_demo_chat_in_process_and_resumed_from_disk(tmp_path: Path, cache_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # No sidecar at --target: the in-process store, and the output says so.
    target = f"unix://{tmp_path}/nobody.sock"
    stdout, first = _demo(cache_dir, tmp_path / "first.json", "--target", target,
                          "--session", "trip")
    assert "in-process TieredStore" in first["store"] and "no sidecar answers" in first["store"]
    assert "session trip: not saved yet" in stdout
    assert "TTFT no cache" in stdout
    _check_turns(first["turns"], first_cached=0)
    # A new store (the first one is closed) resumes the conversation from its disk tier.
    history = first["turns"][-1]["num_prompt_tokens"] + 4
    stdout, resumed = _demo(cache_dir, tmp_path / "resumed.json", "--in-process",
                            "--session", "trip", capsys=capsys)
    assert f"session trip: resumed, {history} tokens of history" in stdout
    assert "(--in-process)" in resumed["store"]
    _check_turns(resumed["turns"], first_cached=(history - 1) // 16 * 16)


def test_demo_chat_through_a_sidecar_survives_its_sigkill(
    tmp_path: Path, cache_dir: Path, sidecar_factory: SidecarFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sidecar = sidecar_factory()
    _, first = _demo(cache_dir, tmp_path / "first.json", "--target", sidecar.unix_target,
                     "--session", "s1", capsys=capsys)
    assert first["store"] == f"the sidecar at {sidecar.unix_target} (shared memory)"
    _check_turns(first["turns"], first_cached=0)
    history = first["turns"][-1]["num_prompt_tokens"] + 4
    # The blocks were written through to disk: a SIGKILLed, restarted sidecar still has them.
    sidecar.kill()
    restarted = sidecar_factory(disk_path=sidecar.disk_path)
    _, resumed = _demo(cache_dir, tmp_path / "resumed.json", "--target", restarted.unix_target,
                       "--session", "s1", capsys=capsys)
    _check_turns(resumed["turns"], first_cached=(history - 1) // 16 * 16)


def _curve(length: int, correct: bool) -> ChatCurve:
    ms = {"recompute": 10.0, "sidecar": 1.0, "in_process": 1.0}
    return ChatCurve(length, ms, {m: [v] for m, v in ms.items()},
                     {"sidecar": length, "in_process": length if correct else 0},
                     {"sidecar": 0.0, "in_process": 0.0}, correct)


def test_bench_chat_fails_when_a_restore_is_not_correct() -> None:
    assert bench_exit_status([_curve(64, True), _curve(128, True)]) == 0
    assert bench_exit_status([_curve(64, True), _curve(128, False)]) == 1


def test_demo_chat_fails_when_a_reply_differs_with_the_cache() -> None:
    def turn(index: int, same: bool) -> DemoTurn:
        return DemoTurn(index, 100, 64, 1.0, 2.0, same, None)

    assert demo_exit_status([turn(1, True), turn(2, True)]) == 0
    assert demo_exit_status([turn(1, True), turn(2, False)]) == 1
