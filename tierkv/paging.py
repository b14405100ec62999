"""Fixed-page allocation for the paged tiers (GPU and HOST slabs): a block's location is one
extent (``start << 32 | num_pages``) or a tuple of them, and a batch lies over as few free runs
as possible. Not thread-safe: the store's lock guards it, since placement is the store's state.
Design: docs/design/paging.md#page-allocation
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator, Sequence

Location = int | tuple[int, ...]
Extent = tuple[int, int]
"""``(slab byte offset, length)``: one run of a block's bytes in a slab."""
BlockExtents = list[Extent]
"""A block's extents in block byte order (what a lease hands a same-host client, per block)."""
CopySpan = tuple[int, int, int]
"""``(slab byte offset, buffer byte offset, length)``: one copy between a slab and a buffer of
blocks laid back to back. Every copy of whole blocks between a slab and a buffer is planned as
a list of these by ``copy_spans``, the one place spans are made and merged."""

_COUNT_BITS = 32
_COUNT_MASK = (1 << _COUNT_BITS) - 1


def pack_extent(start_page: int, num_pages: int) -> int:
    """One extent as an int."""
    return start_page << _COUNT_BITS | num_pages


def unpack_extent(extent: int) -> tuple[int, int]:
    """``(start_page, num_pages)`` of a packed extent."""
    return extent >> _COUNT_BITS, extent & _COUNT_MASK


def iter_extents(location: Location) -> Iterator[tuple[int, int]]:
    """The ``(start_page, num_pages)`` runs of a location, in block byte order."""
    if isinstance(location, int):
        yield unpack_extent(location)
    else:
        for extent in location:
            yield unpack_extent(extent)


def block_extents(location: Location, page_bytes: int, block_bytes: int) -> BlockExtents:
    """The extents of the ``block_bytes`` bytes of a block at ``location`` in a slab of
    ``page_bytes`` pages (its last page may be only partly the block's)."""
    if isinstance(location, int):  # one run of pages: every lease's common case
        return [((location >> _COUNT_BITS) * page_bytes,
                 min(block_bytes, (location & _COUNT_MASK) * page_bytes))]
    return list(_byte_extents(location, page_bytes, block_bytes))


def _byte_extents(location: Location, page_bytes: int, block_bytes: int) -> Iterator[Extent]:
    remaining = block_bytes
    for start, count in iter_extents(location):
        length = min(remaining, count * page_bytes)
        yield start * page_bytes, length
        remaining -= length


def copy_spans(
    locations: Sequence[Location],
    page_bytes: int,
    block_bytes: int,
    buffer_indices: Sequence[int] | None = None,
) -> list[CopySpan]:
    """The copies between a slab of ``page_bytes`` pages and a buffer of whole blocks, where
    the block at ``locations[i]`` pairs with the buffer's block ``buffer_indices[i]`` (default
    ``i``). Spans adjacent in both the slab and the buffer are merged into one copy, so a batch
    placed in one run of pages moves in one copy."""
    spans: list[CopySpan] = []
    for index, location in enumerate(locations):
        slot = index if buffer_indices is None else buffer_indices[index]
        buffer_offset = slot * block_bytes
        remaining = block_bytes
        # (_byte_extents inlined: this runs for every block of every copy)
        for extent in (location,) if isinstance(location, int) else location:
            slab_offset = (extent >> _COUNT_BITS) * page_bytes
            length = min(remaining, (extent & _COUNT_MASK) * page_bytes)
            remaining -= length
            if spans:
                last_slab, last_buffer, last_length = spans[-1]
                if last_slab + last_length == slab_offset and last_buffer + last_length == buffer_offset:
                    spans[-1] = (last_slab, last_buffer, last_length + length)
                    buffer_offset += length
                    continue
            spans.append((slab_offset, buffer_offset, length))
            buffer_offset += length
    return spans


