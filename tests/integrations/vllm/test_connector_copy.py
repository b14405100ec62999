"""The connector worker's copies between vLLM's paged KV cache and a sidecar, through its public
methods (``register``, ``save``/``flush``, ``start_load``/``wait_for_layer``): bit for bit
whatever the bytes (NaN payloads included: on the CPU the index operations move pages as rows
of 16-byte elements), for scattered and repeated block ids, with the blocks a sidecar lacks
reported as load errors and left untouched, and with reused staging buffers never handing one
save or load another's bytes (the saver thread still holds a save's buffer while the engine
gathers the next step)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.harness import BackgroundServer
from tests.support.service_fixtures import mapped_slab
from tierkv import Client, ConfigError, KVLayout, Namespace
from tierkv.bench.report import fresh_hashes
from tierkv.integrations.vllm.copies import CpuCopies
from tierkv.integrations.vllm.geometry import BlockGeometry
from tierkv.integrations.vllm.scheduler import BlockOp, StepMetadata
from tierkv.integrations.vllm.settings import ConnectorSettings
from tierkv.integrations.vllm.worker import IDLE_SAVE_BUFFERS, WorkerSide

NUM_VLLM_BLOCKS = 24


def geometry_of(layout: KVLayout) -> BlockGeometry:
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layout.num_layers))
    return BlockGeometry(names, layout.block_size, layout.block_size, layout)


LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype="fp16")
GEOMETRY = geometry_of(LAYOUT)
NAMESPACE = Namespace("vllm:copy-test", LAYOUT)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BackgroundServer]:
    background = BackgroundServer(tmp_path, tokens={}, host_bytes=64 * 1024 * 1024)
    yield background
    background.close()


def random_caches(geometry: BlockGeometry, seed: int, *, device: str = "cpu"
                  ) -> dict[str, torch.Tensor]:
    """Per-layer caches ``[B, H, N, C]`` of random bits, with double NaNs (signalling and quiet,
    with payloads) planted in every page: a copy through floating-point registers that
    quietened or canonicalised them would show."""
    layout = geometry.layout
    shape = (NUM_VLLM_BLOCKS, layout.num_kv_heads, layout.block_size, 2 * layout.head_dim)
    generator = torch.Generator().manual_seed(seed)
    caches = {}
    for name in geometry.layer_names:
        bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int32, generator=generator)
        cache = bits.to(torch.int16).view(layout.torch_dtype)
        words = cache.view(NUM_VLLM_BLOCKS, -1).view(torch.int64)
        words[:, 0] = 0x7FF0_0000_0000_0001  # a signalling NaN
        words[:, 1] = -0x0007_FFFF_FFFF_FFFF  # 0xFFF8000000000001: a quiet NaN with a payload
        caches[name] = cache.to(device)
    return caches


def filled_caches(geometry: BlockGeometry, value: int) -> dict[str, torch.Tensor]:
    """Caches whose every 16-bit word is ``value``: untouched blocks keep it."""
    layout = geometry.layout
    shape = (NUM_VLLM_BLOCKS, layout.num_kv_heads, layout.block_size, 2 * layout.head_dim)
    return {name: torch.full(shape, value, dtype=torch.int16).view(layout.torch_dtype)
            for name in geometry.layer_names}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16)


def blocks_of(caches: dict[str, torch.Tensor], geometry: BlockGeometry,
              ids: list[int]) -> torch.Tensor:
    """``[n, L, H, N, C]``: what vLLM's blocks ``ids`` hold (a tierkv block each)."""
    index = torch.tensor(ids, dtype=torch.long)
    return torch.stack([caches[name].cpu().index_select(0, index)
                        for name in geometry.layer_names], dim=1)


def stored(target: str, namespace: Namespace, hashes: list[bytes]) -> torch.Tensor:
    """The sidecar's blocks of ``hashes`` as ``[n, L, H, N, C]`` (all must be there)."""
    layout = namespace.layout
    with Client(target) as client:
        got = client.get(namespace, hashes)
    assert got.shape[0] == len(hashes), f"the sidecar holds {got.shape[0]} of {len(hashes)}"
    return got.reshape(len(hashes), layout.num_layers, layout.num_kv_heads, layout.block_size,
                       2 * layout.head_dim)


def put_blocks(target: str, namespace: Namespace, hashes: list[bytes],
               blocks: torch.Tensor) -> None:
    with Client(target) as client:
        client.put(namespace, hashes, blocks.contiguous().view(len(hashes),
                                                               *namespace.layout.block_shape))


