"""The connector's scheduler and worker halves against a real server, without an engine:
vLLM's calls are played by hand with the objects they carry (requests with vLLM's block
hashes, scheduler outputs, per-layer cache tensors)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.harness import BackgroundServer, SidecarFactory
from tierkv import Client, ConfigError, KVLayout, Namespace, block_hashes
from tierkv.integrations.vllm.geometry import BlockGeometry
from tierkv.integrations.vllm.scheduler import SchedulerSide
from tierkv.integrations.vllm.settings import ConnectorSettings
from tierkv.integrations.vllm.worker import WorkerSide

BLOCK = 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=BLOCK, dtype="bf16")
GEOMETRY = BlockGeometry(LAYERS, BLOCK, BLOCK, LAYOUT)
NAMESPACE = Namespace("vllm:test-model", LAYOUT)
NUM_VLLM_BLOCKS = 16


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BackgroundServer]:
    background = BackgroundServer(tmp_path, tokens={}, host_bytes=64 * 1024 * 1024)
    yield background
    background.close()


def settings_for(target: str, **fields: Any) -> ConnectorSettings:
    return ConnectorSettings(address=target, **fields)


def request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    """What the connector reads of vLLM's Request."""
    return SimpleNamespace(request_id=req_id, block_hashes=block_hashes(tokens, BLOCK),
                           num_tokens=len(tokens), num_prompt_tokens=len(tokens),
                           num_computed_tokens=0)


def tokens(n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 30000, (n,), generator=generator).tolist()


def put_prefix(target: str, tokens_: list[int], num_blocks: int) -> torch.Tensor:
    blocks = torch.randn((num_blocks, *LAYOUT.block_shape)).to(LAYOUT.torch_dtype)
    with Client(target) as client:
        client.put(NAMESPACE, block_hashes(tokens_, BLOCK)[:num_blocks], blocks)
    return blocks


