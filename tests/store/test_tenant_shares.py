"""Tenants' shares of each tier (``StoreConfig.tenants``): a tenant at or under its guaranteed
share never loses a block to another tenant's write; room no one uses is lent and taken back;
a cap bounds a tenant by its own blocks; a write that could only fit in another tenant's
guaranteed room is refused. Through the store's public API, with real tiers."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest

from tests.support.tiny_blocks import (
    BLOCK_BYTES,
    RECORD_BYTES,
    TINY_LAYOUT,
    StoreFactory,
    blocks,
    keys,
    same_bytes,
)
from tierkv import (
    CapacityError,
    ConfigError,
    Namespace,
    ReadLease,
    TenantShares,
    TenantTierStats,
    Tier,
    TieredStore,
    WritePolicy,
)
from tierkv.store.migrate import Mover

ALICE, BOB, CAROL = "alice", "bob", "carol"


def ns_of(tenant: str) -> Namespace:
    return Namespace("test-model", TINY_LAYOUT, tenant=tenant)


def held(store: TieredStore, tenant: str, hashes: list[bytes]) -> int:
    """How many of ``hashes`` the tenant's namespace holds (each looked up on its own)."""
    return sum(store.lookup(ns_of(tenant), [h]) for h in hashes)


def share(store: TieredStore, tenant: str, tier: Tier = Tier.HOST) -> TenantTierStats:
    (found,) = [s for s in store.tenant_stats(tenant) if s.tier is tier]
    return found


def flood(store: TieredStore, tenant: str, num_blocks: int, salt: int = 1000,
          refused: bool = False, **put: object) -> None:
    """Puts of 4 blocks; ``refused``: each may fail for want of room the tenant may take."""
    for start in range(salt, salt + num_blocks, 4):
        try:
            store.put(ns_of(tenant), keys(4, start=start), blocks(4, seed=start), **put)  # type: ignore[arg-type]
        except CapacityError:
            if not refused:
                raise


def registered(store: TieredStore, *tenants: str) -> TieredStore:
    for tenant in tenants:
        store.register(ns_of(tenant))
    return store


def test_a_tenant_under_its_share_keeps_every_block_through_another_tenants_flood(
    make_store: StoreFactory,
) -> None:
    """The issue's scenario: B stores its half of HOST, A puts four times HOST of its own."""
    store = registered(make_store(host_blocks=16, tenants=TenantShares.equal([ALICE, BOB])),
                       ALICE, BOB)
    bob_keys = keys(8)
    assert store.put(ns_of(BOB), bob_keys, blocks(8, seed=1)) == 8
    flood(store, ALICE, 64)
    assert held(store, BOB, bob_keys) == 8
    assert same_bytes(store.get(ns_of(BOB), bob_keys), blocks(8, seed=1))
    assert share(store, BOB).evicted_by_others == 0
    alice = share(store, ALICE)
    assert alice.used_bytes <= 8 * BLOCK_BYTES == alice.share_bytes  # its own blocks went
    assert alice.evicted_by_others == 0


def test_unused_share_is_lent_and_taken_back_by_eviction(make_store: StoreFactory) -> None:
    store = registered(make_store(host_blocks=16, tenants=TenantShares.equal([ALICE, BOB])),
                       ALICE, BOB)
    alice_keys = keys(16)
    for start in range(0, 16, 4):
        store.put(ns_of(ALICE), alice_keys[start : start + 4], blocks(4, seed=start))
    assert held(store, ALICE, alice_keys) == 16  # B's idle half, lent
    assert share(store, ALICE).used_bytes == 16 * BLOCK_BYTES
    assert store.put(ns_of(BOB), keys(8, start=100), blocks(8, seed=100)) == 8
    assert held(store, BOB, keys(8, start=100)) == 8
    assert held(store, ALICE, alice_keys[8:]) == 8  # it gave back the least recently used
    assert held(store, ALICE, alice_keys[:8]) == 0
    assert share(store, ALICE).evicted_by_others == 8
    assert share(store, BOB).evicted_by_others == 0


