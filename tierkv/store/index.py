"""The index: one ``Entry`` per stored key (present while some tier holds a complete copy: a hit
now), one ``NamespaceState`` per namespace, one ledger (budget, LRU, counters) per tier.
Guarded by the store's lock and owned by the store alone; the tiers never see it.
Design: docs/design/eviction.md#entries-and-busy-marks
"""
from __future__ import annotations

import abc
import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import cast

import numpy as np

from tierkv.config import TenantShares, Tier
from tierkv.eviction import Residency
from tierkv.keys import Namespace, NamespaceId
from tierkv.paging import Location, PageAllocator, first_page, location_num_pages
from tierkv.shm.presence import Fingerprinter
from tierkv.store.tenants import ShareBook, TenantShare
from tierkv.store.tokens import BlockTokens
from tierkv.tiers.paged import PagedSlab

DOOMED = -1
"""``Entry.priority`` of a deleted entry whose residencies wait for their last reader."""

_TIER_SLOTS = ("gpu", "host", "disk")


class Entry:
    """One stored key and where its copies are."""

    __slots__ = ("block_hash", "disk", "gpu", "host", "key", "ns", "num_children", "parent",
                 "priority", "readers", "tokens")

    def __init__(self, block_hash: bytes, ns: NamespaceState, priority: int,
                 parent: bytes | None = None, tokens: BlockTokens | None = None) -> None:
        self.block_hash = block_hash
        # Its key in the adaptive policy's frequency sketch, -1 until that policy first asks
        # (``StoreCore``'s ``_key_of``).
        self.key = -1
        self.ns = ns
        self.priority = priority
        # The hash of the block before it in its chain, when its writer said (else the put's
        # previous key): a copy it gets in another tier is linked behind its parent's there.
        self.parent = parent
        # Its tokens, when its writer gave them (``tierkv.store.tokens``): every KV event of
        # the block carries them, so that a router can place it (docs/events.md).
        self.tokens = tokens
        # How many entries held now name it as their parent (kept by the store): its last copy
        # is not evicted while it has any, unless nothing else can go.
        self.num_children = 0
        self.readers = 0
        self.gpu: Residency[Entry] | None = None
        self.host: Residency[Entry] | None = None
        self.disk: Residency[Entry] | None = None

    def residency(self, tier: Tier) -> Residency[Entry] | None:
        """This entry's node in ``tier``, if it has a copy there."""
        node: Residency[Entry] | None = getattr(self, _TIER_SLOTS[tier])
        return node

    def set_residency(self, tier: Tier, node: Residency[Entry] | None) -> None:
        """Attach or detach the entry's node in ``tier``."""
        setattr(self, _TIER_SLOTS[tier], node)

    def top_tier(self) -> Tier | None:
        """The fastest tier holding a copy."""
        if self.gpu is not None:
            return Tier.GPU
        if self.host is not None:
            return Tier.HOST
        if self.disk is not None:
            return Tier.DISK
        return None

    @property
    def raw_key(self) -> bytes:
        """The 48-byte disk key."""
        return self.ns.id + self.block_hash


@dataclass(eq=False)
class NamespaceState:
    """A registered namespace with its sizes and its blocks."""

    namespace: Namespace
    record_bytes: int
    blocks: dict[bytes, Entry] = field(default_factory=dict)
    # Held children of parents not indexed now, by the parent's hash (a parent stored again
    # takes its count from here).
    orphan_children: dict[bytes, int] = field(default_factory=dict)
    # Its tenant's share of each tier, by ``Tier`` (set by the store on first use).
    shares: list[TenantShare | None] = field(default_factory=lambda: [None] * len(Tier))
    # This namespace's presence-table fingerprints (set by the store on first use).
    presence_fingerprint: Fingerprinter | None = None

    @property
    def id(self) -> NamespaceId:
        """The key prefix."""
        return self.namespace.id

    @cached_property
    def core_id(self) -> bytes:
        """The namespace's id without its tenant (the tenant keys the presence table)."""
        return bytes(self.namespace.with_tenant("").id)

    @cached_property
    def fingerprint(self) -> str:
        """The layout fingerprint every record of this namespace carries."""
        return self.namespace.layout.fingerprint

    @cached_property
    def block_bytes(self) -> int:
        """Payload bytes per block (read for every block the store moves: computed once)."""
        return self.namespace.layout.bytes_per_block


@dataclass(eq=False)
class TierCounters:
    """Monotonic per-tier counters (reported by ``stats``)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions_in: int = 0
    demotions_in: int = 0


class Ledger(abc.ABC):
    """What the store knows of one tier: its budget, its tenants' shares (each with the LRU of
    its blocks there) and its counters."""

    def __init__(self, tier: Tier, capacity_bytes: int, unit_bytes: int,
                 tenants: TenantShares) -> None:
        self.tier = tier
        self.capacity_bytes = capacity_bytes
        self.shares = ShareBook(tier, capacity_bytes, unit_bytes, tenants)
        self.num_blocks = 0
        self.stored_bytes = 0  # KV bytes of the blocks held (their layouts' bytes_per_block)
        self.counters = TierCounters()

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes held, reserved in-flight copies included."""

    @abc.abstractmethod
    def fits(self, num_bytes: int) -> bool:
        """Whether one block (or record) of ``num_bytes`` could ever fit."""


