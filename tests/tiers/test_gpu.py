"""The CUDA path: a real GPU tier in HBM, a pinned HOST slab, copies on dedicated streams.

Skipped on machines without CUDA; ``scripts/gpu-check`` runs these on one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.service_fixtures import commit_after_a_late_write
from tests.support.tiny_blocks import BLOCK_BYTES, PAGE_BYTES, TINY_LAYOUT, blocks, keys, same_bytes
from tierkv import (
    DiskTierConfig,
    GpuTierConfig,
    HostTierConfig,
    Namespace,
    StoreConfig,
    Tier,
    TieredStore,
    WritePolicy,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture
def cuda_store(tmp_path: Path, namespace: Namespace) -> Iterator[TieredStore]:
    config = StoreConfig(
        host=HostTierConfig(8 * BLOCK_BYTES, PAGE_BYTES),
        gpu=GpuTierConfig(4 * BLOCK_BYTES, PAGE_BYTES, "cuda"),
        disk=DiskTierConfig(tmp_path / "disk", 64 * BLOCK_BYTES),
    )
    with TieredStore(config) as store:
        store.register(namespace)
        yield store


def produced_on_the_current_stream(n: int, seed: int) -> torch.Tensor:
    """Blocks whose last kernel may still be running when the call returns."""
    data = blocks(n, seed).cuda()
    noise = torch.randn(2048, 2048, device="cuda")
    for _ in range(8):  # keep the stream busy so an unsynchronised copy would read early
        noise = noise @ noise
    return data + (noise.sum() * 0).to(data.dtype)


def test_host_slab_is_pinned(cuda_store: TieredStore) -> None:
    assert cuda_store.host_pinned


def test_cuda_blocks_round_trip_through_the_gpu_tier(
    cuda_store: TieredStore, namespace: Namespace
) -> None:
    data = produced_on_the_current_stream(3, seed=1)
    assert cuda_store.put(namespace, keys(3), data) == 3
    assert cuda_store.stats().tiers[Tier.GPU].num_blocks == 3
    out = torch.empty_like(data)
    assert cuda_store.get_into(namespace, keys(3), out) == 3
    assert same_bytes(out.cpu(), data.cpu())
    assert same_bytes(cuda_store.get(namespace, keys(3)), data.cpu())


def test_demotion_to_pinned_host_and_reads_back_to_cuda(
    cuda_store: TieredStore, namespace: Namespace
) -> None:
    data = produced_on_the_current_stream(8, seed=2)
    for i in range(0, 8, 2):
        cuda_store.put(namespace, keys(2, start=i), data[i : i + 2])
    tiers = cuda_store.stats().tiers
    assert tiers[Tier.GPU].num_blocks == 4 and tiers[Tier.HOST].num_blocks == 4
    out = torch.empty_like(data)
    assert cuda_store.get_into(namespace, keys(8), out) == 8
    assert same_bytes(out.cpu(), data.cpu())


def test_cpu_blocks_into_the_gpu_tier_and_through_to_disk(
    cuda_store: TieredStore, namespace: Namespace
) -> None:
    data = blocks(2, seed=3)
    cuda_store.put(namespace, keys(2), data, tier=Tier.GPU, write_policy=WritePolicy.WRITE_THROUGH)
    assert cuda_store.stats().tiers[Tier.DISK].num_blocks == 2
    assert same_bytes(cuda_store.get(namespace, keys(2), device="cuda").cpu(), data)


def test_disk_reads_land_in_a_cuda_buffer(cuda_store: TieredStore, namespace: Namespace) -> None:
    data = blocks(2, seed=4)
    cuda_store.put(namespace, keys(2), data, tier=Tier.DISK)
    out = torch.empty((2, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype, device="cuda")
    assert cuda_store.get_into(namespace, keys(2), out) == 2
    assert same_bytes(out.cpu(), data)


def test_a_page_changed_after_the_clients_hash_is_a_miss_into_a_cuda_buffer(
    cuda_store: TieredStore, namespace: Namespace
) -> None:
    """A commit keeps the client's checksums without hashing the pages; a read into a GPU
    buffer (no CPU pass over what landed) hashes the HOST pages after the copy instead."""
    data = blocks(4, seed=5)
    commit_after_a_late_write(cuda_store, namespace, keys(4, start=40), data, changed=2)
    out = torch.empty((4, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype, device="cuda")
    assert cuda_store.get_into(namespace, keys(4, start=40), out) == 2
    assert same_bytes(out[:2].cpu(), data[:2])
    assert cuda_store.stats().checksum_failures == 1