def test_a_tenant_over_its_share_loses_only_what_it_holds_beyond_it(
    make_store: StoreFactory,
) -> None:
    store = registered(make_store(host_blocks=16, tenants=TenantShares.equal([ALICE, BOB])),
                       ALICE, BOB)
    bob_keys = keys(12)
    for start in range(0, 12, 4):
        store.put(ns_of(BOB), bob_keys[start : start + 4], blocks(4, seed=start))
    flood(store, ALICE, 40)
    assert held(store, BOB, bob_keys) == 8  # its share, the most recent
    assert held(store, BOB, bob_keys[4:]) == 8
    assert share(store, BOB).evicted_by_others == 4
    assert share(store, BOB).used_bytes == share(store, BOB).share_bytes


def test_a_tenant_at_its_cap_evicts_its_own_blocks_even_with_room_free(
    make_store: StoreFactory,
) -> None:
    store = registered(
        make_store(host_blocks=16, tenants=TenantShares({BOB: 1.0}, caps={ALICE: 0.25})),
        ALICE, BOB)
    alice_keys = keys(12)
    for start in range(0, 12, 4):
        store.put(ns_of(ALICE), alice_keys[start : start + 4], blocks(4, seed=start))
    assert held(store, ALICE, alice_keys) == 4 and held(store, ALICE, alice_keys[8:]) == 4
    alice = share(store, ALICE)
    assert (alice.share_bytes, alice.cap_bytes) == (0, 4 * BLOCK_BYTES)
    assert alice.used_bytes == 4 * BLOCK_BYTES
    assert store.stats().tiers[Tier.HOST].evictions == 8
    assert alice.evicted_by_others == 0  # its own writes evicted them


def test_a_write_that_could_only_fit_in_another_tenants_guaranteed_room_is_refused(
    make_store: StoreFactory,
) -> None:
    """A's share is full of its pins, B holds its share: A's next block has nowhere to go but
    B's room, so the put fails and B keeps everything."""
    store = registered(make_store(host_blocks=16, tenants=TenantShares.equal([ALICE, BOB])),
                       ALICE, BOB)
    bob_keys, alice_keys = keys(8), keys(8, start=100)
    assert store.put(ns_of(BOB), bob_keys, blocks(8, seed=1)) == 8
    assert store.put(ns_of(ALICE), alice_keys, blocks(8, seed=2)) == 8
    assert store.pin(ns_of(ALICE), alice_keys) == 8
    with pytest.raises(CapacityError, match="guaranteed to other tenants"):
        store.put(ns_of(ALICE), keys(1, start=200), blocks(1, seed=3))
    assert held(store, BOB, bob_keys) == 8 and held(store, ALICE, alice_keys) == 8
    assert share(store, ALICE).used_bytes == 8 * BLOCK_BYTES  # the refused put holds nothing


def test_a_tenant_without_a_weight_only_borrows(make_store: StoreFactory) -> None:
    store = registered(make_store(host_blocks=16, tenants=TenantShares({ALICE: 1.0})),
                       ALICE, CAROL)
    carol_keys = keys(16)
    for start in range(0, 16, 4):
        store.put(ns_of(CAROL), carol_keys[start : start + 4], blocks(4, seed=start))
    assert held(store, CAROL, carol_keys) == 16  # nobody needed the room
    flood(store, ALICE, 16)
    assert held(store, CAROL, carol_keys) == 0
    assert share(store, CAROL).evicted_by_others == 16
    assert share(store, CAROL).share_bytes == 0


def test_without_shares_one_tenant_is_plain_lru(make_store: StoreFactory) -> None:
    store = registered(make_store(host_blocks=8), ALICE)
    all_keys = keys(16)
    for start in range(0, 16, 4):
        store.put(ns_of(ALICE), all_keys[start : start + 4], blocks(4, seed=start))
    store.get(ns_of(ALICE), all_keys[8:10])  # most recently used now
    store.put(ns_of(ALICE), keys(2, start=100), blocks(2, seed=9))
    assert held(store, ALICE, all_keys[8:10]) == 2 and held(store, ALICE, all_keys[10:12]) == 0