class PagedLedger(Ledger):
    """A GPU or HOST tier: pages of a slab."""

    def __init__(self, tier: Tier, slab: PagedSlab, tenants: TenantShares) -> None:
        super().__init__(tier, slab.capacity_bytes, slab.page_bytes, tenants)
        self.slab = slab
        self.allocator = PageAllocator(slab.num_pages)
        # HOST: the checksum of the block stored at each first page (``tierkv.checksums``), set
        # when the block is published there and checked whenever its bytes leave the tier. An
        # array, not a field of ``Entry``: 8 bytes a page instead of an int object a block.
        self.checksums = np.zeros(slab.num_pages, np.uint64)

    @property
    def used_bytes(self) -> int:
        """Pages in use (held or reserved), in bytes."""
        return (self.allocator.num_pages - self.allocator.num_free_pages) * self.slab.page_bytes

    def pages_for(self, num_bytes: int) -> int:
        """Pages a block of ``num_bytes`` takes."""
        return self.slab.pages_for(num_bytes)

    def fits(self, num_bytes: int) -> bool:
        """Whether one block of ``num_bytes`` could ever fit."""
        return self.pages_for(num_bytes) <= self.allocator.num_pages

    def try_reserve(self, sizes_bytes: list[int], share: TenantShare) -> list[Location] | None:
        """Pages for blocks of the given sizes, adjacent when possible, held by ``share``'s
        tenant from now on; None if not free now."""
        pages = self.pages_of(sizes_bytes)
        locations = self.allocator.try_allocate(pages)
        if locations is not None:
            share.charge(sum(pages) * self.slab.page_bytes)
        return locations

    def pages_of(self, sizes_bytes: list[int]) -> list[int]:
        """The pages each block of ``sizes_bytes`` takes (a batch's sizes are mostly one)."""
        per_size = {size: self.pages_for(size) for size in set(sizes_bytes)}
        return [per_size[size] for size in sizes_bytes]

    def release(self, location: Location, share: TenantShare) -> None:
        """Give pages ``share``'s tenant held back."""
        self.allocator.free(location)
        share.credit(location_num_pages(location) * self.slab.page_bytes)

    def set_checksum(self, location: Location, value: int) -> None:
        """Record the checksum of the block published at ``location``."""
        self.checksums[first_page(location)] = value

    def checksum_of(self, location: Location) -> int:
        """The checksum recorded for the block at ``location``."""
        return int(self.checksums[first_page(location)])


class DiskLedger(Ledger):
    """The DISK tier: a byte budget of records."""

    def __init__(self, capacity_bytes: int, tenants: TenantShares) -> None:
        super().__init__(Tier.DISK, capacity_bytes, 1, tenants)
        self._used_bytes = 0

    @property
    def used_bytes(self) -> int:
        """Record bytes held or reserved."""
        return self._used_bytes

    def fits(self, num_bytes: int) -> bool:
        """Whether one record of ``num_bytes`` could ever fit."""
        return num_bytes <= self.capacity_bytes

    def try_reserve_bytes(self, num_bytes: int, share: TenantShare) -> bool:
        """Reserve ``num_bytes`` for ``share``'s tenant if they are free now."""
        if self._used_bytes + num_bytes > self.capacity_bytes:
            return False
        self._used_bytes += num_bytes
        share.charge(num_bytes)
        return True

    def release_bytes(self, num_bytes: int, share: TenantShare) -> None:
        """Give record bytes ``share``'s tenant held back."""
        self._used_bytes -= num_bytes
        assert self._used_bytes >= 0
        share.credit(num_bytes)


_IS_NOT_NONE = functools.partial(operator.is_not, None)


def leading_run(blocks: Mapping[bytes, Entry], keys: Iterable[bytes],
                readable: bool = False) -> list[Entry]:
    """The entries of the leading stored run of ``keys`` (the store's lock held): up to the
    first key not stored or, ``readable``, the first whose entry has no copy left (going)."""
    find: Callable[[bytes], Entry | None] = blocks.get
    if not readable:  # (no Python loop: every remote lookup's locate runs this)
        return cast("list[Entry]", list(itertools.takewhile(_IS_NOT_NONE, map(find, keys))))
    run: list[Entry] = []
    for key in keys:
        entry = find(key)
        if entry is None or entry.top_tier() is None:
            break
        run.append(entry)
    return run


def leading_count(blocks: Mapping[bytes, Entry], keys: Iterable[bytes]) -> int:
    """``len(leading_run(blocks, keys))``, without a Python loop (every lookup runs it)."""
    return len(list(itertools.takewhile(blocks.__contains__, keys)))


def is_busy(entry: Entry) -> bool:
    """Whether a copy is reading ``entry`` now (it may not be evicted until it is done)."""
    return entry.readers > 0
