"""Tenants' shares of one tier: what each tenant is guaranteed there and may hold at most, what it
holds (stored and reserved), and the LRU of its blocks there. One ``ShareBook`` per tier, owned
by that tier's ledger; guarded by the store's lock. Victims are chosen from these books by the
eviction policy (``tierkv.eviction.EvictionPolicy.ask_tenants``, which reads them as ``Share`` and
``Book``). Design: docs/design/tenants.md
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from tierkv.admission import Admission
from tierkv.config import TenantShares, Tier
from tierkv.eviction import PriorityLru

if TYPE_CHECKING:
    from tierkv.store.index import Entry


class TenantShare:
    """One tenant in one tier: its guarantee and cap, what it holds, its LRU and counters.

    ``used_bytes`` counts every byte of the tier the tenant holds: blocks stored, pinned, read
    and room reserved for its writes (leases included), in the tier's units (whole pages of a
    paged tier, record bytes on DISK). The tenant is *over its share* while ``used_bytes``
    exceeds ``share_bytes``; only then may another tenant's write evict its blocks.
    """

    __slots__ = ("_book", "cap_bytes", "demotions_in", "evicted_by_others", "evictions", "hits",
                 "leaving_bytes", "lru", "misses", "num_blocks", "promotions_in", "read_bytes",
                 "share_bytes", "stored_bytes", "tenant", "used_bytes")

    def __init__(self, book: ShareBook, tenant: str, share_bytes: int, cap_bytes: int) -> None:
        self._book = book
        self.tenant = tenant
        self.share_bytes = share_bytes
        self.cap_bytes = cap_bytes
        self.used_bytes = 0
        # Of ``used_bytes``, what victims picked and not dropped yet hold (a paged tier's
        # eviction lets go of the lock while it demotes them): no other pick counts them again.
        self.leaving_bytes = 0
        self.lru: PriorityLru[Entry] = PriorityLru(book.admission)
        # Of ``used_bytes`` (HOST only): what its live read leases hold, which cannot be
        # evicted; kept by the lease table, bounded with its pins by its share.
        self.read_bytes = 0
        # Its blocks evicted to make room for another tenant (only ever while it was over its
        # share: the books' promise).
        self.evicted_by_others = 0
        # Its part of the tier's own figures (``tierkv.types.TierStats``): what it holds there
        # and its counters since start, kept by the store core beside the tier's.
        self.num_blocks = 0
        self.stored_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.promotions_in = 0
        self.demotions_in = 0

    @property
    def excess_bytes(self) -> int:
        """How far it holds more than it is guaranteed (negative: room it has left)."""
        return self.used_bytes - self.share_bytes

    @property
    def spare_bytes(self) -> int:
        """What it may still lose to others: its excess less what is leaving already."""
        return self.used_bytes - self.leaving_bytes - self.share_bytes

    def charge(self, num_bytes: int) -> None:
        """It holds ``num_bytes`` more (reserved or stored)."""
        self.used_bytes += num_bytes
        if self.used_bytes > self.share_bytes:
            over = self._book.over
            if self.tenant not in over:
                over[self.tenant] = self

    def credit(self, num_bytes: int) -> None:
        """It holds ``num_bytes`` less."""
        self.used_bytes -= num_bytes
        assert self.used_bytes >= 0, f"tenant {self.tenant!r}: more given back than held"
        if self.used_bytes <= self.share_bytes:
            self._book.over.pop(self.tenant, None)


class ShareBook:
    """Every tenant's share of one tier, and which tenants are over their share now (oldest
    first: victims are taken from them in turn)."""

    def __init__(self, tier: Tier, capacity_bytes: int, unit_bytes: int,
                 plan: TenantShares) -> None:
        plan.check_fits(tier, capacity_bytes)
        self.tier = tier
        self.capacity_bytes = capacity_bytes
        self.unit_bytes = unit_bytes  # a page of a paged tier, 1 on DISK
        self.shares: dict[str, TenantShare] = {}
        self.over: dict[str, TenantShare] = {}
        self._plan = plan
        # The tier's frequency filter, under the adaptive policy: every tenant's lists then
        # have a window (``use_admission``, before any share is made).
        self.admission: Admission[Entry] | None = None

    def use_admission(self, admission: Admission[Entry]) -> None:
        """Give every tenant's lists in this tier a window, filtered by ``admission``."""
        assert not self.shares, "the policy is chosen before any block is stored"
        self.admission = admission

    def of(self, tenant: str) -> TenantShare:
        """``tenant``'s share (made on first use, from the plan)."""
        share = self.shares.get(tenant)
        if share is None:
            share = TenantShare(self, tenant, *self._room_of(tenant))
            self.shares[tenant] = share
        return share

    def configure(self, plan: TenantShares) -> None:
        """Adopt new shares and caps: who is over its share (and so who loses blocks to
        another tenant's write next) changes at once; nothing is evicted here. The plan must
        fit the tier (``TenantShares.check_fits``)."""
        self._plan = plan
        turns = list(self.over)  # the turns keep their order
        self.over.clear()
        for tenant, share in self.shares.items():
            share.share_bytes, share.cap_bytes = self._room_of(tenant)
        for tenant in turns + [t for t in self.shares if t not in turns]:
            share = self.shares[tenant]
            if share.used_bytes > share.share_bytes:
                self.over[tenant] = share

    def _room_of(self, tenant: str) -> tuple[int, int]:
        """``(share_bytes, cap_bytes)`` of ``tenant``, in whole units of the tier."""
        unit = self.unit_bytes
        units = self.capacity_bytes // unit
        share = self._plan.share_units(tenant, self.tier, units, unit) * unit
        cap = max(share, int(units * self._plan.cap_fraction(tenant)) * unit)
        return share, cap

    def turn(self, tenant: str) -> None:
        """``tenant`` gave up blocks: the next victims come from the tenants after it."""
        share = self.over.pop(tenant, None)
        if share is not None:
            self.over[tenant] = share

    def lrus(self) -> Iterator[PriorityLru[Entry]]:
        """Every tenant's LRU of this tier."""
        for share in self.shares.values():
            yield share.lru
