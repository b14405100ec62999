"""The eviction policy and the LRU it reads: O(1) lists with priority classes, one per tier.

One ``Residency`` node per block resident in a tier, linked into an intrusive list per priority
class; insert, remove and touch are O(1). ``EvictionPolicy.pick_victims`` chooses victims from
them (the LRU end of the lowest class first); the store marks, demotes and frees what it returns.
Not thread-safe: the store's lock guards it. Design: docs/design/eviction.md#the-lru
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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

    def push_before(self, node: Residency[T], anchor: Residency[T]) -> None:
        """Link ``node`` just less recently used than ``anchor``, a linked node of the same
        class (a block's descendants go there: evicted before it). ``node`` must be unlinked."""
        prev = anchor.prev
        assert prev is not None and node.prev is None
        node.prev = prev
        node.next = anchor
        prev.next = node
        anchor.prev = node
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
        # ``remove`` and ``push_mru`` inlined: this runs for every block read or written.
        prev, nxt = node.prev, node.next
        sentinel = self._sentinels[priority]
        if prev is None or nxt is None or nxt is sentinel:
            return
        prev.next = nxt
        nxt.prev = prev
        last = sentinel.prev
        assert last is not None
        node.prev = last
        node.next = sentinel
        last.next = node
        sentinel.prev = node

    def touch_before(self, node: Residency[T], priority: int,
                     anchor: Residency[T] | None) -> None:
        """``touch``, but just less recently used than ``anchor`` when it is a linked node of
        the same class (None, unlinked or the node itself: most recently used)."""
        if node.prev is None or node is anchor:
            return
        self.remove(node)
        if anchor is None or anchor.prev is None:
            self.push_mru(node, priority)
        else:
            self.push_before(node, anchor)

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


@dataclass(slots=True)
class Victims(Generic[T]):
    """What ``EvictionPolicy.pick_victims`` chose: ``owners`` freeing ``size`` (enough when
    ``size >= needed``), and of the nodes it walked past, the size held by readers now
    (``busy_size``: evictable once they finish) and the size of every node walked
    (``walked_size``: all linked nodes when it did not find enough)."""

    owners: list[T] = field(default_factory=list)
    size: int = 0
    busy_size: int = 0
    walked_size: int = 0


class EvictionPolicy:
    """Which blocks leave a tier to make room. The store calls ``pick_victims`` with its lock
    held, once per reservation that does not fit; subclass and override it to change the policy
    (as ``cachetools`` caches override ``popitem``). It must be pure: read the nodes, change
    nothing. Pinned blocks are never offered (they are unlinked while pinned)."""

    def pick_victims(
        self,
        lru: PriorityLru[T],
        needed: int,
        size_of: Callable[[Residency[T]], int],
        excluded: Callable[[T], bool],
        busy: Callable[[T], bool],
    ) -> Victims[T]:
        """Owners worth at least ``needed`` (in ``size_of`` units) in LRU order, lowest priority
        class first, passing over ``excluded`` owners (a put's own chain, blocks whose demotion
        failed lately) and ``busy`` ones (being read or copied); fewer when the tier holds
        less. O(victims + nodes passed over)."""
        victims: Victims[T] = Victims()
        for node in lru.iter_lru():
            num = size_of(node)
            victims.walked_size += num
            owner = node.owner
            if excluded(owner):
                continue
            if busy(owner):
                victims.busy_size += num
                continue
            victims.owners.append(owner)
            victims.size += num
            if victims.size >= needed:
                break
        return victims
