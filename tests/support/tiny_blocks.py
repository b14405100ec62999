"""Tiny test blocks: a layout of 512-byte blocks, deterministic hashes, random-bit payloads and a
bit-exact comparison. Tests and worker scripts import them by name (``from tiny_blocks import``);
pytest fixtures live in the ``conftest.py`` files, which nothing imports."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from tierkv import KVLayout, TieredStore
from tierkv.tiers.records import block_record_bytes

# 2 layers x 2 (K,V) x 4 tokens x 2 heads x 8 dims x fp16 = 512 bytes a block.
TINY_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
BLOCK_BYTES = TINY_LAYOUT.bytes_per_block
PAGE_BYTES = 256  # two pages a block: exercises multi-page and scattered placement
# What one block occupies in the DISK tier's budget (its record, header included).
RECORD_BYTES = block_record_bytes(TINY_LAYOUT)


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


# What the ``make_store`` fixture (tests/conftest.py) gives: build a store with real tiers.
StoreFactory = Callable[..., TieredStore]
