"""Adversarial tests of the vLLM connector: vLLM 0.32's calls played in its order against a real
server (see ``test_vllm_sides``), each test one way the connector breaks a rule of the project
(a wrong block stored or loaded, an engine stalled or crashed by its sidecar, blocks never freed,
two kinds of blocks in one namespace). Every test here failed against the connector's first
version: each documents a bug that was fixed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput

from tests.integrations.vllm.test_vllm_sides import (
    BLOCK,
    GEOMETRY,
    LAYERS,
    LAYOUT,
    NAMESPACE,
    caches,
    meta,
    op,
    request,
    settings_for,
    step,
    tokens,
)
from tests.support.harness import BackgroundServer, SidecarFactory
from tierkv import Client, Namespace, block_hashes
from tierkv.client import base as client_base
from tierkv.integrations.vllm.connector import TierKVConnector
from tierkv.integrations.vllm.geometry import geometry_of
from tierkv.integrations.vllm.settings import namespace_of
from tierkv.integrations.vllm.worker import WorkerSide


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BackgroundServer]:
    background = BackgroundServer(tmp_path, tokens={}, host_bytes=64 * 1024 * 1024)
    yield background
    background.close()


# --- vLLM, played by hand ----------------------------------------------------------------------


def vllm_config(extra: dict[str, Any], tp_size: int = 1) -> Any:
    """What the connector reads of a VllmConfig (a tiny two-layer bf16 model on the CPU)."""
    hf_config = SimpleNamespace(to_dict=lambda: {"model_type": "llama", "num_hidden_layers": 2})
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra,
                                           kv_load_failure_policy="recompute",
                                           is_kv_producer=True),
        model_config=SimpleNamespace(model="adversarial-model", revision=None,
                                     hf_config=hf_config),
        cache_config=SimpleNamespace(block_size=BLOCK, prefix_caching_hash_algo="sha256",
                                     cache_dtype="auto", kv_cache_layout=None),
        device_config=SimpleNamespace(device_type="cpu"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
    )


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=LAYOUT.num_kv_heads,
                             head_size=LAYOUT.head_dim, dtype=LAYOUT.torch_dtype)
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


class Engine:
    """One engine's scheduler and worker connectors, driven in vLLM 0.32's order: the
    scheduler's lookups and allocations, ``build_connector_meta``, the worker's
    bind / start_load_kv / wait_for_layer_load per layer / wait_for_save / get_finished /
    get_block_ids_with_load_errors, and the worker's output handed back to the scheduler's
    ``update_connector_output``."""

    def __init__(self, target: str, cache: dict[str, torch.Tensor], tp_size: int = 1,
                 **extra: Any) -> None:
        extra = {"address": target, **extra}
        config, kv_config = vllm_config(extra, tp_size), kv_cache_config()
        self.namespace: Namespace = namespace_of(config, kv_config,
                                                 geometry_of(config, kv_config), tp_rank=0)
        self.scheduler = TierKVConnector(config, KVConnectorRole.SCHEDULER, kv_config)
        self.worker = TierKVConnector(config, KVConnectorRole.WORKER, kv_config)
        self.worker.register_kv_caches(cache)
        # TP ranks 1 and up: their worker halves, each on its own cache, fed the same metadata.
        self.ranks: list[WorkerSide] = []
        for rank in range(1, tp_size):
            side = WorkerSide(self.worker.settings, self.worker.geometry, tp_rank=rank)
            side.register(caches(fill=False))
            self.ranks.append(side)

    def admit(self, req: Any, block_ids: list[int], local_tokens: int = 0) -> tuple[int, bool]:
        """A waiting request: the connector's lookup, then the allocation of its blocks."""
        num_tokens, load_async = self.scheduler.get_num_new_matched_tokens(req, local_tokens)
        assert num_tokens is not None
        blocks = SimpleNamespace(get_block_ids=lambda: (list(block_ids),))
        self.scheduler.update_state_after_alloc(req, blocks, num_tokens)
        return num_tokens, load_async

    def run(self, output: Any, finished: set[str] | None = None,
            update: Any = None) -> KVConnectorOutput:
        """One step: the scheduler's metadata through the worker and its output back (to
        ``update`` in place of the connector's ``update_connector_output`` when given)."""
        metadata = self.scheduler.build_connector_meta(output)
        worker = self.worker
        worker.bind_connector_metadata(metadata)
        worker.start_load_kv(None)  # type: ignore[arg-type]
        for name in LAYERS:
            worker.wait_for_layer_load(name)
        worker.wait_for_save()
        sending, recving = worker.get_finished(finished or set())
        invalid = worker.get_block_ids_with_load_errors()
        for side in self.ranks:  # vLLM's KVOutputAggregator: the union of invalid blocks
            side.start_load(metadata)
            for name in LAYERS:
                side.wait_for_layer(name)
            side.finish_loads()
            side.save(metadata)
            side.finished(finished or set())
            invalid |= side.take_load_errors()
        result = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                   invalid_block_ids=invalid)
        worker.clear_connector_metadata()
        (update or self.scheduler.update_connector_output)(result)
        return result

    def flush(self) -> bool:
        return self.worker.flush_saves(30.0) and all(side.flush(30.0) for side in self.ranks)

    def close(self) -> None:
        for side in self.ranks:
            side.close()
        self.worker.shutdown()
        self.scheduler.shutdown()


