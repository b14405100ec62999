"""How often each block was used lately, approximately, in bounded memory: a count-min sketch.

Four rows of ``width`` saturating counters (0-15, as TinyLFU's 4-bit counters), one byte each;
a use adds one to the key's counter in every row (those at 15 stay), the estimate is the
smallest of the four. Every ``reset_uses`` uses, every counter is halved (TinyLFU's reset: old
popularity fades). Keys are 64-bit (a block's: its hash's first 8 bytes); an estimate is never
below the true count since the last reset, halved as it was. Not thread-safe: the store's lock
guards it. Design: docs/design/eviction.md#the-adaptive-policy
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

MAX_COUNT = 15
NUM_ROWS = 4
_HALF = bytes(value >> 1 for value in range(256))  # bytes.translate table: every counter / 2
MIX = 0x9E3779B97F4A7C15
"""Fibonacci hashing's multiplier: spreads a key's bits (the fourth row's index, and which keys
``tierkv.admission`` samples)."""
MASK64 = (1 << 64) - 1
_CHUNK_KEYS = 240  # a counter at 15 plus one use of each key of a chunk stays below 256


class FrequencySketch:
    """A count-min sketch of at least ``num_counters`` counters a row, halved every
    ``reset_uses`` uses (default: ten times ``num_counters``)."""

    __slots__ = ("_mask", "_rows", "_width", "num_uses", "reset_uses")

    def __init__(self, num_counters: int, reset_uses: int | None = None) -> None:
        width = 64
        while width < num_counters:
            width <<= 1
        self._width = width
        self._mask = width - 1
        self._rows = bytearray(NUM_ROWS * width)
        self.reset_uses = reset_uses if reset_uses is not None else 10 * width
        self.num_uses = 0

    @property
    def width(self) -> int:
        """Counters a row (a power of two)."""
        return self._width

    def increment(self, key: int) -> None:
        """Count one use of ``key``."""
        # Row r's counter: bits 21r.. of the key (the fourth row: of the key times MIX), spelled
        # out: this runs for every block used under the adaptive policy.
        key &= MASK64
        mask, width, rows = self._mask, self._width, self._rows
        index = key & mask
        if rows[index] < MAX_COUNT:
            rows[index] += 1
        index = width + ((key >> 21) & mask)
        if rows[index] < MAX_COUNT:
            rows[index] += 1
        index = 2 * width + ((key >> 42) & mask)
        if rows[index] < MAX_COUNT:
            rows[index] += 1
        index = 3 * width + ((((key * MIX) & MASK64) >> 40) & mask)
        if rows[index] < MAX_COUNT:
            rows[index] += 1
        self.num_uses += 1
        if self.num_uses >= self.reset_uses:
            self.halve()

    def increment_all(self, keys: npt.NDArray[np.uint64]) -> None:
        """Count one use of each of ``keys`` (what ``increment`` does for each, vectorised: a
        read of a long run)."""
        mask, width = np.uint64(self._mask), np.uint64(self._width)
        rows = np.frombuffer(self._rows, dtype=np.uint8)
        for start in range(0, len(keys), _CHUNK_KEYS):
            chunk = keys[start : start + _CHUNK_KEYS]
            indices = np.concatenate((
                chunk & mask,
                width + ((chunk >> np.uint64(21)) & mask),
                2 * width + ((chunk >> np.uint64(42)) & mask),
                3 * width + (((chunk * np.uint64(MIX)) >> np.uint64(40)) & mask),
            )).astype(np.intp)
            np.add.at(rows, indices, np.uint8(1))  # a uint8 one: numpy's fast path
            rows[indices] = np.minimum(rows[indices], MAX_COUNT)
        self.num_uses += len(keys)
        if self.num_uses >= self.reset_uses:
            self.halve()

    def estimate(self, key: int) -> int:
        """Uses of ``key`` since the last reset (halved at each), or more (other keys share its
        counters), at most ``MAX_COUNT``."""
        # The rows' counters as ``increment`` finds them (two of these a duel).
        key &= MASK64
        mask, width, rows = self._mask, self._width, self._rows
        return min(rows[key & mask], rows[width + ((key >> 21) & mask)],
                   rows[2 * width + ((key >> 42) & mask)],
                   rows[3 * width + ((((key * MIX) & MASK64) >> 40) & mask)])

    def halve(self) -> None:
        """Halve every counter (one C-level pass) and start counting uses again."""
        self._rows[:] = self._rows.translate(_HALF)
        self.num_uses = 0