def step(new: list[tuple[str, list[int], int, int]] = (),  # type: ignore[assignment]
         cached: list[tuple[str, list[int] | None, int, int]] = (),  # type: ignore[assignment]
         resumed: set[str] | None = None) -> SimpleNamespace:
    """A SchedulerOutput: new requests (id, block ids, computed, scheduled) and running ones
    (id, new block ids, computed, scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=c)
                            for r, ids, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, *_ in cached], resumed_req_ids=resumed or set(),
            new_block_ids=[(ids,) if ids is not None else None for _, ids, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached]),
        num_scheduled_tokens={r: s for r, _, _, s in [*new, *cached]},
    )


# --- scheduler ---------------------------------------------------------------------------------


def test_offers_whole_stored_blocks_beyond_what_vllm_has_never_the_last_token(
    server: BackgroundServer,
) -> None:
    target = server.served.unix_target
    prompt = tokens(5 * BLOCK + 10)
    put_prefix(target, prompt, 5)
    side = SchedulerSide(settings_for(target), GEOMETRY, NAMESPACE)
    try:
        assert side.num_matched_tokens(request("a", prompt), 0) == 5 * BLOCK
        assert side.num_matched_tokens(request("a", prompt), 2 * BLOCK) == 3 * BLOCK
        assert side.num_matched_tokens(request("a", prompt), 5 * BLOCK) == 0
        # A prompt of exactly five blocks: its last token must be computed, so four load.
        assert side.num_matched_tokens(request("b", prompt[: 5 * BLOCK]), 0) == 4 * BLOCK
        assert side.num_matched_tokens(request("c", tokens(200, seed=9)), 0) == 0
        # The block it cannot load is held all the same: it is not saved again.
        exact = request("b", prompt[: 5 * BLOCK])
        side.after_alloc(exact, ([1, 2, 3, 4, 5],), 4 * BLOCK)
        ids = [1, 2, 3, 4, 5]
        steps = [side.build(step(new=[("b", ids, 4 * BLOCK, BLOCK)]))]
        steps += [side.build(step(cached=[("b", None, 5 * BLOCK + i, 1)])) for i in range(3)]
        assert [len(s.loads) for s in steps] == [1, 0, 0, 0]
        assert not any(s.saves for s in steps)
    finally:
        side.close()


def test_plans_loads_then_saves_only_what_the_sidecar_lacks(server: BackgroundServer) -> None:
    target = server.served.unix_target
    prompt = tokens(7 * BLOCK + 5)
    hashes = [bytes(h) for h in block_hashes(prompt, BLOCK)]
    put_prefix(target, prompt, 3)
    side = SchedulerSide(settings_for(target), GEOMETRY, NAMESPACE)
    try:
        req = request("r", prompt)
        # vLLM has block 0 itself; the sidecar has blocks 0-2: two are loaded.
        assert side.num_matched_tokens(req, BLOCK) == 2 * BLOCK
        side.after_alloc(req, ([10, 11, 12, 13],), 2 * BLOCK)
        first = side.build(step(new=[("r", [10, 11, 12, 13], 3 * BLOCK, BLOCK)]))
        assert first.namespaces == (NAMESPACE,)
        assert [(op.hashes, op.block_ids) for op in first.loads] == [(tuple(hashes[1:3]), (11, 12))]
        # What a step computes over a load is saved once the load is known good on every rank:
        # two steps later (vLLM plans the next step before it hears of this one).
        assert not first.saves
        second = side.build(step(cached=[("r", [14, 15, 16, 17], 4 * BLOCK, 3 * BLOCK + 5)]))
        assert not second.loads and not second.saves
        third = side.build(step(cached=[("r", None, 7 * BLOCK + 5, 1)]))
        assert not third.loads and third.namespaces == (NAMESPACE,)  # sent with every op
        assert [(op.hashes, op.block_ids) for op in third.saves] == [
            (tuple(hashes[3:7]), (13, 14, 15, 16))
        ]
        # Preempted and resumed into other blocks: nothing is saved twice.
        fourth = side.build(step(cached=[("r", list(range(20, 28)), 0, 7 * BLOCK + 5)],
                                 resumed={"r"}))
        assert not fourth.saves
        side.finished(req)
        assert not side.build(step(cached=[("r", None, 7 * BLOCK + 6, 1)])).saves  # gone
    finally:
        side.close()


def test_a_request_whose_load_failed_is_offered_nothing_at_its_next_lookup(
    server: BackgroundServer,
) -> None:
    """vLLM's ``test_failed_receive_completion_honors_failure_policy``: after a failed receive
    the request is looked up again, and the same hit would fail the same way (a sidecar that
    stalled still holds every block). Its next lookup offers nothing, even once offers
    resume for everyone else; the one after, and other requests, are offered as before."""
    target = server.served.unix_target
    prompt = tokens(5 * BLOCK + 10)
    put_prefix(target, prompt, 5)
    side = SchedulerSide(settings_for(target, lookup_timeout_s=0.1), GEOMETRY, NAMESPACE)
    try:
        assert side.num_matched_tokens(request("r", prompt), 0) == 5 * BLOCK
        side.after_alloc(request("r", prompt), ([1, 2, 3, 4, 5, 6],), 5 * BLOCK)
        side.on_output(set(), {"r"})
        assert side.num_matched_tokens(request("other", prompt), 0) == 0  # the breaker
        time.sleep(1.05)  # offers resume after a second
        assert side.num_matched_tokens(request("other", prompt), 0) == 5 * BLOCK
        assert side.num_matched_tokens(request("r", prompt), 0) == 0
        assert side.num_matched_tokens(request("r", prompt), 0) == 5 * BLOCK
    finally:
        side.close()


def test_a_sidecar_that_is_not_there_answers_zero(tmp_path: Path) -> None:
    side = SchedulerSide(settings_for(f"unix://{tmp_path}/none.sock"), GEOMETRY, NAMESPACE)
    try:
        req = request("a", tokens(4 * BLOCK))
        assert side.num_matched_tokens(req, 0) == 0
        assert side.num_lookup_errors == 1
        assert side.num_matched_tokens(req, 0) == 0  # the breaker: not asked again at once
        assert side.num_lookup_errors == 1
    finally:
        side.close()


def test_a_sidecar_that_hangs_answers_zero_within_the_lookup_deadline(
    sidecar_factory: SidecarFactory,
) -> None:
    sidecar = sidecar_factory()
    prompt = tokens(3 * BLOCK + 1)
    put_prefix(sidecar.unix_target, prompt, 3)
    side = SchedulerSide(settings_for(sidecar.unix_target, lookup_timeout_s=0.3), GEOMETRY,
                         NAMESPACE)
    assert sidecar.process is not None
    try:
        assert side.num_matched_tokens(request("warm", prompt), 0) == 3 * BLOCK
        os.kill(sidecar.process.pid, signal.SIGSTOP)
        # 100 hashes: more than the shared-memory presence table answers, so a call is made.
        long_prompt = tokens(100 * BLOCK + 1, seed=3)
        started = time.monotonic()
        assert side.num_matched_tokens(request("slow", long_prompt), 0) == 0
        assert time.monotonic() - started < 5.0  # a bound on hanging, not a speed target
        assert side.num_lookup_errors == 1
    finally:
        os.kill(sidecar.process.pid, signal.SIGCONT)
        side.close()


# --- worker ------------------------------------------------------------------------------------


def caches(device: str = "cpu", fill: bool = True) -> dict[str, torch.Tensor]:
    shape = (NUM_VLLM_BLOCKS, LAYOUT.num_kv_heads, BLOCK, 2 * LAYOUT.head_dim)
    return {name: (torch.randn(shape, device=device) if fill else torch.zeros(shape, device=device))
            .to(LAYOUT.torch_dtype) for name in LAYERS}


def meta(loads: list[Any] = (), saves: list[Any] = ()) -> Any:  # type: ignore[assignment]
    from tierkv.integrations.vllm.scheduler import StepMetadata

    return StepMetadata(namespaces=(NAMESPACE,), loads=list(loads), saves=list(saves))


def op(req_id: str, hashes: list[bytes], block_ids: list[int]) -> Any:
    from tierkv.integrations.vllm.scheduler import BlockOp

    return BlockOp(req_id, tuple(hashes), tuple(block_ids))


def round_trip(target: str, device: str) -> None:
    hashes = [bytes(h) for h in block_hashes(tokens(6 * BLOCK), BLOCK)]
    source = caches(device)
    saver = WorkerSide(settings_for(target), GEOMETRY, tp_rank=0)
    loader = WorkerSide(settings_for(target), GEOMETRY, tp_rank=0)
    try:
        saver.register(source)
        saver.save(meta(saves=[op("r", hashes[:4], [3, 5, 7, 9])]))
        assert saver.flush(30.0)
        assert saver.counters.blocks_saved == 4
        target_caches = caches(device, fill=False)
        loader.register(target_caches)
        # Blocks 0-3 are stored, 4-5 are not: they and only they are load errors.
        loader.start_load(meta(loads=[op("q", hashes, [1, 2, 4, 6, 8, 10])]))
        for name in LAYERS:
            loader.wait_for_layer(name)
        assert loader.take_load_errors() == {8, 10}
        assert loader.counters.blocks_loaded == 4 and loader.counters.blocks_failed == 2
        for name in LAYERS:
            assert torch.equal(target_caches[name][[1, 2, 4, 6]].cpu(),
                               source[name][[3, 5, 7, 9]].cpu())
            assert not target_caches[name][[8, 10]].any()
    finally:
        saver.close()
        loader.close()


def test_blocks_saved_from_one_cache_load_into_another_bit_exact(
    server: BackgroundServer,
) -> None:
    round_trip(server.served.unix_target, "cpu")


def test_blocks_round_trip_over_tcp_too(server: BackgroundServer) -> None:
    round_trip(server.served.tcp_target, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_blocks_round_trip_between_gpu_caches(server: BackgroundServer) -> None:
    round_trip(server.served.unix_target, "cuda")


def test_without_a_sidecar_saves_are_dropped_and_loads_fail(tmp_path: Path) -> None:
    worker = WorkerSide(settings_for(f"unix://{tmp_path}/none.sock", load_timeout_s=1.0),
                        GEOMETRY, tp_rank=0)
    try:
        worker.register(caches())
        hashes = [bytes(h) for h in block_hashes(tokens(2 * BLOCK), BLOCK)]
        worker.save(meta(saves=[op("r", hashes, [0, 1])]))
        assert worker.flush(30.0)
        assert worker.counters.blocks_dropped == 2
        worker.start_load(meta(loads=[op("q", hashes, [2, 3])]))
        worker.finish_loads()
        assert worker.take_load_errors() == {2, 3}
    finally:
        worker.close()


def test_saves_beyond_the_queue_bound_are_dropped(server: BackgroundServer) -> None:
    worker = WorkerSide(settings_for(server.served.unix_target,
                                     save_queue_bytes=LAYOUT.bytes_per_block),
                        GEOMETRY, tp_rank=0)
    try:
        worker.register(caches())
        hashes = [bytes(h) for h in block_hashes(tokens(4 * BLOCK), BLOCK)]
        worker.save(meta(saves=[op("r", hashes[:1], [0])]))
        worker.save(meta(saves=[op("s", hashes[:3], [0, 1, 2])]))  # over the bound: r queues
        worker.save(meta(saves=[op("s", hashes[3:], [3])]))  # after a dropped block: not saved
        assert worker.flush(30.0)
        assert worker.counters.blocks_saved + worker.counters.blocks_dropped == 5
        assert worker.counters.blocks_dropped >= 3
    finally:
        worker.close()


def test_caches_of_another_shape_are_refused(server: BackgroundServer) -> None:
    worker = WorkerSide(settings_for(server.served.unix_target), GEOMETRY, tp_rank=0)
    try:
        wrong = caches()
        wrong[LAYERS[1]] = wrong[LAYERS[1]][:, :1]
        with pytest.raises(ConfigError, match=LAYERS[1]):
            worker.register(wrong)
        with pytest.raises(ConfigError, match="no cache for layers"):
            worker.register({LAYERS[0]: caches()[LAYERS[0]]})
    finally:
        worker.close()


def wait_received(worker: WorkerSide, timeout_s: float = 30.0) -> set[str]:
    """The first non-empty report of finished asynchronous loads."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, received, _ = worker.finished(set())
        if received:
            return received
        time.sleep(0.01)
    return set()