def put_blocks(target: str, namespace: Namespace, prompt: list[int], num_blocks: int) -> None:
    blocks = torch.randn((num_blocks, *LAYOUT.block_shape)).to(LAYOUT.torch_dtype)
    with Client(target) as client:
        client.put(namespace, block_hashes(prompt, BLOCK)[:num_blocks], blocks)


def holds(target: str, namespace: Namespace, hashes: list[bytes]) -> int:
    with Client(target) as client:
        return client.lookup(namespace, hashes)


# --- 1. a failed load poisons the saves of its step --------------------------------------------


def test_blocks_computed_on_top_of_a_failed_load_are_not_saved(server: BackgroundServer) -> None:
    """vLLM runs the step's forward over whatever is in the blocks whose load failed; the KV it
    computes for the request's later blocks attends to that garbage. Saving those blocks stores
    wrong KV under the right hashes: every later engine that hits them computes wrong tokens."""
    target = server.served.unix_target
    engine = Engine(target, caches(fill=False))
    try:
        prompt = tokens(5 * BLOCK + 3, seed=11)
        hashes = [bytes(h) for h in block_hashes(prompt, BLOCK)]
        put_blocks(target, engine.namespace, prompt, 3)
        req = request("r", prompt)
        num_tokens, _ = engine.scheduler.get_num_new_matched_tokens(req, 0)
        assert num_tokens == 3 * BLOCK
        # Evicted (or the sidecar restarted) between the lookup and the load.
        with Client(target) as client:
            client.delete(engine.namespace, hashes[1:3])
        blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5, 6],))  # 0: vLLM's null
        engine.scheduler.update_state_after_alloc(req, blocks, num_tokens)
        # The step loads blocks 0-2 and computes the rest of the prompt (blocks 3, 4 and a tail).
        out = engine.run(step(new=[("r", [1, 2, 3, 4, 5, 6], 3 * BLOCK, 2 * BLOCK + 3)]))
        assert out.invalid_block_ids == {2, 3}  # reported: vLLM recomputes blocks 1 and up
        assert engine.flush()
        # Blocks 3 and 4 were computed over the failed blocks 1-2: they must not be stored.
        assert holds(target, engine.namespace, hashes[3:4]) == 0
        assert holds(target, engine.namespace, hashes[4:5]) == 0
    finally:
        engine.close()


