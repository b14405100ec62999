"""Block checksums: the xxh3-64 of a block's bytes, from the writer's bytes to the reader's.

One function of the bytes, used everywhere a block's integrity is checked: a same-host client
computes it over what it copied into the slab and the server checks it at commit; the store
keeps it with the block's HOST copy and checks it when the block is read, copied to disk or
leased; the disk record carries the same value (``tierkv.tiers.records``, whose 8-byte digest is
this integer, big endian). So a late or stray write into the slab can turn a hit into a miss,
never into wrong bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
import xxhash


def checksum(data: np.ndarray | memoryview | bytes) -> int:
    """The checksum of one block's bytes (contiguous)."""
    value: int = xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]  # ndarray: a buffer
    return value


def checksum_of_parts(parts: Iterable[np.ndarray | memoryview]) -> int:
    """The checksum of the concatenation of ``parts`` (a block whose pages are scattered)."""
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)  # type: ignore[arg-type]  # ndarray is a buffer
    value: int = hasher.intdigest()
    return value


def block_checksums(flat: torch.Tensor, block_bytes: int, indices: Sequence[int]) -> list[int]:
    """The checksum of blocks ``indices`` of the flat CPU uint8 tensor ``flat``."""
    array = flat.numpy()
    return [checksum(array[i * block_bytes : (i + 1) * block_bytes]) for i in indices]


def digest_value(digest: bytes) -> int:
    """A record's 8-byte digest as the checksum integer."""
    return int.from_bytes(digest, "big")
