"""PageAllocator: no page is handed out twice, every page comes back, batches stay adjacent;
block extents stop where the block does and copy spans merge only what is adjacent on both sides."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.paging import (
    PageAllocator,
    block_extents,
    copy_spans,
    iter_extents,
    location_num_pages,
    pack_extent,
)


def pages_of(location: int | tuple[int, ...]) -> list[int]:
    return [page for start, count in iter_extents(location) for page in range(start, start + count)]


def test_batch_gets_one_adjacent_run() -> None:
    allocator = PageAllocator(64)
    locations = allocator.try_allocate([4, 4, 4])
    assert locations is not None
    starts = [next(iter_extents(loc))[0] for loc in locations]
    assert starts == [starts[0], starts[0] + 4, starts[0] + 8]
    assert allocator.num_free_pages == 52


def test_allocation_fails_whole_and_changes_nothing_when_too_few_pages() -> None:
    allocator = PageAllocator(10)
    assert allocator.try_allocate([4, 4]) is not None
    assert allocator.try_allocate([2, 1]) is None
    assert allocator.num_free_pages == 2


def test_fragmented_free_pages_still_serve_a_block() -> None:
    allocator = PageAllocator(8)
    locations = allocator.try_allocate([1] * 8)
    assert locations is not None
    for location in locations[::2]:  # free every other page: no two free pages are adjacent
        allocator.free(location)
    (scattered,) = allocator.try_allocate([4]) or []
    assert isinstance(scattered, tuple)
    assert sorted(pages_of(scattered)) == [0, 2, 4, 6]
    assert allocator.num_free_pages == 0


def test_freed_neighbours_coalesce_back_into_one_run() -> None:
    allocator = PageAllocator(12)
    locations = allocator.try_allocate([3, 3, 3, 3])
    assert locations is not None
    for location in (locations[1], locations[3], locations[0], locations[2]):
        allocator.free(location)
    (whole,) = allocator.try_allocate([12]) or []
    assert isinstance(whole, int) and list(iter_extents(whole)) == [(0, 12)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(1, 6), min_size=1, max_size=4)),
                max_size=60), st.integers(0, 2**32))
def test_random_alloc_free_never_double_books(ops: list[tuple[bool, list[int]]], seed: int) -> None:
    allocator = PageAllocator(32)
    rng = random.Random(seed)
    held: list[int | tuple[int, ...]] = []
    for do_free, sizes in ops:
        if do_free and held:
            allocator.free(held.pop(rng.randrange(len(held))))
        else:
            locations = allocator.try_allocate(sizes)
            if locations is None:
                assert sum(sizes) > allocator.num_free_pages
                continue
            for location, size in zip(locations, sizes, strict=True):
                assert location_num_pages(location) == size
            held.extend(locations)
        used = [page for location in held for page in pages_of(location)]
        assert len(used) == len(set(used)), "a page was handed out twice"
        assert all(0 <= page < 32 for page in used)
        assert allocator.num_free_pages == 32 - len(used)
    for location in held:
        allocator.free(location)
    assert allocator.try_allocate([32]) is not None  # everything came back and coalesced


def test_block_extents_cover_the_block_only() -> None:
    """A block of 2.5 pages on scattered pages: its last extent stops where the block does."""
    location = (pack_extent(4, 2), pack_extent(9, 1))
    assert block_extents(location, 100, 250) == [(400, 200), (900, 50)]


def test_copy_spans_merge_what_is_adjacent_in_both_slab_and_buffer() -> None:
    run = [pack_extent(0, 2), pack_extent(2, 2)]  # two blocks back to back in one run
    assert copy_spans(run, 100, 200) == [(0, 0, 400)]
    # The same pages into buffer slots 1 and 3: adjacent in the slab only, so two copies.
    assert copy_spans(run, 100, 200, [1, 3]) == [(0, 200, 200), (200, 600, 200)]
    scattered = [(pack_extent(6, 1), pack_extent(2, 1))]
    assert copy_spans(scattered, 100, 200) == [(600, 0, 100), (200, 100, 100)]