def test_blocks_one_tp_rank_failed_to_load_are_saved_again_once_recomputed(
    server: BackgroundServer,
) -> None:
    """The scheduler looks up TP rank 0's namespace only and, once a lookup said "held", never
    saves those blocks again. When another rank lacks them (its save was dropped by its queue
    bound or refused, or they were evicted there), its load fails, vLLM recomputes them, and
    the recomputed blocks are not saved: every later request with that prefix is offered it
    again, fails again on that rank and recomputes again, for as long as rank 0 holds it."""
    target = server.served.unix_target
    engine = Engine(target, caches(fill=False), tp_size=2)
    try:
        prompt = tokens(3 * BLOCK + 5, seed=71)
        hashes = [bytes(h) for h in block_hashes(prompt, BLOCK)]
        rank1 = Namespace(engine.namespace.model_id, engine.namespace.layout, tp_rank=1,
                          tp_size=2)
        put_blocks(target, engine.namespace, prompt, 3)
        put_blocks(target, rank1, prompt, 1)  # rank 1 lost blocks 1 and 2
        first = request("A", prompt)
        assert engine.admit(first, [1, 2, 3, 4])[0] == 3 * BLOCK
        out = engine.run(step(new=[("A", [1, 2, 3, 4], 3 * BLOCK, 5)]))
        assert out.invalid_block_ids == {2, 3}
        # vLLM: num_computed_tokens back to the first failed block; the next step recomputes.
        engine.run(step(cached=[("A", None, BLOCK, 2 * BLOCK + 5)]))
        assert engine.flush()
        repaired = holds(target, rank1, hashes[:3]) == 3
        offered = engine.scheduler.get_num_new_matched_tokens(request("B", prompt), 0)[0]
        assert repaired or offered <= BLOCK, (
            f"rank 1 still lacks blocks 1-2 and the next request is offered {offered} tokens"
        )
    finally:
        engine.close()


def test_layerwise_loads_are_not_skipped_by_full_cuda_graphs(server: BackgroundServer) -> None:
    """Sync loads are scattered in ``wait_for_layer_load``, which the attention wrapper calls in
    Python: a FULL CUDA graph replay skips it (vLLM's ``requires_piecewise_for_cudagraph``
    docstring). vLLM's default FULL_AND_PIECEWISE replays uniform one-token batches as full
    graphs, and a request whose prompt is loaded up to its last token is such a query: the
    forward attends to blocks not loaded yet, ``wait_for_save`` scatters them afterwards and
    nothing is reported, so its first token is computed from stale KV. Either the connector
    asks vLLM for piecewise graphs, or its loads are in place when ``start_load_kv`` returns."""
    target = server.served.unix_target
    prompt = tokens(2 * BLOCK, seed=81)
    hashes = [bytes(h) for h in block_hashes(prompt, BLOCK)]
    stored = torch.randn((2, *LAYOUT.block_shape)).to(LAYOUT.torch_dtype)
    with Client(target) as client:
        client.put(NAMESPACE, hashes, stored)
    worker = WorkerSide(settings_for(target), GEOMETRY, tp_rank=0)
    try:
        worker.register(cache := caches(fill=False))
        worker.start_load(meta(loads=[op("q", hashes, [2, 3])]))
        time.sleep(0.5)  # whatever runs on threads has had its time; no layer was waited for
        in_place = all(cache[name][[2, 3]].any() for name in LAYERS)
        worker.finish_loads()
        assert TierKVConnector.requires_piecewise_for_cudagraph({}) or in_place
    finally:
        worker.close()


# --- 2. a hung sidecar: hits offered from shared memory, loads that each wait out a timeout ----


def hung_engine(sidecar_factory: SidecarFactory, load_mode: str = "sync"
                ) -> tuple[Any, Engine, list[int]]:
    sidecar = sidecar_factory()
    engine = Engine(sidecar.unix_target, caches(fill=False), load_timeout_s=1.0,
                    lookup_timeout_s=0.3, load_mode=load_mode)
    prompt = tokens(3 * BLOCK + 5, seed=21)
    put_blocks(sidecar.unix_target, engine.namespace, prompt, 3)
    # Warm: a request with no hit computes and saves its blocks (both clients have described
    # the server and mapped its slab), then the sidecar hangs.
    warm = request("warm", tokens(3 * BLOCK + 5, seed=22))
    assert engine.admit(warm, [1, 2, 3, 4]) == (0, False)
    engine.run(step(new=[("warm", [1, 2, 3, 4], 0, 3 * BLOCK + 5)]))
    assert engine.flush()
    assert sidecar.process is not None
    os.kill(sidecar.process.pid, signal.SIGSTOP)
    return sidecar, engine, prompt