def saves(*ops: tuple[str, list[bytes], list[int]], namespace: Namespace = NAMESPACE
          ) -> StepMetadata:
    return StepMetadata((namespace,), saves=[BlockOp(r, tuple(h), tuple(i)) for r, h, i in ops])


def loads(*ops: tuple[str, list[bytes], list[int]], namespace: Namespace = NAMESPACE,
          asynchronous: bool = False) -> StepMetadata:
    planned = [BlockOp(r, tuple(h), tuple(i)) for r, h, i in ops]
    if asynchronous:
        return StepMetadata((namespace,), async_loads=planned)
    return StepMetadata((namespace,), loads=planned)


def load_step(worker: WorkerSide, step: StepMetadata) -> set[int]:
    """A synchronous load step as vLLM runs it; returns its load errors."""
    worker.start_load(step)
    for name in worker.geometry.layer_names:
        worker.wait_for_layer(name)
    return worker.take_load_errors()


def wait_received(worker: WorkerSide, timeout_s: float = 30.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    received: set[str] = set()
    while time.monotonic() < deadline and not received:
        _, received, _ = worker.finished(set())
        time.sleep(0.005)
    return received


def new_worker(target: str, geometry: BlockGeometry = GEOMETRY, **settings: Any) -> WorkerSide:
    return WorkerSide(ConnectorSettings(address=target, **settings), geometry, tp_rank=0)


# --- bit-exact copies --------------------------------------------------------------------------


def test_scattered_blocks_of_several_requests_save_and_load_bit_exact(
    server: BackgroundServer,
) -> None:
    target = server.unix_target
    source = random_caches(GEOMETRY, seed=1)
    a, b = fresh_hashes(4), fresh_hashes(3)
    a_ids, b_ids = [17, 2, 9, 23], [0, 14, 5]
    saver, loader = new_worker(target), new_worker(target)
    try:
        saver.register(source)
        saver.save(saves(("a", a, a_ids), ("b", b, b_ids)))  # one step, two requests
        assert saver.flush(30.0) and saver.counters.blocks_saved == 7
        assert torch.equal(bits(stored(target, NAMESPACE, a)),
                           bits(blocks_of(source, GEOMETRY, a_ids)))
        assert torch.equal(bits(stored(target, NAMESPACE, b)),
                           bits(blocks_of(source, GEOMETRY, b_ids)))
        dest = filled_caches(GEOMETRY, 0x1111)
        loader.register(dest)
        assert load_step(loader, loads(("x", a, [3, 21, 8, 11]), ("y", b, [19, 1, 13]))) == set()
        assert torch.equal(bits(blocks_of(dest, GEOMETRY, [3, 21, 8, 11, 19, 1, 13])),
                           bits(blocks_of(source, GEOMETRY, a_ids + b_ids)))
        untouched = sorted(set(range(NUM_VLLM_BLOCKS)) - {3, 21, 8, 11, 19, 1, 13})
        assert bool((bits(blocks_of(dest, GEOMETRY, untouched)) == 0x1111).all())
    finally:
        saver.close()
        loader.close()


def test_no_layer_is_waited_for_before_the_whole_load_landed_and_was_checked(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU the fetching thread scatters a sync load out of the sidecar's pages, and
    the checksums are read after that copy: ``wait_for_layer`` of even the first layer waits
    for the whole load (with the scatter held by a gate, standing for a slow one, it does not
    return), then every layer is in place, bit-exact."""
    target = server.unix_target
    source = random_caches(GEOMETRY, seed=7)
    hashes, ids = fresh_hashes(3), [4, 12, 20]
    put_blocks(target, NAMESPACE, hashes, blocks_of(source, GEOMETRY, [1, 2, 3]))
    gate, entered = threading.Event(), threading.Event()
    scatter = CpuCopies.scatter

    def gated(self: CpuCopies, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        scatter(self, block_ids, blocks)
        entered.set()
        assert gate.wait(30.0)

    monkeypatch.setattr(CpuCopies, "scatter", gated)
    dest = filled_caches(GEOMETRY, 0x2222)
    loader = new_worker(target)
    waited = threading.Event()
    try:
        loader.register(dest)
        loader.start_load(loads(("r", hashes, ids)))
        first = GEOMETRY.layer_names[0]
        waiter = threading.Thread(target=lambda: (loader.wait_for_layer(first), waited.set()))
        waiter.start()
        assert entered.wait(30.0)  # every layer is copied, the checksums not read yet
        assert not waited.wait(0.3), "a layer was handed to the model before its check"
        gate.set()
        waiter.join(30.0)
        assert waited.is_set()
        for name in GEOMETRY.layer_names[1:]:
            loader.wait_for_layer(name)
        assert loader.take_load_errors() == set()
        expected = blocks_of(source, GEOMETRY, [1, 2, 3])
        assert torch.equal(bits(blocks_of(dest, GEOMETRY, ids)), bits(expected))
    finally:
        gate.set()
        loader.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_block_whose_pages_were_changed_in_the_slab_is_a_load_error_from_there_on(
    server: BackgroundServer, asynchronous: bool,
) -> None:
    """A stray write into block 2's pages in the sidecar's slab: the load scatters what it
    read, the checksum after that copy fails, and blocks 2 and 3 are load errors (vLLM
    recomputes them); blocks 0 and 1 are exact, and the sidecar counts the damage."""
    target = server.unix_target
    source = random_caches(GEOMETRY, seed=8)
    hashes, ids = fresh_hashes(4), [3, 9, 15, 21]
    put_blocks(target, NAMESPACE, hashes, blocks_of(source, GEOMETRY, [0, 1, 2, 3]))
    lease = server.store.sidecar.acquire(NAMESPACE, hashes)
    try:
        offset = lease.blocks[2][0][0]
    finally:
        server.store.sidecar.release(lease.lease_id)
    with mapped_slab(server.store.sidecar.host_shm_name) as slab:
        slab[offset + 100] ^= 0x04
    dest = filled_caches(GEOMETRY, 0x4444)
    loader = new_worker(target, load_mode="async" if asynchronous else "sync")
    try:
        loader.register(dest)
        step = loads(("r", hashes, ids), asynchronous=asynchronous)
        if asynchronous:
            loader.start_load(step)
            assert wait_received(loader) == {"r"}
            errors = loader.take_load_errors()
        else:
            errors = load_step(loader, step)
        assert errors == {15, 21}
        assert loader.counters.blocks_loaded == 2 and loader.counters.blocks_failed == 2
        assert torch.equal(bits(blocks_of(dest, GEOMETRY, [3, 9])),
                           bits(blocks_of(source, GEOMETRY, [0, 1])))
        assert server.store.stats().checksum_failures == 1
        with Client(target) as client:
            assert client.lookup(NAMESPACE, hashes) == 2  # the damaged block is gone
    finally:
        loader.close()


def test_repeated_block_ids_and_hashes_save_and_load_bit_exact(server: BackgroundServer) -> None:
    """Two requests of one step sharing a prefix (vLLM's prefix cache gives them the same
    blocks): the shared blocks are saved once, bit-exact; and one stored block loaded into
    several of vLLM's blocks, or the same block twice in a step, lands bit-exact."""
    target = server.unix_target
    source = random_caches(GEOMETRY, seed=2)
    h = fresh_hashes(4)
    saver, loader = new_worker(target), new_worker(target)
    try:
        saver.register(source)
        saver.save(saves(("a", h[:3], [4, 9, 1]), ("b", [h[0], h[1], h[3]], [4, 9, 6])))
        assert saver.flush(30.0) and saver.counters.blocks_dropped == 0
        assert torch.equal(bits(stored(target, NAMESPACE, h)),
                           bits(blocks_of(source, GEOMETRY, [4, 9, 1, 6])))
        dest = filled_caches(GEOMETRY, 0x2222)
        loader.register(dest)
        step = loads(("x", h[:2], [10, 12]), ("y", h[:2], [10, 12]), ("z", [h[1]], [15]))
        assert load_step(loader, step) == set()
        assert torch.equal(bits(blocks_of(dest, GEOMETRY, [10, 12, 15])),
                           bits(blocks_of(source, GEOMETRY, [4, 9, 9])))
    finally:
        saver.close()
        loader.close()


@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (3, 2), (3, 1)],
                         ids=["16-byte rows", "8-byte rows", "2-byte elements"])