def test_async_loads_are_planned_while_the_request_waits_and_reported_when_done(
    server: BackgroundServer,
) -> None:
    target = server.served.unix_target
    prompt = tokens(4 * BLOCK + 3)
    stored = put_prefix(target, prompt, 3)
    settings = settings_for(target, load_mode="async")
    side = SchedulerSide(settings, GEOMETRY, NAMESPACE)
    worker = WorkerSide(settings, GEOMETRY, tp_rank=0)
    try:
        worker.register(target_caches := caches(fill=False))
        req = request("r", prompt)
        assert side.num_matched_tokens(req, 0) == 3 * BLOCK and side.loads_async
        side.after_alloc(req, ([4, 5, 6, 7, 8],), 3 * BLOCK)
        waiting = side.build(step())  # the request waits: it is not scheduled this step
        assert not waiting.loads and [o.block_ids for o in waiting.async_loads] == [(4, 5, 6)]
        worker.start_load(waiting)
        received = wait_received(worker)
        assert received == {"r"} and worker.take_load_errors() == set()
        blocks = stored.view(3, -1)
        for layer_index, name in enumerate(LAYERS):
            got = target_caches[name][[4, 5, 6]].reshape(3, 2, -1)
            want = blocks.view(3, 2, -1)[:, layer_index]
            assert torch.equal(got.reshape(3, -1), want.reshape(3, -1))
        # Scheduled once loaded: nothing is loaded again; the blocks it computes are saved.
        side.after_alloc(req, ([4, 5, 6, 7, 8],), 0)
        later = side.build(step(new=[("r", [4, 5, 6, 7, 8], 3 * BLOCK, BLOCK + 3)]))
        assert not later.loads and not later.async_loads
        assert [o.block_ids for o in later.saves] == [(7,)]
    finally:
        side.close()
        worker.close()


