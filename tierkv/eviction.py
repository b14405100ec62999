"""The eviction policies and the lists they read: O(1) lists with priority classes, one set per
tenant in each tier.

One ``Residency`` node per block resident in a tier, linked into an intrusive list per priority
class; insert, remove and touch are O(1). ``EvictionPolicy.pick_tier_victims`` chooses a tier's
victims for one tenant's write: which tenants give up blocks (``ask_tenants``: caps, guaranteed
shares, borrowing, turns) and, within each, which blocks (``pick_victims``: the LRU end of the
lowest class first); the store gathers the books under its lock and marks, demotes and frees
what it returns. ``TinyLfuEviction`` (``--eviction adaptive``) reads two segments of the lists,
a small window for new copies and the main lists, and lets a copy from the window into main by
frequency (``tierkv.admission``). The policies see the store's books only through ``Share``,
``Book`` and ``Blocks``, so plain objects stand in for them. Not thread-safe: the store's lock
guards them.
Design: docs/design/eviction.md#the-lru, #the-adaptive-policy, docs/design/tenants.md
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

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
    """What ``EvictionPolicy.pick_victims`` chose in one list (or ``pick_tier_victims`` in a
    tier, summed over the lists it asked): ``owners`` freeing ``size`` (enough when
    ``size >= needed``), and of the nodes it walked past, the size held by readers now
    (``busy_size``: evictable once they finish) and the size of every node walked
    (``walked_size``: all linked nodes when it did not find enough). ``admitted``: window nodes
    the adaptive policy lets into main (``pick_victims`` only: ``pick_tier_victims`` moves them
    through ``Blocks.admit`` once each list's pick is done)."""

    owners: list[T] = field(default_factory=list)
    size: int = 0
    busy_size: int = 0
    walked_size: int = 0
    admitted: list[Residency[T]] = field(default_factory=list)


class Share(Protocol[T]):
    """One tenant's share of one tier, as a pick reads it (``tierkv.store.tenants.TenantShare``
    in the store): its lists and, in the tier's bytes, what it is guaranteed
    (``share_bytes``), may hold at most (``cap_bytes``), holds (``used_bytes``) and, of that,
    what victims picked earlier and not dropped yet hold (``leaving_bytes``)."""

    @property
    def tenant(self) -> str: ...
    @property
    def lru(self) -> PriorityLru[T]: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def leaving_bytes(self) -> int: ...
    @property
    def share_bytes(self) -> int: ...
    @property
    def cap_bytes(self) -> int: ...


class Book(Protocol[T]):
    """Every tenant's share of one tier, as a pick reads it (``tierkv.store.tenants.ShareBook``
    in the store): the tier's unit (a page, or 1 on DISK) and the tenants over their share
    now, oldest turn first."""

    @property
    def unit_bytes(self) -> int: ...
    @property
    def over(self) -> Mapping[str, Share[T]]: ...

    def turn(self, tenant: str) -> None:
        """``tenant`` gave up blocks: the next victims come from the tenants after it."""


class Blocks(Protocol[T]):
    """What a pick asks of the blocks of one tier (the store's books answer for its entries)."""

    def size_of(self, node: Residency[T]) -> int:
        """The size of a copy, in the units of the pick (pages, or record bytes)."""

    def node_of(self, owner: T) -> Residency[T]:
        """``owner``'s copy in the tier."""

    def busy(self, owner: T) -> bool:
        """Whether a reader holds ``owner`` now (it may not go until the reader is done)."""

    def admit(self, lru: PriorityLru[T], node: Residency[T]) -> None:
        """Let a window copy the adaptive policy admitted into main (``PriorityLru.admit``;
        the store lets its chain's window ancestors in with it)."""

    def key(self, owner: T) -> Hashable:
        """What names ``owner`` in its chain (a block hash)."""

    def parent(self, owner: T) -> Hashable | None:
        """The ``key`` of the block ``owner`` continues (None: it starts its chain)."""

    def held_children(self, owner: T) -> int:
        """How many held blocks continue ``owner``, if its copy in this tier is its last (0
        if it has one in a tier above)."""


class EvictionPolicy:
    """Which blocks leave a tier to make room. The store calls ``pick_tier_victims`` with its
    lock held, once per reservation that does not fit: tenants give up blocks in the order
    ``ask_tenants`` asks them (caps, guaranteed shares, borrowing, turns), each from its lists in
    the order ``pick_victims`` walks them (LRU, lowest priority class first). Subclass and
    override one of the two to change the policy (as ``cachetools`` caches override
    ``popitem``), and pass it to ``TieredStore(eviction=...)``. ``pick_victims`` must be pure:
    read the nodes, change nothing. Pinned blocks are never offered (they are unlinked while
    pinned)."""

    def pick_tier_victims(
        self,
        book: Book[T],
        requester: Share[T],
        needed: int,
        free: int,
        blocks: Blocks[T],
        excluded: Callable[[T], bool],
        spare: frozenset[T] = frozenset(),
        last_copies: bool = False,
    ) -> tuple[Victims[T], int]:
        """Victims that make room for ``needed`` units held by ``requester``'s tenant in a tier
        with ``free`` units free, and how many units are still missing with them (0: enough), as
        ``ask_tenants`` takes them; never ``excluded`` owners (a put's own chain, blocks whose
        demotion failed lately). With ``last_copies`` (the lowest tier, where a victim's copy is
        its last), first without the blocks whose children are held (a block is not evicted
        before its descendants: docs/design/eviction.md#chains) and without ``spare`` (the
        blocks a put continues: its children are on their way), then, were that not enough,
        with them. Admitted window copies are moved through ``blocks.admit`` and turns through
        ``book.turn`` as the pick goes; nothing else is changed."""
        if not last_copies:
            return self._pick_in_turn(book, requester, needed, free, blocks, excluded)
        # Children taken by this pick, by their parent's key: the walk meets a chain's tail
        # before its parent (tail first), so the parent goes next, as with no children. A block
        # neither excluded nor busy is taken at once (``pick_victims``' order; a policy that
        # orders otherwise only makes this rule spare less).
        taken: dict[Hashable, int] = {}

        def spared(owner: T) -> bool:
            if excluded(owner) or owner in spare:
                return True
            if blocks.held_children(owner) > taken.get(blocks.key(owner), 0):
                return True  # it leads on to held blocks
            parent = blocks.parent(owner)
            if parent is not None and not blocks.busy(owner):  # the picker takes it now
                taken[parent] = taken.get(parent, 0) + 1
            return False

        picked, missing = self._pick_in_turn(book, requester, needed, free, blocks, spared)
        if missing:
            picked, missing = self._pick_in_turn(book, requester, needed, free, blocks, excluded)
        return picked, missing

    def _pick_in_turn(
        self, book: Book[T], requester: Share[T], needed: int, free: int, blocks: Blocks[T],
        excluded: Callable[[T], bool],
    ) -> tuple[Victims[T], int]:
        pick = TierPick(self, book, requester, needed, free, blocks, excluded)
        missing = self.ask_tenants(pick)
        return pick.victims, missing

    def ask_tenants(self, pick: TierPick[T]) -> int:
        """Take ``pick``'s victims tenant by tenant; how many units are still missing. Override
        it to change who gives up blocks. This one takes, in this order (docs/design/tenants.md,
        2):

        1. the requester's own blocks, as many as its cap asks for;
        2. for room still missing, up to what it is guaranteed and does not hold yet: blocks of
           the tenants over their share, from each in turn, never below its share;
        3. then its own blocks (it is at or past its share: it pays with its own room);
        4. then, its own being pinned or in use, other tenants' blocks beyond their share.

        So a tenant at or under its share never loses a block to another's write."""
        share, unit = pick.requester, pick.unit
        everything = (share.used_bytes - share.leaving_bytes) // unit
        over_cap = -(-(share.used_bytes + pick.needed * unit - share.cap_bytes) // unit)
        if over_cap > 0:
            own = pick.take(share, over_cap, everything)
            if own < over_cap:
                return over_cap - own
        missing = pick.needed - pick.free - pick.victims.size
        if missing > 0:
            missing -= pick.from_others(min(missing, (share.share_bytes - share.used_bytes) // unit))
        if missing > 0:
            missing -= pick.take(share, missing, everything)
        if missing > 0:
            missing -= pick.from_others(missing)
        return max(0, missing)

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


class TierPick(Generic[T]):
    """One ``pick_tier_victims`` under way: victims in one tier for a write of ``requester``'s
    tenant that needs ``needed`` units with ``free`` free (``unit``: the bytes of one), chosen
    so far (``victims``). ``ask_tenants`` makes its moves, ``take`` and ``from_others``; each
    takes from a tenant's lists in its policy's ``pick_victims`` order, and never takes a
    victim twice."""

    def __init__(self, policy: EvictionPolicy, book: Book[T], requester: Share[T], needed: int,
                 free: int, blocks: Blocks[T], excluded: Callable[[T], bool]) -> None:
        self.requester = requester
        self.needed = needed
        self.free = free
        self.unit = book.unit_bytes
        self.victims: Victims[T] = Victims()
        self._policy = policy
        self._book = book
        self._blocks = blocks
        self._excluded = excluded
        self._chosen: set[T] = set()
        self._taken: dict[str, int] = {}  # units taken from each tenant

    def take(self, owner: Share[T], units: int, limit: int) -> int:
        """Up to ``units`` of ``owner``'s blocks, never more than ``limit`` units from it in this
        pick (what was taken from it before counts); how many units it took."""
        limit -= self._taken.get(owner.tenant, 0)
        if units <= 0 or limit <= 0:
            return 0
        blocks = self._blocks
        got = self._policy.pick_victims(owner.lru, min(units, limit), blocks.size_of,
                                        self._passed_over, blocks.busy)
        for admitted in got.admitted:  # the adaptive policy's window copies let into main
            blocks.admit(owner.lru, admitted)
        victims = self.victims
        size = 0
        for victim in got.owners:
            num = blocks.size_of(blocks.node_of(victim))
            if size + num > limit:
                break  # never below its share
            size += num
            self._chosen.add(victim)
            victims.owners.append(victim)
        victims.size += size
        victims.busy_size += got.busy_size
        victims.walked_size += got.walked_size
        self._taken[owner.tenant] = self._taken.get(owner.tenant, 0) + size
        return size

    def from_others(self, units: int) -> int:
        """Up to ``units`` of the blocks of the tenants over their share but the requester,
        oldest turn first, each never below its share (it gives at most its excess less what is
        leaving it already); a tenant that gave goes to the end of the turns. How many units it
        took."""
        # O(1) a tenant visited: the set, which may hold every tenant, is not copied.
        got = 0
        gave: list[str] = []
        for other in self._book.over.values():
            if got >= units:
                break
            if other is not self.requester:
                spare_bytes = other.used_bytes - other.leaving_bytes - other.share_bytes
                from_other = self.take(other, units - got, spare_bytes // self.unit)
                if from_other:
                    got += from_other
                    gave.append(other.tenant)
        for tenant in gave:
            self._book.turn(tenant)
        return got

    def _passed_over(self, owner: T) -> bool:
        return owner in self._chosen or self._excluded(owner)


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