def test_new_shares_change_who_is_evicted_next_and_evict_nothing_themselves(
    make_store: StoreFactory,
) -> None:
    store = registered(make_store(host_blocks=16, tenants=TenantShares.equal([ALICE, BOB])),
                       ALICE, BOB)
    alice_keys, bob_keys = keys(8), keys(8, start=100)
    assert store.put(ns_of(ALICE), alice_keys, blocks(8, seed=1)) == 8
    assert store.put(ns_of(BOB), bob_keys, blocks(8, seed=2)) == 8
    store.set_tenant_shares(TenantShares({ALICE: 3.0, BOB: 1.0}))
    assert held(store, BOB, bob_keys) == 8  # over its new share, but nothing needed room
    assert share(store, BOB).share_bytes == 4 * BLOCK_BYTES
    store.put(ns_of(ALICE), keys(4, start=200), blocks(4, seed=3))
    # A put's head block is its most recently used (a chain's tail is worth nothing alone).
    assert held(store, BOB, bob_keys) == 4 and held(store, BOB, bob_keys[:4]) == 4
    assert held(store, ALICE, alice_keys) == 8
    assert share(store, BOB).evicted_by_others == 4


def test_evicted_blocks_are_demoted_into_their_owners_share_below(
    make_store: StoreFactory,
) -> None:
    """HOST victims go down to DISK charged to their own tenant, whose room there is
    honoured in turn: A's flood through both tiers leaves B's blocks in both."""
    store = registered(make_store(host_blocks=8, disk_blocks=16,
                                  tenants=TenantShares.equal([ALICE, BOB])), ALICE, BOB)
    bob_host, bob_disk = keys(4), keys(8, start=100)
    assert store.put(ns_of(BOB), bob_disk, blocks(8, seed=1), tier=Tier.DISK) == 8
    assert store.put(ns_of(BOB), bob_host, blocks(4, seed=2)) == 4
    flood(store, ALICE, 64)
    assert store.sidecar.locate(ns_of(BOB), bob_host)[Tier.HOST] == 4
    assert held(store, BOB, bob_disk) == 8
    assert same_bytes(store.get(ns_of(BOB), bob_disk), blocks(8, seed=1))
    for tier in (Tier.HOST, Tier.DISK):
        assert share(store, BOB, tier).evicted_by_others == 0
        assert share(store, ALICE, tier).used_bytes <= share(store, ALICE, tier).share_bytes
    assert share(store, ALICE, Tier.DISK).used_bytes > 0  # its HOST victims went down


def test_write_through_records_honour_disk_shares(make_store: StoreFactory) -> None:
    store = registered(make_store(host_blocks=8, disk_blocks=16,
                                  tenants=TenantShares.equal([ALICE, BOB])), ALICE, BOB)
    bob_keys = keys(8)
    assert store.put(ns_of(BOB), bob_keys, blocks(8, seed=1),
                     write_policy=WritePolicy.WRITE_THROUGH) == 8
    flood(store, ALICE, 48, write_policy=WritePolicy.WRITE_THROUGH)
    assert held(store, BOB, bob_keys) == 8  # half in HOST (its share there), all on DISK
    assert share(store, BOB, Tier.DISK).used_bytes == 8 * RECORD_BYTES
    assert share(store, BOB, Tier.DISK).evicted_by_others == 0
    assert same_bytes(store.get(ns_of(BOB), bob_keys), blocks(8, seed=1))


def test_every_byte_a_tier_holds_is_charged_to_exactly_one_tenant(
    make_store: StoreFactory,
) -> None:
    store = registered(make_store(host_blocks=12, gpu_blocks=4, disk_blocks=24,
                                  tenants=TenantShares({ALICE: 2.0, BOB: 1.0})),
                       ALICE, BOB, CAROL)
    for round_number in range(3):
        for tenant in (ALICE, BOB, CAROL):
            # C, guaranteed nothing, is refused once A and B hold their shares.
            flood(store, tenant, 12, salt=100 * round_number, refused=tenant == CAROL)
            flood(store, tenant, 4, salt=900, refused=True, tier=Tier.GPU)  # 4 of GPU's 4
        store.delete(ns_of(BOB), keys(4, start=100 * round_number))
    stats = store.stats().tiers
    for tier in (Tier.GPU, Tier.HOST, Tier.DISK):
        charged = sum(s.used_bytes for s in store.tenant_stats() if s.tier is tier)
        assert charged == stats[tier].used_bytes, tier


