"""One harness for real vLLM engines in tests: each engine is a fresh process running
``tierkv.integrations.vllm.engine_run`` against a spec, as a restarted inference worker is.

By default an engine runs vLLM's engine core and its worker inside that one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the layout of vLLM's own connector tests), on one
OpenMP thread as vLLM gives its own worker process on this machine: each of the two processes
vLLM would otherwise spawn costs 7-8 s of imports on the 2-core test machine, half of an
engine's start. ``in_process=False`` keeps vLLM's production layout, where the scheduler's
half of the connector and the worker's live in two processes and everything between them
crosses as pickled metadata: the handover tests run that way."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support import child_env
from tierkv.bench.vllm_bench import ONE_PROCESS_ENV

ENGINE_TIMEOUT_S = 600.0
BLOCK_SIZE = 32  # the CPU backend's smallest: more blocks, and partial ones, in short prompts
ALPHA, BETA = "alpha-token-0123456789", "beta-token-0123456789"
TOKENS = f"{ALPHA} tenant-a\n{BETA} tenant-b\n"


@dataclass
class EngineResult:
    """What one engine process produced, per round."""

    tokens: list[list[list[int]]]
    num_cached_tokens: list[list[int]]
    counters: dict[str, float]
    raw: dict[str, Any]


def run_engine(workdir: Path, name: str, spec: dict[str, Any],
               env: dict[str, str] | None = None, *, in_process: bool = True) -> EngineResult:
    """Run one engine to completion; its log is ``workdir/<name>.log``."""
    out_path = workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    process = start_engine(workdir, name, spec, env, in_process=in_process)
    try:
        code = process.wait(timeout=ENGINE_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code == 0 and out_path.exists(), (
        f"engine {name} exited with {code}:\n{log_path.read_text()[-6000:]}"
    )
    return result_of(workdir, name)


def start_engine(workdir: Path, name: str, spec: dict[str, Any],
                 env: dict[str, str] | None = None, *,
                 in_process: bool = True) -> subprocess.Popen[bytes]:
    """Start one engine process (see ``run_engine``); ``result_of`` reads what it wrote."""
    spec_path = workdir / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    layout = ONE_PROCESS_ENV if in_process else {}
    environment = {**child_env(), "VLLM_CPU_KVCACHE_SPACE": "1", **layout, **(env or {})}
    environment.pop("PYTHONHASHSEED", None)  # vLLM's default seed, as tierkv's default assumes
    with (workdir / f"{name}.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tierkv.integrations.vllm.engine_run", str(spec_path),
             str(workdir / f"{name}.out.json")],
            stdout=log, stderr=subprocess.STDOUT, env=environment,
        )


def one_core(core: int) -> dict[str, str]:
    """An engine's environment for one OpenMP thread bound to ``core``: the thread count an
    engine alone on this machine picks, also when two engines start at once (the count
    changes bf16 sums, and greedy tokens with them)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": str(core)}


def result_of(workdir: Path, name: str) -> EngineResult:
    raw = json.loads((workdir / f"{name}.out.json").read_text())
    return EngineResult(
        tokens=[r["tokens"] for r in raw["rounds"]],
        num_cached_tokens=[r["num_cached_tokens"] for r in raw["rounds"]],
        counters=raw.get("counters", {}), raw=raw,
    )


def spec(model: Path, address: str | None, rounds: list[list[dict[str, Any]]], *,
         token: str = ALPHA, write_policy: str | None = None,
         connector: str | None = "tierkv", extra: dict[str, Any] | None = None,
         **fields: Any) -> dict[str, Any]:
    """An engine spec: ``rounds`` of prompts; the connector talks to ``address`` (with more
    ``extra`` config)."""
    extra_config: dict[str, Any] = {}
    if connector == "tierkv" or (connector and ":" in connector):
        extra_config = {"address": address, "token": token, **(extra or {})}
        if write_policy:
            extra_config["write_policy"] = write_policy
    return {
        "model": str(model), "connector": connector, "extra_config": extra_config,
        "block_size": BLOCK_SIZE, "max_tokens": 12, "max_model_len": 2048,
        "rounds": [{"prompts": r} if isinstance(r, list) else r for r in rounds], **fields,
    }


def prompt_set(seed: int = 1) -> list[dict[str, Any]]:
    """Prompts that share prefixes: whole blocks, a partial last block, a prompt of exactly
    three blocks (the last token is always computed, so only two can be loaded), and one
    shorter than a block."""
    rnd = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rnd.randrange(100, 32000) for _ in range(n)]

    base = tokens(200)
    return [
        {"tokens": base[:160] + tokens(7)},
        {"tokens": base + tokens(30)},
        {"tokens": tokens(96)},
        {"tokens": tokens(20)},
    ]


def loadable_tokens(prompt: dict[str, Any]) -> int:
    """Tokens of a prompt a connector can load when every full block is stored."""
    return (len(prompt["tokens"]) - 1) // BLOCK_SIZE * BLOCK_SIZE


def salted(prompts: list[dict[str, Any]], salt: str) -> list[dict[str, Any]]:
    """The prompts, each with its own cache salt (one salt for all would let prompts that share
    a prefix share blocks among themselves, as they should)."""
    return [{**p, "cache_salt": f"{salt}-{i}"} for i, p in enumerate(prompts)]


def crowd(seed: int, num_prompts: int = 12) -> list[dict[str, Any]]:
    """Prompts of exactly three blocks sharing their first two: every request needs a new block
    on its first output token, so a small cache must preempt some."""
    rnd = random.Random(seed)
    shared = [rnd.randrange(100, 32000) for _ in range(2 * BLOCK_SIZE)]
    return [{"tokens": shared + [rnd.randrange(100, 32000) for _ in range(BLOCK_SIZE)]}
            for _ in range(num_prompts)]
