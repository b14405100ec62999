"""Checks of caller input, done before anything is reserved, so that bad input stores nothing."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tierkv.errors import InvalidArgumentError
from tierkv.keys import BLOCK_HASH_BYTES
from tierkv.layout import KVLayout
from tierkv.types import PutDetail

MAX_TTL_S = 30 * 24 * 3600.0
"""Longest pin TTL accepted (30 days); longer pins are a leak, not a cache."""


def check_hashes(hashes: Sequence[bytes]) -> list[bytes]:
    """The hashes as plain bytes, each exactly 32 bytes long."""
    if isinstance(hashes, bytes | bytearray | memoryview | str):
        raise InvalidArgumentError("hashes must be a sequence of 32-byte block hashes, not one value")
    keys = [bytes(h) for h in hashes]
    if any(len(key) != BLOCK_HASH_BYTES for key in keys):
        bad = next(i for i, key in enumerate(keys) if len(key) != BLOCK_HASH_BYTES)
        raise InvalidArgumentError(
            f"hashes[{bad}] is {len(keys[bad])} bytes; block hashes are {BLOCK_HASH_BYTES} bytes"
        )
    return keys


def check_lookup_hashes(hashes: Sequence[bytes], num_found: int = 0) -> None:
    """Cheap check for lookups: every hash is 32 bytes (no copies).

    The first ``num_found`` hashes were found in the index, whose keys are all 32 bytes, so
    only the rest are looked at (a fully cached chain costs nothing here).
    """
    if isinstance(hashes, bytes | bytearray | memoryview | str):
        raise InvalidArgumentError("hashes must be a sequence of 32-byte block hashes, not one value")
    rest = hashes[num_found:] if num_found else hashes
    if rest and set(map(len, rest)) != {BLOCK_HASH_BYTES}:
        raise InvalidArgumentError(f"every block hash must be {BLOCK_HASH_BYTES} bytes")


def check_blocks(layout: KVLayout, blocks: torch.Tensor, num_hashes: int) -> torch.Tensor:
    """``blocks`` as one flat uint8 tensor, after checking its shape and dtype against ``layout``.

    Raises ``InvalidArgumentError`` naming what differs.
    """
    if not isinstance(blocks, torch.Tensor):
        raise InvalidArgumentError(f"blocks must be a torch.Tensor, got {type(blocks).__name__}")
    expected = (num_hashes, *layout.block_shape)
    if tuple(blocks.shape) != expected:
        if blocks.dim() >= 1 and blocks.shape[0] != num_hashes:
            raise InvalidArgumentError(
                f"got {num_hashes} hashes but {blocks.shape[0]} blocks; they must match"
            )
        raise InvalidArgumentError(
            f"blocks have shape {tuple(blocks.shape)}; this namespace's layout needs {expected}"
        )
    if blocks.dtype != layout.torch_dtype:
        raise InvalidArgumentError(
            f"blocks have dtype {blocks.dtype}; this namespace's layout needs {layout.torch_dtype}"
        )
    return blocks.contiguous().view(torch.uint8).reshape(-1)


def check_out(layout: KVLayout, out: torch.Tensor, num_hashes: int) -> torch.Tensor:
    """``out`` as one flat uint8 view, after checking it can hold ``num_hashes`` blocks."""
    if not isinstance(out, torch.Tensor):
        raise InvalidArgumentError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dim() != 1 + len(layout.block_shape) or tuple(out.shape[1:]) != layout.block_shape:
        raise InvalidArgumentError(
            f"out has shape {tuple(out.shape)}; it must be [n, *{layout.block_shape}]"
        )
    if out.shape[0] < num_hashes:
        raise InvalidArgumentError(f"out holds {out.shape[0]} blocks; {num_hashes} were asked for")
    if out.dtype != layout.torch_dtype:
        raise InvalidArgumentError(f"out has dtype {out.dtype}; the layout needs {layout.torch_dtype}")
    if not out.is_contiguous():
        raise InvalidArgumentError("out must be contiguous")
    return out.view(torch.uint8).reshape(-1)


def check_ttl(ttl_s: float | None, max_s: float = MAX_TTL_S, name: str = "ttl_s") -> float | None:
    """A TTL: None (none) or a finite number of seconds in (0, ``max_s``] (pins: 30 days)."""
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float):
        raise InvalidArgumentError(f"{name} must be a number of seconds or None, got {ttl_s!r}")
    if not math.isfinite(ttl_s) or not 0 < ttl_s <= max_s:
        raise InvalidArgumentError(f"{name} must be in (0, {max_s:.0f}] seconds, got {ttl_s}")
    return float(ttl_s)


def check_detail(detail: PutDetail | None, num_blocks: int, block_size: int) -> None:
    """A put's ``detail``, if any: a ``PutDetail`` that fits ``num_blocks`` blocks of
    ``block_size`` tokens (``InvalidArgumentError`` if not)."""
    if detail is not None:
        if not isinstance(detail, PutDetail):
            raise InvalidArgumentError(f"detail must be a PutDetail, got {type(detail).__name__}")
        detail.check(num_blocks, block_size)
