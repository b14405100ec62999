"""``TieredStore.clear``: every block and session of the matching namespaces goes, in every
tier, pinned or not; busy blocks are skipped and counted; other namespaces are untouched."""

from __future__ import annotations

import threading

import pytest

from tests.support.tiny_blocks import BLOCK_BYTES, StoreFactory, blocks, keys, same_bytes
from tierkv import InvalidArgumentError, KVLayout, Namespace, Tier, TieredStore, WritePolicy
from tierkv.store import ClearResult

ALICE_A = Namespace("model-a", KVLayout(2, 2, 8, 4), tenant="alice")
ALICE_B = Namespace("model-b", KVLayout(2, 2, 8, 4), tenant="alice")
BOB_A = Namespace("model-a", KVLayout(2, 2, 8, 4), tenant="bob")
ALL = (ALICE_A, ALICE_B, BOB_A)


def filled(make_store: StoreFactory, **fields: object) -> TieredStore:
    """A store with 3 blocks and a session in each namespace of ``ALL``, HOST and DISK."""
    store = make_store(host_blocks=16, disk_blocks=32, **fields)
    for index, ns in enumerate(ALL):
        store.register(ns)
        store.put(ns, keys(3), blocks(3, seed=index), write_policy=WritePolicy.WRITE_THROUGH)
        store.save_session(ns, f"chat-{index}", [1, 2, 3])
    return store


def test_a_tenant_clear_removes_its_blocks_and_sessions_everywhere_and_nothing_else(
        make_store: StoreFactory) -> None:
    store = filled(make_store)
    store.pin(ALICE_A, keys(2))  # pinned blocks go too
    calls: list[tuple[int, int]] = []
    result = store.clear(tenant="alice", progress=lambda done, total: calls.append((done, total)))
    assert result == ClearResult(2, 6, 6 * BLOCK_BYTES, 2, 0)
    assert calls[0] == (0, 6) and calls[-1] == (6, 6)
    for ns in (ALICE_A, ALICE_B):
        assert store.lookup(ns, keys(3)) == 0
    assert store.list_sessions("alice") == []
    assert same_bytes(store.get(BOB_A, keys(3)), blocks(3, seed=2))
    assert [s.session_id for s in store.list_sessions("bob")] == ["chat-2"]
    stats = store.stats()
    assert stats.tiers[Tier.HOST].num_blocks == stats.tiers[Tier.DISK].num_blocks == 3
    assert stats.tiers[Tier.HOST].used_bytes == 3 * BLOCK_BYTES
    assert (stats.num_pinned, stats.num_sessions) == (0, 1)
    assert store.is_registered(ALICE_A)  # still usable as it is
    store.put(ALICE_A, keys(1), blocks(1))
    assert store.lookup(ALICE_A, keys(1)) == 1


def test_filters_combine_model_and_namespace(make_store: StoreFactory) -> None:
    store = filled(make_store)
    assert store.clear(model_id="model-a").num_blocks == 6
    assert store.lookup(ALICE_B, keys(3)) == 3
    assert store.clear(namespace=ALICE_B) == ClearResult(1, 3, 3 * BLOCK_BYTES, 1, 0)
    assert store.clear(tenant="bob", model_id="model-b") == ClearResult(0, 0, 0, 0, 0)
    assert store.clear().num_blocks == 0
    assert store.stats().tiers[Tier.DISK].used_bytes == 0
    with pytest.raises(InvalidArgumentError, match="namespace"):
        store.clear(namespace="model-a")  # type: ignore[arg-type]


def test_a_clear_is_durable_across_a_restart(make_store: StoreFactory) -> None:
    store = filled(make_store)
    store.clear(tenant="alice")
    store.close()
    reopened = make_store(host_blocks=16, disk_blocks=32)
    assert reopened.list_sessions("alice") == []
    for ns in ALL:
        reopened.register(ns)
    assert [reopened.lookup(ns, keys(3)) for ns in ALL] == [0, 0, 3]


def test_leased_blocks_are_misses_at_once_and_their_room_comes_back_at_release(
    make_store: StoreFactory,
) -> None:
    store = filled(make_store)
    used_bytes = store.stats().tiers[Tier.HOST].used_bytes
    lease = store.acquire(ALICE_A, keys(2), owner="reader")
    result = store.clear(tenant="alice")
    assert (result.num_blocks, result.num_busy) == (6, 2)
    assert store.lookup(ALICE_A, keys(3)) == 0
    assert store.stats().tiers[Tier.HOST].used_bytes == used_bytes - 4 * BLOCK_BYTES
    store.release(lease.lease_id, owner="reader")
    assert store.stats().tiers[Tier.HOST].used_bytes == used_bytes - 6 * BLOCK_BYTES
    assert store.clear(tenant="alice") == ClearResult(2, 0, 0, 0, 0)


def test_a_large_clear_reports_progress_in_batches(make_store: StoreFactory) -> None:
    store = make_store(host_blocks=5000)
    store.register(ALICE_A)
    store.put(ALICE_A, keys(5000), blocks(5000))
    calls: list[tuple[int, int]] = []
    result = store.clear(progress=lambda done, total: calls.append((done, total)))
    assert result.num_blocks == 5000 and len(calls) >= 3
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert calls[-1] == (5000, 5000) and store.stats().tiers[Tier.HOST].used_bytes == 0


def test_a_clear_racing_with_puts_and_gets_leaves_consistent_books(
        make_store: StoreFactory) -> None:
    store = make_store(host_blocks=64, disk_blocks=256)
    for ns in ALL:
        store.register(ns)
    stop = threading.Event()
    errors: list[BaseException] = []

    def traffic(ns: Namespace, seed: int) -> None:
        try:
            round_ = 0
            while not stop.is_set():
                chain = keys(8, start=8 * (round_ % 4), salt=str(seed))
                data = blocks(8, seed=seed + round_ % 4)
                store.put(ns, chain, data, write_policy=WritePolicy.WRITE_THROUGH)
                got = store.get(ns, chain)
                assert same_bytes(got, data[: len(got)])  # a hit is the bytes, or a miss
                round_ += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=traffic, args=(ns, 100 * i)) for i, ns in enumerate(ALL)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(20):
            store.clear(tenant="alice")
            store.clear(model_id="model-a")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
    store.clear()
    stats = store.stats()
    for tier in (Tier.HOST, Tier.DISK):
        assert (stats.tiers[tier].num_blocks, stats.tiers[tier].used_bytes) == (0, 0)
    assert all(s.num_blocks == 0 for s in store.namespace_stats())