def test_a_failed_async_load_reports_its_blocks_before_the_request(tmp_path: Path) -> None:
    worker = WorkerSide(settings_for(f"unix://{tmp_path}/none.sock", load_mode="async",
                                     load_timeout_s=1.0), GEOMETRY, tp_rank=0)
    try:
        worker.register(caches())
        hashes = [bytes(h) for h in block_hashes(tokens(2 * BLOCK), BLOCK)]
        loads = meta()
        loads.async_loads.append(op("q", hashes, [2, 3]))
        worker.start_load(loads)
        received = wait_received(worker)
        assert received == {"q"} and worker.take_load_errors() == {2, 3}
    finally:
        worker.close()


# --- several KV cache groups (vLLM's hybrid allocator) -----------------------------------------

WINDOW = 70  # tokens: a hit of P tokens needs blocks (P - 69) // 32 to P // 32 - 1
SLIDING = ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn")
GLOBAL = ("model.layers.1.self_attn.attn",)


def hybrid() -> tuple[Any, tuple[Namespace, Namespace]]:
    from tierkv.integrations.vllm.geometry import EngineGeometry

    full = BlockGeometry(GLOBAL, BLOCK, BLOCK, replace(LAYOUT, num_layers=1), group_index=0)
    window = BlockGeometry(SLIDING, BLOCK, BLOCK, LAYOUT, kind="sliding", window_tokens=WINDOW,
                           group_index=1)
    namespaces = (Namespace("vllm:hybrid|group=0:full", full.layout),
                  Namespace(f"vllm:hybrid|group=1:sliding:{WINDOW}", window.layout))
    return EngineGeometry((full, window)), namespaces


