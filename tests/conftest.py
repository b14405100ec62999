"""Shared fixtures: tiny layouts and stores with real tiers (shared memory, LMDB in tmp_path)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tierkv import (
    DiskTierConfig,
    GpuTierConfig,
    HostTierConfig,
    KVLayout,
    Namespace,
    StoreConfig,
    TieredStore,
)

# The `tierkv serve` subprocess harness and its `sidecar_factory` fixture.
pytest_plugins = ["sidecar"]

# 2 layers x 2 (K,V) x 4 tokens x 2 heads x 8 dims x fp16 = 512 bytes a block.
TINY_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
BLOCK_BYTES = TINY_LAYOUT.bytes_per_block
PAGE_BYTES = 256  # two pages a block: exercises multi-page and scattered placement


def key(i: int, salt: str = "") -> bytes:
    """A deterministic 32-byte block hash for test block ``i``."""
    return hashlib.sha256(f"block-{salt}-{i}".encode()).digest()


def keys(n: int, start: int = 0, salt: str = "") -> list[bytes]:
    """Hashes of test blocks ``start .. start + n - 1``."""
    return [key(i, salt) for i in range(start, start + n)]


def blocks(n: int, seed: int = 0, layout: KVLayout = TINY_LAYOUT) -> torch.Tensor:
    """``n`` blocks of random bits (every byte pattern, NaNs included, must round-trip)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, layout.bytes_per_block), dtype=torch.uint8, generator=generator)
    return raw.view(layout.torch_dtype).reshape(n, *layout.block_shape)


def block_for(i: int, layout: KVLayout = TINY_LAYOUT) -> torch.Tensor:
    """The one block whose content is derived from ``i`` (so any reader can check it)."""
    return blocks(1, seed=i, layout=layout)[0]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe: compares the raw bytes)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@pytest.fixture
def namespace() -> Namespace:
    """A namespace with the tiny layout."""
    return Namespace("test-model", TINY_LAYOUT)


StoreFactory = Callable[..., TieredStore]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[StoreFactory]:
    """Build stores with real tiers; every store is closed at the end of the test.

    Keyword arguments: ``host_blocks`` (HOST budget in blocks), ``gpu_blocks`` (emulated GPU
    tier, 0 = off), ``disk_blocks`` (0 = no disk tier), ``disk_path``, and any ``StoreConfig``
    field (``write_policy``, ``promote_on_read``, ...) plus ``clock``.
    """
    stores: list[TieredStore] = []

    def build(
        host_blocks: int = 8,
        gpu_blocks: int = 0,
        disk_blocks: int = 0,
        disk_path: Path | None = None,
        clock: Callable[[], float] | None = None,
        **store_fields: object,
    ) -> TieredStore:
        disk = None
        if disk_blocks:
            # Records are a block plus a header of under 128 bytes.
            disk = DiskTierConfig(disk_path or tmp_path / "disk", disk_blocks * (BLOCK_BYTES + 128))
        config = StoreConfig(
            host=HostTierConfig(host_blocks * BLOCK_BYTES, PAGE_BYTES),
            gpu=GpuTierConfig(gpu_blocks * BLOCK_BYTES, PAGE_BYTES, "emulated"),
            disk=disk,
            **store_fields,  # type: ignore[arg-type]
        )
        store = TieredStore(config, clock=clock) if clock else TieredStore(config)
        stores.append(store)
        return store

    yield build
    for store in stores:
        store.close(flush=False)
