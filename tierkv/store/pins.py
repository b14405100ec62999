"""Pins: blocks that must not be evicted until unpinned or their TTL runs out. A pinned entry is
unlinked from every LRU list and linked back when its last pin goes; the deadline heap is
bounded by the live pins. Guarded by the store's lock. Design: docs/design/eviction.md#pins
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tierkv.config import Tier
from tierkv.store.index import Entry

# Heap items tolerated beyond twice the live pins before a rebuild (keeps small tables cheap).
_HEAP_SLACK = 64


@dataclass(slots=True)
class _Pin:
    count: int
    deadline_s: float


class PinTable:
    """Pin counts and deadlines of pinned entries."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._pins: dict[Entry, _Pin] = {}
        self._deadlines: list[tuple[float, int, Entry]] = []
        self._sequence = itertools.count()

    def __contains__(self, entry: Entry) -> bool:
        return entry in self._pins

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def num_heap_items(self) -> int:
        """Deadline items held, stale ones included (at most about twice the pins)."""
        return len(self._deadlines)

    def pin(self, entry: Entry, ttl_s: float | None) -> bool:
        """Add one pin; the entry stays pinned until ``unpin`` or ``ttl_s`` seconds from now
        (the later deadline wins when pinned again). Returns True if it was not pinned before."""
        deadline = math.inf if ttl_s is None else self._clock() + ttl_s
        pin = self._pins.get(entry)
        if pin is None:
            self._pins[entry] = pin = _Pin(1, deadline)
        else:
            pin.count += 1
            if deadline <= pin.deadline_s:
                return False  # its heap item (if any) already stands for the later deadline
            pin.deadline_s = deadline
        if deadline != math.inf:
            heapq.heappush(self._deadlines, (deadline, next(self._sequence), entry))
            if len(self._deadlines) > 2 * len(self._pins) + _HEAP_SLACK:
                self._rebuild()
        return pin.count == 1

    def _rebuild(self) -> None:
        self._deadlines = [
            (pin.deadline_s, next(self._sequence), entry)
            for entry, pin in self._pins.items() if pin.deadline_s != math.inf
        ]
        heapq.heapify(self._deadlines)

    def unpin(self, entry: Entry) -> bool:
        """Drop one pin; returns True if the entry is no longer pinned."""
        pin = self._pins.get(entry)
        if pin is None:
            return False
        pin.count -= 1
        if pin.count > 0:
            return False
        del self._pins[entry]
        return True

    def num_affordable(self, run: Sequence[Entry], room: dict[Tier, int],
                       held_bytes: Callable[[Entry], dict[Tier, int]]) -> int:
        """How many leading entries of ``run`` a tenant may pin with ``room`` left of its
        guaranteed share in each tier (an entry pinned already costs nothing; ``held_bytes``:
        what an entry's copies take in each tier). ``room`` is charged for those."""
        charged: set[Entry] = set()  # (a key named twice is charged once)
        for num_pinned, entry in enumerate(run):
            if entry in self._pins or entry in charged:
                continue
            held = held_bytes(entry)
            if any(num_bytes > room[tier] for tier, num_bytes in held.items()):
                return num_pinned
            for tier, num_bytes in held.items():
                room[tier] -= num_bytes
            charged.add(entry)
        return len(run)

    def entries(self) -> list[Entry]:
        """Every pinned entry."""
        return list(self._pins)

    def forget(self, entry: Entry) -> None:
        """Drop every pin of an entry that is going away."""
        self._pins.pop(entry, None)

    def pop_expired(self) -> list[Entry]:
        """Entries whose pins all ran out; they are no longer pinned (link them back)."""
        now = self._clock()
        expired: list[Entry] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _deadline, _, entry = heapq.heappop(self._deadlines)
            pin = self._pins.get(entry)
            if pin is not None and pin.deadline_s <= now:
                del self._pins[entry]
                expired.append(entry)
        if len(self._deadlines) > 2 * len(self._pins) + _HEAP_SLACK:
            self._rebuild()  # unpinned and forgotten entries leave stale items behind
        return expired
