"""Fixed-page allocation for the paged tiers (GPU and HOST slabs).

A block owns one or more *extents* (runs of adjacent pages). An extent is packed into one int,
``start << 32 | num_pages``, and a block's location is one such int (the common case: its pages
are adjacent) or a tuple of them; this keeps the index near 250 bytes per block at a million
blocks. The allocator is not thread-safe: the store's lock guards it, since placement is the
store's state.

Decisions:
1. Pages are fixed-size, so there is no external fragmentation: any free pages can serve any
   block, and an allocation fails only when the free page count is too small.
2. A batch first asks for one run of pages large enough for all its blocks, so that one copy moves
   the whole batch; it falls back to one run per block, then to scattered pages.
3. Free runs are coalesced with their neighbours on free, in O(1), through start and end maps.
"""

from __future__ import annotations

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
# First-fit scans at most this many free runs before settling for scattered pages.
_MAX_SCAN = 64


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
    return unpack_extent(location if isinstance(location, int) else location[0])[0]


def location_num_pages(location: Location) -> int:
    """How many pages a location holds."""
    return sum(count for _, count in iter_extents(location))


class PageAllocator:
    """Hands out and takes back runs of pages of one slab of ``num_pages`` pages."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.num_free_pages = num_pages
        self._start_to_count: dict[int, int] = {0: num_pages} if num_pages else {}
        self._end_to_start: dict[int, int] = {num_pages: 0} if num_pages else {}

    def try_allocate(self, pages_per_block: Sequence[int]) -> list[Location] | None:
        """One location per block, or None (nothing allocated) if too few pages are free."""
        total = sum(pages_per_block)
        if total > self.num_free_pages:
            return None
        run_start = self._take_run(total)
        if run_start is not None:
            locations: list[Location] = []
            for count in pages_per_block:
                locations.append(pack_extent(run_start, count))
                run_start += count
            return locations
        return [self._allocate_one(count) for count in pages_per_block]

    def free(self, location: Location) -> None:
        """Return a location's pages; they merge with adjacent free runs."""
        for start, count in iter_extents(location):
            self._insert_run(start, count)
            self.num_free_pages += count

    def _allocate_one(self, count: int) -> Location:
        start = self._take_run(count)
        if start is not None:
            return pack_extent(start, count)
        # Scattered: take whole runs (and a piece of the last) until the block is covered.
        extents: list[int] = []
        needed = count
        while needed:
            run_start, run_count = next(iter(self._start_to_count.items()))
            take = min(needed, run_count)
            self._remove_run(run_start, run_count)
            if take < run_count:
                self._insert_run(run_start + take, run_count - take)
            extents.append(pack_extent(run_start, take))
            self.num_free_pages -= take
            needed -= take
        return tuple(extents)

    def _take_run(self, count: int) -> int | None:
        """Carve ``count`` adjacent pages out of the first free run that holds them."""
        for index, (start, run_count) in enumerate(self._start_to_count.items()):
            if run_count >= count:
                self._remove_run(start, run_count)
                if run_count > count:
                    self._insert_run(start + count, run_count - count)
                self.num_free_pages -= count
                return start
            if index >= _MAX_SCAN:
                break
        return None

    def _remove_run(self, start: int, count: int) -> None:
        del self._start_to_count[start]
        del self._end_to_start[start + count]

    def _insert_run(self, start: int, count: int) -> None:
        end = start + count
        before_start = self._end_to_start.pop(start, None)
        if before_start is not None:
            count += self._start_to_count.pop(before_start)
            start = before_start
        after_count = self._start_to_count.pop(end, None)
        if after_count is not None:
            del self._end_to_start[end + after_count]
            count += after_count
        self._start_to_count[start] = count
        self._end_to_start[start + count] = start
