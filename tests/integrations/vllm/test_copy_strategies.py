"""The vLLM worker's two copy strategies (``tierkv.integrations.vllm.copies``), each alone through
the ``Copies`` and ``Landing`` interface: the CPU's (gather and scatter straight between vLLM's
blocks and host memory, a load scattered as it is received) with real CPU tensors, the GPU's
(pinned staging, each layer's copy on a side stream) on a CUDA machine. Every copy is bit-exact
whatever the bytes (NaN payloads included), for scattered and repeated block ids, and touches no
other block; a load lands only the blocks that arrived."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from tests.support.harness import BackgroundServer
from tierkv import Client, KVLayout, Namespace
from tierkv.bench.report import fresh_hashes
from tierkv.integrations.vllm.copies import Copies, CpuCopies, GpuCopies, copies_for
from tierkv.integrations.vllm.geometry import BlockGeometry
from tierkv.integrations.vllm.scheduler import BlockOp

NUM_VLLM_BLOCKS = 12
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype="fp16")
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def geometry_of(layout: KVLayout) -> BlockGeometry:
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layout.num_layers))
    return BlockGeometry(names, layout.block_size, layout.block_size, layout)


GEOMETRY = geometry_of(LAYOUT)
NAMESPACE = Namespace("vllm:copy-strategies", LAYOUT)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BackgroundServer]:
    background = BackgroundServer(tmp_path, tokens={}, host_bytes=16 * 1024 * 1024)
    yield background
    background.close()


def random_layers(geometry: BlockGeometry, seed: int, *, permuted: bool = False,
                  device: str = "cpu") -> list[torch.Tensor]:
    """vLLM's per-layer caches ``[B, H, N, C]`` of random bits, a signalling and a quiet NaN
    with payloads planted in each block; ``permuted``: laid out ``[B, N, H, C]`` in memory (no
    page of it contiguous)."""
    layout = geometry.layout
    shape = (NUM_VLLM_BLOCKS, layout.block_size, layout.num_kv_heads, 2 * layout.head_dim)
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in geometry.layer_names:
        raw = torch.randint(-(2**15), 2**15, shape, dtype=torch.int32, generator=generator)
        physical = raw.to(torch.int16)
        words = physical.view(NUM_VLLM_BLOCKS, -1)
        if words.shape[1] >= 8:
            words[:, :4] = torch.tensor([0x0001, 0x0000, 0x0000, 0x7FF0], dtype=torch.int16)
            words[:, 4:8] = torch.tensor([0x0001, 0x0000, 0x0000, -0x0008], dtype=torch.int16)
        typed = physical.view(layout.torch_dtype)  # [B, N, H, C]
        cache = typed.transpose(1, 2) if permuted else typed.view(
            NUM_VLLM_BLOCKS, layout.num_kv_heads, layout.block_size, -1)
        layers.append(cache.to(device))
    return layers


def filled_layers(geometry: BlockGeometry, value: int, *, device: str = "cpu"
                  ) -> list[torch.Tensor]:
    layout = geometry.layout
    shape = (NUM_VLLM_BLOCKS, layout.num_kv_heads, layout.block_size, 2 * layout.head_dim)
    return [torch.full(shape, value, dtype=torch.int16).view(layout.torch_dtype).to(device)
            for _ in geometry.layer_names]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu().contiguous().view(torch.int16)


def blocks_of(layers: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """``[n, L, H, N, C]``: what vLLM's blocks ``ids`` hold."""
    index = torch.tensor(ids, dtype=torch.long)
    return torch.stack([layer.cpu().index_select(0, index) for layer in layers], dim=1)


def untouched(layers: list[torch.Tensor], ids: list[int], value: int) -> bool:
    rest = sorted(set(range(NUM_VLLM_BLOCKS)) - set(ids))
    return bool((bits(blocks_of(layers, rest)) == value).all())


def put_blocks(target: str, hashes: list[bytes], blocks: torch.Tensor) -> None:
    with Client(target) as client:
        client.put(NAMESPACE, hashes, blocks.contiguous().view(len(hashes), *LAYOUT.block_shape))


def done(count: int) -> Future[int]:
    fetched: Future[int] = Future()
    fetched.set_result(count)
    return fetched


