"""``TieredStore.clear``: every block and session of the matching namespaces goes, in every
tier, pinned or not; busy blocks are skipped and counted; other namespaces are untouched.

A clear also holds against what is in flight: leased bytes through a clear and the puts after
it, blocks moving between tiers, sessions saved during a clear, every tier and pin; and what a
reopened store serves after all of it is the bytes stored under its key, or a miss.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.support.fake_clock import FakeClock
from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, StoreFactory, blocks, keys, same_bytes
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
    assert store.list_sessions(tenant="alice") == []
    assert same_bytes(store.get(BOB_A, keys(3)), blocks(3, seed=2))
    assert [s.session_id for s in store.list_sessions(tenant="bob")] == ["chat-2"]
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
    assert reopened.list_sessions(tenant="alice") == []
    for ns in ALL:
        reopened.register(ns)
    assert [reopened.lookup(ns, keys(3)) for ns in ALL] == [0, 0, 3]


def test_leased_blocks_are_misses_at_once_and_their_room_comes_back_at_release(
    make_store: StoreFactory,
) -> None:
    store = filled(make_store)
    used_bytes = store.stats().tiers[Tier.HOST].used_bytes
    lease = store.sidecar.acquire(ALICE_A, keys(2), owner="reader")
    result = store.clear(tenant="alice")
    assert (result.num_blocks, result.num_busy) == (6, 2)
    assert store.lookup(ALICE_A, keys(3)) == 0
    assert store.stats().tiers[Tier.HOST].used_bytes == used_bytes - 4 * BLOCK_BYTES
    store.sidecar.release(lease.lease_id, owner="reader")
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


# --- clear under load: leases, blocks between tiers, sessions, pins, a reopened store ----------


KEPT = Namespace("kept", TINY_LAYOUT, tenant="alice")
CLEARED = Namespace("cleared", TINY_LAYOUT, tenant="bob")


@pytest.fixture
def slab_of() -> Iterator[object]:
    """Map a store's HOST slab as a same-host client does (by name, under /dev/shm)."""
    maps: list[mmap.mmap] = []

    def open_slab(store: TieredStore) -> np.ndarray:
        fd = os.open(f"/dev/shm/{store.sidecar.host_shm_name}", os.O_RDWR)
        try:
            maps.append(mmap.mmap(fd, 0))
        finally:
            os.close(fd)
        return np.frombuffer(maps[-1], np.uint8)

    yield open_slab
    for mapping in maps:
        with contextlib.suppress(BufferError):
            mapping.close()


def raw(data: torch.Tensor) -> bytes:
    return data.contiguous().view(torch.uint8).numpy().tobytes()


def test_leased_bytes_survive_a_clear_and_the_puts_that_follow_it(
        make_store: StoreFactory, slab_of: object) -> None:
    """A reader holding a lease (the shm Acquire) through a clear keeps reading the bytes it
    was given while puts fill the HOST tier and put other bytes under the same keys; after
    its release a clear takes them, and the keys then serve only the new bytes."""
    store = make_store(host_blocks=8, disk_blocks=32)
    store.register(CLEARED)
    old = blocks(3, seed=1)
    store.put(CLEARED, keys(3), old, write_policy=WritePolicy.WRITE_THROUGH)
    lease = store.sidecar.acquire(CLEARED, keys(2), owner="reader")
    result = store.clear(namespace=CLEARED)
    assert (result.num_blocks, result.num_busy) == (3, 2)
    assert store.lookup(CLEARED, keys(3)) == 0  # misses at once, leased or not
    new = blocks(3, seed=2)
    store.put(CLEARED, keys(3), new)  # new bytes under the same keys, beside the leased ones
    store.put(CLEARED, keys(6, start=10), blocks(6, seed=3))  # HOST pressure
    slab = slab_of(store)  # type: ignore[operator]
    for index, extents in enumerate(lease.blocks):
        leased = b"".join(slab[o : o + n].tobytes() for o, n in extents)
        assert leased == raw(old[index])
    assert same_bytes(store.get(CLEARED, keys(3)), new)
    store.sidecar.release(lease.lease_id, owner="reader")
    store.wait_for_background()
    assert store.clear(namespace=CLEARED).num_busy == 0
    assert store.lookup(CLEARED, keys(3)) == 0
    store.put(CLEARED, keys(3), new, write_policy=WritePolicy.WRITE_THROUGH)
    assert same_bytes(store.get(CLEARED, keys(3)), new)


