"""``tierkv bench trace``: the simulated policies on real and synthetic traces, and the sidecar
replayed through ``tierkv serve`` and the SDK. Hit ratios are counts, not timings: they are
asserted exactly where the policy is deterministic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.bench.policies import (
    AdaptiveTinyLfu,
    Belady,
    Lru,
    TraceFacts,
    WTinyLfu,
    simulate,
    simulated_policies,
)
from tierkv.bench.trace_bench import TraceBenchConfig, replay_sidecar
from tierkv.bench.traces import Request, load_mooncake, synthetic
from tierkv.config import Eviction
from tierkv.errors import ConfigError

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / (
    "mooncake_conversation_first6000.jsonl")
needs_trace = pytest.mark.skipif(not TRACE.is_file(), reason=f"no trace at {TRACE}")


def _requests() -> list[Request]:
    return load_mooncake(TRACE, 0, 600) if TRACE.is_file() else synthetic("chat", 600)


@pytest.mark.parametrize("share", [0.02, 0.1, 0.3])
def test_no_policy_beats_the_optimum_or_its_capacity(share: float) -> None:
    requests = _requests()
    facts = TraceFacts(requests)
    capacity = int(share * facts.num_distinct)
    replays = {}
    for policy in simulated_policies(capacity, facts):
        replays[policy.name] = simulate(requests, policy, facts)
        assert len(policy.held()) <= capacity, policy.name
    optimum = replays["Belady (optimum)"]
    assert optimum.num_stranded == 0
    assert all(r.num_hit_blocks <= optimum.num_hit_blocks for r in replays.values())
    # The chain-aware LRU never strands a block; it is never behind the plain one here.
    assert replays["chain-aware LRU"].num_stranded == 0
    assert replays["chain-aware LRU"].num_hit_blocks >= replays["LRU"].num_hit_blocks


def test_an_unbounded_cache_gets_every_repeated_prefix() -> None:
    requests = [Request((0, 1, 2), 1536), Request((0, 1, 3), 1536), Request((0, 1, 2, 4), 2048),
                Request((5,), 512)]
    facts = TraceFacts(requests)
    for policy in simulated_policies(100, facts):
        replay = simulate(requests, policy, facts)
        assert (replay.num_hit_blocks, replay.num_blocks) == (2 + 3, 11), policy.name
        assert replay.num_hit_tokens == 2 * 512 + 3 * 512


def test_a_chain_in_several_puts_keeps_its_head_in_the_chain_aware_lru() -> None:
    """The issue's case in the simulation: a 16-block chain put 4 at a time, then 24 blocks of
    others through a 32-block cache. Plain LRU strands the chain's tail, the chain-aware one
    keeps its head."""
    chain = Request(tuple(range(16)), 16 * 512)
    others = [Request(tuple(range(100 + 4 * i, 104 + 4 * i)), 2048) for i in range(6)]
    requests = [chain, *others, chain]
    facts = TraceFacts(requests)
    plain = simulate(requests, Lru(32, chains=False), facts)
    chained = simulate(requests, Lru(32), facts)
    assert plain.num_hit_blocks == 0
    assert chained.num_hit_blocks == 8 and chained.num_stranded == 0


def test_belady_stores_nothing_it_will_not_use_before_what_it_holds() -> None:
    requests = [Request((0,), 512), Request((1,), 512), Request((0,), 512), Request((2,), 512),
                Request((0,), 512)]
    facts = TraceFacts(requests)
    replay = simulate(requests, Belady(1, facts.next_use, facts.depth), facts)
    assert replay.num_hit_blocks == 2  # block 0 kept throughout


def test_synthetic_traces_are_chains_and_repeatable() -> None:
    for kind in ("chat", "agent"):
        first, again = synthetic(kind, 400, seed=3), synthetic(kind, 400, seed=3)
        assert first == again
        parents: dict[int, int | None] = {}
        for request in first:
            for position, block in enumerate(request.block_ids):
                parent = request.block_ids[position - 1] if position else None
                assert parents.setdefault(block, parent) == parent  # one parent per block
        facts = TraceFacts(first)
        assert facts.num_distinct < sum(len(r.block_ids) for r in first)  # prefixes repeat
    with pytest.raises(ConfigError):
        synthetic("batch", 10)


def test_a_file_that_is_not_a_trace_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ConfigError, match="not a Mooncake trace"):
        load_mooncake(bad)
    bad.write_bytes(b"\x00\xff garbage")
    with pytest.raises(ConfigError, match="not a Mooncake trace"):
        load_mooncake(bad)
    good = tmp_path / "one.jsonl"
    good.write_text('{"hash_ids": [1, 2], "input_length": 1000}\n')
    assert load_mooncake(good) == [Request((1, 2), 1000)]
    with pytest.raises(ConfigError, match="no requests"):
        load_mooncake(good, start=1)


@pytest.mark.slow
def test_the_sidecar_replays_exactly_as_the_chain_aware_lru(tmp_path: Path) -> None:
    """``tierkv serve`` driven as an engine drives it (lookup, same-host read lease, puts of 4
    naming parents) gets the chain-aware LRU's hits block for block, and strands nothing."""
    requests = _requests()[:400]
    facts = TraceFacts(requests)
    capacity = int(0.05 * facts.num_distinct)
    sidecar = replay_sidecar(requests, facts, capacity, TraceBenchConfig(tmp_path))
    simulated = simulate(requests, Lru(capacity), facts)
    assert sidecar.replay.num_hit_blocks == simulated.num_hit_blocks > 0
    assert sidecar.replay.num_stranded == 0
    assert sidecar.hits_by_tier["DISK"] == 0