def put_group(target: str, namespace: Namespace, prompt: list[int], indices: range) -> None:
    hashes = block_hashes(prompt, BLOCK)
    blocks = torch.randn((len(indices), *namespace.layout.block_shape)).to(LAYOUT.torch_dtype)
    with Client(target) as client:
        client.put(namespace, [hashes[k] for k in indices], blocks)


def test_a_hybrid_hit_is_the_longest_prefix_every_group_can_serve(
    server: BackgroundServer,
) -> None:
    """Full attention needs every block of the hit; the sliding group only the window before
    its end. A window block missing cuts the hit to before it, and again until the window
    of the shorter hit is held (vLLM's fixed point), never to a hit a group cannot serve."""
    target = server.served.unix_target
    geometry, (full, window) = hybrid()
    prompt = tokens(8 * BLOCK + 5)
    put_group(target, full, prompt, range(8))
    side = SchedulerSide(settings_for(target), geometry, (full, window))
    try:
        # Only the window of an 8-block hit: blocks 5, 6, 7 (tokens 187..255).
        put_group(target, window, prompt, range(5, 8))
        assert side.num_matched_tokens(request("a", prompt), 0) == 8 * BLOCK
        # Its first block is gone: a hit must end before block 5, whose window (blocks 2-4)
        # is not held either, and so on down to no hit.
        with Client(target) as client:
            client.delete(window, [block_hashes(prompt, BLOCK)[5]])
        assert side.num_matched_tokens(request("b", prompt), 0) == 0
        put_group(target, window, prompt, range(2, 5))
        assert side.num_matched_tokens(request("c", prompt), 0) == 5 * BLOCK
        # vLLM's table: the null block (0) where a window's position is skipped.
        ids = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 10, 11, 12, 13, 14, 15, 16])
        side.after_alloc(request("c", prompt), ids, 5 * BLOCK)
        new = [("c", ids, 5 * BLOCK, 3 * BLOCK + 5)]
        first = side.build(SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="c", block_ids=ids,
                                                num_computed_tokens=5 * BLOCK)],
            scheduled_cached_reqs=step().scheduled_cached_reqs,
            num_scheduled_tokens={r: s for r, _, _, s in new}))
        # Several groups: loaded while the request waits (the only loads whose failure vLLM
        # takes for such a model).
        assert not first.loads
        loads = {op.group: op for op in first.async_loads}
        assert loads[0].block_ids == (1, 2, 3, 4, 5)
        assert loads[1].block_ids == (10, 11, 12)  # the window of the 5-block hit only
        assert loads[1].hashes == tuple(bytes(h) for h in block_hashes(prompt, BLOCK)[2:5])
        assert first.namespaces == (full, window)
    finally:
        side.close()


