"""The store's record of what becomes readable and what goes, per namespace and tier, for a
publisher of KV events (the sidecar's ``tierkv.service.events``). The store appends one tuple
a copy (no other work on the hot path; REMOTE's writer appends without the store's lock); the
publisher pops what is there and does the rest on its own thread. Bounded: past
``max_pending`` records a record is dropped, counted, and its namespace is marked lost, so that
the publisher restates that namespace in full (a resync) instead of leaving its subscribers
with a wrong index.

Contract: for each namespace, the records come in the order the store's state changed (a
``STORED`` after the copy is readable, a ``REMOVED`` once no reader can be given that copy), so
that a subscriber applying them in order holds exactly what the store holds.
Design: docs/design/events.md
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tierkv.store.tokens import BlockTokens

if TYPE_CHECKING:
    from tierkv.store.index import NamespaceState

REMOTE_TIER = 3
"""The REMOTE tier's code in records (``Tier`` names the local tiers 0-2)."""

STORED, REMOVED, CLEARED, SNAPSHOT = range(4)
"""Record kinds: a copy became readable; a copy went; every block of the namespace went; the
namespace's whole holding at one instant (a resync)."""


class StoredBlock(Protocol):
    """What a publisher reads of a block a record names (the store's index entry): its hash,
    its parent's, and its tokens (``tierkv.store.tokens``), fixed once set."""

    @property
    def block_hash(self) -> bytes: ...

    @property
    def parent(self) -> bytes | None: ...

    @property
    def tokens(self) -> BlockTokens | None: ...


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a namespace held at one instant: block hashes by tier code, and whether the
    publisher must add REMOTE's (read from the cluster when it reaches this record, so that
    every REMOTE change after it comes after it too)."""

    by_tier: Mapping[int, Sequence[StoredBlock]]
    with_remote: bool


EventRecord = tuple[int, int, "NamespaceState", object, "StoredBlock | None"]
"""``(kind, tier code, namespace, block hash | Snapshot | None, entry | None)``: a ``STORED``
or ``REMOVED`` record of a local tier names the block's entry, whose ``parent`` and ``tokens``
its event carries (fixed once set: the publisher reads them on its own thread)."""


class EventLog:
    """Records for one publisher (see the module docstring). Thread-safe: records go into a
    deque (its appends are atomic, so the hot path takes no lock) and ``take`` pops what is
    there; the store calls it with its own lock held, never the other way round. ``wake`` is
    set once ``wake_at`` records wait (the publisher then sends before its interval is up).
    ``max_pending`` bounds the waiting records, give or take a few appended at once."""

    def __init__(self, max_pending: int = 1_000_000, wake_at: int = 4096,
                 keep_tokens: bool = True) -> None:
        self.max_pending = max_pending
        self.wake_at = wake_at
        # Whether the store keeps the token ids writers give (with each block, in memory and
        # on disk) for these events: prompt content, kept only to be published.
        self.keep_tokens = keep_tokens
        self.num_dropped = 0
        self.wake = threading.Event()
        self._lock = threading.Lock()  # the lost namespaces' only
        self._records: deque[EventRecord] = deque()
        self._lost: dict[bytes, NamespaceState] = {}

    def stored(self, state: NamespaceState, tier: int, block_hash: bytes,
               entry: StoredBlock | None = None) -> None:
        """``block_hash``'s copy in ``tier`` is readable now (``entry``: its index entry, for
        its parent and tokens; None for a REMOTE copy)."""
        # Spelled out, as ``removed``: it runs for every copy linked.
        records = self._records
        size = len(records)
        if size >= self.max_pending:
            self._drop(state)
            return
        records.append((STORED, tier, state, block_hash, entry))
        if size + 1 == self.wake_at:
            self.wake.set()

    def removed(self, state: NamespaceState, tier: int, block_hash: bytes,
                entry: StoredBlock | None = None) -> None:
        """``block_hash``'s copy in ``tier`` is gone (no reader gets it any more; ``entry``: its
        index entry, for the order of removals, children first)."""
        records = self._records
        size = len(records)
        if size >= self.max_pending:
            self._drop(state)
            return
        records.append((REMOVED, tier, state, block_hash, entry))
        if size + 1 == self.wake_at:
            self.wake.set()

    def cleared(self, state: NamespaceState) -> None:
        """Every block of ``state`` goes (an operator's clear): what follows is what is left.
        Never dropped (the log may grow past ``max_pending`` by these)."""
        self._records.append((CLEARED, 0, state, None, None))

    def snapshot(self, state: NamespaceState, snapshot: Snapshot) -> None:
        """``state``'s whole holding now (taken under the store lock by the caller); never
        dropped."""
        self._records.append((SNAPSHOT, 0, state, snapshot, None))
        self.wake.set()

    def lose(self, states: Iterable[NamespaceState]) -> None:
        """Mark the namespaces of ``states`` lost (records of theirs taken and not published:
        the next ``take`` names them, to be restated)."""
        with self._lock:
            for state in states:
                self._lost[state.id] = state

    def _drop(self, state: NamespaceState) -> None:
        with self._lock:
            self.num_dropped += 1
            self._lost[state.id] = state

    def take(self) -> tuple[list[EventRecord], list[NamespaceState]]:
        """Everything recorded since the last call, in order, and the namespaces whose records
        were dropped since (their subscribers need a resync)."""
        self.wake.clear()
        with self._lock:
            lost, self._lost = list(self._lost.values()), {}
        records = self._records
        popleft = records.popleft
        return [popleft() for _ in range(len(records))], lost
