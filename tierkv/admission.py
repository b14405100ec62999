"""Whether a tier's adaptive policy admits by frequency: W-TinyLFU's filter, switched on or off by
two miniature simulations.

The adaptive policy (``tierkv.eviction.TinyLfuEviction``) lets a block leaving a tenant's window
into its main list only if it was used more often than main's next victim, while ``on``; while
off, every block leaving the window enters main (an LRU in two segments). Which of the two is
better depends on the traffic (docs/design/eviction.md#measured-hit-ratios), so each tier runs
both in miniature (Waldspurger et al., ATC 2017): two small W-TinyLFU simulations, with and
without the filter, at 1/``sample`` of the tier's capacity in blocks, fed the uses of the
blocks whose key falls in 1/``sample`` of the key space; the filter follows whichever had more
hits lately (each hit count decayed by ``decay`` a sampled use). Not thread-safe: the store's
lock guards it. Design: docs/design/eviction.md#the-adaptive-policy
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from tierkv.frequency import FrequencySketch

T = TypeVar("T")

WINDOW_SHARE = 0.01
"""The window's part of a list's room (W-TinyLFU's 1 %)."""

_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def window_room(num_blocks: int) -> int:
    """How many of ``num_blocks`` the window holds: 1 %, at least one."""
    return max(1, int(num_blocks * WINDOW_SHARE))


def sampled(key: int, sample: int) -> bool:
    """Whether ``key`` is one of the 1/``sample`` of keys the miniatures see (a fixed pattern of
    the key's mixed bits, apart from those the sketch indexes with)."""
    return ((((key & _MASK64) * _MIX) & _MASK64) >> 32) % sample == 0


class MiniatureTinyLfu:
    """A W-TinyLFU of ``capacity`` keys (set by its owner before each use), with its frequency
    filter on or off, counting nothing itself: ``access`` says whether it was a hit."""

    __slots__ = ("capacity", "filtered", "main", "window")

    def __init__(self, filtered: bool, capacity: int = 4) -> None:
        self.filtered = filtered
        self.capacity = capacity
        self.window: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()

    def access(self, key: int, sketch: FrequencySketch) -> bool:
        """Use ``key``: a hit refreshes it, a miss stores it in the window; the window's
        overflow enters main (past main's victim only by frequency, when filtered)."""
        window, main = self.window, self.main
        if key in window:
            window.move_to_end(key)
            return True
        if key in main:
            main.move_to_end(key)
            return True
        window[key] = None
        window_capacity = window_room(self.capacity)
        main_capacity = max(1, self.capacity - window_capacity)
        while len(window) > window_capacity:
            candidate = window.popitem(last=False)[0]
            if len(main) < main_capacity:
                main[candidate] = None
                continue
            victim = next(iter(main))
            if not self.filtered or sketch.estimate(candidate) > sketch.estimate(victim):
                del main[victim]
                main[candidate] = None
        while len(main) > main_capacity:  # the capacity shrank
            main.popitem(last=False)
        return False


class Admission(Generic[T]):
    """One tier's admission filter: ``on`` or off as its miniatures say, and the frequency of a
    block (``estimate``) from the store's sketch. ``key_of`` gives an owner's 64-bit key;
    ``capacity_blocks`` the tier's room in blocks now (an estimate: blocks differ in size)."""

    __slots__ = ("capacity_blocks", "decay", "hits", "key_of", "miniatures", "on", "sample",
                 "sketch")

    def __init__(self, sketch: FrequencySketch, key_of: Callable[[T], int],
                 capacity_blocks: Callable[[], int], sample: int = 16,
                 decay: float = 0.999) -> None:
        self.sketch = sketch
        self.key_of = key_of
        self.capacity_blocks = capacity_blocks
        self.sample = sample
        self.decay = decay
        self.miniatures = (MiniatureTinyLfu(filtered=False), MiniatureTinyLfu(filtered=True))
        self.hits = [0.0, 0.0]
        self.on = False  # until the filtered miniature does better

    def estimate(self, owner: T) -> int:
        """``owner``'s recent uses, as the sketch has them."""
        return self.sketch.estimate(self.key_of(owner))

    def observe(self, key: int) -> None:
        """A use of a sampled ``key`` (``sampled(key, self.sample)``): both miniatures see it."""
        capacity = max(4, self.capacity_blocks() // self.sample)
        hits, decay = self.hits, self.decay
        for which, miniature in enumerate(self.miniatures):
            miniature.capacity = capacity
            hits[which] = hits[which] * decay + miniature.access(key, self.sketch)
        self.on = hits[1] > hits[0]