def test_a_step_with_several_loads_waits_at_most_one_load_timeout_for_a_hung_sidecar(
    sidecar_factory: SidecarFactory,
) -> None:
    """Each request's load is fetched on one thread with its own deadline, one after the other:
    a step that admits N requests with hits stalls the engine N x load_timeout_s."""
    sidecar, engine, prompt = hung_engine(sidecar_factory)
    try:
        new = []
        for index in range(4):
            req_id = f"q{index}"
            ids = [4 + 3 * index, 5 + 3 * index, 6 + 3 * index]
            # The hashes are in the presence table: the hung sidecar is not asked.
            assert engine.admit(request(req_id, prompt[: 2 * BLOCK + 1]), ids)[0] == 2 * BLOCK
            new.append((req_id, ids, 2 * BLOCK, BLOCK + 1))
        started = time.monotonic()
        out = engine.run(step(new=new))
        elapsed = time.monotonic() - started
        assert len(out.invalid_block_ids) == 8  # every load failed, and said so
        assert elapsed < 2.0, f"one step stalled the engine for {elapsed:.1f} s"
    finally:
        assert sidecar.process is not None
        os.kill(sidecar.process.pid, signal.SIGCONT)
        engine.close()


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_after_loads_failed_against_a_hung_sidecar_it_is_not_offered_again(
    sidecar_factory: SidecarFactory, load_mode: str,
) -> None:
    """Lookups of up to 64 hashes are answered from the presence table in shared memory, which a
    hung (SIGSTOPped, swapping, GC-paused) sidecar keeps answering: the scheduler offers hits,
    every load then waits out load_timeout_s and fails, and nothing tells the scheduler (the
    connector ignores ``update_connector_output``). Sync: every new request stalls its step for
    load_timeout_s. Async: a request whose first block failed is reset to 0 by vLLM, looked up
    again, offered the same blocks again: it never runs while the sidecar hangs."""
    sidecar, engine, prompt = hung_engine(sidecar_factory, load_mode)
    try:
        first = request("first", prompt)
        num_tokens, _ = engine.admit(first, [4, 5, 6, 7])
        assert num_tokens == 3 * BLOCK
        if load_mode == "sync":
            out = engine.run(step(new=[("first", [4, 5, 6, 7], 3 * BLOCK, 5)]))
            invalid = set(out.invalid_block_ids)
        else:
            out = engine.run(step())  # the request waits for its blocks
            invalid = set(out.invalid_block_ids)
            deadline = time.monotonic() + 30
            while not out.finished_recving and time.monotonic() < deadline:
                time.sleep(0.05)
                out = engine.run(step())
                invalid |= out.invalid_block_ids
            assert out.finished_recving == {"first"}
        assert invalid == {4, 5, 6}
        # vLLM: the async request is reset to no computed tokens and looked up again; a new
        # request is looked up. The sidecar still hangs: neither should be offered its blocks.
        again = request("first" if load_mode == "async" else "second", prompt)
        assert engine.scheduler.get_num_new_matched_tokens(again, 0)[0] == 0
    finally:
        assert sidecar.process is not None
        os.kill(sidecar.process.pid, signal.SIGCONT)
        engine.close()