def pages_for(num_bytes: int, page_bytes: int) -> int:
    """Pages a block of ``num_bytes`` takes in a slab of ``page_bytes`` pages (whole pages)."""
    return -(-num_bytes // page_bytes)


def blocks_that_fit(capacity_bytes: int, page_bytes: int, block_bytes: int) -> int:
    """How many blocks of ``block_bytes`` a slab of ``capacity_bytes`` holds: the slab has
    ``capacity_bytes // page_bytes`` pages and each block takes ``pages_for`` of them (the
    arithmetic of the HOST and GPU tiers; ``tierkv size`` reports it)."""
    return (capacity_bytes // page_bytes) // pages_for(block_bytes, page_bytes)


def first_page(location: Location) -> int:
    """The page a location starts at (its block's bytes begin there)."""
    return (location if isinstance(location, int) else location[0]) >> _COUNT_BITS


def location_num_pages(location: Location) -> int:
    """How many pages a location holds."""
    return sum(count for _, count in iter_extents(location))


class PageAllocator:
    """Hands out and takes back runs of pages of one slab of ``num_pages`` pages."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.num_free_pages = num_pages
        # The free runs, maximal (coalesced): by start and by end (to merge on free), and by
        # length (to find the best fit): the starts of the runs of each length, and the
        # distinct lengths in ascending order.
        self._start_to_count: dict[int, int] = {}
        self._end_to_start: dict[int, int] = {}
        self._starts_by_count: dict[int, set[int]] = {}
        self._counts: list[int] = []
        if num_pages:
            self._add_run(0, num_pages)

    def try_allocate(self, pages_per_block: Sequence[int]) -> list[Location] | None:
        """One location per block, or None (nothing allocated) if too few pages are free.

        The blocks are laid back to back in block order over as few free runs as possible:
        the smallest run that holds the whole batch; else the largest runs, a block straddling
        two of them where one ends, and the rest in the smallest run that holds it."""
        total = sum(pages_per_block)
        if total > self.num_free_pages:
            return None
        counts = self._counts
        index = bisect_left(counts, total)
        if index < len(counts):
            start = self._take_run(counts[index], total)
            locations: list[Location] = []
            for count in pages_per_block:
                locations.append(start << _COUNT_BITS | count)
                start += count
            return locations
        return self._spread(pages_per_block, total)

    def free(self, location: Location) -> None:
        """Return a location's pages; they merge with adjacent free runs."""
        if isinstance(location, int):
            self._insert_run(location >> _COUNT_BITS, location & _COUNT_MASK)
        else:
            for extent in location:
                self._insert_run(extent >> _COUNT_BITS, extent & _COUNT_MASK)

    def _spread(self, pages_per_block: Sequence[int], total: int) -> list[Location]:
        """``total`` pages over the fewest runs: whole largest runs until the rest fits one,
        then that rest from the smallest run that holds it; the blocks follow in order."""
        counts = self._counts
        pieces: list[tuple[int, int]] = []
        remaining = total
        while remaining:
            index = bisect_left(counts, remaining)
            take = counts[index] if index < len(counts) else counts[-1]
            piece = min(take, remaining)
            pieces.append((self._take_run(take, piece), piece))
            remaining -= piece
        locations: list[Location] = []
        next_piece = iter(pieces)
        start, left = 0, 0
        for count in pages_per_block:
            if count <= left:
                locations.append(start << _COUNT_BITS | count)
                start += count
                left -= count
                continue
            extents: list[int] = []
            needed = count
            while needed:
                if not left:
                    start, left = next(next_piece)
                take = min(needed, left)
                extents.append(start << _COUNT_BITS | take)
                start += take
                left -= take
                needed -= take
            locations.append(extents[0] if len(extents) == 1 else tuple(extents))
        return locations

    def _take_run(self, run_count: int, count: int) -> int:
        """Carve ``count`` pages off the front of a free run of ``run_count`` pages; its start."""
        start = next(iter(self._starts_by_count[run_count]))
        self._unindex(start, run_count)
        del self._start_to_count[start]
        del self._end_to_start[start + run_count]
        if run_count > count:  # the rest's neighbours are both allocated: nothing to merge
            self._add_run(start + count, run_count - count)
        self.num_free_pages -= count
        return start

    def _add_run(self, start: int, count: int) -> None:
        self._start_to_count[start] = count
        self._end_to_start[start + count] = start
        starts = self._starts_by_count.get(count)
        if starts is None:
            self._starts_by_count[count] = {start}
            insort(self._counts, count)
        else:
            starts.add(start)

    def _unindex(self, start: int, count: int) -> None:
        """Drop a run that is leaving the free set from the index by length."""
        starts = self._starts_by_count[count]
        if len(starts) == 1:
            del self._starts_by_count[count]
            del self._counts[bisect_left(self._counts, count)]
        else:
            starts.remove(start)

    def _insert_run(self, start: int, count: int) -> None:
        """Free ``count`` pages from ``start``, merged with the free runs either side."""
        if not count:
            return
        self.num_free_pages += count
        end = start + count
        before_start = self._end_to_start.pop(start, None)
        if before_start is not None:
            before_count = self._start_to_count.pop(before_start)
            self._unindex(before_start, before_count)
            start = before_start
            count += before_count
        after_count = self._start_to_count.pop(end, None)
        if after_count is not None:
            del self._end_to_start[end + after_count]
            self._unindex(end, after_count)
            count += after_count
        self._add_run(start, count)
