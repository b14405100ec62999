"""vLLM 0.32.0's own unit tests of the connector contract, from its sdist (fetched at test time,
cached, never copied here: ``tests/support/vllm_sdist.py``), run against ``TierKVConnector``
with a live sidecar: their mocked connector replaced by ours, their assertions kept
(``tests/support/vllm_contract_plugin.py`` says how). The files are the ones that hold any
connector to vLLM's scheduler: load failures (sync, async, shared blocks, progressive, several
KV cache groups), the ``fail`` and ``recompute`` policies, the prefix-cache pollution a failed
load must not cause, and the metadata lifecycle of the worker's no-forward path. vLLM's other
connector tests are of one connector each, whose protocols a sidecar does not have: NIXL's
pull of a prefill engine's GPU blocks (``test_remote_prefill_lifecycle``,
``test_remote_decode_lifecycle``: the decode engine reads ``remote_block_ids`` out of the
prefill engine's memory; tierkv's handoff is a ticket in the sidecar), Mooncake, LMCache,
MoRIIO, HF3FS, FlexKV, the offloading connectors' own workers, or which connector classes
vLLM's config picks for the hybrid allocator (``test_hma_auto_config``, by name)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.support import REPO
from tests.support.harness import SidecarFactory
from tests.support.vllm_sdist import UNIT, vllm_tests_root
from tierkv.bench.models import TINY, build_llama, save_word_tokenizer

FILES = (
    "test_kv_load_failure_recovery.py",
    "test_invalid_blocks_correctness.py",
    "test_error_propagation.py",
    "test_cache_pollution_prevention.py",
    "test_kv_connector_lifecycle.py",
)
NUM_CASES = 21  # the parametrized cases of FILES in vLLM 0.32.0: every one must run and pass


def test_vllms_own_connector_tests_pass_against_tierkv(
    tmp_path: Path, sidecar_factory: SidecarFactory,
) -> None:
    root = vllm_tests_root()
    model = build_llama(tmp_path / "tiny-llama", TINY)
    save_word_tokenizer(model)  # their configs load a tokenizer
    sidecar = sidecar_factory("--host-bytes", "64MiB", "--disk-bytes", "64MiB")
    report = tmp_path / "junit.xml"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    # vLLM's ``tests`` package first (its root is the working folder); ours is not on the path.
    env.update(PYTHONPATH=str(REPO / "tests" / "support"), TIERKV_CONTRACT_MODEL=str(model),
               TIERKV_CONTRACT_TARGET=sidecar.unix_target, VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "vllm_contract_plugin", "-p", "no:cacheprovider",
         "-q", "-rfE", "--timeout", "300", f"--junitxml={report}", "--rootdir", str(root),
         *(f"{UNIT}/{name}" for name in FILES)],
        cwd=root, env=env, capture_output=True, text=True, timeout=900, check=False)
    outcomes = _outcomes(report) if report.exists() else {}
    failed = {case: why for case, why in outcomes.items() if why}
    assert len(outcomes) == NUM_CASES, f"ran {len(outcomes)} cases:\n{done.stdout[-6000:]}"
    assert not failed, "\n\n".join(f"{case}: {why}" for case, why in failed.items())


def _outcomes(report: Path) -> dict[str, str]:
    """Test id -> '' when it passed, else its failure's message."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        problems = [e for e in case if e.tag in ("failure", "error", "skipped")]
        out[name] = "; ".join(f"{e.tag}: {(e.get('message') or '')[:400]}" for e in problems)
    return out