@pytest.mark.parametrize(("weights", "caps", "message"), [
    ({ALICE: 0.0}, {}, "alice's weight must be a positive number"),
    ({ALICE: -1.0}, {}, "positive"),
    ({ALICE: float("inf")}, {}, "positive"),
    ({}, {ALICE: 1.5}, r"alice's cap must be a fraction in \(0, 1\]"),
    ({}, {ALICE: 0.0}, "fraction"),
    ({ALICE: 1.0, BOB: 1.0}, {ALICE: 0.25}, "below its guaranteed share"),
])
def test_shares_that_do_not_fit_are_refused_by_name(
    weights: dict[str, float], caps: dict[str, float], message: str,
) -> None:
    with pytest.raises(ConfigError, match=message):
        TenantShares(weights, caps)


def test_a_share_in_bytes_takes_its_room_first_and_the_weights_split_the_rest(
    make_store: StoreFactory,
) -> None:
    """Alice is guaranteed 12 of HOST's 16 blocks in bytes; Bob and Carol, weighted 1 and 1,
    share the 4 left. Alice keeps her 12 through Bob's flood."""
    plan = TenantShares({BOB: 1.0, CAROL: 1.0}, sizes={(ALICE, Tier.HOST): 12 * BLOCK_BYTES})
    store = registered(make_store(host_blocks=16, tenants=plan), ALICE, BOB, CAROL)
    assert [share(store, t).share_bytes for t in (ALICE, BOB, CAROL)] == [
        12 * BLOCK_BYTES, 2 * BLOCK_BYTES, 2 * BLOCK_BYTES]
    alice_keys = keys(12)
    for start in range(0, 12, 4):
        store.put(ns_of(ALICE), alice_keys[start : start + 4], blocks(4, seed=start))
    flood(store, BOB, 64)
    assert held(store, ALICE, alice_keys) == 12
    assert share(store, ALICE).evicted_by_others == 0


def test_shares_in_bytes_that_do_not_fit_a_tier_are_refused_naming_it(
    make_store: StoreFactory,
) -> None:
    too_big = TenantShares(sizes={(ALICE, Tier.HOST): 12 * BLOCK_BYTES,
                                  (BOB, Tier.HOST): 8 * BLOCK_BYTES})
    with pytest.raises(ConfigError, match=r"the host shares \(alice .*, bob .*\) sum to"):
        make_store(host_blocks=16, tenants=too_big)
    store = registered(make_store(host_blocks=16, tenants=TenantShares.equal([ALICE, BOB])),
                       ALICE)
    with pytest.raises(ConfigError, match="the host shares"):
        store.set_tenant_shares(too_big)
    assert share(store, ALICE).share_bytes == 8 * BLOCK_BYTES  # nothing changed
    capped = TenantShares(caps={ALICE: 0.25}, sizes={(ALICE, Tier.HOST): 8 * BLOCK_BYTES})
    with pytest.raises(ConfigError, match=r"alice's cap .* is below its host share"):
        store.set_tenant_shares(capped)
    with pytest.raises(ConfigError, match="positive number of bytes"):
        TenantShares(sizes={(ALICE, Tier.HOST): 0})


def test_room_is_taken_from_each_tenant_over_its_share_down_to_its_share_only(
    make_store: StoreFactory,
) -> None:
    """A and B each hold 2 blocks beyond their share; C claims its 4: 2 from each, in turn,
    never 4 from the first it meets."""
    store = registered(
        make_store(host_blocks=12, tenants=TenantShares.equal([ALICE, BOB, CAROL])),
        ALICE, BOB, CAROL)
    for tenant in (ALICE, BOB):
        flood(store, tenant, 4, salt=0)
        store.put(ns_of(tenant), keys(2, start=10), blocks(2, seed=10))
    assert store.put(ns_of(CAROL), keys(4, start=20), blocks(4, seed=20)) == 4
    for tenant in (ALICE, BOB):
        assert share(store, tenant).used_bytes == share(store, tenant).share_bytes
        assert share(store, tenant).evicted_by_others == 2


