"""Copies with checksums spread over threads: every block copied and hashed in order, whatever
the mix of block sizes and parts, and a failure leaves no copy running."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import xxhash

from tierkv.checksums import CopyParts, checksums, copy_with_checksums


def _blocks(rng: np.random.Generator, sizes: list[int], num_parts: int
            ) -> tuple[list[CopyParts], np.ndarray, np.ndarray]:
    source = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    destination = np.zeros_like(source)
    blocks: list[CopyParts] = []
    offset = 0
    for size in sizes:
        cuts = sorted({0, size, *rng.integers(0, size, num_parts - 1).tolist()})
        blocks.append([(destination[offset + a : offset + b], source[offset + a : offset + b])
                       for a, b in itertools.pairwise(cuts)])
        offset += size
    return blocks, source, destination


@pytest.mark.parametrize("sizes", [
    [2 << 20] * 32,  # the bench's batch
    [128 << 10] * 256,  # small blocks: one task per thread, not per block
    [16 << 20, 4096, 4096, 3 << 20],  # one block larger than the share of a thread
    [4096] * 2000,
    [1, 7 << 20, 1, 5 << 20, 3],
])
@pytest.mark.parametrize("num_parts", [1, 3])
def test_every_block_is_copied_and_hashed_in_order(sizes: list[int], num_parts: int) -> None:
    rng = np.random.default_rng(len(sizes) * 10 + num_parts)
    blocks, source, destination = _blocks(rng, sizes, num_parts)
    got = copy_with_checksums(blocks)
    np.testing.assert_array_equal(destination, source)
    offset = 0
    expected = []
    for size in sizes:
        expected.append(xxhash.xxh3_64_intdigest(source[offset : offset + size].tobytes()))
        offset += size
    assert got == expected
    assert checksums([[dst for dst, _ in parts] for parts in blocks]) == expected


def test_a_failing_copy_raises_after_every_other_copy_ended() -> None:
    rng = np.random.default_rng(3)
    blocks, _, _ = _blocks(rng, [4 << 20] * 8, 1)
    bad = np.zeros(10, np.uint8)  # the wrong size: numpy refuses to broadcast it
    blocks[-1] = [(bad, blocks[-1][0][1])]
    before = threading.active_count()
    with pytest.raises(ValueError):
        copy_with_checksums(blocks)
    np.testing.assert_array_equal(blocks[0][0][0], blocks[0][0][1])  # the other run finished
    assert threading.active_count() <= before + 2  # the pool's threads, at most
