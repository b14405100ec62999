"""PageAllocator: no page is handed out twice, every page comes back, a batch takes the best-fit
run or else the fewest runs; block extents stop where the block does and copy spans merge only
what is adjacent on both sides."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.paging import (
    Location,
    PageAllocator,
    block_extents,
    copy_spans,
    iter_extents,
    location_num_pages,
    pack_extent,
)


def pages_of(location: int | tuple[int, ...]) -> list[int]:
    return [page for start, count in iter_extents(location) for page in range(start, start + count)]


def batch_runs(locations: list[Location]) -> list[tuple[int, int]]:
    """The runs of adjacent pages a batch's blocks take, in block order (one copy each)."""
    runs: list[tuple[int, int]] = []
    for location in locations:
        for start, count in iter_extents(location):
            if runs and sum(runs[-1]) == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + count)
            elif count:
                runs.append((start, count))
    return runs


def free_runs(held: list[Location], num_pages: int) -> list[tuple[int, int]]:
    """The maximal runs of pages no held location has, worked out from the held ones only."""
    used = {page for location in held for page in pages_of(location)}
    runs: list[tuple[int, int]] = []
    for page in range(num_pages):
        if page in used:
            continue
        if runs and sum(runs[-1]) == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def fewest_runs(run_lengths: list[int], total: int) -> int:
    """How many free runs at least a batch of ``total`` pages needs: the largest ones first."""
    covered = 0
    for needed, length in enumerate(sorted(run_lengths, reverse=True), 1):
        covered += length
        if covered >= total:
            return needed
    raise AssertionError("too few free pages")


def allocator_with_free_runs(lengths: list[int]) -> tuple[PageAllocator, list[Location]]:
    """A full slab whose free runs are ``lengths`` in address order, one page apart; the
    blocks of those one-page gaps are returned."""
    allocator = PageAllocator(sum(lengths) + len(lengths))
    locations = allocator.try_allocate([size for length in lengths for size in (length, 1)])
    assert locations is not None and allocator.num_free_pages == 0
    for location in locations[::2]:
        allocator.free(location)
    return allocator, locations[1::2]


def test_batch_gets_one_adjacent_run() -> None:
    allocator = PageAllocator(64)
    locations = allocator.try_allocate([4, 4, 4])
    assert locations is not None
    starts = [next(iter_extents(loc))[0] for loc in locations]
    assert starts == [starts[0], starts[0] + 4, starts[0] + 8]
    assert allocator.num_free_pages == 52


def test_a_batch_takes_the_smallest_run_that_holds_it() -> None:
    """Best fit: first fit would carve the 8-page run and leave no room for a later 8."""
    allocator, _ = allocator_with_free_runs([8, 4])
    locations = allocator.try_allocate([2, 2])
    assert locations is not None and batch_runs(locations) == [(9, 4)]
    (whole,) = allocator.try_allocate([8]) or []
    assert isinstance(whole, int) and list(iter_extents(whole)) == [(0, 8)]


def test_a_batch_no_run_holds_takes_the_fewest_runs() -> None:
    """Runs of 10, 3 and 7 pages and a batch of 16: the 10 whole, then 6 of the 7 (the smallest
    run that holds the rest), a block straddling the two; the 3 stays free. The old first fit
    per block took 4 runs."""
    allocator, _ = allocator_with_free_runs([10, 3, 7])
    locations = allocator.try_allocate([4, 4, 4, 4])
    assert locations is not None
    assert batch_runs(locations) == [(0, 10), (15, 6)]
    assert locations[2] == (pack_extent(8, 2), pack_extent(15, 2))  # straddles the two runs
    assert all(location_num_pages(location) == 4 for location in locations)
    assert allocator.num_free_pages == 4
    (three,) = allocator.try_allocate([3]) or []
    assert list(iter_extents(three)) == [(11, 3)]


def test_a_batch_bigger_than_every_run_leaves_the_runs_it_need_not_touch() -> None:
    """20 pages over runs of 2, 9, 5, 9, 1: both 9s, then the 2 (the smallest run that holds
    the rest); the 5 and the 1 stay whole."""
    allocator, _ = allocator_with_free_runs([2, 9, 5, 9, 1])
    locations = allocator.try_allocate([5, 5, 5, 5])
    assert locations is not None
    assert sorted(batch_runs(locations)) == [(0, 2), (3, 9), (19, 9)]
    assert allocator.num_free_pages == 5 + 1
    (five,) = allocator.try_allocate([5]) or []
    assert list(iter_extents(five)) == [(13, 5)]


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


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 80),
       st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 12), min_size=1, max_size=6)),
                max_size=80), st.integers(0, 2**32))
def test_every_page_is_one_blocks_or_free_and_batches_take_the_fewest_runs(
    num_pages: int, ops: list[tuple[bool, list[int]]], seed: int
) -> None:
    """After every step: each allocated page is one block's, allocated + free = all pages; a
    batch that fits a free run takes one of the smallest such runs, else the fewest runs."""
    allocator = PageAllocator(num_pages)
    rng = random.Random(seed)
    held: list[Location] = []
    for do_free, sizes in ops:
        if do_free and held:
            allocator.free(held.pop(rng.randrange(len(held))))
        else:
            before = [length for _, length in free_runs(held, num_pages)]
            locations = allocator.try_allocate(sizes)
            if locations is None:
                assert sum(sizes) > allocator.num_free_pages == sum(before)
                continue
            assert [location_num_pages(location) for location in locations] == sizes
            runs = batch_runs(locations)
            if sum(sizes) and max(before, default=0) >= sum(sizes):
                assert len(runs) == 1
                best = min(length for length in before if length >= sum(sizes))
                run_of = {start + i: length for start, length in free_runs(held, num_pages)
                          for i in range(length)}
                assert run_of[runs[0][0]] == best
            elif sum(sizes):
                assert len(runs) == fewest_runs(before, sum(sizes))
            held.extend(locations)
        used = [page for location in held for page in pages_of(location)]
        assert len(used) == len(set(used)), "a page was handed out twice"
        assert all(0 <= page < num_pages for page in used)
        assert allocator.num_free_pages + len(used) == num_pages
    rest = allocator.try_allocate([allocator.num_free_pages])  # exactly the pages nobody has
    assert rest is not None and allocator.num_free_pages == 0
    everything = [page for location in [*held, *rest] for page in pages_of(location)]
    assert sorted(everything) == list(range(num_pages))


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
