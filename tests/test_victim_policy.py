"""The tenant-aware victim choice (``EvictionPolicy.pick_tier_victims``) alone, with plain owners:
strings in a fake tier that answers for the store's books. Caps, guaranteed shares, borrowing,
turns, passed-over blocks, the lowest tier's chain rule and ``spare``, shortfalls, the adaptive
policy's admissions, and a subclass that asks the tenants in another order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from tierkv.admission import Admission
from tierkv.config import Priority
from tierkv.eviction import (
    EvictionPolicy,
    PriorityLru,
    Residency,
    TierPick,
    TinyLfuEviction,
    Victims,
)
from tierkv.frequency import FrequencySketch

T = TypeVar("T")


@dataclass(eq=False)
class Tenant:
    """One tenant's share of the fake tier (what ``Share`` reads)."""

    tenant: str
    share_bytes: int = 0
    cap_bytes: int = 1 << 20
    used_bytes: int = 0
    leaving_bytes: int = 0
    lru: PriorityLru[str] = field(default_factory=PriorityLru)


class FakeTier:
    """A tier of unit-sized blocks named by strings: the ``Book`` and the ``Blocks`` of a pick.
    ``add`` stores blocks; ``parents`` and ``children`` are their chains."""

    unit_bytes = 1

    def __init__(self, *tenants: Tenant, admission: Admission[str] | None = None) -> None:
        self.tenants = {t.tenant: t for t in tenants}
        self.over: dict[str, Tenant] = {}
        self.nodes: dict[str, Residency[str]] = {}
        self.sizes: dict[str, int] = {}
        self.busy_now: set[str] = set()
        self.parents: dict[str, str] = {}
        self.children: dict[str, int] = {}
        self.admitted: list[str] = []
        for tenant in tenants:
            if admission is not None:
                tenant.lru = PriorityLru(admission)
            self._update_over(tenant)

    def add(self, tenant: str, *names: str, size: int = 1) -> None:
        """Store ``names`` of ``size`` units each for ``tenant``, oldest first."""
        share = self.tenants[tenant]
        for name in names:
            node = Residency(name, 0)
            self.nodes[name] = node
            self.sizes[name] = size
            share.lru.push_mru(node, Priority.NORMAL)
            share.used_bytes += size
        self._update_over(share)

    def _update_over(self, share: Tenant) -> None:
        if share.used_bytes > share.share_bytes:
            self.over.setdefault(share.tenant, share)

    def turn(self, tenant: str) -> None:
        share = self.over.pop(tenant, None)
        if share is not None:
            self.over[tenant] = share

    def size_of(self, node: Residency[str]) -> int:
        return self.sizes[node.owner]

    def node_of(self, owner: str) -> Residency[str]:
        return self.nodes[owner]

    def busy(self, owner: str) -> bool:
        return owner in self.busy_now

    def admit(self, lru: PriorityLru[str], node: Residency[str]) -> None:
        self.admitted.append(node.owner)
        lru.admit(node)

    def key(self, owner: str) -> str:
        return owner

    def parent(self, owner: str) -> str | None:
        return self.parents.get(owner)

    def held_children(self, owner: str) -> int:
        return self.children.get(owner, 0)

    def pick(self, tenant: str, needed: int, free: int = 0,
             policy: EvictionPolicy | None = None,
             excluded: Callable[[str], bool] = lambda owner: False,
             spare: frozenset[str] = frozenset(), last_copies: bool = False,
             ) -> tuple[list[str], int]:
        """``tenant``'s write of ``needed`` units: the victims' names, and the units missing."""
        picked, missing = (policy or EvictionPolicy()).pick_tier_victims(
            self, self.tenants[tenant], needed, free, self, excluded, spare, last_copies)
        assert picked.size == sum(self.sizes[owner] for owner in picked.owners)
        return picked.owners, missing


def test_a_tenant_at_its_cap_gives_up_its_own_blocks_even_with_room_free() -> None:
    tier = FakeTier(Tenant("a", cap_bytes=3), Tenant("b"))
    tier.add("b", "b1", "b2")
    tier.add("a", "a1", "a2", "a3")
    assert tier.pick("a", 2, free=10) == (["a1", "a2"], 0)


def test_a_tenant_at_its_cap_is_short_what_its_own_blocks_cannot_give() -> None:
    tier = FakeTier(Tenant("a", cap_bytes=3), Tenant("b"))
    tier.add("b", "b1", "b2")
    tier.add("a", "a1", "a2", "a3")
    # a2 and a3 may not go: a is one unit short, and b's blocks do not make a's room.
    assert tier.pick("a", 2, free=10, excluded=lambda o: o in ("a2", "a3")) == (["a1"], 1)