# --- the CPU's copies --------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (3, 2), (3, 1)],
                         ids=["16-byte rows", "8-byte rows", "2-byte elements"])
@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
def test_cpu_gather_and_scatter_move_whole_pages_bit_exact(
    head_dim: int, block_size: int, permuted: bool,
) -> None:
    """Gathered (repeated ids too) into a staging buffer and into uint8 rows (what ``put_with``
    fills), then scattered into other blocks: the same bits, and no other block touched."""
    layout = KVLayout(num_layers=2, num_kv_heads=2 if head_dim == 64 else 1, head_dim=head_dim,
                      block_size=block_size, dtype="bf16")
    geometry = geometry_of(layout)
    source = random_layers(geometry, seed=1, permuted=permuted)
    reader = CpuCopies(geometry, source)
    ids = [7, 0, 11, 7]
    staging = reader.staging(len(ids))
    reader.gather(ids, staging)
    assert torch.equal(bits(staging), bits(blocks_of(source, ids)))
    rows = torch.empty((len(ids), layout.bytes_per_block), dtype=torch.uint8)
    reader.gather(ids, rows)
    assert torch.equal(rows, staging.view(torch.uint8).view(len(ids), -1))

    dest = [torch.zeros_like(layer) for layer in source]
    CpuCopies(geometry, dest).scatter([3, 9, 1], rows[:3])
    assert torch.equal(bits(blocks_of(dest, [3, 9, 1])), bits(blocks_of(source, ids[:3])))
    assert untouched(dest, [3, 9, 1], 0)


def test_cpu_staging_is_plain_host_memory_and_saves_are_gathered_by_the_saver() -> None:
    copies = CpuCopies(GEOMETRY, random_layers(GEOMETRY, seed=2))
    staging = copies.staging(5)
    assert staging.shape == (5, LAYOUT.num_layers, *GEOMETRY.page_shape)
    assert staging.dtype == GEOMETRY.cache_dtype and staging.device.type == "cpu"
    assert not staging.is_pinned()
    assert copies.gathers_in_step is False


def test_cpu_copies_are_chosen_for_caches_in_host_memory() -> None:
    chosen = copies_for([(GEOMETRY, random_layers(GEOMETRY, seed=3))])
    assert [type(copies) for copies in chosen] == [CpuCopies]
    assert copies_for([]) == []


@pytest.mark.parametrize("asynchronous", [False, True], ids=["step", "async"])
def test_a_cpu_load_is_scattered_into_vllms_blocks_as_it_is_received(
    server: BackgroundServer, asynchronous: bool,
) -> None:
    """The sidecar holds 3 of the 4 blocks asked for: ``receive`` says 3 and those are in
    vLLM's blocks once it returned, bit-exact; the fourth one's block is untouched, and the
    scatters the worker asks for after it change nothing."""
    source = random_layers(GEOMETRY, seed=4)
    hashes = fresh_hashes(4)
    put_blocks(server.unix_target, hashes[:3], blocks_of(source, [1, 2, 3]))
    dest = filled_layers(GEOMETRY, 0x1111)
    copies: Copies = CpuCopies(GEOMETRY, dest)
    op = BlockOp("r", tuple(hashes), (10, 4, 0, 6))
    landing = copies.async_landing(op) if asynchronous else copies.step_landings([op])[0]
    with Client(server.unix_target) as client:
        count = landing.receive(client, NAMESPACE, 30.0)
    assert count == 3
    assert torch.equal(bits(blocks_of(dest, [10, 4, 0])), bits(blocks_of(source, [1, 2, 3])))
    assert untouched(dest, [10, 4, 0], 0x1111)
    if asynchronous:
        landing.scatter_all(count)
    else:
        for index in range(LAYOUT.num_layers):
            landing.scatter_layer(index, done(count))
    assert torch.equal(bits(blocks_of(dest, [10, 4, 0])), bits(blocks_of(source, [1, 2, 3])))
    assert untouched(dest, [10, 4, 0], 0x1111)


