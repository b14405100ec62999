"""The client's mapping of the server's slab is populated ahead of a copy: touching a populated
range costs no page fault, ranges past the mapping are ignored, and what is read through it is
the server's bytes."""

from __future__ import annotations

import mmap
import os
import resource
import secrets
from collections.abc import Iterator

import numpy as np
import pytest

from tierkv.client.base import SlabMapping

MiB = 1 << 20


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.fixture
def segment() -> Iterator[tuple[str, np.ndarray]]:
    """A 16 MiB shared-memory segment written by its 'server' mapping (resident pages)."""
    name = f"tierkv-test-populate-{secrets.token_hex(4)}"
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 16 * MiB)
        with mmap.mmap(fd, 16 * MiB) as server_map:
            server = np.frombuffer(server_map, np.uint8)
            server[:] = np.random.default_rng(7).integers(0, 256, 16 * MiB, dtype=np.uint8)
            yield name, server.copy()
            del server
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{name}")


def _touch(array: np.ndarray) -> int:
    """Read one byte of every page of ``array``; the page faults it took."""
    before = _faults()
    int(array[::4096].sum())
    return _faults() - before


def test_a_populated_range_is_touched_without_faults(segment: tuple[str, np.ndarray]) -> None:
    name, expected = segment
    slab = SlabMapping(name, 16 * MiB, b"id")
    try:
        slab.populate([(3 * MiB + 17, 5 * MiB)])  # granules 1 .. 4 (2 MiB each)
        assert _touch(slab.array[2 * MiB : 10 * MiB]) < 8  # a handful (the test's own arrays)
        assert _touch(slab.array[12 * MiB : 16 * MiB]) >= 64  # never populated: faults
        np.testing.assert_array_equal(slab.array, expected)
    finally:
        slab.close()


def test_ranges_past_the_mapping_are_clipped_and_populating_goes_on(
        segment: tuple[str, np.ndarray]) -> None:
    name, expected = segment
    slab = SlabMapping(name, 16 * MiB, b"id")
    try:
        slab.populate([(15 * MiB, 4 * MiB), (64 * MiB, MiB)])  # past the end: clipped, ignored
        slab.populate([(0, MiB), (MiB, MiB), (0, 0)])  # overlapping and empty extents
        slab.populate([])
        assert _touch(slab.array[: 2 * MiB]) < 8
        assert _touch(slab.array[14 * MiB :]) < 8
        np.testing.assert_array_equal(slab.array, expected)
    finally:
        slab.close()
