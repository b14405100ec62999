"""The eviction policies and the lists they read: O(1) lists with priority classes, one set per
tenant in each tier.

One ``Residency`` node per block resident in a tier, linked into an intrusive list per priority
class; insert, remove and touch are O(1). ``EvictionPolicy.pick_victims`` chooses victims from
them (the LRU end of the lowest class first); the store marks, demotes and frees what it returns.
``TinyLfuEviction`` (``--eviction adaptive``) reads two segments of the lists, a small window
for new copies and the main lists, and lets a copy from the window into main by frequency
(``tierkv.admission``). Not thread-safe: the store's lock guards them.
Design: docs/design/eviction.md#the-lru, #the-adaptive-policy
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tierkv.admission import Admission, window_room
from tierkv.config import Priority

T = TypeVar("T")

MAIN, WINDOW = 0, 1
"""The segments of a ``PriorityLru``: every copy is in main unless the list is windowed."""


class Residency(Generic[T]):
    """A block's presence in one tier: its owner, its place there and its LRU links.

    ``owner`` is the block's entry in the store's books (None for a list's sentinel); ``location`` is
    tier-specific (pages for paged tiers, record size for DISK). ``prev`` and ``next`` are None while
    the node is unlinked; ``segment`` and ``priority`` name the segment (``MAIN`` or
    ``WINDOW``) and the class it was last linked in.
    """

    __slots__ = ("location", "next", "owner", "prev", "priority", "segment")

    def __init__(self, owner: T, location: int | tuple[int, ...]) -> None:
        self.owner = owner
        self.location = location
        self.prev: Residency[T] | None = None
        self.next: Residency[T] | None = None
        self.segment = MAIN
        self.priority = 0

    @property
    def linked(self) -> bool:
        """Whether the node is in an LRU list."""
        return self.prev is not None


class PriorityLru(Generic[T]):
    """One tenant's LRU lists in one tier, one per ``Priority`` class; with an ``admission``
    (the adaptive policy), two segments of them: new copies enter the window, and only the
    policy moves them to main (``admit``). A node is touched within its own segment."""

    def __init__(self, admission: Admission[T] | None = None) -> None:
        self._sentinels: tuple[list[Residency[T]], list[Residency[T]]] = ([], [])
        for segment in (MAIN, WINDOW):
            for _ in Priority:
                sentinel: Residency[T] = Residency(None, 0)  # type: ignore[arg-type]
                sentinel.prev = sentinel.next = sentinel
                self._sentinels[segment].append(sentinel)
        self.admission = admission
        self._new = MAIN if admission is None else WINDOW  # where new copies go
        self.num_linked = 0
        self.num_window = 0

    @property
    def window_target(self) -> int:
        """How many nodes the window holds before its oldest must leave it (1 % of the linked
        nodes, at least one)."""
        return window_room(self.num_linked)

    def push_mru(self, node: Residency[T], priority: int, main: bool = False) -> None:
        """Link ``node`` as the most recently used of its class: in the window, if the list
        has one, unless ``main`` (a tier with room to spare: W-TinyLFU's main has room then).
        It must be unlinked."""
        segment = MAIN if main else self._new
        sentinel = self._sentinels[segment][priority]
        last = sentinel.prev
        assert last is not None and node.prev is None
        node.segment = segment
        node.priority = priority
        node.prev = last
        node.next = sentinel
        last.next = node
        sentinel.prev = node
        self.num_linked += 1
        self.num_window += segment

    def push_before(self, node: Residency[T], anchor: Residency[T], main: bool = False) -> None:
        """Link ``node`` just less recently used than ``anchor``, a linked node of the same
        class (a block's descendants go there: evicted before it); with a window, only if
        ``anchor`` is in it or ``main`` allows main (else ``push_mru``: nothing enters main but
        by the policy or with room to spare). ``node`` must be unlinked."""
        segment = anchor.segment
        if segment != self._new and not main:
            self.push_mru(node, anchor.priority)
            return
        prev = anchor.prev
        assert prev is not None and node.prev is None
        node.segment = segment
        node.priority = anchor.priority
        node.prev = prev
        node.next = anchor
        prev.next = node
        anchor.prev = node
        self.num_linked += 1
        self.num_window += segment

    def remove(self, node: Residency[T]) -> None:
        """Unlink ``node`` if it is linked."""
        prev, nxt = node.prev, node.next
        if prev is None or nxt is None:
            return
        prev.next = nxt
        nxt.prev = prev
        node.prev = node.next = None
        self.num_linked -= 1
        self.num_window -= node.segment

    def touch(self, node: Residency[T], priority: int) -> None:
        """Make a linked node the most recently used of its class in its segment; unlinked
        nodes stay so."""
        # ``remove`` and ``push_mru`` inlined: this runs for every block read or written.
        prev, nxt = node.prev, node.next
        sentinel = self._sentinels[node.segment][priority]
        if prev is None or nxt is None or nxt is sentinel:
            return
        prev.next = nxt
        nxt.prev = prev
        last = sentinel.prev
        assert last is not None
        node.priority = priority
        node.prev = last
        node.next = sentinel
        last.next = node
        sentinel.prev = node

    def touch_before(self, node: Residency[T], priority: int,
                     anchor: Residency[T] | None) -> None:
        """``touch``, but just less recently used than ``anchor`` when it is a linked node of
        the same class and segment (None, unlinked or the node itself: most recently used)."""
        if node.prev is None or node is anchor:
            return
        if anchor is None or anchor.prev is None or anchor.segment != node.segment:
            self.touch(node, priority)
            return
        self.remove(node)
        self.push_before(node, anchor, main=True)  # in the anchor's segment, whichever

    def admit(self, node: Residency[T]) -> None:
        """Move a linked window node to main, as the most recently used of its class there."""
        if node.prev is None or node.segment != WINDOW:
            return
        self.remove(node)
        self.push_mru(node, node.priority, main=True)

    def iter_lru(self) -> Iterator[Residency[T]]:
        """Nodes from least to most recently used, lowest priority class first (in each class,
        the window's before main's).

        The caller may unlink the node it was just given, but no other.
        """
        for priority in Priority:
            yield from self.iter_segment(WINDOW, priority)
            yield from self.iter_segment(MAIN, priority)

    def iter_segment(self, segment: int, priority: int) -> Iterator[Residency[T]]:
        """One class of one segment, least recently used first (``iter_lru``'s contract)."""
        sentinel = self._sentinels[segment][priority]
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
    (``walked_size``: all linked nodes when it did not find enough). ``admitted``: window nodes
    the adaptive policy lets into main (the store moves them, ``PriorityLru.admit``, once the
    pick is done)."""

    owners: list[T] = field(default_factory=list)
    size: int = 0
    busy_size: int = 0
    walked_size: int = 0
    admitted: list[Residency[T]] = field(default_factory=list)


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


class TinyLfuEviction(EvictionPolicy):
    """W-TinyLFU (Einziger et al., 2017) over a windowed ``PriorityLru``, class by class, lowest
    first: while the window holds more than its target, its oldest copy (the candidate) meets
    main's oldest (the victim), and the one used less often lately leaves; with the filter off
    (the tier's miniatures found it worse), the candidate always enters main and the victim
    leaves: an LRU in two segments. A candidate with no victim to meet enters main; one that
    lost but may not leave stays in the window (the store lets a block's window ancestors into
    main with it, so such a block's children are in the window, older, and decided first).
    Then, room still wanted, main's oldest leave (admitted candidates last), or the window's
    when main has none. A list without an admission is picked as ``EvictionPolicy`` does.
    ``excluded`` is asked only of a copy about to be taken, which is taken unless excluded (the
    store's held-children rule counts on it); busy copies are passed over. O(victims + nodes
    passed over + candidates admitted)."""

    def pick_victims(
        self,
        lru: PriorityLru[T],
        needed: int,
        size_of: Callable[[Residency[T]], int],
        excluded: Callable[[T], bool],
        busy: Callable[[T], bool],
    ) -> Victims[T]:
        admission = lru.admission
        if admission is None:
            return super().pick_victims(lru, needed, size_of, excluded, busy)
        victims: Victims[T] = Victims()
        over = lru.num_window - lru.window_target  # window copies beyond its target

        def idle(nodes: Iterator[Residency[T]]) -> Residency[T] | None:
            for node in nodes:
                num = size_of(node)
                victims.walked_size += num
                if busy(node.owner):
                    victims.busy_size += num
                    continue
                return node
            return None

        def take(node: Residency[T]) -> bool:
            if excluded(node.owner):
                return False
            victims.owners.append(node.owner)
            victims.size += size_of(node)
            return True

        for priority in Priority:
            window = lru.iter_segment(WINDOW, priority)
            admitted: list[Residency[T]] = []  # this class's, main's newest once moved
            main = _MainOrder(lru.iter_segment(MAIN, priority), admitted)
            candidate, victim = idle(window), idle(main)
            while victims.size < needed and over > 0 and candidate is not None:
                if victim is None:  # nothing to meet in main: it enters
                    admitted.append(candidate)
                    victim = idle(main)
                elif not admission.on or (
                        admission.estimate(candidate.owner) > admission.estimate(victim.owner)):
                    if not take(victim):  # main's victim may not go: meet the next one
                        victim = idle(main)
                        continue
                    admitted.append(candidate)  # it enters, the victim leaves
                    victim = idle(main)
                else:
                    take(candidate)  # it lost: it leaves, or, excluded, stays in the window
                over -= 1
                candidate = idle(window)
            while victims.size < needed and (victim is not None or candidate is not None):
                if victim is not None:
                    take(victim)
                    victim = idle(main)
                else:
                    assert candidate is not None
                    take(candidate)
                    candidate = idle(window)
            victims.admitted += admitted
            if victims.size >= needed:
                break
        return victims


class _MainOrder(Iterator[Residency[T]]):
    """Main's nodes in eviction order as a pick sees them: the linked ones, least recently used
    first, then the candidates the pick admitted, in order (they will be main's newest). Never
    exhausted for good: a candidate admitted later is met next."""

    def __init__(self, linked: Iterator[Residency[T]], admitted: list[Residency[T]]) -> None:
        self._linked: Iterator[Residency[T]] | None = linked
        self._admitted = admitted
        self._next_admitted = 0

    def __next__(self) -> Residency[T]:
        if self._linked is not None:
            node = next(self._linked, None)
            if node is not None:
                return node
            self._linked = None
        if self._next_admitted < len(self._admitted):
            self._next_admitted += 1
            return self._admitted[self._next_admitted - 1]
        raise StopIteration