def test_caches_whose_pages_do_not_fit_wide_rows_copy_bit_exact(
    server: BackgroundServer, head_dim: int, block_size: int,
) -> None:
    """Pages of 24 or 12 bytes (no 16-byte row; no 8-byte one either) and caches whose pages
    are not contiguous (a cache laid out ``[B, N, H, C]``, seen as ``[B, H, N, C]``) are moved
    through other views, with the same result."""
    target = server.unix_target
    layout = KVLayout(num_layers=2, num_kv_heads=2 if head_dim == 64 else 1, head_dim=head_dim,
                      block_size=block_size, dtype="bf16")
    geometry, namespace = geometry_of(layout), Namespace("vllm:odd-pages", layout)
    shape = (NUM_VLLM_BLOCKS, layout.block_size, layout.num_kv_heads, 2 * layout.head_dim)
    generator = torch.Generator().manual_seed(3)
    for permuted in (False, True):
        source, dest = {}, {}
        for name in geometry.layer_names:
            raw = torch.randint(-(2**15), 2**15, shape, dtype=torch.int32, generator=generator)
            physical = raw.to(torch.int16).view(layout.torch_dtype)  # [B, N, H, C]
            source[name] = physical.transpose(1, 2) if permuted else physical.view(
                NUM_VLLM_BLOCKS, layout.num_kv_heads, layout.block_size, -1)
            dest[name] = torch.zeros_like(source[name])
        hashes = fresh_hashes(3)
        saver, loader = new_worker(target, geometry), new_worker(target, geometry)
        try:
            saver.register(source)
            saver.save(saves(("a", hashes, [7, 0, 19]), namespace=namespace))
            assert saver.flush(30.0) and saver.counters.blocks_saved == 3
            assert torch.equal(bits(stored(target, namespace, hashes)),
                               bits(blocks_of(source, geometry, [7, 0, 19])))
            loader.register(dest)
            assert load_step(loader, loads(("x", hashes, [2, 22, 5]), namespace=namespace)) == set()
            assert torch.equal(bits(blocks_of(dest, geometry, [2, 22, 5])),
                               bits(blocks_of(source, geometry, [7, 0, 19])))
        finally:
            saver.close()
            loader.close()


