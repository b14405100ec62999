"""The adaptive policy (``eviction=Eviction.ADAPTIVE``) in a real store: a set of blocks read
again and again survives scans of blocks used once, where the LRU loses it every scan; pinned
and leased blocks are never its victims; without frequency to tell, it keeps the recent, as the
LRU does. (Both property tests of the store run under either policy.)"""

from __future__ import annotations

from tests.support.tiny_blocks import StoreFactory, block_for, key, same_bytes
from tierkv import Namespace
from tierkv.config import Eviction

HOST_BLOCKS = 64


def hot_hits_after_scans(make_store: StoreFactory, namespace: Namespace,
                         eviction: Eviction) -> tuple[int, int]:
    """Fifteen rounds of: read 32 hot blocks (put again when missing), then put 200 new blocks
    once. The hot hits of the last five rounds, and of how many reads."""
    store = make_store(host_blocks=HOST_BLOCKS, eviction=eviction)
    store.register(namespace)
    hot = list(range(32))
    scan = iter(range(1000, 10**6))
    hits = reads = 0
    for round_ in range(15):
        for i in hot:
            found = store.lookup(namespace, [key(i)]) == 1
            if found:
                assert same_bytes(store.get(namespace, [key(i)])[0], block_for(i))
            else:
                store.put(namespace, [key(i)], block_for(i)[None])
            if round_ >= 10:
                hits += found
                reads += 1
        for _ in range(200):
            i = next(scan)
            store.put(namespace, [key(i)], block_for(i)[None])
    return hits, reads


def test_blocks_read_often_outlive_scans_under_the_adaptive_policy(
        make_store: StoreFactory, namespace: Namespace) -> None:
    adaptive, reads = hot_hits_after_scans(make_store, namespace, Eviction.ADAPTIVE)
    lru, _ = hot_hits_after_scans(make_store, namespace, Eviction.LRU)
    assert lru == 0  # every scan flushes a 64-block LRU
    assert adaptive >= 0.9 * reads, (adaptive, reads)


def test_recent_blocks_are_kept_when_nothing_is_used_twice(
        make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=HOST_BLOCKS, eviction=Eviction.ADAPTIVE)
    store.register(namespace)
    for i in range(500):
        store.put(namespace, [key(i)], block_for(i)[None])
    held = [i for i in range(500) if store.lookup(namespace, [key(i)])]
    assert len(held) == HOST_BLOCKS and held == list(range(500 - HOST_BLOCKS, 500))


def test_pinned_and_leased_blocks_are_never_its_victims(
        make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=HOST_BLOCKS, eviction=Eviction.ADAPTIVE)
    store.register(namespace)
    for i in range(8):
        store.put(namespace, [key(i)], block_for(i)[None])
    assert store.pin(namespace, [key(i) for i in range(4)]) == 4
    lease = store.acquire(namespace, [key(i) for i in range(4, 8)])
    try:
        for i in range(1000, 1600):  # ten times the tier, each used once
            store.put(namespace, [key(i)], block_for(i)[None])
        assert all(store.lookup(namespace, [key(i)]) == 1 for i in range(8))
    finally:
        store.release(lease.lease_id)
    assert same_bytes(store.get(namespace, [key(0)])[0], block_for(0))