def test_only_the_room_not_free_is_taken() -> None:
    tier = FakeTier(Tenant("a"), Tenant("b"))
    tier.add("b", "b1", "b2", "b3")
    assert tier.pick("a", 3, free=1) == (["b1", "b2"], 0)
    assert tier.pick("a", 3, free=3) == ([], 0)


def test_a_tenant_under_its_share_takes_its_room_back_from_the_borrower() -> None:
    tier = FakeTier(Tenant("a", share_bytes=6), Tenant("b", share_bytes=6))
    tier.add("a", "a1")
    tier.add("b", *(f"b{i}" for i in range(11)))  # b borrowed a's idle room
    assert tier.pick("a", 3) == (["b0", "b1", "b2"], 0)  # b's least recently used


def test_a_tenant_at_or_under_its_share_loses_no_block_to_another() -> None:
    tier = FakeTier(Tenant("a", share_bytes=4), Tenant("b", share_bytes=4),
                    Tenant("c", share_bytes=4))
    tier.add("b", "b1", "b2", "b3", "b4")  # at its share
    tier.add("c", "c1", "c2", "c3", "c4", "c5", "c6")  # two past it
    tier.add("a", "a1", "a2")
    # a is owed 2: c gives its two beyond its share, never more; then a pays with its own.
    assert tier.pick("a", 4) == (["c1", "c2", "a1", "a2"], 0)


def test_beyond_what_it_is_owed_a_tenant_pays_with_its_own_blocks() -> None:
    tier = FakeTier(Tenant("a", share_bytes=4), Tenant("b", share_bytes=2))
    tier.add("b", "b1", "b2", "b3", "b4", "b5", "b6")
    tier.add("a", "a1", "a2", "a3")
    assert tier.pick("a", 3) == (["b1", "a1", "a2"], 0)  # it was owed one unit


def test_a_tenant_keeps_a_block_it_holds_less_than_beyond_its_share() -> None:
    tier = FakeTier(Tenant("a", share_bytes=4), Tenant("b", share_bytes=1))
    tier.add("b", "b1")
    tier.add("b", "b2", size=2)  # b is two units past its share: b2 would take it below
    assert tier.pick("a", 3) == (["b1"], 2)


def test_a_tenant_over_its_share_is_not_asked_again_for_its_own_blocks() -> None:
    tier = FakeTier(Tenant("a"), Tenant("b"))
    tier.add("a", "a1")
    tier.busy_now.add("a1")
    picked, missing = EvictionPolicy().pick_tier_victims(
        tier, tier.tenants["a"], 1, 0, tier, lambda o: False)
    assert (picked.owners, missing, picked.busy_size, picked.walked_size) == ([], 1, 1, 1)


def test_what_cannot_be_freed_is_the_shortfall() -> None:
    tier = FakeTier(Tenant("a", share_bytes=4), Tenant("b", share_bytes=4),
                    Tenant("c", share_bytes=4))
    tier.add("b", "b1", "b2", "b3", "b4")
    tier.add("c", "c1", "c2", "c3", "c4", "c5", "c6")
    tier.add("a", "a1", "a2")
    assert tier.pick("a", 7) == (["c1", "c2", "a1", "a2"], 3)


def test_tenants_over_their_share_give_up_blocks_in_turn() -> None:
    tier = FakeTier(Tenant("a", share_bytes=4), Tenant("b", share_bytes=2),
                    Tenant("c", share_bytes=2))
    tier.add("b", "b1", "b2", "b3", "b4", "b5")
    tier.add("c", "c1", "c2", "c3", "c4", "c5")
    assert list(tier.over) == ["b", "c"]
    assert tier.pick("a", 1) == (["b1"], 0)
    assert list(tier.over) == ["c", "b"]  # b gave: c's turn next
    assert tier.pick("a", 1) == (["c1"], 0)
    assert list(tier.over) == ["b", "c"]


def test_a_tenant_gives_no_more_than_its_excess_less_what_is_leaving_it() -> None:
    tier = FakeTier(Tenant("a", share_bytes=4), Tenant("b", share_bytes=2))
    tier.add("b", "b1", "b2", "b3", "b4")
    tier.tenants["b"].leaving_bytes = 1  # one of its blocks is being demoted by another pick
    assert tier.pick("a", 3) == (["b1"], 2)