def test_hybrid_saves_skip_the_null_block_and_load_into_each_groups_own_blocks(
    server: BackgroundServer,
) -> None:
    """Layers of two groups share vLLM's memory (a block id belongs to one group at a time):
    each group's blocks go through its own layers only, and the null block is never read."""
    target = server.served.unix_target
    geometry, namespaces = hybrid()
    prompt = tokens(6 * BLOCK + 5)
    side = SchedulerSide(settings_for(target), geometry, namespaces)
    worker = WorkerSide(settings_for(target), geometry, tp_rank=0)
    shape = (NUM_VLLM_BLOCKS, LAYOUT.num_kv_heads, BLOCK, 2 * LAYOUT.head_dim)
    source = {name: torch.randn(shape).to(LAYOUT.torch_dtype) for name in (*SLIDING, *GLOBAL)}
    try:
        worker.register(source)
        assert side.num_matched_tokens(request("s", prompt), 0) == 0
        ids = ([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 8, 9, 10, 11])  # positions 0-2 left the window
        side.after_alloc(request("s", prompt), ids, 0)
        step_meta = side.build(SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id="s", block_ids=ids, num_computed_tokens=0)],
            scheduled_cached_reqs=step().scheduled_cached_reqs,
            num_scheduled_tokens={"s": len(prompt)}))
        saves = {op.group: op for op in step_meta.saves}
        assert saves[0].block_ids == (1, 2, 3, 4, 5, 6)
        assert saves[1].block_ids == (8, 9, 10)  # never the null block
        worker.save(step_meta)
        assert worker.flush(30.0)
        # A fresh worker loads them into other block ids of each group.
        target_caches = {name: torch.zeros(shape).to(LAYOUT.torch_dtype) for name in source}
        loader = WorkerSide(settings_for(target), geometry, tp_rank=0)
        try:
            loader.register(target_caches)
            from tierkv.integrations.vllm.scheduler import BlockOp, StepMetadata

            full_hashes, window_hashes = saves[0].hashes, saves[1].hashes
            loader.start_load(StepMetadata(namespaces, loads=[
                BlockOp("t", full_hashes, (9, 10, 11, 12, 13, 14), 0),
                BlockOp("t", window_hashes, (1, 2, 3), 1)]))
            loader.finish_loads()
            assert loader.take_load_errors() == set()
            for name in GLOBAL:
                assert torch.equal(target_caches[name][9:15].view(torch.int16),
                                   source[name][1:7].view(torch.int16))
                assert not target_caches[name][1:4].any()  # the other group's blocks
            for name in SLIDING:
                assert torch.equal(target_caches[name][1:4].view(torch.int16),
                                   source[name][8:11].view(torch.int16))
                assert not target_caches[name][9:15].any()
        finally:
            loader.close()
    finally:
        worker.close()
        side.close()


