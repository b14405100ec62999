"""``TierKVConnector`` under vLLM 0.32's own ``Scheduler`` (``tests/support/vllm_scheduler.py``):
what vLLM does with a load that fails, on a model of one KV cache group and on one of several
(full attention beside a sliding window: Gemma 3, gpt-oss), for every way a load fails: the
sidecar cleared between the lookup and the load, SIGKILLed as the load starts (and restarted),
stalled past ``load_timeout_s``, a stray write over its slab. Each mirrors a vLLM test of
``tests/v1/kv_connector/unit/``: ``test_block_level_load_failure_fails_closed_with_multiple_groups``
(with several groups vLLM stops the engine when told of failed blocks: the connector must fail
the request instead, ``failed_recving``), ``test_failed_receive_completion_honors_failure_policy``
(``recompute``: the request starts again and its next lookup offers nothing; ``fail``: it alone
ends in an error, its blocks freed) and ``test_sync_load_failure`` (one group: recomputed from
the first failed block). Every prompt's pages must hold what a recompute writes, and the engine
must serve the next request."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import Sidecar, SidecarFactory
from tests.support.redis_cluster import RedisCluster, wait_until
from tests.support.service_fixtures import flip_every_page
from tests.support.vllm_scheduler import (
    BLOCK,
    SchedulerEngine,
    kv_cache_config,
    request,
    vllm_config,
)
from tierkv import Client, ConfigError
from tierkv.bench.models import TINY, build_llama

NUM_BLOCKS = 10  # the prompt's full blocks; a hit loads 9 (the last token is computed)
LOAD_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local model folder for vLLM's ModelConfig (the caches are the tests' own)."""
    return build_llama(tmp_path_factory.mktemp("model") / "tiny-llama", TINY)


@pytest.fixture
def sidecar(sidecar_factory: SidecarFactory, tmp_path: Path) -> Sidecar:
    return sidecar_factory("--host-bytes", "64MiB", "--disk-bytes", "256MiB",
                           "--write-policy", "write_through", disk_path=tmp_path / "disk")


def prompt(seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(100, 30000) for _ in range(NUM_BLOCKS * BLOCK + 5)]


@pytest.fixture
def engines() -> Iterator[Callable[..., SchedulerEngine]]:
    made: list[SchedulerEngine] = []

    def make(model: Path, target: str, *, sliding: bool, **settings: Any) -> SchedulerEngine:
        engine = SchedulerEngine(vllm_config(model, target, load_timeout_s=LOAD_TIMEOUT_S,
                                             lookup_timeout_s=0.25,
                                             **settings), kv_cache_config(sliding=sliding))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def store(engine: SchedulerEngine, tokens: list[int], req_id: str = "a") -> None:
    """Compute ``tokens`` in ``engine`` and wait until its saves are in the sidecar."""
    engine.add(request(req_id, tokens))
    engine.run(req_id)
    assert engine.wrong[req_id] == []
    assert engine.worker.flush_saves(30.0)


def on_first_load(fault: Callable[[], None]) -> Callable[[Any], None]:
    """A ``before_load`` that runs ``fault`` once, in the first step that loads anything."""
    done: list[bool] = []

    def before_load(out: Any) -> None:
        meta = out.kv_connector_metadata
        if not done and (meta.loads or meta.async_loads):
            done.append(True)
            fault()

    return before_load


def scheduled_computed(engine: SchedulerEngine, req_id: str) -> list[int]:
    return [c for r, c in engine.admitted if r == req_id]


GROUPS = {"one group": False, "several groups": True}


@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_blocks_cleared_between_lookup_and_load_fail_the_request_never_the_engine(
    model: Path, sidecar: Sidecar, engines: Callable[..., SchedulerEngine], groups: str,
    policy: str,
) -> None:
    sliding = GROUPS[groups]
    tokens = prompt(1)
    store(engines(model, sidecar.unix_target, sliding=sliding), tokens)
    engine = engines(model, sidecar.unix_target, sliding=sliding, policy=policy)
    engine.add(request("b", tokens))

    def clear() -> None:
        with Client(sidecar.unix_target) as client:
            client.clear(all_namespaces=True)

    engine.run("b", before_load=on_first_load(clear))  # vLLM 0.32 raised RuntimeError here
    counters = engine.worker.worker_counters()
    assert counters["loads_failed"] == 1 and counters["blocks_loaded"] == 0
    if policy == "fail":
        assert str(engine.outputs["b"].finish_reason) == "error"
    else:
        assert str(engine.outputs["b"].finish_reason) == "length"
        assert engine.wrong["b"] == []  # every page as a recompute writes it
        if sliding:  # started again from nothing: its next lookup offered no hit
            assert scheduled_computed(engine, "b")[-1] == 0
    # The engine serves on: another prompt, then (once the breaker lets offers through) the
    # same prompt again, hit from what the engine saved after recomputing it (or A's).
    engine.add(request("c", prompt(2)))
    engine.run("c")
    assert engine.wrong["c"] == [] and str(engine.outputs["c"].finish_reason) == "length"
    assert engine.worker.flush_saves(30.0)
    if policy == "recompute":
        time.sleep(1.1)
        engine.add(request("b2", tokens))
        engine.run("b2")
        assert engine.wrong["b2"] == []
        assert scheduled_computed(engine, "b2")[-1] == NUM_BLOCKS * BLOCK  # every full block
        assert engine.worker.worker_counters()["blocks_loaded"] > 0


def faults(sidecar: Sidecar) -> dict[str, Callable[[], None]]:
    assert sidecar.process is not None
    pid = sidecar.process.pid
    return {
        "a stray write over the slab": lambda: flip_every_page(sidecar.ready["host_shm_name"]),
        "the sidecar SIGKILLed": sidecar.kill,
        "the sidecar stalled past load_timeout_s": lambda: os.kill(pid, signal.SIGSTOP),
    }


