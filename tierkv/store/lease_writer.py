"""A write lease filled from this process: a byte stream copied straight into its HOST pages.

The stream's bytes are the lease's blocks in order: byte ``k`` belongs to block
``k // block_bytes``. Each chunk is copied into the pages it belongs to as it arrives (no staging
buffer), and each written block is hashed as its bytes land, while they are still in the CPU
cache: its checksum goes with the commit, with no pass over the pages afterwards. Bytes of
blocks the lease does not list (stored already) are dropped.

This saves a copy of every byte against staging the batch and then ``put``-ting it: the
server's CPU is what bounds a remote put. The lease (``TieredStore.allocate_in_process``) never
expires, so its pages are never handed to another block while the stream is still copying; the
writer's owner ends it (commit, or abort on any failure, a short stream or a cancelled call), so
nothing of a broken stream ever becomes visible.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from tierkv.errors import InvalidArgumentError
from tierkv.paging import CopySpan


class LeaseWriter:
    """Routes ``total_bytes`` of stream, in order, into the pages of one write lease.

    Handed out by ``TieredStore.lease_writer``. It holds a view of the HOST slab, which cannot
    be unmapped while the view lives: use it in a ``with`` block (``checksums``, ``complete``
    and ``received_bytes`` stay readable after it).
    """

    def __init__(
        self, slab: memoryview, spans: list[CopySpan], write_indices: Sequence[int],
        block_bytes: int, total_bytes: int,
    ) -> None:
        """``spans``: ``(slab offset, stream offset, length)``, in stream order, of the blocks
        ``write_indices`` (ascending)."""
        self._slab = slab
        self._spans = spans
        self._next_span = 0
        self._block_bytes = block_bytes
        self._write_indices = list(write_indices)
        self._hashers = {index: xxhash.xxh3_64() for index in self._write_indices}
        self.total_bytes = total_bytes
        self.received_bytes = 0

    def write(self, data: memoryview) -> None:
        """Copy the next ``len(data)`` bytes of the stream to where they belong
        (``InvalidArgumentError`` past ``total_bytes``)."""
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

    def close(self) -> None:
        """Release the slab view (writing afterwards raises ``ValueError``). Idempotent."""
        self._slab.release()

    def __enter__(self) -> LeaseWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
