"""The adaptive policy (``eviction=Eviction.ADAPTIVE``) in a real store: a set of blocks read
again and again survives scans of blocks used once, where the LRU loses it every scan; pinned
and leased blocks are never its victims; without frequency to tell, it keeps the recent, as the
LRU does. (Both property tests of the store run under either policy.)"""

from __future__ import annotations

from tests.support.tiny_blocks import StoreFactory, block_for, blocks, key, keys, same_bytes
from tierkv import Namespace, TieredStore
from tierkv.config import Eviction
from tierkv.types import PutDetail

HOST_BLOCKS = 64


def store_of(make_store: StoreFactory, namespace: Namespace,
             eviction: Eviction = Eviction.ADAPTIVE) -> TieredStore:
    store = make_store(host_blocks=HOST_BLOCKS, eviction=eviction)
    store.register(namespace)
    return store


def put_block(store: TieredStore, namespace: Namespace, i: int) -> None:
    store.put(namespace, [key(i)], block_for(i)[None])


def hot_reads_between_scans(store: TieredStore, namespace: Namespace, hot: range,
                            num_rounds: int, scan_blocks: int) -> list[int]:
    """Rounds of: read the ``hot`` blocks (put again when missing), then put ``scan_blocks``
    new blocks once. The hot hits of each round."""
    scan = iter(range(1000, 10**6))
    hits = []
    for _ in range(num_rounds):
        hits.append(0)
        for i in hot:
            if store.lookup(namespace, [key(i)]) == 1:
                assert same_bytes(store.get(namespace, [key(i)])[0], block_for(i))
                hits[-1] += 1
            else:
                put_block(store, namespace, i)
        for _ in range(scan_blocks):
            put_block(store, namespace, next(scan))
    return hits


def hot_hits_after_scans(make_store: StoreFactory, namespace: Namespace,
                         eviction: Eviction) -> tuple[int, int]:
    """Fifteen rounds of 32 hot blocks and 200 new ones: the hot hits of the last five
    rounds, and of how many reads."""
    hits = hot_reads_between_scans(store_of(make_store, namespace, eviction), namespace,
                                   range(32), 15, 200)
    return sum(hits[10:]), 5 * 32


def test_blocks_read_often_outlive_scans_under_the_adaptive_policy(
        make_store: StoreFactory, namespace: Namespace) -> None:
    adaptive, reads = hot_hits_after_scans(make_store, namespace, Eviction.ADAPTIVE)
    lru, _ = hot_hits_after_scans(make_store, namespace, Eviction.LRU)
    assert lru == 0  # every scan flushes a 64-block LRU
    assert adaptive >= 0.9 * reads, (adaptive, reads)


def test_a_prefix_just_read_is_not_evicted_by_the_put_that_continues_it(
        make_store: StoreFactory, namespace: Namespace) -> None:
    """Its filter on and main full of blocks used often, a new prompt's blocks lose every duel:
    the put of its continuation must not evict the prefix it continues (the tail just read, in
    the window), or the continuation would be held behind a missing head."""
    store = store_of(make_store, namespace)
    hot = range(HOST_BLOCKS - 1)
    hot_reads_between_scans(store, namespace, hot, 8, 100)
    assert sum(store.lookup(namespace, [key(i)]) for i in hot) >= HOST_BLOCKS - 4
    chain = keys(8, salt="new-prompt")
    store.put(namespace, chain[:4], blocks(4, seed=1))
    assert same_bytes(store.get(namespace, chain[:4]), blocks(4, seed=1))
    store.put(namespace, chain[4:], blocks(4, seed=2), detail=PutDetail(parent_hash=chain[3]))
    held = [i for i in range(8) if store.lookup(namespace, [chain[i]])]
    assert held == list(range(len(held))), held  # a prefix, or nothing: never a stranded tail
    assert store.lookup(namespace, chain) == 8


def test_recent_blocks_are_kept_when_nothing_is_used_twice(
        make_store: StoreFactory, namespace: Namespace) -> None:
    store = store_of(make_store, namespace)
    for i in range(500):
        put_block(store, namespace, i)
    held = [i for i in range(500) if store.lookup(namespace, [key(i)])]
    assert len(held) == HOST_BLOCKS and held == list(range(500 - HOST_BLOCKS, 500))


def test_pinned_and_leased_blocks_are_never_its_victims(
        make_store: StoreFactory, namespace: Namespace) -> None:
    store = store_of(make_store, namespace)
    for i in range(8):
        put_block(store, namespace, i)
    assert store.pin(namespace, [key(i) for i in range(4)]) == 4
    lease = store.sidecar.acquire(namespace, [key(i) for i in range(4, 8)])
    try:
        for i in range(1000, 1600):  # ten times the tier, each used once
            put_block(store, namespace, i)
        assert all(store.lookup(namespace, [key(i)]) == 1 for i in range(8))
    finally:
        store.sidecar.release(lease.lease_id)
    assert same_bytes(store.get(namespace, [key(0)])[0], block_for(0))
