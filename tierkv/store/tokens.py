"""A block's tokens: what its writer said of it that a router needs to place it (its token ids,
and the LoRA and extra keys that enter a router's own block hash), kept with the block's index
entry so that every KV event of the block, in any tier and after any move, restart or
restatement, carries them (docs/events.md). Compact: the token ids as one ``bytes`` of
little-endian uint32 (4 B a token, 33 B of object header), in a tuple only when a LoRA or an
extra key goes with them. Pure functions, tested alone; the disk form (``encode``) rides beside
the block's record and is checked like every record (a bad one reads as None, never as tokens).
"""
from __future__ import annotations

import sys
from typing import Any, cast

import msgpack
import numpy as np

from tierkv.types import PutDetail

BlockTokens = bytes | tuple[bytes, str | None, tuple[Any, ...] | None]
"""Token ids packed as uint32 little-endian, alone or with ``(lora_name, extra_key)``."""

def pack_put(detail: PutDetail | None, num_blocks: int, block_size: int) -> list[BlockTokens | None]:
    """Each block's tokens from a put's ``detail`` (None for every block when it gave no token
    ids). One vectorised conversion for the whole put; a slice of it per block."""
    if detail is None or not detail.token_ids:
        return [None] * num_blocks
    packed = np.asarray(detail.token_ids, dtype="<u4").tobytes()
    step = 4 * block_size
    blocks: list[BlockTokens | None] = []
    for index in range(num_blocks):
        ids = packed[index * step:(index + 1) * step]
        extra = detail.extra_keys[index] if detail.extra_keys else None
        if detail.lora_name is None and extra is None:
            blocks.append(ids)
        else:
            blocks.append((ids, detail.lora_name, None if extra is None else tuple(extra)))
    return blocks


def token_ids(tokens: BlockTokens) -> list[int]:
    """The token ids, as a list of ints."""
    ids = tokens if isinstance(tokens, bytes) else tokens[0]
    values: list[int] = np.frombuffer(ids, dtype="<u4").tolist()
    return values


def lora_name(tokens: BlockTokens) -> str | None:
    """The LoRA its writer named, if any."""
    return None if isinstance(tokens, bytes) else tokens[1]


def extra_key(tokens: BlockTokens) -> tuple[Any, ...] | None:
    """Its entry of vLLM's ``BlockStored.extra_keys`` (cache salt, multimodal hashes), if any."""
    return None if isinstance(tokens, bytes) else tokens[2]


def num_bytes(tokens: BlockTokens | None) -> int:
    """Memory it holds beyond the entry's slot (the figure docs/design/eviction.md counts)."""
    if tokens is None:
        return 0
    if isinstance(tokens, bytes):
        return sys.getsizeof(tokens)
    return sys.getsizeof(tokens) + sys.getsizeof(tokens[0])


def encode(parent: bytes | None, tokens: BlockTokens | None) -> bytes:
    """The disk form of a block's parent hash and tokens (sealed by the disk tier)."""
    if tokens is None:
        fields: list[Any] = [parent]
    elif isinstance(tokens, bytes):
        fields = [parent, tokens]
    else:
        fields = [parent, tokens[0], tokens[1], None if tokens[2] is None else list(tokens[2])]
    return cast(bytes, msgpack.packb(fields, use_bin_type=True))


def decode(data: bytes, block_size: int) -> tuple[bytes | None, BlockTokens | None] | None:
    """``(parent, tokens)`` from ``encode``'s form for a block of ``block_size`` tokens, or None
    for anything else (foreign bytes, a wrong token count, a bad hash)."""
    try:
        fields = msgpack.unpackb(data, raw=False, use_list=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    if not isinstance(fields, list) or not 1 <= len(fields) <= 4:
        return None
    parent = fields[0]
    if parent is not None and not (isinstance(parent, bytes) and len(parent) == 32):
        return None
    if len(fields) == 1:
        return parent, None
    ids = fields[1]
    if not isinstance(ids, bytes) or len(ids) != 4 * block_size:
        return None
    if len(fields) == 2:
        return parent, ids
    if len(fields) != 4:
        return None
    lora, extra = fields[2], fields[3]
    if (lora is not None and not isinstance(lora, str)) or (
            extra is not None and not isinstance(extra, list)):
        return None
    return parent, (ids, lora, None if extra is None else tuple(extra))