def test_pins_and_read_leases_together_stop_at_the_share(make_store: StoreFactory) -> None:
    """A pins 2 and read-leases 2 of its 6 blocks: its share of 4, and no more (a further
    lease leases none, a further pin pins none). So its next put recycles its own other
    blocks, and B, past its share too, loses nothing to it. (Before, pins and leases were each
    bounded alone: A could hold twice its share unevictable, and B's put within its share
    waited 5 s and was refused.)"""
    store = registered(
        make_store(host_blocks=12, tenants=TenantShares.equal([ALICE, BOB, CAROL])),
        ALICE, BOB)
    alice_keys = keys(6, start=100)
    store.put(ns_of(ALICE), alice_keys, blocks(6, seed=1))
    assert store.pin(ns_of(ALICE), alice_keys[:2]) == 2
    lease = store.sidecar.acquire(ns_of(ALICE), alice_keys[2:], ttl_s=600)
    assert (len(lease.blocks), lease.num_cached) == (2, 4)
    more = store.sidecar.acquire(ns_of(ALICE), alice_keys[4:], ttl_s=600)
    assert len(more.blocks) == 0
    store.sidecar.release(more.lease_id)
    assert store.pin(ns_of(ALICE), alice_keys[4:]) == 0
    bob_keys = keys(6)
    store.put(ns_of(BOB), bob_keys, blocks(6, seed=10))  # B borrows C's idle share
    assert store.put(ns_of(ALICE), keys(2, start=200), blocks(2, seed=2)) == 2
    assert held(store, ALICE, alice_keys[:4]) == 4  # pinned and read: kept
    assert held(store, ALICE, alice_keys[4:]) == 0  # its own, recycled
    assert held(store, BOB, bob_keys) == 6 and share(store, BOB).evicted_by_others == 0
    store.sidecar.release(lease.lease_id)
    assert store.unpin(ns_of(ALICE), alice_keys[:2]) == 2