def test_a_request_aborted_while_its_async_load_runs_is_not_reported_twice(
    server: BackgroundServer,
) -> None:
    """A request that had saves, was preempted, resumes with an asynchronous load of its own
    prefix and is aborted while it waits: vLLM already keeps its blocks until the load is
    received (``finish_requests``: WAITING_FOR_REMOTE_KVS), and the connector answers True as
    well (it had saves). The worker then reports it in ``finished_recving`` *and*
    ``finished_sending``; vLLM frees and forgets the request on the first and asserts on the
    second (``Scheduler._update_from_kv_xfer_finished``): the engine core dies.

    (The saves were copied out of vLLM's blocks within their step, so nothing needed the blocks
    kept in the first place.)"""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    target = server.served.unix_target
    engine = Engine(target, caches(), load_mode="async")
    try:
        prompt = tokens(4 * BLOCK + 3, seed=61)
        req = request("R", prompt)
        # Prefilled in one step: blocks 0-3 are saved.
        assert engine.admit(req, [1, 2, 3, 4, 10]) == (0, False)
        engine.run(step(new=[("R", [1, 2, 3, 4, 10], 0, 4 * BLOCK + 3)]))
        assert engine.flush()
        # Preempted (vLLM frees its blocks, num_computed_tokens = 0), then resumed: its own
        # prefix is in the sidecar now, loaded asynchronously while it waits.
        assert engine.admit(req, [5, 6, 7, 8, 9]) == (4 * BLOCK, True)
        # vLLM's side of it: the request, and what update_from_output does with the outputs.
        vllm = SimpleNamespace(
            connector=engine.scheduler, finished_recving_kv_req_ids=set(),
            requests={"R": SimpleNamespace(request_id="R", status=RequestStatus.WAITING)},
            _set_kv_fetch_stage=lambda *args: None)
        vllm._free_blocks = lambda request_: vllm.requests.pop(request_.request_id)

        def update(output: KVConnectorOutput) -> None:
            Scheduler._update_from_kv_xfer_finished(vllm, output)  # type: ignore[arg-type]

        engine.run(step(), update=update)  # the step that starts the load
        # Aborted while it waits (Scheduler.finish_requests): vLLM delays the free until the
        # load is received, and asks the connector.
        vllm.requests["R"].status = RequestStatus.FINISHED_ABORTED
        engine.scheduler.request_finished(req, [5, 6, 7, 8, 9])
        engine.run(step(), finished={"R"}, update=update)
        deadline = time.monotonic() + 10
        while "R" in vllm.requests and time.monotonic() < deadline:
            engine.run(step(), update=update)
            time.sleep(0.01)
        for _ in range(5):  # anything the worker still reports about it
            engine.run(step(), update=update)
            time.sleep(0.01)
        assert "R" not in vllm.requests
    finally:
        engine.close()


# --- 3. a client error that is not a TierKVError -----------------------------------------------