@pytest.mark.slow
@needs_trace
def test_the_cli_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    done = subprocess.run(
        [sys.executable, "-m", "tierkv", "bench", "trace", "--quick", "--disk-factor", "2",
         "--trace", str(TRACE), "--start", "3000", "--json", str(out), "--eviction", "adaptive"],
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| 10% (" in done.stdout and "Belady (optimum)" in done.stdout
    assert "tierkv (adaptive)" in done.stdout and "tierkv (lru)" not in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert any(row["metric"].startswith("10% HOST: tierkv") for row in rows)


def _hot_chains_and_scans(num_requests: int) -> list[Request]:
    """Traffic that favours frequency: 20 hot 4-block prompts asked for again and again between
    long one-off prompts that flush an LRU."""
    requests: list[Request] = []
    next_id = 1000
    for i in range(num_requests):
        if i % 3:
            hot = i % 20
            requests.append(Request(tuple(range(4 * hot, 4 * hot + 4)), 2048))
        else:
            requests.append(Request(tuple(range(next_id, next_id + 40)), 40 * 512))
            next_id += 40
    return requests


@pytest.mark.parametrize("traffic", ["chat", "hot chains and scans"])
def test_the_adaptive_policy_follows_the_better_of_its_two_modes(traffic: str) -> None:
    """W-TinyLFU's admission wins on one traffic and loses on the other; the adaptive policy,
    which switches it by two miniature simulations, gets near the better one on both."""
    requests = synthetic("chat", 1500) if traffic == "chat" else _hot_chains_and_scans(1500)
    facts = TraceFacts(requests)
    capacity = int(0.1 * facts.num_distinct) if traffic == "chat" else 160
    lru, tiny, adaptive = (simulate(requests, policy, facts).num_hit_blocks
                           for policy in (Lru(capacity), WTinyLfu(capacity),
                                          AdaptiveTinyLfu(capacity)))
    better, worse = max(lru, tiny), min(lru, tiny)
    assert better > 1.2 * worse, (lru, tiny)  # the two modes really differ here
    assert adaptive >= 0.95 * better, (lru, tiny, adaptive)


@pytest.mark.slow
def test_the_sidecar_under_the_adaptive_policy_keeps_hot_chains_through_scans(
        tmp_path: Path) -> None:
    """``tierkv serve --eviction adaptive`` on traffic where frequency pays: hot prompts between
    one-off prompts that flush an LRU (which then hits nothing). It keeps the hot chains, with
    nothing stranded; it gets less than the simulated adaptive W-TinyLFU, which rejects a
    one-off prompt block by block, where the store keeps the prefix of a chain still being
    written (its continuation would be stranded otherwise) and takes that room from main."""
    requests = _hot_chains_and_scans(900)
    facts = TraceFacts(requests)
    sidecar = replay_sidecar(requests, facts, 160, TraceBenchConfig(tmp_path),
                             eviction=Eviction.ADAPTIVE)
    simulated = simulate(requests, AdaptiveTinyLfu(160), facts).num_hit_blocks
    assert simulate(requests, Lru(160), facts).num_hit_blocks == 0
    assert sidecar.replay.name == "tierkv (adaptive)"
    assert sidecar.replay.num_hit_blocks >= 0.4 * simulated > 0, (sidecar.replay, simulated)
    assert sidecar.replay.num_stranded == 0