# --- partial loads and reused load buffers -----------------------------------------------------


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_blocks_the_sidecar_lacks_are_load_errors_and_keep_their_bytes(
    server: BackgroundServer, asynchronous: bool,
) -> None:
    """A first load fills the (reused) staging buffer with other blocks' bytes; a second one,
    whose later blocks the sidecar lacks, reports exactly those as load errors and leaves them
    as they were: nothing of the first load's bytes reaches them."""
    target = server.unix_target
    source = random_caches(GEOMETRY, seed=4)
    full, partial = fresh_hashes(5), fresh_hashes(5)
    put_blocks(target, NAMESPACE, full, blocks_of(source, GEOMETRY, [0, 1, 2, 3, 4]))
    put_blocks(target, NAMESPACE, partial[:2], blocks_of(source, GEOMETRY, [5, 6]))
    dest = filled_caches(GEOMETRY, 0x3333)
    loader = new_worker(target, load_mode="async" if asynchronous else "sync")

    def run(step: StepMetadata) -> set[int]:
        if not asynchronous:
            return load_step(loader, step)
        loader.start_load(step)
        assert wait_received(loader) == {step.async_loads[0].req_id}
        return loader.take_load_errors()

    try:
        loader.register(dest)
        assert run(loads(("x", full, [10, 11, 12, 13, 14]), asynchronous=asynchronous)) == set()
        errors = run(loads(("y", partial, [15, 16, 17, 18, 19]), asynchronous=asynchronous))
        assert errors == {17, 18, 19}
        assert loader.counters.blocks_loaded == 7 and loader.counters.blocks_failed == 3
        assert torch.equal(bits(blocks_of(dest, GEOMETRY, [10, 11, 12, 13, 14, 15, 16])),
                           bits(blocks_of(source, GEOMETRY, [0, 1, 2, 3, 4, 5, 6])))
        assert bool((bits(blocks_of(dest, GEOMETRY, [17, 18, 19])) == 0x3333).all())
    finally:
        loader.close()