def test_a_cpu_layer_is_not_handed_over_before_its_fetch_is_done() -> None:
    """The fetching thread scatters every layer, then checks the pages it read: a layer is
    handed to the model only once that fetch returned."""
    copies = CpuCopies(GEOMETRY, filled_layers(GEOMETRY, 0))
    landing = copies.step_landings([BlockOp("r", tuple(fresh_hashes(1)), (2,))])[0]
    fetched: Future[int] = Future()
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (landing.scatter_layer(0, fetched), returned.set()),
                              daemon=True)
    waiter.start()
    assert not returned.wait(0.3), "a layer was handed over before its fetch was done"
    fetched.set_result(1)
    waiter.join(30.0)
    assert returned.is_set()


# --- the GPU's copies --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("permuted", [False, True], ids=["contiguous", "permuted"])
def test_gpu_copies_gather_into_pinned_staging_within_the_step(permuted: bool) -> None:
    """Chosen for caches on a CUDA device; a save's gather lands in pinned staging, bit-exact
    (repeated ids too), and is done when ``gather`` returns."""
    source = random_layers(GEOMETRY, seed=5, permuted=permuted, device="cuda")
    (copies,) = copies_for([(GEOMETRY, source)])
    assert isinstance(copies, GpuCopies) and copies.gathers_in_step is True
    ids = [7, 0, 11, 7]
    staging = copies.staging(len(ids))
    assert staging.is_pinned() and staging.device.type == "cpu"
    assert staging.shape == (len(ids), LAYOUT.num_layers, *GEOMETRY.page_shape)
    copies.gather(ids, staging)
    assert torch.equal(bits(staging), bits(blocks_of(source, ids)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_step_loads_land_in_staging_and_reach_vllms_blocks_a_layer_at_a_time(
    server: BackgroundServer,
) -> None:
    """Two loads of a step are received into pinned staging (vLLM's blocks untouched); each
    layer reaches vLLM's blocks when ``scatter_layer`` asks for it, on the side stream that the
    engine's stream then waits for: only the blocks that arrived (3 of the second load's 4)."""
    source = random_layers(GEOMETRY, seed=6)
    hashes = fresh_hashes(6)
    put_blocks(server.unix_target, hashes[:5], blocks_of(source, [1, 2, 3, 4, 5]))
    dest = filled_layers(GEOMETRY, 0x2222, device="cuda")
    (copies,) = copies_for([(GEOMETRY, dest)])
    ops = [BlockOp("a", tuple(hashes[:2]), (10, 4)), BlockOp("b", tuple(hashes[2:]), (0, 6, 8, 2))]
    landings = copies.step_landings(ops)
    with Client(server.unix_target) as client:
        counts = [landing.receive(client, NAMESPACE, 30.0) for landing in landings]
    assert counts == [2, 3]
    assert untouched(dest, [], 0x2222)
    loaded = [10, 4, 0, 6, 8]
    for index in range(LAYOUT.num_layers):
        for landing, count in zip(landings, counts, strict=True):
            landing.scatter_layer(index, done(count))
        # Read on the engine's stream, which waits for the side stream's copy.
        assert torch.equal(bits(blocks_of([dest[index]], loaded)),
                           bits(blocks_of([source[index]], [1, 2, 3, 4, 5])))
        assert untouched([dest[index]], loaded, 0x2222)
        assert all(untouched([later], [], 0x2222) for later in dest[index + 1 :])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_asynchronous_load_is_in_vllms_blocks_when_scatter_all_returns(
    server: BackgroundServer,
) -> None:
    source = random_layers(GEOMETRY, seed=7)
    hashes = fresh_hashes(3)
    put_blocks(server.unix_target, hashes[:2], blocks_of(source, [8, 9]))
    dest = filled_layers(GEOMETRY, 0x3333, device="cuda")
    (copies,) = copies_for([(GEOMETRY, dest)])
    landing = copies.async_landing(BlockOp("r", tuple(hashes), (5, 1, 3)))
    with Client(server.unix_target) as client:
        count = landing.receive(client, NAMESPACE, 30.0)
    assert count == 2
    landing.scatter_all(count)
    assert torch.equal(bits(blocks_of(dest, [5, 1])), bits(blocks_of(source, [8, 9])))
    assert untouched(dest, [5, 1], 0x3333)
