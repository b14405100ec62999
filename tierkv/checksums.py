"""Block checksums: the xxh3-64 of a block's bytes, from the writer's bytes to the reader's.

One function of the bytes, used everywhere a block's integrity is checked: a same-host client
computes it over what it copied into the slab and the server checks it at commit; the store
keeps it with the block's HOST copy and checks it when the block is read, copied to disk or
leased; the disk record carries the same value (``tierkv.tiers.records``, whose 8-byte digest is
this integer, big endian). So a late or stray write into the slab can turn a hit into a miss,
never into wrong bytes.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch
import xxhash

# Below this many bytes in all, blocks are hashed on the caller's thread (a hop costs more).
_PARALLEL_FROM_BYTES = 4 << 20
# Copied, then hashed while still in the cache (1 MiB measured fastest on two threads here).
_COPY_CHUNK_BYTES = 1 << 20
_NUM_THREADS = max(1, min(4, os.cpu_count() or 1))


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


def checksums(blocks: Sequence[np.ndarray | Sequence[np.ndarray]]) -> list[int]:
    """The checksum of each block (an array, or the arrays of its scattered parts in order),
    on all cores for large batches: hashing is bound by memory reads, and xxhash lets go of
    the GIL, so two threads hash 64 MiB in 3.4 ms here where one takes 5.2."""
    sizes = [_num_bytes(block) for block in blocks]
    if _NUM_THREADS == 1 or sum(sizes) < _PARALLEL_FROM_BYTES:
        return [_digest(block) for block in blocks]
    return _in_groups(blocks, sizes, lambda group: [_digest(block) for block in group])


def _digest(block: np.ndarray | Sequence[np.ndarray]) -> int:
    if isinstance(block, np.ndarray):
        return checksum(block)
    return checksum(block[0]) if len(block) == 1 else checksum_of_parts(block)


def _num_bytes(block: np.ndarray | Sequence[np.ndarray]) -> int:
    return block.nbytes if isinstance(block, np.ndarray) else sum(part.nbytes for part in block)


# (destination, source) arrays of one block's bytes, in block order.
CopyParts = Sequence[tuple[np.ndarray, np.ndarray]]


def copy_with_checksums(blocks: Sequence[CopyParts]) -> list[int]:
    """Copy each block's parts and return the checksum of each block as copied: every chunk is
    hashed right after it lands, while it is still in the CPU cache, and large batches are
    spread over all cores, the caller's thread included (numpy's copies and xxhash both let go
    of the GIL). Measured here on 32 MiB: 16.7 GB/s in 2 MiB blocks, 11.6 in 128 KiB ones,
    where a task per block gave 9.3 and 3.2, and a torch copy followed by a hashing pass moved
    6 GB/s (torch's idle OpenMP threads spin on the cores the hashing needs)."""
    sizes = [sum(source.nbytes for _, source in parts) for parts in blocks]
    if _NUM_THREADS == 1 or sum(sizes) < _PARALLEL_FROM_BYTES:
        return [copy_with_checksum(parts) for parts in blocks]
    return _in_groups(blocks, sizes, lambda group: [copy_with_checksum(p) for p in group])


T = TypeVar("T")


def _in_groups(blocks: Sequence[T], sizes: Sequence[int],
               work: Callable[[Sequence[T]], list[int]]) -> list[int]:
    """``work`` over runs of ``blocks`` of about equal bytes, one run per thread (the caller's
    thread takes the last), results in block order. One task per thread, not per block: a
    task costs ~20 us of hand-over, which at 128 KiB blocks halved the throughput."""
    shares = np.arange(1, _NUM_THREADS) * (sum(sizes) / _NUM_THREADS)
    bounds = np.searchsorted(np.cumsum(sizes), shares)
    edges = [0, *(int(edge) + 1 for edge in bounds), len(blocks)]
    runs = [blocks[start:end] for start, end in itertools.pairwise(edges) if start < end]
    futures = [_executor().submit(work, run) for run in runs[:-1]]
    try:
        last = work(runs[-1]) if runs else []
    finally:  # never leave a copy running into a buffer the caller takes back
        concurrent.futures.wait(futures)
    return [value for future in futures for value in future.result()] + last


def copy_with_checksum(parts: CopyParts, chunk_bytes: int = _COPY_CHUNK_BYTES) -> int:
    """Copy one block's parts, hashing each chunk of ``chunk_bytes`` right after it lands;
    returns the checksum of the block as copied (on the caller's thread)."""
    if len(parts) == 1 and parts[0][1].nbytes <= chunk_bytes:  # one chunk: no hasher object
        destination, source = parts[0]
        np.copyto(destination, source)
        return checksum(destination)
    hasher = xxhash.xxh3_64()
    for destination, source in parts:
        for start in range(0, source.nbytes, chunk_bytes):
            landed = destination[start : start + chunk_bytes]
            np.copyto(landed, source[start : start + chunk_bytes])
            hasher.update(landed)  # type: ignore[arg-type]  # ndarray is a buffer
    value: int = hasher.intdigest()
    return value


def block_checksums(flat: torch.Tensor, block_bytes: int, indices: Sequence[int]) -> list[int]:
    """The checksum of blocks ``indices`` of the flat CPU uint8 tensor ``flat``."""
    array = flat.numpy()
    return checksums([array[i * block_bytes : (i + 1) * block_bytes] for i in indices])


@functools.cache
def _executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_NUM_THREADS, "tierkv-checksum")


def digest_value(digest: bytes) -> int:
    """A record's 8-byte digest as the checksum integer."""
    return int.from_bytes(digest, "big")


def value_digest(value: int) -> bytes:
    """The checksum integer as a record's 8-byte digest."""
    return value.to_bytes(8, "big")