def test_a_clear_during_demotions_leaves_nothing_to_come_back_at_the_next_start(
        make_store: StoreFactory, tmp_path: object) -> None:
    """Puts of one namespace keep demoting (HOST -> DISK) the blocks of another while that one
    is cleared: busy blocks are cleared too (freed when their copies end), and a store
    reopened on the same disk (after a flush) serves none of them; the writer's blocks come
    back bit-exact."""
    store = make_store(host_blocks=16, disk_blocks=512)
    for ns in (KEPT, CLEARED):
        store.register(ns)
    for start in range(0, 64, 8):  # most demoted to disk already
        store.put(CLEARED, keys(8, start=start, salt="c"), blocks(8, seed=start))
    stop = threading.Event()
    written: list[int] = []
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            round_ = 0
            while not stop.is_set() and round_ < 60:
                store.put(KEPT, keys(4, start=4 * round_, salt="k"), blocks(4, seed=round_))
                written.append(round_)
                round_ += 1
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        cleared = skipped = 0
        while thread.is_alive() or not cleared:
            result = store.clear(namespace=CLEARED)
            cleared += result.num_blocks
            skipped += result.num_busy
            store.put(CLEARED, keys(8, start=100, salt="c"), blocks(8, seed=6))  # more to demote
    finally:
        stop.set()
        thread.join()
    assert errors == []
    store.clear(namespace=CLEARED)
    assert store.namespace_stats("bob")[0].num_blocks == 0
    assert cleared >= 64
    store.close()
    reopened = make_store(host_blocks=16, disk_blocks=512)
    assert reopened.lookup(CLEARED, keys(64, salt="c")) == 0
    assert reopened.lookup(CLEARED, keys(8, start=100, salt="c")) == 0
    assert reopened.namespace_stats("bob") == [] or reopened.namespace_stats("bob")[0].num_blocks == 0
    for round_ in written:
        chain = keys(4, start=4 * round_, salt="k")
        got = reopened.get(KEPT, chain)
        assert got.shape[0] == 4 and same_bytes(got, blocks(4, seed=round_))


def test_sessions_saved_during_clears_are_the_same_after_a_restart(
        make_store: StoreFactory) -> None:
    """Sessions saved (and saved again) while clears delete them: whatever the store holds when
    the dust settles, a reopened store holds exactly that (memory and disk agree)."""
    store = make_store(host_blocks=8, disk_blocks=64)
    store.register(CLEARED)
    stop = threading.Event()
    errors: list[BaseException] = []

    def saver(index: int) -> None:
        try:
            round_ = 0
            while not stop.is_set() and round_ < 300:
                store.save_session(CLEARED, f"s{index}-{round_ % 5}", [index, round_])
                round_ += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        while any(thread.is_alive() for thread in threads):
            store.clear(tenant="bob")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []

    def held(s: TieredStore) -> dict[str, tuple[int, ...]]:
        return {info.session_id: s.resume_session(info.session_id, tenant="bob").token_ids
                for info in s.list_sessions(tenant="bob")}

    before = held(store)
    assert store.stats().num_sessions == len(before)
    store.close()
    reopened = make_store(host_blocks=8, disk_blocks=64)
    assert held(reopened) == before
    assert reopened.stats().num_sessions == len(before)


def test_a_clear_empties_every_tier_and_pin_and_the_counts_follow(
        make_store: StoreFactory) -> None:
    """GPU (emulated), HOST and DISK copies and pins with and without a TTL all go; the tiers'
    bytes and blocks, the pins and the namespace counts are zero after it, and the kept
    namespace's figures are unchanged."""
    clock = FakeClock()
    store = make_store(gpu_blocks=4, host_blocks=8, disk_blocks=32, clock=clock)
    for ns in (KEPT, CLEARED):
        store.register(ns)
    store.put(KEPT, keys(2), blocks(2, seed=1), write_policy=WritePolicy.WRITE_THROUGH)
    before = {tier: (s.used_bytes, s.num_blocks) for tier, s in store.stats().tiers.items()}
    for start in range(0, 12, 4):
        store.put(CLEARED, keys(4, start=start), blocks(4, seed=start), tier=Tier.GPU,
                  write_policy=WritePolicy.WRITE_THROUGH)
    store.pin(CLEARED, keys(2))
    store.pin(CLEARED, keys(2, start=8), ttl_s=60.0)
    located = store.sidecar.locate(CLEARED, keys(12))
    assert located[Tier.GPU] >= 1 and sum(located.values()) == 12
    result = store.clear(namespace=CLEARED)
    assert (result.num_blocks, result.num_busy) == (12, 0)
    stats = store.stats()
    assert {tier: (s.used_bytes, s.num_blocks) for tier, s in stats.tiers.items()} == before
    assert stats.num_pinned == 0
    clock.now_s += 120.0  # the TTL pin's expiry finds nothing to unpin
    assert store.stats().num_pinned == 0
    assert [s.num_blocks for s in store.namespace_stats("bob")] == [0]
    assert [s.num_blocks for s in store.namespace_stats("alice")] == [2]
