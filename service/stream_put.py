"""A Put stream copied straight into the HOST pages of a write lease (no staging buffer).

The stream's bytes are the blocks in order: byte ``k`` belongs to block ``k // block_bytes``.
The servicer leases pages for the blocks that need bytes (``TieredStore.allocate``), copies each
chunk into them as it arrives, and commits once the last byte is in: every block becomes
visible at once. Bytes of blocks the lease does not list (stored already) are dropped. The
servicer aborts the lease on any failure, a short stream or a cancelled call, so nothing of a
broken stream ever becomes visible.

This saves a copy of every byte against staging the batch and then ``put``-ting it: the
server's CPU is what bounds a remote put.
"""

from __future__ import annotations

import xxhash

from tierkv.errors import InvalidArgumentError
from tierkv.paging import copy_spans
from tierkv.store.leases import WriteLease


class LeaseFiller:
    """Routes ``total_bytes`` of stream, in order, into the extents of ``lease`` in ``slab``."""

    def __init__(self, slab: memoryview, lease: WriteLease, block_bytes: int, total_bytes: int):
        self._slab = slab
        # (slab offset, stream offset, length), in stream order (write_indices ascend).
        self._spans = copy_spans(lease.blocks, lease.write_indices, block_bytes)
        self._next_span = 0
        self._block_bytes = block_bytes
        self._write_indices = lease.write_indices
        # Each written block is hashed as its bytes are copied in (still in the CPU cache):
        # its checksum goes with the commit, no pass over the pages afterwards.
        self._hashers = {index: xxhash.xxh3_64() for index in lease.write_indices}
        self.total_bytes = total_bytes
        self.received_bytes = 0

    def write(self, data: memoryview) -> None:
        """Copy the next ``len(data)`` bytes of the stream to where they belong."""
        start = self.received_bytes
        end = start + len(data)
        if end > self.total_bytes:
            raise InvalidArgumentError(f"more than the {self.total_bytes} bytes the blocks hold")
        spans, slab = self._spans, self._slab
        while self._next_span < len(spans):
            slab_offset, stream_offset, length = spans[self._next_span]
            if stream_offset >= end:
                break
            low, high = max(start, stream_offset), min(end, stream_offset + length)
            slab[slab_offset + low - stream_offset : slab_offset + high - stream_offset] = (
                data[low - start : high - start]
            )
            self._hash(data, start, low, high)
            if stream_offset + length > end:
                break  # the span goes on in the next chunk
            self._next_span += 1
        self.received_bytes = end

    def _hash(self, data: memoryview, start: int, low: int, high: int) -> None:
        """Feed stream bytes ``[low, high)`` (``data`` begins at ``start``) to their blocks."""
        block_bytes = self._block_bytes
        while low < high:
            index = low // block_bytes
            piece_end = min(high, (index + 1) * block_bytes)
            self._hashers[index].update(data[low - start : piece_end - start])
            low = piece_end

    @property
    def checksums(self) -> list[int]:
        """The checksum of each written block (``tierkv.checksums``), in ``write_indices``
        order; valid once ``complete``."""
        return [self._hashers[index].intdigest() for index in self._write_indices]

    @property
    def complete(self) -> bool:
        """Whether every byte of the blocks has arrived."""
        return self.received_bytes == self.total_bytes