def test_pinned_busy_and_excluded_blocks_are_passed_over() -> None:
    tier = FakeTier(Tenant("a"), Tenant("b"))
    tier.add("b", "b1", "b2", "b3", "b4", "b5")
    tier.tenants["b"].lru.remove(tier.nodes["b2"])  # pinned: unlinked
    tier.busy_now.add("b3")
    picked, missing = EvictionPolicy().pick_tier_victims(
        tier, tier.tenants["a"], 2, 0, tier, lambda o: o == "b1")
    assert (picked.owners, missing, picked.busy_size) == (["b4", "b5"], 0, 1)


def test_the_lowest_tier_keeps_a_block_whose_children_are_held_until_nothing_else_is_left(
) -> None:
    tier = FakeTier(Tenant("a"), Tenant("b"))
    tier.add("b", "p", "q", "x")
    tier.children["p"] = 1  # a block held only in a tier above continues p
    assert tier.pick("a", 1) == (["p"], 0)  # a tier with copies below: plain order
    assert tier.pick("a", 1, last_copies=True) == (["q"], 0)  # p leads on to c
    assert tier.pick("a", 3, last_copies=True) == (["p", "q", "x"], 0)  # room wins


def test_children_taken_by_the_same_pick_count_as_gone() -> None:
    tier = FakeTier(Tenant("a"), Tenant("b"))
    tier.add("b", "c", "p", "x")  # a chain's tail is older than its head
    tier.parents["c"] = "p"
    tier.children["p"] = 1
    assert tier.pick("a", 2, last_copies=True) == (["c", "p"], 0)
    tier.busy_now.add("c")  # a busy child stays: its parent is kept for it
    assert tier.pick("a", 1, last_copies=True) == (["x"], 0)


def test_the_blocks_a_put_continues_are_spared_in_the_lowest_tier_only() -> None:
    tier = FakeTier(Tenant("a"), Tenant("b"))
    tier.add("b", "b1", "b2")
    assert tier.pick("a", 1, spare=frozenset({"b1"})) == (["b1"], 0)
    assert tier.pick("a", 1, spare=frozenset({"b1"}), last_copies=True) == (["b2"], 0)
    assert tier.pick("a", 2, spare=frozenset({"b1"}), last_copies=True) == (["b1", "b2"], 0)


def test_the_adaptive_policy_lets_its_candidates_into_main_as_it_picks() -> None:
    admission: Admission[str] = Admission(FrequencySketch(1024), hash, lambda: 100)
    admission.on = False  # an LRU in two segments: every candidate enters main
    tier = FakeTier(Tenant("a"), Tenant("b"), admission=admission)
    tier.add("b", "m1", "w1", "w2")
    tier.tenants["b"].lru.admit(tier.nodes["m1"])
    assert tier.pick("a", 1, policy=TinyLfuEviction()) == (["m1"], 0)
    assert tier.admitted == ["w1"]  # moved before the pick returned


class _OwnFirst(EvictionPolicy):
    """A replacement policy: a tenant pays with its own blocks first, whatever its share."""

    def ask_tenants(self, pick: TierPick[T]) -> int:
        share, unit = pick.requester, pick.unit
        missing = pick.needed - pick.free
        missing -= pick.take(share, missing, (share.used_bytes - share.leaving_bytes) // unit)
        if missing > 0:
            missing -= pick.from_others(missing)
        return max(0, missing)


def test_a_subclass_that_overrides_ask_tenants_changes_who_gives_up_blocks() -> None:
    def fresh() -> FakeTier:
        tier = FakeTier(Tenant("a", share_bytes=4), Tenant("b", share_bytes=2))
        tier.add("a", "a1", "a2")
        tier.add("b", "b1", "b2", "b3", "b4")
        return tier

    assert fresh().pick("a", 3) == (["b1", "b2", "a1"], 0)
    assert fresh().pick("a", 3, policy=_OwnFirst()) == (["a1", "a2", "b1"], 0)


def test_a_subclass_that_overrides_pick_victims_orders_each_tenants_blocks() -> None:
    class NewestFirst(EvictionPolicy):
        def pick_victims(self, lru: PriorityLru[T], needed: int,
                         size_of: Callable[[Residency[T]], int], excluded: Callable[[T], bool],
                         busy: Callable[[T], bool]) -> Victims[T]:
            victims: Victims[T] = Victims()
            for node in reversed(list(lru.iter_lru())):
                if victims.size >= needed:
                    break
                if not excluded(node.owner):
                    victims.owners.append(node.owner)
                    victims.size += size_of(node)
            return victims

    tier = FakeTier(Tenant("a", share_bytes=4), Tenant("b", share_bytes=2))
    tier.add("b", "b1", "b2", "b3", "b4")
    assert tier.pick("a", 2, policy=NewestFirst()) == (["b4", "b3"], 0)