def test_a_larger_load_after_a_smaller_one_lands_whole(server: BackgroundServer) -> None:
    """The reused load buffer grows for a step that loads more than any before."""
    target = server.unix_target
    source = random_caches(GEOMETRY, seed=5)
    small, large = fresh_hashes(1), fresh_hashes(9)
    put_blocks(target, NAMESPACE, small, blocks_of(source, GEOMETRY, [0]))
    put_blocks(target, NAMESPACE, large, blocks_of(source, GEOMETRY, list(range(1, 10))))
    dest = filled_caches(GEOMETRY, 0)
    loader = new_worker(target)
    try:
        loader.register(dest)
        assert load_step(loader, loads(("x", small, [23]))) == set()
        ids = [12, 3, 20, 7, 15, 1, 9, 18, 5]
        assert load_step(loader, loads(("y", large[:4], ids[:4]), ("z", large[4:], ids[4:]))) \
            == set()
        assert torch.equal(bits(blocks_of(dest, GEOMETRY, [23, *ids])),
                           bits(blocks_of(source, GEOMETRY, list(range(10)))))
    finally:
        loader.close()


# --- reused save buffers -----------------------------------------------------------------------


class GatedPuts:
    """Holds every ``Client.put`` and ``put_with`` until ``open``, before it calls the sidecar
    (the saver keeps its buffer, or has not gathered its save, meanwhile)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)
        self.methods: list[str] = []
        for method in ("put", "put_with"):
            monkeypatch.setattr(Client, method, self._gated(method, getattr(Client, method)))

    def _gated(self, method: str, original: Callable[..., int]) -> Callable[..., int]:
        def call(client: Client, *args: Any, **kwargs: Any) -> int:
            self.methods.append(method)
            self.started.release()
            assert self.gate.wait(30.0), "the test never opened the gate"
            return original(client, *args, **kwargs)

        return call

    def wait_started(self) -> None:
        assert self.started.acquire(timeout=30.0), "the saver never started a put"


def test_saves_queued_behind_a_slow_put_each_store_their_own_bytes(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM reuses its blocks from the next step on (after ``handle_preemptions``, which is
    ``before_step``): steps that save the same vLLM blocks over and over (new bytes each time)
    while the saver is stuck on the first put must each store the bytes of their own step,
    whether their buffer is new or one a finished save gave back; and as many buffers as were
    in flight at once do not all stay."""
    target = server.unix_target
    caches = random_caches(GEOMETRY, seed=6)
    ids = [3, 8, 20]
    worker = new_worker(target)
    gated = GatedPuts(monkeypatch)
    expected: list[tuple[list[bytes], torch.Tensor]] = []

    def save_new_bytes(seed: int, num_blocks: int = 3) -> None:
        worker.before_step()
        fresh = random_caches(GEOMETRY, seed=seed)
        for name in GEOMETRY.layer_names:
            caches[name].copy_(fresh[name])  # vLLM writes the blocks anew (the same tensors)
        hashes = fresh_hashes(num_blocks)
        expected.append((hashes, blocks_of(caches, GEOMETRY, ids[:num_blocks]).clone()))
        worker.save(saves((f"r{seed}", hashes, ids[:num_blocks])))

    try:
        worker.register(caches)
        save_new_bytes(10)
        gated.wait_started()  # the saver holds the first step's buffer
        for seed in (11, 12, 13):
            save_new_bytes(seed)  # three more steps while it is stuck
        gated.gate.set()
        assert worker.flush(30.0) and worker.counters.blocks_saved == 12
        for seed in (14, 15):  # buffers given back, reused back to back
            save_new_bytes(seed)
        save_new_bytes(16, num_blocks=1)  # a smaller save in a larger buffer
        worker.before_step()
        assert worker.flush(30.0) and worker.counters.blocks_saved == 19
        assert worker.counters.blocks_dropped == 0
        for hashes, blocks in expected:
            assert torch.equal(bits(stored(target, NAMESPACE, hashes)), bits(blocks))
        assert len(worker._groups[0].save_buffers) <= IDLE_SAVE_BUFFERS
    finally:
        gated.gate.set()
        worker.close()


