"""Review attacks on the operator's counters: ``bytes_moved`` agrees with the per-tier
promotion and demotion counts under a mixed workload, ``leases_expired`` counts each lease
once however it ends, and ``num_sessions`` follows saves, deletes, expiry and clears."""

from __future__ import annotations

import random

import pytest

from tests.support.fake_clock import FakeClock
from tests.support.tiny_blocks import BLOCK_BYTES, StoreFactory, blocks, keys
from tierkv import LeaseStateError, Namespace, Tier, WritePolicy


def test_bytes_moved_agrees_with_every_tiers_promotions_and_demotions(
        make_store: StoreFactory, namespace: Namespace) -> None:
    """Puts into GPU and HOST, gets, prefetches and pins at random (one block size): the bytes
    moved into each tier are its promotions and demotions in, times the block's bytes, and
    the routes' totals are the store's promotions and demotions."""
    store = make_store(gpu_blocks=4, host_blocks=8, disk_blocks=64)
    store.register(namespace)
    rng = random.Random(3)
    for step in range(200):
        start = rng.randrange(40)
        chain = keys(rng.randint(1, 3), start=start)
        action = rng.randrange(4)
        if action == 0:
            store.put(namespace, chain, blocks(len(chain), seed=start),
                      tier=rng.choice([Tier.GPU, Tier.HOST]))
        elif action == 1:
            store.get(namespace, chain)
        elif action == 2:
            store.prefetch(namespace, chain, rng.choice([Tier.GPU, Tier.HOST])).result()
        elif step % 7 == 0:
            store.delete(namespace, chain)
        store.wait_for_background()
    stats = store.stats()
    into = {tier: 0 for tier in Tier if tier in stats.tiers}
    promotions = demotions = 0
    for (source, destination), num_bytes in stats.bytes_moved.items():
        assert num_bytes % BLOCK_BYTES == 0 and source != destination
        into[destination] += num_bytes
        if destination < source:
            promotions += num_bytes // BLOCK_BYTES
        else:
            demotions += num_bytes // BLOCK_BYTES
    for tier, num_bytes in into.items():
        t = stats.tiers[tier]
        assert num_bytes == (t.promotions_in + t.demotions_in) * BLOCK_BYTES, tier
    assert (promotions, demotions) == (stats.promotions, stats.demotions)
    assert stats.promotions and stats.demotions  # both happened


def test_each_lease_is_counted_expired_once_however_it_ends(
        make_store: StoreFactory, namespace: Namespace) -> None:
    clock = FakeClock()
    store = make_store(host_blocks=8, clock=clock)
    store.register(namespace)
    store.put(namespace, keys(2), blocks(2))
    released = store.acquire(namespace, keys(1), ttl_s=5.0, owner="a")
    late = store.acquire(namespace, keys(2), ttl_s=5.0, owner="a")
    write = store.allocate(namespace, keys(2, start=10), ttl_s=5.0, owner="a")
    aborted = store.allocate(namespace, keys(1, start=20), ttl_s=5.0, owner="a")
    store.release(released.lease_id, owner="a")
    store.abort(aborted.lease_id, owner="a")
    clock.now_s += 6.0
    with pytest.raises(LeaseStateError, match="expired"):
        store.release(late.lease_id, owner="a")  # reaps both, reports this one expired
    with pytest.raises(LeaseStateError, match="expired"):
        store.commit(write.lease_id, owner="a", checksums=[0, 0])
    assert store.expire_leases() == 0
    stats = store.stats()
    assert (stats.num_leases, stats.leases_expired) == (0, 2)
    assert store.lookup(namespace, keys(2, start=10)) == 0


def test_num_sessions_follows_saves_deletes_expiry_and_clears(
        make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=8, disk_blocks=16)
    store.register(namespace)
    other = namespace.with_tenant("bob")
    store.register(other)
    store.save_session(namespace, "a", [1])
    store.save_session(namespace, "b", [2], ttl_s=1e-9)  # expired by the next call
    store.save_session(other, "c", [3], ttl_s=3600.0)
    store.put(other, keys(1), blocks(1), write_policy=WritePolicy.WRITE_THROUGH)
    assert store.list_sessions("default") == [s for s in store.list_sessions("default")
                                              if s.session_id == "a"]  # drops "b"
    assert store.stats().num_sessions == 2
    assert {(s.namespace.tenant, s.num_sessions) for s in store.namespace_stats()} == {
        ("default", 1), ("bob", 1)}
    assert store.delete_session("default", "a")
    assert store.clear(tenant="bob").num_sessions == 1
    stats = store.stats()
    assert stats.num_sessions == 0
    assert all(s.num_sessions == 0 for s in store.namespace_stats())
    store.close()
    assert make_store(host_blocks=8, disk_blocks=16).stats().num_sessions == 0
