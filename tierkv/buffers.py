"""Reused byte buffers: the server's Get stream batches and the records sent to REMOTE.

A fresh multi-MiB ``bytearray`` is page-faulted and zeroed on first touch, which costs more than
the copy into it (about 3x for a 64 MiB Get batch; ~35 of ~54 ms for 64 MiB of REMOTE records
on this kind of machine); reusing buffers keeps those pages mapped. Thread-safe.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable


class BufferPool:
    """Hands out ``bytearray``s and takes them back, keeping at most ``max_pooled_bytes`` idle.

    A buffer is never handed to two callers; give back only a buffer nothing else still reads.
    When the pool is full, the smallest idle buffers make way for a larger one (large batches
    are the costly ones to fault in).
    """

    def __init__(self, max_pooled_bytes: int) -> None:
        self.max_pooled_bytes = max_pooled_bytes
        self._sizes: list[int] = []  # sorted, one per idle buffer
        self._idle: dict[int, list[bytearray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        """Bytes of the buffers kept for reuse now."""
        return self._idle_bytes

    def take(self, num_bytes: int, exact: bool = False) -> bytearray:
        """A buffer of ``len >= num_bytes`` (``exact``: of exactly ``num_bytes``, as a record
        needs); its contents are stale: overwrite what you use."""
        with self._lock:
            i = bisect.bisect_left(self._sizes, num_bytes)
            if i < len(self._sizes) and (not exact or self._sizes[i] == num_bytes):
                size = self._sizes.pop(i)
                self._idle_bytes -= size
                same = self._idle[size]
                buffer = same.pop()
                if not same:
                    del self._idle[size]
                return buffer
        return bytearray(num_bytes)

    def give(self, buffers: bytearray | Iterable[bytes | bytearray]) -> None:
        """Keep ``buffers`` (one, or several; only bytearrays are kept) for later takes."""
        given = [buffers] if isinstance(buffers, bytearray) else buffers
        with self._lock:
            for buffer in given:
                if isinstance(buffer, bytearray):
                    self._keep_locked(buffer)

    def _keep_locked(self, buffer: bytearray) -> None:
        size = len(buffer)
        if size > self.max_pooled_bytes:
            return
        while self._idle_bytes + size > self.max_pooled_bytes:
            if not self._sizes or self._sizes[0] >= size:
                return  # only larger buffers are idle: keep them, drop this one
            smallest = self._sizes.pop(0)
            same = self._idle[smallest]
            same.pop()
            if not same:
                del self._idle[smallest]
            self._idle_bytes -= smallest
        bisect.insort(self._sizes, size)
        self._idle.setdefault(size, []).append(buffer)
        self._idle_bytes += size