@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("fault", ["a stray write over the slab", "the sidecar SIGKILLed",
                                   "the sidecar stalled past load_timeout_s"])
def test_every_failed_load_is_recomputed_on_every_model_shape(
    model: Path, sidecar: Sidecar, sidecar_factory: SidecarFactory, tmp_path: Path,
    engines: Callable[..., SchedulerEngine], groups: str, fault: str,
) -> None:
    sliding = GROUPS[groups]
    tokens = prompt(3)
    store(engines(model, sidecar.unix_target, sliding=sliding), tokens)
    engine = engines(model, sidecar.unix_target, sliding=sliding)
    engine.add(request("b", tokens))
    try:
        engine.run("b", before_load=on_first_load(faults(sidecar)[fault]))
    finally:
        if sidecar.alive:
            assert sidecar.process is not None
            os.kill(sidecar.process.pid, signal.SIGCONT)
    assert str(engine.outputs["b"].finish_reason) == "length"
    assert engine.wrong["b"] == []
    assert engine.worker.worker_counters()["loads_failed"] >= 1
    if not sidecar.alive:  # restarted on its disk (write_through: A's blocks are there)
        sidecar = sidecar_factory("--host-bytes", "64MiB", "--disk-bytes", "256MiB",
                                  "--write-policy", "write_through", disk_path=tmp_path / "disk")
    time.sleep(1.1)  # the connector's breaker: no offers for a moment after a failure
    engine.add(request("c", tokens))
    engine.run("c")
    assert engine.wrong["c"] == [] and str(engine.outputs["c"].finish_reason) == "length"


def test_sync_loads_with_several_groups_are_refused_at_start(model: Path, sidecar: Sidecar,
                                                              ) -> None:
    """vLLM 0.32 cannot take a failed synchronous load of a model of several groups."""
    with pytest.raises(ConfigError, match="load_mode='sync' with 2 KV cache groups"):
        SchedulerEngine(vllm_config(model, sidecar.unix_target, load_mode="sync"),
                        kv_cache_config(sliding=True))


@pytest.mark.parametrize("groups", list(GROUPS))
def test_a_remote_fetch_that_fails_is_recomputed(
    model: Path, sidecar_factory: SidecarFactory, tmp_path: Path,
    engines: Callable[..., SchedulerEngine], groups: str,
) -> None:
    """Node X's engine stores through to REMOTE (a real Redis Cluster); node Y's sidecar holds
    nothing locally, so its lookup answers from REMOTE; every Redis node stops as Y's load
    starts: the fetch fails (a miss, as REMOTE's failures always are), vLLM recomputes."""
    sliding = GROUPS[groups]
    tokens = prompt(5)
    with RedisCluster(tmp_path / "redis") as cluster:
        remote = ("--host-bytes", "64MiB", "--no-disk", "--remote", cluster.url,
                  "--remote-timeout-s", "0.5")
        x = sidecar_factory(*remote, disk_path=tmp_path / "x")
        y = sidecar_factory(*remote, disk_path=tmp_path / "y")
        store(engines(model, x.unix_target, sliding=sliding, write_policy="write_through"),
              tokens)
        with Client(x.unix_target) as client:
            wait_until(lambda: _remote_drained(client), 30.0, "X's blocks written to REMOTE")
        engine = engines(model, y.unix_target, sliding=sliding)
        engine.add(request("b", tokens))
        pids = [cluster.pid(i) for i in range(len(cluster.ports))]
        try:
            engine.run("b", before_load=on_first_load(
                lambda: [os.kill(pid, signal.SIGSTOP) for pid in pids]))
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        assert str(engine.outputs["b"].finish_reason) == "length"
        assert engine.wrong["b"] == []
        counters = engine.worker.worker_counters()  # REMOTE's blocks were offered, and failed
        assert counters["loads_failed"] == 1 and counters["blocks_failed"] > 0
        assert counters["blocks_loaded"] == 0


def _remote_drained(client: Client) -> bool:
    stats = client.stats().remote
    return stats is not None and stats.queued_bytes == 0 and stats.written > 0


@pytest.mark.parametrize("parents", [True, False])
def test_a_prompt_saved_in_chunks_keeps_its_head_under_pressure(
    model: Path, sidecar_factory: SidecarFactory, engines: Callable[..., SchedulerEngine],
    parents: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt saved as vLLM saves a chunked prefill (three blocks a step, each save naming
    its blocks' parents), then another prompt through a 16-block HOST: the first prompt's tail
    is evicted, its head half still hits. Without parents (the connector before issue 43: each
    step's save newer than the last), the head went first and nothing hit."""
    if not parents:
        from tierkv.integrations.vllm import scheduler
        monkeypatch.setattr(scheduler, "PutDetail", _no_parents)
    sidecar = sidecar_factory("--host-bytes", "512KiB", "--no-disk")  # 16 blocks of 32 KiB
    engine = engines(model, sidecar.unix_target, sliding=False,
                     max_num_batched_tokens=3 * BLOCK)
    store(engine, prompt(1), "a")
    store(engine, prompt(2), "b")
    engine.add(request("a2", prompt(1)))
    engine.run("a2")
    assert engine.wrong["a2"] == []
    assert scheduled_computed(engine, "a2")[0] == (6 * BLOCK if parents else 0)


def _no_parents(*args: Any, **kwargs: Any) -> Any:
    from tierkv.types import PutDetail

    kwargs.pop("parent_hashes", None)
    return PutDetail(*args, **kwargs)
