"""O(1) LRU with priority classes, one per tier: one ``Residency`` node per block resident in a
tier, linked into an intrusive list per priority class; insert, remove and touch are O(1), and
victims come from the LRU end of the lowest class first. Not thread-safe: the store's lock guards it.
Design: docs/design/eviction.md#the-lru
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from tierkv.config import Priority

T = TypeVar("T")


class Residency(Generic[T]):
    """A block's presence in one tier: its owner, its place there and its LRU links.

    ``owner`` is the block's entry in the store's books (None for a list's sentinel); ``location`` is
    tier-specific (pages for paged tiers, record size for DISK). ``prev`` and ``next`` are None while
    the node is unlinked.
    """

    __slots__ = ("location", "next", "owner", "prev")

    def __init__(self, owner: T, location: int | tuple[int, ...]) -> None:
        self.owner = owner
        self.location = location
        self.prev: Residency[T] | None = None
        self.next: Residency[T] | None = None

    @property
    def linked(self) -> bool:
        """Whether the node is in an LRU list."""
        return self.prev is not None


class PriorityLru(Generic[T]):
    """Per-tier LRU lists, one per ``Priority`` class."""

    def __init__(self) -> None:
        self._sentinels: list[Residency[T]] = []
        for _ in Priority:
            sentinel: Residency[T] = Residency(None, 0)  # type: ignore[arg-type]
            sentinel.prev = sentinel.next = sentinel
            self._sentinels.append(sentinel)
        self.num_linked = 0

    def push_mru(self, node: Residency[T], priority: int) -> None:
        """Link ``node`` as the most recently used of its class. It must be unlinked."""
        sentinel = self._sentinels[priority]
        last = sentinel.prev
        assert last is not None and node.prev is None
        node.prev = last
        node.next = sentinel
        last.next = node
        sentinel.prev = node
        self.num_linked += 1

    def remove(self, node: Residency[T]) -> None:
        """Unlink ``node`` if it is linked."""
        prev, nxt = node.prev, node.next
        if prev is None or nxt is None:
            return
        prev.next = nxt
        nxt.prev = prev
        node.prev = node.next = None
        self.num_linked -= 1

    def touch(self, node: Residency[T], priority: int) -> None:
        """Make a linked node the most recently used of its class; unlinked nodes stay so."""
        if node.prev is None:
            return
        self.remove(node)
        self.push_mru(node, priority)

    def iter_lru(self) -> Iterator[Residency[T]]:
        """Nodes from least to most recently used, lowest priority class first.

        The caller may unlink the node it was just given, but no other.
        """
        for sentinel in self._sentinels:
            node = sentinel.next
            while node is not sentinel:
                assert node is not None
                following = node.next
                yield node
                node = following
