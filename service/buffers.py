"""Reused byte buffers for the Get stream (a Put stream writes into lease pages instead).

A fresh 64 MiB buffer per call page-faults on every first write (about 3x the cost of the copy
itself on this kind of machine); reusing buffers keeps those pages mapped.
"""

from __future__ import annotations

import threading


class BufferPool:
    """Hands out ``bytearray``s of at least the size asked for, and takes them back.

    Keeps at most ``max_pooled_bytes`` of idle buffers; a buffer is never handed to two callers.
    """

    def __init__(self, max_pooled_bytes: int) -> None:
        self._max_pooled_bytes = max_pooled_bytes
        self._idle: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> bytearray:
        """A buffer of ``len >= num_bytes`` (its contents are stale: overwrite what you use)."""
        with self._lock:
            fitting = [buffer for buffer in self._idle if len(buffer) >= num_bytes]
            if fitting:
                buffer = min(fitting, key=len)
                self._idle.remove(buffer)
                return buffer
        return bytearray(num_bytes)

    def give(self, buffer: bytearray) -> None:
        """Return a buffer taken from this pool."""
        with self._lock:
            self._idle.append(buffer)
            self._idle.sort(key=len)
            while sum(map(len, self._idle)) > self._max_pooled_bytes:
                self._idle.pop(0)  # drop the smallest: large batches are the costly ones
