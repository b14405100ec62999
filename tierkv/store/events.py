"""The store's record of what becomes readable and what goes, per namespace and tier, for a
publisher of KV events (the sidecar's ``tierkv.service.events``). The store appends under its
own lock (one tuple a block, no other work on the hot path); the publisher takes what is there
in one swap and does the rest on its own thread. Bounded: past ``max_pending`` records a record
is dropped, counted, and its namespace is marked lost, so that the publisher restates that
namespace in full (a resync) instead of leaving its subscribers with a wrong index.

Contract: for each namespace, the records come in the order the store's state changed (a
``STORED`` after the copy is readable, a ``REMOVED`` once no reader can be given that copy), so
that a subscriber applying them in order holds exactly what the store holds.
Design: docs/design/events.md
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierkv.types import PutDetail

if TYPE_CHECKING:
    from tierkv.store.index import NamespaceState

REMOTE_TIER = 3
"""The REMOTE tier's code in records (``Tier`` names the local tiers 0-2)."""

STORED, REMOVED, CLEARED, SNAPSHOT = range(4)
"""Record kinds: a copy became readable; a copy went; every block of the namespace went; the
namespace's whole holding at one instant (a resync)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a namespace held at one instant: block hashes by tier code, and whether the
    publisher must add REMOTE's (read from the cluster when it reaches this record, so that
    every REMOTE change after it comes after it too)."""

    by_tier: dict[int, list[bytes]]
    with_remote: bool


BlockDetail = tuple[PutDetail, int, "bytes | None"]
"""What a put's writer said of one block: its put's ``PutDetail``, its index in that put, and
its parent's hash (the put's previous block's, or the detail's ``parent_hash`` for the first)."""

EventRecord = tuple[int, int, "NamespaceState", object, "BlockDetail | None"]
"""``(kind, tier code, namespace, block hash | Snapshot | None, BlockDetail | None)``."""


class EventLog:
    """Records for one publisher (see the module docstring). Thread-safe; the store calls it
    with its own lock held, never the other way round. ``wake`` is set once ``wake_at``
    records wait (the publisher then sends before its interval is up)."""

    def __init__(self, max_pending: int = 1_000_000, wake_at: int = 4096) -> None:
        self.max_pending = max_pending
        self.wake_at = wake_at
        self.num_recorded = 0
        self.num_dropped = 0
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._records: list[EventRecord] = []
        self._lost: dict[bytes, NamespaceState] = {}

    def stored(self, state: NamespaceState, tier: int, block_hash: bytes,
               detail: BlockDetail | None = None) -> None:
        """``block_hash``'s copy in ``tier`` is readable now (``detail``: what its writer said
        of it)."""
        self._add((STORED, tier, state, block_hash, detail))

    def removed(self, state: NamespaceState, tier: int, block_hash: bytes) -> None:
        """``block_hash``'s copy in ``tier`` is gone (no reader gets it any more)."""
        self._add((REMOVED, tier, state, block_hash, None))

    def cleared(self, state: NamespaceState) -> None:
        """Every block of ``state`` goes (an operator's clear): what follows is what is left."""
        self._add((CLEARED, 0, state, None, None))

    def snapshot(self, state: NamespaceState, snapshot: Snapshot) -> None:
        """``state``'s whole holding now (taken under the store lock by the caller)."""
        self._add((SNAPSHOT, 0, state, snapshot, None), bounded=False)

    def _add(self, record: EventRecord, bounded: bool = True) -> None:
        with self._lock:
            if bounded and len(self._records) >= self.max_pending:
                self.num_dropped += 1
                self._lost[record[2].id] = record[2]
                return
            self._records.append(record)
            self.num_recorded += 1
            if len(self._records) >= self.wake_at:
                self.wake.set()

    def take(self) -> tuple[list[EventRecord], list[NamespaceState]]:
        """Everything recorded since the last call, in order, and the namespaces whose records
        were dropped since (their subscribers need a resync)."""
        with self._lock:
            records, self._records = self._records, []
            lost, self._lost = list(self._lost.values()), {}
            self.wake.clear()
        return records, lost

    @property
    def num_pending(self) -> int:
        """Records waiting for the publisher."""
        with self._lock:
            return len(self._records)
