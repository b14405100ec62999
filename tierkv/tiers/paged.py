"""A paged slab: one flat uint8 tensor cut into fixed pages (the GPU and HOST tiers).

The slab copies whole blocks between itself and a caller's buffer along ``CopySpan``s planned
by ``tierkv.paging.copy_spans`` (which merges adjacent copies, so a batch placed in one run of
pages moves in one copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierkv.checksums import checksums
from tierkv.paging import CopySpan, Location, block_extents, copy_spans, iter_extents, pages_for


class PagedSlab:
    """``num_pages`` pages of ``page_bytes`` bytes in ``tensor`` (1-D uint8, on any device)."""

    def __init__(self, tensor: torch.Tensor, page_bytes: int) -> None:
        assert tensor.dtype == torch.uint8 and tensor.dim() == 1
        self.tensor = tensor
        self.page_bytes = page_bytes
        self.num_pages = tensor.numel() // page_bytes
        self.capacity_bytes = self.num_pages * page_bytes

    @property
    def device(self) -> torch.device:
        """Where the slab lives."""
        return self.tensor.device

    def pages_for(self, num_bytes: int) -> int:
        """Pages needed to hold ``num_bytes``."""
        return pages_for(num_bytes, self.page_bytes)

    def plan(
        self,
        locations: Sequence[Location],
        block_bytes: int,
        buffer_indices: Sequence[int] | None = None,
    ) -> list[CopySpan]:
        """Merged copy spans between the slab and a buffer of blocks laid back to back
        (``tierkv.paging.copy_spans``): block ``i`` of ``locations`` pairs with the buffer's
        block ``buffer_indices[i]`` (default ``i``)."""
        return copy_spans(locations, self.page_bytes, block_bytes, buffer_indices)

    def write(self, spans: Sequence[CopySpan], source: torch.Tensor, non_blocking: bool) -> None:
        """Copy ``source`` (flat uint8) into the slab along ``spans``."""
        for slab_offset, buffer_offset, length in spans:
            self.tensor[slab_offset : slab_offset + length].copy_(
                source[buffer_offset : buffer_offset + length], non_blocking=non_blocking
            )

    def read(self, spans: Sequence[CopySpan], destination: torch.Tensor, non_blocking: bool) -> None:
        """Copy from the slab along ``spans`` into ``destination`` (flat uint8)."""
        for slab_offset, buffer_offset, length in spans:
            destination[buffer_offset : buffer_offset + length].copy_(
                self.tensor[slab_offset : slab_offset + length], non_blocking=non_blocking
            )

    def view(self, location: Location, block_bytes: int) -> torch.Tensor | None:
        """The block's bytes as one slab view when its pages are adjacent, else None."""
        if not isinstance(location, int):
            return None
        ((start, _),) = iter_extents(location)
        offset = start * self.page_bytes
        return self.tensor[offset : offset + block_bytes]

    def checksum(self, location: Location, block_bytes: int) -> int:
        """The checksum (``tierkv.checksums``) of the block at ``location`` (CPU slabs only)."""
        return self.checksums([location], block_bytes)[0]

    def checksums(self, locations: Sequence[Location], block_bytes: int) -> list[int]:
        """The checksums of the blocks at ``locations`` (CPU slabs only; large batches on all
        cores)."""
        array = self.tensor.numpy()
        blocks = [
            [array[offset : offset + length]
             for offset, length in block_extents(location, self.page_bytes, block_bytes)]
            for location in locations
        ]
        return checksums(blocks)

    def close(self) -> None:
        """Release the slab's memory (subclasses release what they mapped)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