def close_the_slab_once_in(thread_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interleaving of a sidecar restart: the worker's one Client is shared by the saver,
    the fetcher and the async loader; when one of them calls ``describe()`` and finds the slab
    replaced, ``_forget_server`` closes the mapping (``del self.array``) under another that is
    between its lease call and its copy. Played here by running the client's own
    ``_forget_server`` right before the first copy made on a thread named ``thread_prefix``."""
    original_adopt = client_base.ClientBase._adopt
    clients: list[Any] = []
    done = threading.Event()

    def adopt(self: Any, info: Any) -> None:
        clients.append(self)
        original_adopt(self, info)

    def closing_first(original: Callable[..., Any]) -> Callable[..., Any]:
        def locate(self: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name.startswith(thread_prefix) and not done.is_set():
                done.set()
                for client in clients:
                    if client._slab is self:
                        client._forget_server()  # as another thread's describe() does
            return original(self, *args, **kwargs)
        return locate

    monkeypatch.setattr(client_base.ClientBase, "_adopt", adopt)
    # Every copy in or out of the slab first asks the mapping where the pages lie: by block
    # (``parts``: put, get_into) or by run of blocks (``runs``: put_with, get_with).
    for name in ("parts", "runs"):
        monkeypatch.setattr(client_base.SlabMapping, name,
                            closing_first(getattr(client_base.SlabMapping, name)))


def test_the_saver_thread_survives_a_client_error_that_is_not_a_tierkv_error(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_save_loop`` caught TierKVError only: the AttributeError of a mapping closed under it
    ended the saver thread for good. Every later save was queued and never done, and the queue
    filled."""
    close_the_slab_once_in("tierkv-save", monkeypatch)
    worker = WorkerSide(settings_for(server.served.unix_target), GEOMETRY, tp_rank=0)
    try:
        worker.register(caches())
        hashes = [bytes(h) for h in block_hashes(tokens(2 * BLOCK, seed=31), BLOCK)]
        worker.save(meta(saves=[op("r1", hashes[:1], [0])]))
        time.sleep(0.5)
        worker.save(meta(saves=[op("r2", hashes[1:], [1])]))
        assert worker.flush(10.0), "the second save was never done"
        assert holds(server.served.unix_target, NAMESPACE, hashes[1:]) == 1
        assert worker.counters.blocks_saved >= 1
    finally:
        worker.close(timeout_s=1.0)


def test_a_load_that_fails_with_another_error_is_reported_not_raised_into_the_forward(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_fetch`` catches TierKVError only; anything else comes out of ``wait_for_layer_load``
    inside the model's forward pass and takes the engine down."""
    target = server.served.unix_target
    prompt = tokens(2 * BLOCK, seed=41)
    hashes = [bytes(h) for h in block_hashes(prompt, BLOCK)]
    with Client(target) as client:
        client.put(NAMESPACE, hashes, torch.randn((2, *LAYOUT.block_shape)).to(LAYOUT.torch_dtype))
    close_the_slab_once_in("tierkv-load", monkeypatch)
    worker = WorkerSide(settings_for(target), GEOMETRY, tp_rank=0)
    try:
        worker.register(caches(fill=False))
        worker.start_load(meta(loads=[op("q", hashes, [2, 3])]))
        for name in LAYERS:
            worker.wait_for_layer(name)  # raises AttributeError today
        assert worker.take_load_errors() == {2, 3}
    finally:
        worker.close(timeout_s=1.0)


# --- 4. a dropped save followed by an accepted one ---------------------------------------------


def test_after_a_save_is_dropped_later_blocks_of_the_prefix_are_not_stored_unreachable(
    server: BackgroundServer,
) -> None:
    """Saves were all or nothing per op and never retried, while the request's next op went out:
    a long first chunk over the queue bound was dropped whole (its leading blocks, the most
    valuable, with it), and the next chunk's blocks were stored although no lookup can ever
    reach them (lookups count leading blocks)."""
    target = server.served.unix_target
    worker = WorkerSide(settings_for(target, save_queue_bytes=2 * LAYOUT.bytes_per_block),
                        GEOMETRY, tp_rank=0)
    try:
        worker.register(caches())
        hashes = [bytes(h) for h in block_hashes(tokens(4 * BLOCK, seed=51), BLOCK)]
        worker.save(meta(saves=[op("r", hashes[:3], [0, 1, 2])]))  # chunk 1: over the bound
        assert worker.flush(30.0) and worker.counters.blocks_dropped >= 1
        worker.save(meta(saves=[op("r", hashes[3:], [3])]))  # chunk 2: fits
        assert worker.flush(30.0)
        leading = holds(target, NAMESPACE, hashes)
        assert leading > 0 or holds(target, NAMESPACE, hashes[3:]) == 0, (
            "block 3 is stored, blocks 0-2 are not: it can never be hit"
        )
    finally:
        worker.close()


# --- 5. namespace ------------------------------------------------------------------------------


def test_an_engine_that_quantizes_its_weights_does_not_share_blocks_with_one_that_does_not(
    tmp_path: Path,
) -> None:
    """``--quantization fp8`` on a bf16 checkpoint changes the weights, so the KV of every
    prefix, but not the HF config: both engines get one namespace, and each loads the other's
    blocks as its own."""
    from tests.integrations.vllm.test_vllm_config import namespace
    from tierkv.bench.models import TINY, build_llama

    model = build_llama(tmp_path / "tiny", TINY)
    plain = namespace(model)
    quantized = namespace(model, quantization="fp8")
    assert plain.id != quantized.id, plain.model_id
