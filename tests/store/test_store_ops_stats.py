"""The counters operators read: bytes moved between tiers, leases open and expired, sessions,
and each namespace's blocks, bytes and sessions (``TieredStore.namespace_stats``).

The counters agree with each other: ``bytes_moved`` with the per-tier promotion and demotion
counts under a mixed workload, ``leases_expired`` counts each lease once however it ends, and
``num_sessions`` follows saves, deletes, expiry and clears.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.support.fake_clock import FakeClock
from tests.support.tiny_blocks import BLOCK_BYTES, StoreFactory, blocks, keys
from tierkv import KVLayout, LeaseStateError, Namespace, Tier, WritePolicy
from tierkv.store import NamespaceStats


def test_bytes_moved_counts_each_route_a_copy_took(
        make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(gpu_blocks=2, host_blocks=2, disk_blocks=8, promote_on_read=False)
    store.register(namespace)
    for i in range(0, 6, 2):
        store.put(namespace, keys(2, start=i), blocks(2, seed=i), tier=Tier.GPU)
    moved = store.stats().bytes_moved
    # Blocks 0-3 went GPU -> HOST (4 blocks), 0 and 1 then HOST -> DISK.
    assert moved == {(Tier.GPU, Tier.HOST): 4 * BLOCK_BYTES, (Tier.HOST, Tier.DISK): 2 * BLOCK_BYTES}
    assert store.prefetch_async(namespace, keys(2), Tier.HOST).result() == 2
    moved = store.stats().bytes_moved
    assert moved[(Tier.DISK, Tier.HOST)] == 2 * BLOCK_BYTES
    as_dict = store.stats().as_dict()
    assert as_dict["bytes_moved"]["gpu->host"] == 4 * BLOCK_BYTES
    assert json.loads(json.dumps(as_dict)) == as_dict  # JSON-able as it is


def test_leases_open_and_expired_are_counted(make_store: StoreFactory, namespace: Namespace) -> None:
    clock = FakeClock()
    store = make_store(host_blocks=8, clock=clock)
    store.register(namespace)
    store.put(namespace, keys(2), blocks(2))
    read = store.sidecar.acquire(namespace, keys(2), ttl_s=5.0, owner="a")
    store.sidecar.allocate(namespace, keys(2, start=10), ttl_s=5.0, owner="a")
    stats = store.stats()
    assert (stats.num_leases, stats.leases_expired) == (2, 0) == (store.sidecar.num_leases, 0)
    store.sidecar.release(read.lease_id, owner="a")
    clock.now_s += 6.0
    assert store.sidecar.expire_leases() == 1  # the write lease; the read lease was released
    stats = store.stats()
    assert (stats.num_leases, stats.leases_expired) == (0, 1)


def test_sessions_are_counted_per_namespace_and_in_all(
        make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(disk_blocks=8)
    other = Namespace("other-model", KVLayout(1, 1, 8, 4), tenant="bob")
    for ns in (namespace, other):
        store.register(ns)
    store.save_session(namespace, "a", [1, 2, 3])
    store.save_session(namespace, "b", [1])
    store.save_session(other, "c", [4])
    store.save_session(namespace, "a", [5])  # replaced: still one session
    assert store.stats().num_sessions == 3
    by_model = {s.namespace.model_id: s.num_sessions for s in store.namespace_stats()}
    assert by_model == {"test-model": 2, "other-model": 1}
    assert store.delete_session("b")
    assert store.stats().num_sessions == 2
    assert [s.num_sessions for s in store.namespace_stats("bob")] == [1]


def test_sessions_are_counted_after_a_restart(
        make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(disk_blocks=8)
    store.register(namespace)
    store.save_session(namespace, "a", [1, 2])
    store.close()
    reopened = make_store(disk_blocks=8)
    assert reopened.stats().num_sessions == 1
    assert [s.num_sessions for s in reopened.namespace_stats()] == [1]


def test_namespace_stats_count_each_block_once_and_follow_deletes(
        make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=8, disk_blocks=16)
    big = Namespace("big", KVLayout(2, 2, 8, 8), tenant="bob")  # blocks of 1 KiB
    for ns in (namespace, big):
        store.register(ns)
    # write_through: each block sits in HOST and on DISK, and counts once.
    store.put(namespace, keys(3), blocks(3), write_policy=WritePolicy.WRITE_THROUGH)
    store.put(big, keys(2), blocks(2, layout=big.layout))
    assert store.namespace_stats() == [
        NamespaceStats(big, 2, 2 * big.layout.bytes_per_block, 0),
        NamespaceStats(namespace, 3, 3 * BLOCK_BYTES, 0),
    ]
    assert store.namespace_stats("default") == [NamespaceStats(namespace, 3, 3 * BLOCK_BYTES, 0)]
    assert store.namespace_stats("nobody") == []
    store.delete(namespace, keys(2))
    assert store.namespace_stats("default")[0].num_blocks == 1
    assert store.namespace_stats("default")[0].as_dict() == {
        "tenant": "default", "model_id": "test-model", "layout": "2x2x8/4/fp16", "tp_rank": 0,
        "tp_size": 1, "num_blocks": 1, "stored_bytes": BLOCK_BYTES, "num_sessions": 0,
    }


def test_evicted_blocks_leave_the_namespace_counts(
        make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=4)
    store.register(namespace)
    store.put(namespace, keys(4), blocks(4))
    store.put(namespace, keys(4, start=4), blocks(4, seed=1))  # evicts the first four
    (stats,) = store.namespace_stats()
    assert stats.num_blocks == 4 == store.stats().tiers[Tier.HOST].num_blocks


def test_a_same_host_acquire_counts_hits_and_misses_as_a_get_does(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path,
) -> None:
    # Acquire (the shared-memory read) counted hits only: a missing block was no miss, and a
    # block read from DISK no miss in HOST, so the hit ratio of same-host clients was 100%.
    counts = []
    for read in ("get", "acquire"):
        store = make_store(host_blocks=6, disk_blocks=16, disk_path=tmp_path / read)
        store.register(namespace)
        for start in (0, 3):
            store.put(namespace, keys(3, start=start), blocks(3))
        store.put(namespace, keys(2, salt="other"), blocks(2))  # blocks 0 and 1 go to disk
        wanted = keys(7)  # the last one was never stored
        if read == "get":
            assert store.get(namespace, wanted).shape[0] == 6
        else:  # as a client reads: the blocks a lease could not hold in a second one
            done = 0
            while True:
                lease = store.sidecar.acquire(namespace, wanted[done:], owner="reader")
                store.sidecar.release(lease.lease_id, owner="reader")
                done += len(lease.blocks)
                if not lease.blocks or len(lease.blocks) >= lease.num_cached:
                    break
            assert done == 6
        counts.append({tier: (t.hits, t.misses) for tier, t in store.stats().tiers.items()})
    by_get, by_acquire = counts
    assert by_acquire == by_get
    assert by_get[Tier.HOST] == (4, 3) and by_get[Tier.DISK] == (2, 1)


# --- the counters under mixed workloads --------------------------------------------------------


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
            store.prefetch_async(namespace, chain, rng.choice([Tier.GPU, Tier.HOST])).result()
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
    released = store.sidecar.acquire(namespace, keys(1), ttl_s=5.0, owner="a")
    late = store.sidecar.acquire(namespace, keys(2), ttl_s=5.0, owner="a")
    write = store.sidecar.allocate(namespace, keys(2, start=10), ttl_s=5.0, owner="a")
    aborted = store.sidecar.allocate(namespace, keys(1, start=20), ttl_s=5.0, owner="a")
    store.sidecar.release(released.lease_id, owner="a")
    store.sidecar.abort(aborted.lease_id, owner="a")
    clock.now_s += 6.0
    with pytest.raises(LeaseStateError, match="expired"):
        store.sidecar.release(late.lease_id, owner="a")  # reaps both, reports this one expired
    with pytest.raises(LeaseStateError, match="expired"):
        store.sidecar.commit(write.lease_id, owner="a", checksums=[0, 0])
    assert store.sidecar.expire_leases() == 0
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
    assert store.list_sessions() == [s for s in store.list_sessions()
                                              if s.session_id == "a"]  # drops "b"
    assert store.stats().num_sessions == 2
    assert {(s.namespace.tenant, s.num_sessions) for s in store.namespace_stats()} == {
        ("default", 1), ("bob", 1)}
    assert store.delete_session("a")
    assert store.clear(tenant="bob").num_sessions == 1
    stats = store.stats()
    assert stats.num_sessions == 0
    assert all(s.num_sessions == 0 for s in store.namespace_stats())
    store.close()
    assert make_store(host_blocks=8, disk_blocks=16).stats().num_sessions == 0