def test_a_hybrid_async_load_is_received_once_after_every_group_and_fails_as_a_request(
    server: BackgroundServer,
) -> None:
    """Several groups load asynchronously (``load_mode`` auto): a request is reported received
    once, when every group's blocks are in place (reported after its first group, vLLM ran
    the request on the other's unloaded blocks, then met a second report of a request it had
    finished and stopped: ``assert req_id in self.requests``); a request whose load failed in
    any group is reported failed (``failed_recving``), never as block ids, which vLLM refuses
    for such a model."""
    target = server.served.unix_target
    geometry, namespaces = hybrid()
    shape = (NUM_VLLM_BLOCKS, LAYOUT.num_kv_heads, BLOCK, 2 * LAYOUT.head_dim)
    source = {name: torch.randn(shape).to(LAYOUT.torch_dtype) for name in (*SLIDING, *GLOBAL)}
    from tierkv.integrations.vllm.scheduler import BlockOp, StepMetadata

    prompts = {r: tokens(6 * BLOCK, seed=20 + i) for i, r in enumerate(("x", "y", "z"))}
    hashes = {r: tuple(bytes(h) for h in block_hashes(p, BLOCK)) for r, p in prompts.items()}
    saver = WorkerSide(settings_for(target), geometry, tp_rank=0)
    loader = WorkerSide(settings_for(target), geometry, tp_rank=0)
    try:
        saver.register(source)
        saver.save(StepMetadata(namespaces, saves=[
            op_ for r in ("x", "y") for op_ in (BlockOp(r, hashes[r], (1, 2, 3, 4, 5, 6), 0),
                                                BlockOp(r, hashes[r][3:6], (8, 9, 10), 1))]))
        assert saver.flush(30.0)
        assert loader.settings.load_mode == "async"
        target_caches = {name: torch.zeros(shape).to(LAYOUT.torch_dtype) for name in source}
        loader.register(target_caches)
        ids = {"x": (9, 10, 11), "y": (12, 13, 14), "z": (1, 2, 3)}
        loads = [op_ for r in ("x", "y", "z") for op_ in (
            BlockOp(r, hashes[r][:3], ids[r], 0), BlockOp(r, hashes[r][3:6], ids[r], 1))]
        loader.start_load(StepMetadata(namespaces, async_loads=loads))
        reports: list[str] = []
        failed: set[str] = set()
        deadline = time.monotonic() + 30
        while len(reports) < 3 and time.monotonic() < deadline:
            _, received, failing = loader.finished(set())
            for req_id in received:  # in place when reported: both groups' blocks
                if req_id not in failing:
                    for name in (*SLIDING, *GLOBAL):
                        assert target_caches[name][list(ids[req_id])].any(), (req_id, name)
            reports += sorted(received)
            failed |= failing
        assert sorted(reports) == ["x", "y", "z"]  # each once
        assert failed == {"z"}  # never stored: a failed request, not block ids
        assert loader.take_load_errors() == set()
        assert loader.take_stats()["loads_failed"] == 1
    finally:
        saver.close()
        loader.close()


def test_an_engine_with_a_state_group_gets_no_hits_and_saves_nothing(
    server: BackgroundServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """A group the connector cannot cache (Mamba-like state) beside attention: a hit that
    restored the attention alone would be wrong, so none is offered, nothing is saved, and
    the start says so once."""
    from tierkv.integrations.vllm.geometry import EngineGeometry

    target = server.served.unix_target
    prompt = tokens(4 * BLOCK + 3)
    put_prefix(target, prompt, 4)
    state = "KV cache group 1 (MambaSpec, 1 layers from x) holds state the connector does not cache"
    geometry = EngineGeometry((GEOMETRY,), (state,))
    with caplog.at_level("WARNING", logger="tierkv.integrations.vllm"):
        side = SchedulerSide(settings_for(target), geometry, NAMESPACE)
    try:
        assert [r.getMessage() for r in caplog.records if "MambaSpec" in r.getMessage()] == [
            f"tierkv: no hits and no saves for this model: {state}"]
        req = request("m", prompt)
        assert side.num_matched_tokens(req, 0) == 0
        side.after_alloc(req, ([1, 2, 3, 4, 5],), 0)
        out = side.build(step(new=[("m", [1, 2, 3, 4, 5], 0, len(prompt))]))
        assert not out.saves and not out.loads
    finally:
        side.close()