def test_acquires_at_once_never_lease_past_the_share_together(
    make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two acquires of one tenant at once, each let go of the lock while its blocks are
    promoted: the room each plans is charged before then, so together they lease no more than
    the share (before, each saw the whole room and 16 of a share of 8 were leased)."""
    store = registered(make_store(host_blocks=16, tenants=TenantShares.equal([ALICE, BOB])),
                       ALICE, BOB)
    alice_keys = keys(16)
    for start in range(0, 16, 4):
        store.put(ns_of(ALICE), alice_keys[start : start + 4], blocks(4, seed=start))
    promote = Mover.promote

    def slow_promote(self: Mover, *args: object, **kwargs: object) -> object:
        time.sleep(0.2)
        return promote(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Mover, "promote", slow_promote)
    leases: list[ReadLease] = []
    threads = [threading.Thread(target=lambda part=part: leases.append(
        store.sidecar.acquire(ns_of(ALICE), part, ttl_s=600))) for part in (alice_keys[:8], alice_keys[8:])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(len(lease.blocks) for lease in leases) == 8
    for lease in leases:
        store.sidecar.release(lease.lease_id)
    assert store.put(ns_of(BOB), keys(8, start=100), blocks(8, seed=1)) == 8


def test_a_tenant_pins_no_more_than_its_share(make_store: StoreFactory) -> None:
    """A pinned block cannot be evicted: pins past a tenant's share would hold room that is
    guaranteed to others, so the run of pinned blocks ends there."""
    store = registered(make_store(host_blocks=16, tenants=TenantShares.equal([ALICE, BOB])),
                       ALICE, BOB, CAROL)
    alice_keys = keys(12)
    for start in range(0, 12, 4):
        store.put(ns_of(ALICE), alice_keys[start : start + 4], blocks(4, seed=start))
    assert store.pin(ns_of(ALICE), alice_keys) == 8  # its share of HOST
    assert store.pin(ns_of(ALICE), alice_keys[:8]) == 8  # pinned again: takes no more room
    assert store.put(ns_of(CAROL), keys(1, start=200), blocks(1, seed=2)) == 1  # borrowed
    assert store.pin(ns_of(CAROL), keys(1, start=200)) == 0  # guaranteed nothing, pins nothing
    assert store.put(ns_of(BOB), keys(8, start=100), blocks(8, seed=1)) == 8  # its room is free
    assert held(store, ALICE, alice_keys[:8]) == 8
    assert held(store, CAROL, keys(1, start=200)) == 0
    assert store.unpin(ns_of(ALICE), alice_keys[:4]) == 4
    assert store.pin(ns_of(ALICE), alice_keys[8:12]) == 0  # gone: evicted for B
    assert store.pin(ns_of(ALICE), alice_keys[:4]) == 4


def test_a_tenant_read_leases_no_more_than_its_share(make_store: StoreFactory) -> None:
    """Blocks read cannot be evicted: A, holding all of HOST (borrowed while B was idle), read-
    leases only its share of it at once (the rest of the run is for the next call, or the
    stream), so B's put within its own share still finds room; a release gives the room back."""
    store = registered(make_store(host_blocks=16, tenants=TenantShares.equal([ALICE, BOB])),
                       ALICE, BOB)
    alice_keys = keys(16)
    for start in range(0, 16, 4):
        store.put(ns_of(ALICE), alice_keys[start : start + 4], blocks(4, seed=start))
    first = store.sidecar.acquire(ns_of(ALICE), alice_keys)
    assert (len(first.blocks), first.num_cached) == (8, 16)  # its share of HOST
    gets = store.stats().gets
    second = store.sidecar.acquire(ns_of(ALICE), alice_keys[8:])
    assert (len(second.blocks), second.num_cached) == (0, 8)  # none past its share
    assert store.stats().gets == gets  # the read that serves them counts it (the stream)
    store.sidecar.release(second.lease_id)
    assert store.put(ns_of(BOB), keys(8, start=100), blocks(8, seed=1)) == 8
    assert held(store, BOB, keys(8, start=100)) == 8
    assert share(store, BOB).used_bytes == 8 * BLOCK_BYTES
    store.sidecar.release(first.lease_id)
    third = store.sidecar.acquire(ns_of(ALICE), alice_keys[:8])
    assert len(third.blocks) == 8  # the room came back with the release
    store.sidecar.release(third.lease_id)


def test_without_guarantees_pins_are_unbounded(make_store: StoreFactory) -> None:
    store = registered(make_store(host_blocks=8), ALICE)
    assert store.put(ns_of(ALICE), keys(8), blocks(8, seed=1)) == 8
    assert store.pin(ns_of(ALICE), keys(8)) == 8


def _put_two_at_once(store: TieredStore, start: threading.Barrier, salt: int) -> None:
    start.wait()
    with contextlib.suppress(CapacityError):
        store.put(ns_of(BOB), keys(2, start=1000 + salt), blocks(2, seed=salt))


def test_concurrent_writes_never_take_the_same_excess_twice(make_store: StoreFactory) -> None:
    """An eviction demotes its victims with the lock let go; a second write choosing victims
    meanwhile must not count the first one's as its owner's excess still to give. A holds 2
    blocks beyond its share, B's two threads put 2 blocks each at once: A keeps its share."""
    for attempt in range(6):
        store = registered(make_store(host_blocks=8, disk_blocks=64,
                                      tenants=TenantShares.equal([ALICE, BOB])), ALICE, BOB)
        store.put(ns_of(ALICE), keys(6, start=100 * attempt), blocks(6, seed=1))
        store.put(ns_of(BOB), keys(2, start=100 * attempt), blocks(2, seed=2))
        start = threading.Barrier(2)
        threads = [threading.Thread(target=_put_two_at_once, args=(store, start, salt))
                   for salt in (10, 20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        alice = share(store, ALICE)
        assert alice.evicted_by_others <= 2, attempt
        assert alice.used_bytes >= alice.share_bytes == 4 * BLOCK_BYTES, attempt
        store.close(flush=False)
