"""Run one real vLLM engine over a list of token prompts and write what it produced as JSON.

The tests and ``tierkv bench vllm`` run each engine in its own process with this module
(``python -m tierkv.integrations.vllm.engine_run SPEC.json OUT.json``), so that every engine is
a fresh one, as a restarted inference worker is. SPEC holds:

``model`` (a local directory), ``connector`` (null for none, or ``"tierkv"``, ``"example"``
for vLLM's ``ExampleConnector``, or ``"module:Class"``), ``extra_config`` (the connector's),
``dtype``, ``block_size``, ``max_model_len``, ``num_gpu_blocks`` (null for vLLM's own sizing),
``max_tokens``, and ``rounds``: a list of rounds, each ``{"prompts": [{"tokens": [...],
"cache_salt": ...}, ...]}`` generated together (greedy) after the previous round, with
``max_tokens`` (this round's), ``repeat`` (time the round several times), ``wait_for`` (a
file to wait for before the round), ``flush`` (wait until the connector's saves are in the
sidecar after it) and ``signal`` (a file to create after it); ``round_counters`` (the
connector's worker counters after each round). OUT holds per round the generated token ids,
``num_cached_tokens`` per prompt and the wall time of each repeat (and the counters), plus
the engine's start time and vLLM's counters (preemptions, external hits).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
# ``flush`` sends a function to the workers (LLM.collective_rpc); vLLM pickles it.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

WAIT_TIMEOUT_S = 300.0


def _transfer_config(spec: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    connector = spec.get("connector")
    if not connector:
        return None
    if connector == "tierkv":
        name, module = "TierKVConnector", "tierkv.integrations.vllm"
    elif connector == "example":
        name, module = "ExampleConnector", None
    else:
        module, name = connector.split(":")
    return KVTransferConfig(
        kv_connector=name, kv_connector_module_path=module, kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=spec.get("extra_config") or {},
    )


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Start the engine of ``spec``, run its rounds, and return what happened."""
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if spec.get("num_gpu_blocks"):
        kwargs["num_gpu_blocks_override"] = int(spec["num_gpu_blocks"])
    if spec.get("kv_cache_dtype"):
        kwargs["kv_cache_dtype"] = str(spec["kv_cache_dtype"])
    if spec.get("kv_events_endpoint"):  # vLLM's own KV events, beside the sidecar's
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=str(spec["kv_events_endpoint"]),
            topic="vllm")
    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
        dtype=spec.get("dtype", "bfloat16"), max_model_len=int(spec.get("max_model_len", 4096)),
        enable_prefix_caching=bool(spec.get("prefix_caching", True)),
        kv_transfer_config=_transfer_config(spec),
        max_num_batched_tokens=int(spec.get("max_num_batched_tokens", 8192)),
        max_num_seqs=int(spec.get("max_num_seqs", 16)), seed=0, disable_log_stats=False,
        block_size=int(spec.get("block_size", 128)), **kwargs,
    )
    result: dict[str, Any] = {"start_s": time.perf_counter() - started, "rounds": []}
    for round_spec in spec["rounds"]:
        params = SamplingParams(
            max_tokens=int(round_spec.get("max_tokens", spec.get("max_tokens", 8))),
            temperature=0.0, detokenize=False, ignore_eos=True,
        )
        if round_spec.get("wait_for"):
            _wait_for(Path(round_spec["wait_for"]))
        prompts = []
        for prompt in round_spec["prompts"]:
            item: dict[str, Any] = {"prompt_token_ids": list(prompt["tokens"])}
            if prompt.get("cache_salt"):
                item["cache_salt"] = prompt["cache_salt"]
            prompts.append(item)
        times, outputs = [], []
        for _ in range(int(round_spec.get("repeat", 1))):
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        result["rounds"].append({
            "tokens": [list(out.outputs[0].token_ids) for out in outputs],
            "num_cached_tokens": [int(out.num_cached_tokens or 0) for out in outputs],
            "times_s": times,
        })
        if round_spec.get("flush"):
            assert all(llm.collective_rpc(_flush_saves, timeout=120.0)), "saves did not finish"
        if spec.get("round_counters"):
            result["rounds"][-1]["worker_counters"] = llm.collective_rpc(_worker_counters,
                                                                          timeout=60.0)
        if round_spec.get("signal"):
            Path(round_spec["signal"]).touch()
    result["counters"] = _counters(llm)
    if spec.get("connector") == "tierkv":
        result["worker_counters"] = llm.collective_rpc(_worker_counters, timeout=60.0)
    return result


def _flush_saves(worker: Any) -> bool:
    """Run in each worker: wait until the connector's queued saves are in the sidecar."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return bool(get_kv_transfer_group().flush_saves(60.0))


def _worker_counters(worker: Any) -> dict[str, int]:
    """Run in each worker: what its connector moved."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return dict(get_kv_transfer_group().worker_counters())


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.05)


def _counters(llm: Any) -> dict[str, float]:
    """vLLM's counters of interest (from its metrics), summed over engines."""
    wanted = {"vllm:num_preemptions": "num_preemptions",
              "vllm:external_prefix_cache_hits": "external_prefix_cache_hits",
              "vllm:prefix_cache_hits": "prefix_cache_hits",
              # The connector's own (``stats.py``), as an operator's Prometheus sees them.
              "vllm:tierkv_loads_failed": "tierkv_loads_failed",
              "vllm:tierkv_blocks_loaded": "tierkv_blocks_loaded"}
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        name = wanted.get(metric.name)
        if name is not None and hasattr(metric, "value"):
            totals[name] = totals.get(name, 0.0) + float(metric.value)
    return totals


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result = run(spec)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":  # vLLM starts its engine in a subprocess: this guard is required
    sys.exit(main(sys.argv[1:]))
