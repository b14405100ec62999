"""The store's lock and books: namespaces, per-tier ledgers, pins, busy marks, the eviction policy
and the queue of disk writes. Methods ending in ``_locked`` need ``core.lock`` held; the others
take it. Copies mark what they read busy (``mark_busy_locked``/``release_busy_locked``, or a
``busy()`` scope); nothing else changes ``Entry.readers``. Moving bytes is ``Mover``'s job.
Design: docs/design/eviction.md, docs/design/data-path.md#the-write-path
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tierkv.admission import Admission, count_uses
from tierkv.buffers import BufferPool
from tierkv.config import Eviction, StoreConfig, TenantShares, Tier, WritePolicy
from tierkv.copy_engine import CopyEngine
from tierkv.errors import CapacityError, ConfigError, TierKVError
from tierkv.eviction import (
    WINDOW,
    EvictionPolicy,
    PriorityLru,
    Residency,
    TinyLfuEviction,
    Victims,
)
from tierkv.frequency import FrequencySketch
from tierkv.paging import Location, location_num_pages
from tierkv.shm.presence import Fingerprinter, PresenceTable
from tierkv.store.events import EventLog, Snapshot
from tierkv.store.index import DOOMED, DiskLedger, Entry, Ledger, NamespaceState, PagedLedger, is_busy
from tierkv.store.pins import PinTable
from tierkv.store.tenants import TenantShare
from tierkv.tiers.disk import DiskTier, DiskWrite

if TYPE_CHECKING:
    import torch
from tierkv.types import RemoteStats

log = logging.getLogger(__name__)


SizeOf = Callable[[Residency[Entry]], int]
"""A copy's size in its tier's units (pages, or record bytes)."""


def _record_bytes(node: Residency[Entry]) -> int:
    return node.owner.ns.record_bytes



class _TierBlocks:
    """The blocks of one tier as the eviction policy asks about them (``tierkv.eviction.Blocks``;
    made for each pick, with the lock held)."""

    __slots__ = ("_core", "size_of", "tier")
    busy = staticmethod(is_busy)

    def __init__(self, core: StoreCore, tier: Tier, size_of: SizeOf) -> None:
        self._core = core
        self.tier = tier
        self.size_of = size_of

    def node_of(self, owner: Entry) -> Residency[Entry]:
        node = owner.residency(self.tier)
        assert node is not None
        return node

    def admit(self, lru: PriorityLru[Entry], node: Residency[Entry]) -> None:
        self._core.admit_locked(lru, node, self.tier)

    @staticmethod
    def key(owner: Entry) -> bytes:
        return owner.block_hash

    @staticmethod
    def parent(owner: Entry) -> bytes | None:
        return owner.parent

    def held_children(self, owner: Entry) -> int:
        return owner.num_children if owner.top_tier() is self.tier else 0


class Spill(Protocol):
    """The tier below the lowest local one (REMOTE; its one implementation is
    ``tierkv.store.remote.RemoteLink``), as the store calls it: records go down without
    blocking (write-through, and the lowest local tier's evictions), the miss path fetches back
    into HOST, and a delete or clear forgets."""

    record_buffers: BufferPool
    """Buffers of records it has sent and nothing else reads, for the next records."""

    def offer(self, records: Sequence[tuple[bytes, bytes | bytearray]]) -> object:
        """Queue ``(raw key, record)`` pairs of write-through blocks."""

    def offer_demoted(self, records: Sequence[tuple[bytes, bytes | bytearray, float]]) -> None:
        """Queue records of DISK's victims, each with when it was evicted."""

    def demote(self, entries: list[Entry]) -> None:
        """Without a disk tier: HOST's busy-marked victims, about to be dropped."""

    def fetch(self, state: NamespaceState, keys: Sequence[bytes]) -> int:
        """The miss path: bring the blocks of ``keys``' leading run that only this tier holds
        into HOST, verified; how many it brought."""

    def lookup_suffix(self, state: NamespaceState, keys: Sequence[bytes], num_local: int) -> int:
        """How many leading ``keys`` are held locally or here, the first ``num_local`` being
        held locally."""

    def forgetting(self, raw_keys: Sequence[bytes] = (), namespace_ids: Sequence[bytes] = ()
                   ) -> AbstractContextManager[None]:
        """Around a delete's or a clear's doom of the local copies: this tier's copies go too,
        and nothing in flight brings them back."""

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until what was offered so far has been sent; False on timeout."""

    def publish(self, state: NamespaceState, keys: Sequence[bytes], timeout_s: float,
                read: Callable[[list[bytes]], torch.Tensor]) -> int:
        """Send the local copies (``read``: the leading ones of the keys given, verified) of
        the blocks of ``keys`` this tier lacks, and wait up to ``timeout_s``: how many leading
        ``keys`` this tier then holds."""

    def hashes_in(self, namespace_id: bytes) -> list[bytes]:
        """The block hashes it holds under ``namespace_id`` now (a scan: O(its keys))."""

    def stats(self) -> RemoteStats:
        """Its figures."""

    def close(self) -> None:
        """Send what is queued (briefly), then stop."""


class BusyMarks:
    """The entries one ``StoreCore.busy`` scope marked busy (released at its end)."""

    __slots__ = ("_core", "entries")

    def __init__(self, core: StoreCore) -> None:
        self._core = core
        self.entries: list[Entry] = []

    def add_locked(self, entry: Entry) -> None:
        """Mark ``entry`` busy until the scope ends (the store lock held)."""
        self._core.mark_busy_locked(entry)
        self.entries.append(entry)


@dataclass(eq=False)
class GlobalCounters:
    """Store-wide counters (reported by ``stats``)."""

    promotions: int = 0
    demotions: int = 0
    failed_demotions: int = 0
    checksum_failures: int = 0
    puts: int = 0
    gets: int = 0
    # Payload bytes copied by promotions and demotions, by (source tier, destination tier).
    bytes_moved: dict[tuple[Tier, Tier], int] = field(default_factory=dict)
    # Leases ended because their deadline passed (or their client was gone), since start.
    leases_expired: int = 0


@dataclass(slots=True)
class TenantCounters:
    """One tenant's part of ``GlobalCounters.puts``, ``gets`` and ``checksum_failures`` (of
    its own blocks; its other figures are kept per tier, in its ``TenantShare``s)."""

    puts: int = 0
    gets: int = 0
    checksum_failures: int = 0


class StoreCore:
    """The lock and the books: namespaces, per-tier ledgers, pins, busy marks, the eviction
    policy and the queue of disk writes (moving bytes between tiers is ``Mover``'s job)."""

    def __init__(
        self,
        config: StoreConfig,
        paged: dict[Tier, PagedLedger],
        disk: DiskTier | None,
        clock: Callable[[], float],
        presence: PresenceTable | None = None,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        self.config = config
        self.tenants = config.tenants  # the shares in force (a reload replaces them)
        adaptive = config.eviction is Eviction.ADAPTIVE
        self.eviction = eviction or (TinyLfuEviction() if adaptive else EvictionPolicy())
        self.lock = threading.Lock()
        # Notified whenever room may have been freed (a reader finished, pages were released).
        self.changed = threading.Condition(self.lock)
        self.namespaces: dict[bytes, NamespaceState] = {}
        self.paged = paged
        self.disk = disk
        self.disk_ledger = (DiskLedger(disk.config.capacity_bytes, config.tenants)
                            if disk is not None else None)
        self.ledgers: dict[Tier, Ledger] = dict(paged)
        if self.disk_ledger is not None:
            self.ledgers[Tier.DISK] = self.disk_ledger
        # The adaptive policy's books: how often blocks were used lately (one sketch: a use is
        # a block's, wherever it was served) and each tier's filter (``use_locked`` feeds them).
        self.sketch: FrequencySketch | None = None
        self.admissions: list[Admission[Entry]] = []
        if adaptive:
            # Wide enough for the most blocks a tier could hold (a page each; 16 KiB records on
            # DISK); halved every ten times what memory holds (``use_locked`` keeps it so).
            self.sketch = FrequencySketch(min(1 << 22, max(
                4096, *(_room_in_blocks(ledger) for ledger in self.ledgers.values()))))
            self.sketch.reset_uses = self._reset_uses_locked()
            for ledger in self.ledgers.values():
                admission: Admission[Entry] = Admission(
                    self.sketch, _key_of, functools.partial(_room_in_blocks, ledger))
                ledger.shares.use_admission(admission)
                self.admissions.append(admission)
        self.pins = PinTable(clock)
        self.presence = presence
        self.engine = CopyEngine()
        self.counters = GlobalCounters()
        self.tenant_counters: dict[str, TenantCounters] = {}  # by tenant: ``counters_of_locked``
        # Entries whose demotion out of their paged tier failed, and when it last did (counted
        # once, in ``failed_demotions``); docs/design/eviction.md (moves, 4) says what becomes of
        # them. An entry leaves it with that tier's copy, or when it gets a copy below.
        self.undemotable: dict[Entry, float] = {}
        self.clock = clock
        self._pending_deletes: list[bytes] = []
        # The tier past the lowest local one (REMOTE), if any: ``attach_spill``.
        self.spill: Spill | None = None
        self._pending_takes: list[tuple[bytes, float]] = []  # DISK victims: (raw key, evicted at)
        # Where copies that become readable or go are recorded for KV events, if anywhere (set
        # by ``TieredStore`` after recovery, whose blocks a publisher restates at its start).
        self.events: EventLog | None = None

    def snapshot_events_locked(self, state: NamespaceState) -> None:
        """Record ``state``'s whole holding now for the publisher (a resync of its topic)."""
        assert self.events is not None
        self.events.snapshot(state, Snapshot(self.holding_locked(state), self.spill is not None))

    def holding_locked(self, state: NamespaceState) -> dict[int, list[Entry]]:
        """``state``'s entries with a copy in each local tier, by tier."""
        by_tier: dict[int, list[Entry]] = {tier: [] for tier in self.ledgers}
        for entry in state.blocks.values():
            if entry.gpu is not None:
                by_tier[Tier.GPU].append(entry)
            if entry.host is not None:
                by_tier[Tier.HOST].append(entry)
            if entry.disk is not None:
                by_tier[Tier.DISK].append(entry)
        return by_tier

    def attach_spill(self, spill: Spill) -> None:
        """Make ``spill`` the tier below the lowest local one (once, before any call)."""
        assert self.spill is None
        self.spill = spill

    def write_policy(self, asked: WritePolicy | None, call: str) -> WritePolicy:
        """The policy a write of ``call`` ("put", "allocate") runs under: ``asked``, else the
        store's; ``ConfigError`` for ``write_through`` without a disk tier or a spill tier."""
        policy = asked or self.config.write_policy
        if policy is WritePolicy.WRITE_THROUGH and self.disk is None and self.spill is None:
            raise ConfigError(f"{call}: write_through needs a disk tier (--disk-path) or a "
                              "REMOTE tier (--remote)")
        return policy

    # --- books ----------------------------------------------------------------------------

    def share_of_locked(self, state: NamespaceState, tier: Tier) -> TenantShare:
        """The share of ``tier`` of ``state``'s tenant (what its blocks there are charged to)."""
        share = state.shares[tier]
        if share is None:
            share = self.ledgers[tier].shares.of(state.namespace.tenant)
            state.shares[tier] = share
        return share

    def configure_tenants_locked(self, tenants: TenantShares) -> None:
        """Adopt new shares and caps in every tier (nothing is evicted until room is needed);
        ``ConfigError``, with nothing changed, when they do not fit a tier."""
        for tier, ledger in self.ledgers.items():
            tenants.check_fits(tier, ledger.capacity_bytes)
        self.tenants = tenants
        for ledger in self.ledgers.values():
            ledger.shares.configure(tenants)

    def unevictable_room_locked(self, state: NamespaceState) -> dict[Tier, int] | None:
        """What ``state``'s tenant may still pin or read-lease in each tier, in the tier's
        bytes: its share less what it has pinned there and, in HOST, less what its live read
        leases hold (a block pinned or being read cannot be evicted, so either beyond the
        share would hold room guaranteed to others); None when no tenant is guaranteed
        anything (then unbounded, as without tenants). O(pins)."""
        if not self.tenants.guarantees:
            return None
        tenant = state.namespace.tenant
        room = {tier: self.share_of_locked(state, tier).share_bytes for tier in self.ledgers}
        room[Tier.HOST] -= self.share_of_locked(state, Tier.HOST).read_bytes
        for entry in self.pins.entries():
            if entry.ns.namespace.tenant == tenant:
                for tier, num_bytes in self.held_bytes(entry).items():
                    room[tier] -= num_bytes
        return room

    def held_bytes(self, entry: Entry) -> dict[Tier, int]:
        """The bytes ``entry``'s copies take in each tier that holds one (its share's units)."""
        held: dict[Tier, int] = {}
        for tier, ledger in self.ledgers.items():
            node = entry.residency(tier)
            if node is not None:
                held[tier] = (entry.ns.record_bytes if tier is Tier.DISK else
                              location_num_pages(node.location) * ledger.shares.unit_bytes)
        return held

    def tier_below(self, tier: Tier) -> Tier | None:
        """The next enabled tier below ``tier``."""
        for lower in Tier:
            if lower > tier and lower in self.ledgers:
                return lower
        return None

    def link_locked(
        self, entry: Entry, tier: Tier, location: Location, checksum: int | None = None,
        parent: Entry | None = None,
    ) -> None:
        """Give ``entry`` a (complete) copy in ``tier`` at ``location``; a HOST copy comes with
        the checksum of its bytes (computed by the caller, outside the lock). Its KV event
        carries the entry's parent and tokens. ``parent``: its chain's stored
        block before it, which it is linked just behind (evicted before it; docs/design/
        eviction.md#chains), else it is the most recently used."""
        node: Residency[Entry] = Residency(entry, location)
        # Each tier spelled out: this runs for every block stored.
        if tier is Tier.HOST:
            assert checksum is not None, "a HOST copy needs its checksum"
            self.paged[Tier.HOST].set_checksum(location, checksum)
            entry.host = node
        elif tier is Tier.DISK:
            entry.disk = node
            self.undemotable.pop(entry, None)  # it has its copy below now
        else:
            entry.gpu = node
        ledger = self.ledgers[tier]
        ledger.num_blocks += 1
        ledger.stored_bytes += entry.ns.block_bytes
        share = self.share_of_locked(entry.ns, tier)
        share.num_blocks += 1
        share.stored_bytes += entry.ns.block_bytes
        if entry not in self.pins:
            # The adaptive policy: while the tier has room for another block, a new copy goes
            # to main, past the window (W-TinyLFU's main has room then); once full, to the
            # window, which only a pick lets into main (``TinyLfuEviction``).
            main = (share.lru.admission is not None
                    and ledger.capacity_bytes - ledger.used_bytes >= entry.ns.block_bytes)
            anchor = _anchor(parent, tier, entry.priority)
            if anchor is None:
                share.lru.push_mru(node, entry.priority, main)
            else:
                share.lru.push_before(node, anchor, main)
        if self.events is not None:
            self.events.stored(entry.ns, tier, entry.block_hash, entry)

    def announce_locked(self, entry: Entry) -> None:
        """Record every copy ``entry`` has again (its tokens became known)."""
        if self.events is not None:
            for tier in (Tier.GPU, Tier.HOST, Tier.DISK):
                if entry.residency(tier) is not None:
                    self.events.stored(entry.ns, tier, entry.block_hash, entry)

    def drop_locked(self, entry: Entry, tier: Tier) -> None:
        """Remove ``entry``'s copy in ``tier`` and free its room; forget the entry if it was the
        last copy. A paged copy must not be busy (its pages would be reused under a reader)."""
        node = entry.residency(tier)
        assert node is not None
        ledger = self.ledgers[tier]
        share = self.share_of_locked(entry.ns, tier)
        share.lru.remove(node)
        entry.set_residency(tier, None)
        if self.events is not None and entry.priority != DOOMED:  # a doom said so already
            self.events.removed(entry.ns, tier, entry.block_hash, entry)
        ledger.num_blocks -= 1
        ledger.stored_bytes -= entry.ns.block_bytes
        share.num_blocks -= 1
        share.stored_bytes -= entry.ns.block_bytes
        if isinstance(ledger, PagedLedger):
            ledger.release(node.location, share)
            self.undemotable.pop(entry, None)
            self.changed.notify_all()
        else:
            assert isinstance(ledger, DiskLedger)
            ledger.release_bytes(entry.ns.record_bytes, share)
            self._pending_deletes.append(entry.raw_key)
        if entry.top_tier() is None:
            self.forget_locked(entry)

    def _count_child_locked(self, entry: Entry, change: int) -> None:
        """Count ``entry`` (indexed: +1, forgotten: -1) as a held child of its parent."""
        parent_hash = entry.parent
        if parent_hash is None or parent_hash == entry.block_hash:
            return
        ns = entry.ns
        parent = ns.blocks.get(parent_hash)
        if parent is not None:
            parent.num_children = max(0, parent.num_children + change)
            return
        num = ns.orphan_children.get(parent_hash, 0) + change
        if num > 0:
            ns.orphan_children[parent_hash] = num
        else:
            ns.orphan_children.pop(parent_hash, None)

    def index_locked(self, entry: Entry) -> None:
        """Put a new entry into its namespace's index (and the shared presence table)."""
        ns = entry.ns
        ns.blocks[entry.block_hash] = entry
        entry.num_children = ns.orphan_children.pop(entry.block_hash, 0)
        self._count_child_locked(entry, 1)
        presence = self.presence
        if presence is not None and presence.enabled and not presence.add(self.presence_value(entry)):
            log.warning("the presence table is full and now off: same-host clients look up "
                        "over RPC; raise presence_slots")

    def forget_locked(self, entry: Entry) -> None:
        """Take an entry out of its namespace's index, the presence table and the pins."""
        blocks = entry.ns.blocks
        if blocks.get(entry.block_hash) is entry:
            del blocks[entry.block_hash]
            if entry.num_children:
                orphans = entry.ns.orphan_children
                orphans[entry.block_hash] = orphans.get(entry.block_hash, 0) + entry.num_children
            self._count_child_locked(entry, -1)
            if self.presence is not None:
                self.presence.remove(self.presence_value(entry))
        self.pins.forget(entry)

    def presence_value(self, entry: Entry) -> int:
        """The entry's fingerprint in the presence table."""
        assert self.presence is not None
        ns = entry.ns
        if ns.presence_fingerprint is None:
            ns.presence_fingerprint = Fingerprinter(self.presence.tenant_key(ns.namespace.tenant),
                                                    ns.core_id)
        return ns.presence_fingerprint(entry.block_hash)

    def doom_locked(self, entry: Entry) -> None:
        """Delete ``entry``: at once if idle, else when its last reader is done (it is a miss
        at once: its copies are reported gone now)."""
        self.forget_locked(entry)
        for tier in Tier:
            node = entry.residency(tier)
            if node is not None:
                self.share_of_locked(entry.ns, tier).lru.remove(node)
                if self.events is not None and entry.priority != DOOMED:
                    self.events.removed(entry.ns, tier, entry.block_hash, entry)
        entry.priority = DOOMED
        if entry.disk is not None:
            # At once, even under readers (LMDB reads see a snapshot): a deferred delete could
            # otherwise remove a record written for the same key after this delete.
            self.drop_locked(entry, Tier.DISK)
        if entry.readers == 0:
            self._drop_all_locked(entry)

    def damaged_locked(self, entry: Entry, tier: Tier) -> None:
        """``entry``'s bytes in ``tier`` failed their checksum: count it and delete the block
        (when its last reader is done), so that it is a miss from now on."""
        self.count_checksum_failures_locked(entry.ns)
        log.warning("block %s failed its checksum in %s; deleted", entry.raw_key.hex(), tier.label)
        if entry.priority != DOOMED:
            self.doom_locked(entry)

    # --- busy marks -------------------------------------------------------------------------

    def mark_busy_locked(self, entry: Entry) -> None:
        """One more copy reads ``entry``: until it is released, none of its copies is evicted
        and no page of it is freed or reused (docs/design/eviction.md, entries and busy marks,
        2)."""
        entry.readers += 1

    def release_busy_locked(self, entry: Entry) -> None:
        """One copy that read ``entry`` is done (a deleted entry goes with its last one)."""
        entry.readers -= 1
        if entry.readers == 0:
            if entry.priority == DOOMED:
                self._drop_all_locked(entry)
                self.submit_deletes_locked()  # the delete() that doomed it did not wait for these
            self.changed.notify_all()

    @contextmanager
    def busy(self) -> Iterator[BusyMarks]:
        """A scope for one copy: the entries marked through the ``BusyMarks`` it gives (with
        the lock held, in the same critical section that chose them, so that none is evicted
        in between) are released when the scope ends, however it ends."""
        marks = BusyMarks(self)
        try:
            yield marks
        finally:
            if marks.entries:
                with self.lock:
                    for entry in marks.entries:
                        self.release_busy_locked(entry)

    def _drop_all_locked(self, entry: Entry) -> None:
        for tier in Tier:
            if entry.residency(tier) is not None:
                self.drop_locked(entry, tier)

    def set_priority_locked(self, entry: Entry, priority: int) -> None:
        """Move ``entry`` to another priority class in every tier it is linked in."""
        if entry.priority in (priority, DOOMED):
            return
        entry.priority = priority
        for tier in Tier:
            node = entry.residency(tier)
            if node is not None and node.linked:
                self.share_of_locked(entry.ns, tier).lru.touch(node, priority)

    def count_read_locked(self, state: NamespaceState, tier: Tier | None,
                          num_blocks: int = 1) -> None:
        """Count blocks of ``state`` a read (a get or an acquire) gave its caller from
        ``tier``, where their fastest copy was: a hit there and a miss in every faster tier;
        ``tier`` None: blocks asked for and not given (not stored, damaged, or no room to serve
        them), a miss in every tier. Counted once the caller has them, never when they are only
        planned; in the tiers' counters and in the tenant's."""
        for other, ledger in self.ledgers.items():
            if tier is None or other < tier:
                ledger.counters.misses += num_blocks
                self.share_of_locked(state, other).misses += num_blocks
        if tier is not None:
            self.ledgers[tier].counters.hits += num_blocks
            self.share_of_locked(state, tier).hits += num_blocks

    def count_served_locked(self, state: NamespaceState, tiers: Sequence[Tier],
                            missed: bool) -> None:
        """``count_read_locked`` for blocks of ``state`` a reader received, each from the
        tier in ``tiers``, and, if ``missed``, the one miss that ended its read."""
        for tier in set(tiers):
            self.count_read_locked(state, tier, tiers.count(tier))
        if missed:
            self.count_read_locked(state, None)

    def count_put_locked(self, state: NamespaceState, num_puts: int) -> None:
        """Count ``num_puts`` puts into ``state``: the store's and its tenant's."""
        self.counters.puts += num_puts
        self.counters_of_locked(state.namespace.tenant).puts += num_puts

    def count_get_locked(self, state: NamespaceState) -> None:
        """Count one read (a get or an acquire) of ``state``: the store's and its tenant's."""
        self.counters.gets += 1
        self.counters_of_locked(state.namespace.tenant).gets += 1

    def count_checksum_failures_locked(self, state: NamespaceState, num_blocks: int = 1) -> None:
        """Count ``num_blocks`` blocks of ``state`` whose bytes failed their checksum: in the
        store's counter and its tenant's."""
        self.counters.checksum_failures += num_blocks
        self.counters_of_locked(state.namespace.tenant).checksum_failures += num_blocks

    def counters_of_locked(self, tenant: str) -> TenantCounters:
        """``tenant``'s counters (made on first use)."""
        counters = self.tenant_counters.get(tenant)
        if counters is None:
            counters = self.tenant_counters[tenant] = TenantCounters()
        return counters

    def touch_locked(self, entry: Entry, parent: Entry | None = None) -> None:
        """Mark ``entry`` most recently used in every tier it is in; with its chain's
        ``parent``, just less recently used than it wherever both are linked in one class."""
        # Each tier spelled out: this runs for every block of every put and get. A linked copy's
        # share was set when it was linked.
        shares, priority = entry.ns.shares, entry.priority
        if parent is not None:
            for tier in Tier:
                node = entry.residency(tier)
                if node is not None:
                    shares[tier].lru.touch_before(  # type: ignore[union-attr]
                        node, priority, _anchor(parent, tier, priority))
            return
        if entry.gpu is not None:
            shares[Tier.GPU].lru.touch(entry.gpu, priority)  # type: ignore[union-attr]
        if entry.host is not None:
            shares[Tier.HOST].lru.touch(entry.host, priority)  # type: ignore[union-attr]
        if entry.disk is not None:
            shares[Tier.DISK].lru.touch(entry.disk, priority)  # type: ignore[union-attr]

    def touch_run_locked(self, run: Sequence[Entry]) -> None:
        """Touch a chain's leading blocks tail first, as every read does: the head ends most
        recently used, and the run's tail is evicted before its head. A use of each."""
        for entry in reversed(run):
            self.touch_locked(entry)
        if self.sketch is not None:
            self.use_locked(run)

    def use_locked(self, entries: Sequence[Entry]) -> None:
        """Count a use of each of ``entries`` (read, or written by a put) for the adaptive
        policy's frequencies and its tiers' miniatures; nothing under the LRU."""
        sketch = self.sketch
        if sketch is not None and count_uses(
                sketch, self.admissions,
                [entry.key if entry.key >= 0 else _key_of(entry) for entry in entries]):
            sketch.reset_uses = self._reset_uses_locked()

    def _reset_uses_locked(self) -> int:
        """How many uses the sketch counts before it halves: ten times the blocks the paged
        tiers hold when full (W-TinyLFU's sample size; DISK shares these frequencies)."""
        return 10 * max(64, sum(_room_in_blocks(ledger) for ledger in self.paged.values()))

    def relink_locked(self, entry: Entry) -> None:
        """Link an entry's copies back into their LRU lists (after its pins went)."""
        for tier in Tier:
            node = entry.residency(tier)
            if node is not None and not node.linked:
                self.share_of_locked(entry.ns, tier).lru.push_mru(node, entry.priority)

    def unlink_all_locked(self, entry: Entry) -> None:
        """Take an entry's copies out of the LRU lists (it was pinned)."""
        for tier in Tier:
            node = entry.residency(tier)
            if node is not None:
                self.share_of_locked(entry.ns, tier).lru.remove(node)

    def expire_pins_locked(self) -> None:
        """Unpin entries whose TTL ran out."""
        for entry in self.pins.pop_expired():
            self.relink_locked(entry)

    # --- disk writes ----------------------------------------------------------------------

    def submit_disk_locked(
        self, puts: Sequence[tuple[bytes, bytes | bytearray]] = (),
        namespace_puts: Sequence[tuple[bytes, bytes]] = (),
        token_puts: Sequence[tuple[bytes, bytes]] = (),
    ) -> DiskWrite:
        """Queue a disk write carrying every pending delete (order matters:
        docs/design/data-path.md, the write path, 3); ``token_puts``: the parent and tokens of
        blocks of ``puts`` (``tierkv.store.tokens``)."""
        assert self.disk is not None
        job = DiskWrite(puts, self._pending_deletes, namespace_puts,
                        block_takes=self._pending_takes, token_puts=token_puts)
        self._pending_deletes = []
        self._pending_takes = []
        spill = self.spill
        if job.block_takes and spill is not None:  # DISK's victims go on to the spill tier
            job.future.add_done_callback(lambda _: spill.offer_demoted(job.taken))
        self.disk.submit(job)
        return job

    def queue_deletes_locked(self, raw_keys: Sequence[bytes]) -> None:
        """Delete records the index does not know (they ride in the next disk write)."""
        self._pending_deletes.extend(raw_keys)

    def submit_deletes_locked(self) -> DiskWrite | None:
        """Submit the pending record deletes now, if there are any."""
        if self.disk is None or not self._pending_deletes:
            return None
        return self.submit_disk_locked()

    def wait_disk(self, job: DiskWrite) -> None:
        """Wait for ``job``; if it failed, queue its deletes again (they must not be lost: the
        index already forgot those records) and raise its error."""
        try:
            job.future.result()
        except TierKVError:
            if job.block_deletes:
                with self.lock:
                    self._pending_deletes[:0] = job.block_deletes
            raise

    def flush_deletes(self) -> None:
        """Submit pending record deletes now and wait until they are durable.

        Raises ``DiskFullError`` (or ``TierKVError``) if they could not be committed; they stay
        queued and ride in the next disk write.
        """
        with self.lock:
            job = self.submit_deletes_locked()
        if job is not None:
            self.wait_disk(job)

    # --- reserving room -------------------------------------------------------------------

    def admit_locked(self, lru: PriorityLru[Entry], node: Residency[Entry], tier: Tier) -> None:
        """Let a window copy into main, and its chain's ancestors in the window after it
        (newer: a chain still leaves main tail first), so that no block whose descendants
        are in main waits in the window (the adaptive policy is prefix-aware)."""
        lru.admit(node)
        entry = node.owner
        blocks = entry.ns.blocks
        while entry.parent is not None:
            parent = blocks.get(entry.parent)
            if parent is None:
                return
            above = parent.residency(tier)
            if above is None or above.prev is None or above.segment != WINDOW:
                return
            lru.admit(above)
            entry = parent

    def pick_victims_locked(
        self, ledger: Ledger, share: TenantShare, needed: int, size_of: SizeOf,
        excluded: Callable[[Entry], bool], spare: frozenset[Entry] = frozenset(),
    ) -> tuple[Victims[Entry], int]:
        """Victims (not marked yet) that make room for ``needed`` units (pages of a paged tier,
        record bytes on DISK) held by ``share``'s tenant, and how many units are still missing
        with them (0: enough), as the eviction policy chooses them from this tier's books
        (``EvictionPolicy.pick_tier_victims``: tenants' caps, shares and turns; in the lowest
        tier, blocks whose children are held and ``spare`` go only when nothing else can)."""
        unit = ledger.shares.unit_bytes
        return self.eviction.pick_tier_victims(
            ledger.shares, share, needed,
            ledger.capacity_bytes // unit - ledger.used_bytes // unit,
            _TierBlocks(self, ledger.tier, size_of), excluded, spare,
            last_copies=self.tier_below(ledger.tier) is None)

    def reserve_disk_locked(
        self, num_records: int, record_bytes: int, share: TenantShare,
        exclude: frozenset[Entry] = frozenset(), spare: frozenset[Entry] = frozenset(),
    ) -> None:
        """Reserve room for records held by ``share``'s tenant, dropping records (no copies
        needed) to make it as ``pick_victims_locked`` chooses them; ``exclude`` are never
        dropped (a put's own chain), ``spare`` only when nothing else is left."""
        ledger = self.disk_ledger
        assert ledger is not None
        needed = num_records * record_bytes
        if share.used_bytes + needed <= share.cap_bytes and ledger.try_reserve_bytes(needed, share):
            return
        self.expire_pins_locked()
        picked, missing = self.pick_victims_locked(ledger, share, needed, _record_bytes,
                                                   exclude.__contains__, spare)
        if missing:
            raise CapacityError(
                f"disk tier: no room for {num_records} record(s) of {record_bytes} B in "
                f"{ledger.capacity_bytes} B for tenant {share.tenant!r}: the rest is pinned or in "
                "use, or guaranteed to other tenants"
            )
        for entry in picked.owners:
            self.count_eviction_locked(entry, Tier.DISK, share)
            self.drop_locked(entry, Tier.DISK)
            if self.spill is not None:  # DISK eviction demotes to the spill tier
                self._pending_takes.append((entry.raw_key, time.monotonic()))
        reserved = ledger.try_reserve_bytes(needed, share)
        assert reserved

    def count_eviction_locked(self, entry: Entry, tier: Tier, requester: TenantShare) -> None:
        """Count ``entry``'s copy in ``tier`` as evicted to make room for ``requester``."""
        self.ledgers[tier].counters.evictions += 1
        share = self.share_of_locked(entry.ns, tier)
        share.evictions += 1
        if share is not requester:
            share.evicted_by_others += 1

    def release_room_locked(self, tier: Tier, entry: Entry, location: Location) -> None:
        """Give back room reserved for ``entry`` in ``tier`` that will not be used."""
        if tier is Tier.DISK:
            assert self.disk_ledger is not None
            self.disk_ledger.release_bytes(entry.ns.record_bytes, self.share_of_locked(entry.ns, tier))
        else:
            self.release_pages_locked(tier, location, entry.ns)

    def release_pages_locked(self, tier: Tier, location: Location, state: NamespaceState
                             ) -> None:
        """Give back pages reserved for a block of ``state`` that will not be used."""
        self.paged[tier].release(location, self.share_of_locked(state, tier))
        self.changed.notify_all()

    def release_records_locked(self, state: NamespaceState, num_records: int) -> None:
        """Give back DISK room reserved for ``num_records`` records of ``state``."""
        assert self.disk_ledger is not None
        self.disk_ledger.release_bytes(num_records * state.record_bytes,
                                       self.share_of_locked(state, Tier.DISK))


def _key_of(entry: Entry) -> int:
    """An entry's key in the frequency sketch (``Entry.key``, set on first use): its hash's
    first 8 bytes (block hashes are uniform; the same key in every process and run, so the
    policy is reproducible)."""
    if entry.key < 0:
        entry.key = int.from_bytes(entry.block_hash[:8], "little")
    return entry.key


def _room_in_blocks(ledger: Ledger) -> int:
    """About how many blocks ``ledger``'s tier holds when full: its capacity over the bytes a
    block takes there now (before any: a page a block, or 16 KiB a record on DISK; at most
    2**22)."""
    if ledger.num_blocks and ledger.used_bytes:
        return max(1, ledger.capacity_bytes * ledger.num_blocks // ledger.used_bytes)
    unit = ledger.shares.unit_bytes if ledger.tier is not Tier.DISK else 16384
    return max(1, min(1 << 22, ledger.capacity_bytes // unit))


def _anchor(parent: Entry | None, tier: Tier, priority: int) -> Residency[Entry] | None:
    """``parent``'s linked node in ``tier`` when it is of class ``priority``: where a block of
    its chain goes (just before it); None: the block goes most recently used."""
    if parent is None or parent.priority != priority:
        return None
    node = parent.residency(tier)
    return node if node is not None and node.linked else None