def test_a_save_is_gathered_into_the_sidecars_pages_and_the_next_step_waits_for_that_gather(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU the saver gathers a save straight into the leased slab pages (no staging
    buffer, ``put_with``); ``before_step`` (vLLM's step about to write its blocks) does not
    return while that gather is under way, so the stored bytes are the saved step's."""
    target = server.unix_target
    caches = random_caches(GEOMETRY, seed=8)
    ids, hashes = [5, 1, 17, 9], fresh_hashes(4)
    expected = blocks_of(caches, GEOMETRY, ids).clone()
    entered, gate = threading.Event(), threading.Event()
    original = CpuCopies.gather

    def gather(copies: CpuCopies, block_ids: Sequence[int], out: torch.Tensor) -> None:
        if threading.current_thread().name == "tierkv-save":
            entered.set()
            assert gate.wait(30.0), "the test never opened the gate"
        original(copies, block_ids, out)

    monkeypatch.setattr(CpuCopies, "gather", gather)
    worker = new_worker(target)
    stepped = threading.Event()
    try:
        worker.register(caches)
        worker.save(saves(("r", hashes, ids)))
        assert entered.wait(30.0), "the saver never gathered"
        step = threading.Thread(target=lambda: (worker.before_step(), stepped.set()))
        step.start()
        assert not stepped.wait(0.5), "the next step began while a save was being gathered"
        gate.set()
        step.join(30.0)
        assert stepped.is_set()
        for name in GEOMETRY.layer_names:  # the step overwrites the blocks
            caches[name].copy_(random_caches(GEOMETRY, seed=9)[name])
        assert worker.flush(30.0) and worker.counters.blocks_saved == 4
        assert torch.equal(bits(stored(target, NAMESPACE, hashes)), bits(expected))
        assert worker._groups[0].save_buffers == []  # nothing was staged
    finally:
        gate.set()
        worker.close()


def test_a_save_the_sidecar_is_slow_to_take_is_staged_before_the_next_step(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A put stuck before its Allocate when the next step begins: ``before_step`` gathers the
    save into staging itself (the engine never waits for the sidecar), the step overwrites
    vLLM's blocks, and the put, once through, stores the saved step's bytes out of staging."""
    target = server.unix_target
    caches = random_caches(GEOMETRY, seed=10)
    ids, hashes = [2, 11, 4], fresh_hashes(3)
    expected = blocks_of(caches, GEOMETRY, ids).clone()
    worker = new_worker(target)
    gated = GatedPuts(monkeypatch)
    try:
        worker.register(caches)
        worker.save(saves(("r", hashes, ids)))
        gated.wait_started()
        started_s = time.monotonic()
        worker.before_step()
        assert time.monotonic() - started_s < 20.0  # did not wait for the gate (30 s)
        for name in GEOMETRY.layer_names:
            caches[name].copy_(random_caches(GEOMETRY, seed=11)[name])
        gated.gate.set()
        assert worker.flush(30.0) and worker.counters.blocks_saved == 3
        assert gated.methods == ["put_with"]  # taken before it was staged; filled from staging
        assert torch.equal(bits(stored(target, NAMESPACE, hashes)), bits(expected))
    finally:
        gated.gate.set()
        worker.close()


def test_a_step_whose_saves_exceed_the_queue_bound_keeps_each_requests_leading_blocks(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step's requests go in one put, but the bound still counts per request: the first
    request's blocks that fit are saved, the rest of it and what no longer fits are dropped,
    and a later step of a truncated request saves nothing."""
    target = server.unix_target
    caches = random_caches(GEOMETRY, seed=7)
    worker = new_worker(target, save_queue_bytes=4 * LAYOUT.bytes_per_block)
    gated = GatedPuts(monkeypatch)
    a, b = fresh_hashes(3), fresh_hashes(3)
    try:
        worker.register(caches)
        worker.save(saves(("a", a, [0, 1, 2]), ("b", b, [3, 4, 5])))  # 6 blocks, room for 4
        gated.wait_started()
        worker.save(saves(("b", fresh_hashes(1), [6])))  # b was truncated: never saved
        gated.gate.set()
        assert worker.flush(30.0)
        assert worker.counters.blocks_saved == 4 and worker.counters.blocks_dropped == 3
        assert torch.equal(bits(stored(target, NAMESPACE, a + b[:1])),
                           bits(blocks_of(caches, GEOMETRY, [0, 1, 2, 3])))
    finally:
        gated.gate.set()
        worker.close()


@pytest.mark.parametrize("head_dim", [64, 3])  # pages of 16-byte rows, and pages of no row view
def test_an_fp8_cache_in_uint8_pages_saves_and_loads_its_bytes(
    server: BackgroundServer, head_dim: int,
) -> None:
    """vLLM keeps an fp8 cache in uint8 tensors (``kv_cache_dtype="fp8"``): the worker takes
    them as they are and moves their bytes, every one of the 256 values included (NaN and
    infinity encodings of e4m3 and e5m2 among them), never converted to or from float8."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=head_dim, block_size=16,
                      dtype="fp8")
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layout.num_layers))
    geometry = BlockGeometry(names, layout.block_size, layout.block_size, layout, torch.uint8)
    namespace = Namespace("vllm:fp8-copy-test", layout)
    shape = (NUM_VLLM_BLOCKS, layout.num_kv_heads, layout.block_size, 2 * layout.head_dim)
    generator = torch.Generator().manual_seed(8)
    source = {name: torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
              for name in names}
    dest = {name: torch.full(shape, 0x5A, dtype=torch.uint8) for name in names}
    hashes, ids = fresh_hashes(5), [4, 19, 0, 1, 7]
    source[names[0]].view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # in blocks 0, 1
    saver, loader = new_worker(server.unix_target, geometry), new_worker(server.unix_target,
                                                                          geometry)
    try:
        saver.register(source)
        saver.save(saves(("a", hashes, ids), namespace=namespace))
        assert saver.flush(30.0) and saver.counters.blocks_saved == 5
        loader.register(dest)
        assert load_step(loader, loads(("b", hashes, [1, 2, 3, 5, 6]), namespace=namespace)) == set()
        for name in names:
            assert torch.equal(dest[name][[1, 2, 3, 5, 6]], source[name][ids])
        assert bool((dest[names[1]][[0, 4, 8]] == 0x5A).all())  # untouched blocks
        other = new_worker(server.unix_target, geometry)
        try:
            with pytest.raises(ConfigError, match="uint8"):  # pages not of the told dtype
                other.register({name: t.view(torch.int8) for name, t in source.items()})
        finally:
            other.close()
    finally:
        saver.close()
        loader.close()


@pytest.mark.parametrize("value_dim", [0, 32], ids=["mla-latent", "k192-v32"])
def test_pages_of_one_latent_or_of_two_head_sizes_round_trip_bit_exact(
    server: BackgroundServer, value_dim: int,
) -> None:
    """An MLA latent (vLLM's ``[B, 1, N, 576]`` page, no V) and K and V of two head sizes
    (``[B, H, N, K + V]``): saved by rank 1 of two only where they are not replicated, loaded
    by every rank; rank 1 of a replicated group saves nothing (rank 0 holds the same pages)."""
    target = server.served.unix_target
    heads, key_dim = (1, 576) if value_dim == 0 else (2, 192)
    layout = KVLayout(2, heads, key_dim, 16, "bf16", value_dim)
    names = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
    geometry = BlockGeometry(names, 16, 16, layout, replicated=value_dim == 0)
    namespace = Namespace(f"vllm:latent-{value_dim}", layout, tp_rank=0, tp_size=2)
    shape = (NUM_VLLM_BLOCKS, heads, 16, key_dim + value_dim)
    generator = torch.Generator().manual_seed(5)
    source = {name: torch.randint(-(2**15), 2**15, shape, dtype=torch.int32,
                                  generator=generator).to(torch.int16).view(torch.bfloat16)
              for name in names}
    hashes = [bytes([value_dim, k]) * 16 for k in range(5)]
    rank1 = WorkerSide(ConnectorSettings(address=target), geometry, tp_rank=1)
    saver = WorkerSide(ConnectorSettings(address=target), geometry, tp_rank=0)
    try:
        for worker in (rank1, saver):
            worker.register(source)
        step = StepMetadata((namespace,), saves=[BlockOp("r", tuple(hashes), (3, 4, 5, 6, 7))])
        rank1.save(step)
        assert rank1.flush(30.0)
        assert rank1.counters.blocks_saved == (0 if geometry.replicated else 5)
        saver.save(step)
        assert saver.flush(30.0) and saver.counters.blocks_saved == 5
    finally:
        rank1.close()
        saver.close()
    for rank in (0, 1):
        caches = {name: torch.zeros(shape, dtype=torch.bfloat16) for name in names}
        loader = WorkerSide(ConnectorSettings(address=target), geometry, tp_rank=rank)
        try:
            loader.register(caches)
            if not geometry.replicated and rank == 1:
                continue  # rank 1's own blocks of a split group were saved by rank 1 above
            assert load_step(loader, StepMetadata((namespace,), loads=[
                BlockOp("q", tuple(hashes), (10, 11, 12, 13, 14))])) == set()
            for name in names:
                assert torch.equal(caches[name][10:15].view(torch.int16),
                                   source[name][3:8].view(torch.int16))
        finally:
            loader.close()
