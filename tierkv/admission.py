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
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from tierkv.frequency import MASK64, MIX, FrequencySketch

T = TypeVar("T")

WINDOW_SHARE = 0.01
"""The window's part of a list's room (W-TinyLFU's 1 %)."""

_RESIZE_EVERY = 64


def window_room(num_blocks: int) -> int:
    """How many of ``num_blocks`` the window holds: 1 %, at least one."""
    return max(1, int(num_blocks * WINDOW_SHARE))


def sampled(key: int, sample: int) -> bool:
    """Whether ``key`` is one of the 1/``sample`` of keys the miniatures see (a fixed pattern of
    the key's mixed bits, apart from those the sketch indexes with)."""
    return ((((key & MASK64) * MIX) & MASK64) >> 32) % sample == 0


VECTOR_USES = 16
"""From this many keys a call on, ``count_uses`` counts them with numpy."""


def count_uses(sketch: FrequencySketch, admissions: Sequence[Admission[Any]],
               keys: Sequence[int]) -> bool:
    """Count a use of each of ``keys`` in ``sketch`` and show the sampled ones to every
    admission's miniatures (all of ``admissions`` sample alike); whether any was sampled."""
    if not admissions:
        return False
    sample = admissions[0].sample
    if len(keys) >= VECTOR_USES:
        array = np.fromiter(keys, np.uint64, len(keys))
        sketch.increment_all(array)
        mixed = (array * np.uint64(MIX)) >> np.uint64(32)  # ``sampled``, vectorised
        picked: list[int] = array[mixed % np.uint64(sample) == 0].tolist()
    else:
        for key in keys:
            sketch.increment(key)
        picked = [key for key in keys if sampled(key, sample)]
    for key in picked:
        for admission in admissions:
            admission.observe(key)
    return bool(picked)


class MiniatureTinyLfu:
    """A W-TinyLFU of ``capacity`` keys (``resize`` it), with its frequency filter on or off,
    counting nothing itself: ``access`` says whether it was a hit."""

    __slots__ = ("capacity", "filtered", "main", "main_capacity", "window", "window_capacity")

    def __init__(self, filtered: bool, capacity: int = 4) -> None:
        self.filtered = filtered
        self.window: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()
        self.capacity = self.window_capacity = self.main_capacity = 0
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        """Hold ``capacity`` keys from the next access on (a shrink evicts then)."""
        self.capacity = capacity
        self.window_capacity = window_room(capacity)
        self.main_capacity = max(1, capacity - self.window_capacity)

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
        while len(window) > self.window_capacity:
            candidate = window.popitem(last=False)[0]
            if len(main) < self.main_capacity:
                main[candidate] = None
                continue
            victim = next(iter(main))
            if not self.filtered or sketch.estimate(candidate) > sketch.estimate(victim):
                del main[victim]
                main[candidate] = None
        while len(main) > self.main_capacity:  # the capacity shrank
            main.popitem(last=False)
        return False


class Admission(Generic[T]):
    """One tier's admission filter: ``on`` or off as its miniatures say, and the frequency of a
    block (``estimate``) from the store's sketch. ``key_of`` gives an owner's 64-bit key;
    ``capacity_blocks`` the tier's room in blocks now (an estimate: blocks differ in size)."""

    __slots__ = ("_until_resize", "capacity_blocks", "decay", "hits", "key_of", "miniatures",
                 "on", "sample", "sketch")

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
        self._until_resize = 0

    def estimate(self, owner: T) -> int:
        """``owner``'s recent uses, as the sketch has them."""
        return self.sketch.estimate(self.key_of(owner))

    def observe(self, key: int) -> None:
        """A use of a sampled ``key`` (``sampled(key, self.sample)``): both miniatures see it
        (sized to the tier's room every ``_RESIZE_EVERY`` uses)."""
        self._until_resize -= 1
        if self._until_resize <= 0:
            self._until_resize = _RESIZE_EVERY
            capacity = max(4, self.capacity_blocks() // self.sample)
            for miniature in self.miniatures:
                miniature.resize(capacity)
        plain, filtered = self.miniatures
        hits, decay, sketch = self.hits, self.decay, self.sketch
        plain_hits = hits[0] * decay + plain.access(key, sketch)
        filtered_hits = hits[1] * decay + filtered.access(key, sketch)
        # (Hit counts that decayed to nothing are zero, not subnormal floats: those are slow.)
        hits[0] = plain_hits if plain_hits > 1e-9 else 0.0
        hits[1] = filtered_hits if filtered_hits > 1e-9 else 0.0
        self.on = hits[1] > hits[0]
