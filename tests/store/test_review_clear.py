"""Review attacks on ``TieredStore.clear``: leased bytes through a clear and the puts after it,
blocks in flight between tiers, sessions saved during a clear, every tier and pin, and what a
reopened store serves after all of it: a hit is the bytes stored under its key, or a miss."""

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
from tests.support.tiny_blocks import TINY_LAYOUT, StoreFactory, blocks, keys, same_bytes
from tierkv import Namespace, Tier, TieredStore, WritePolicy

KEPT = Namespace("kept", TINY_LAYOUT, tenant="alice")
CLEARED = Namespace("cleared", TINY_LAYOUT, tenant="bob")


@pytest.fixture
def slab_of() -> Iterator[object]:
    """Map a store's HOST slab as a same-host client does (by name, under /dev/shm)."""
    maps: list[mmap.mmap] = []

    def open_slab(store: TieredStore) -> np.ndarray:
        fd = os.open(f"/dev/shm/{store.host_shm_name}", os.O_RDWR)
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
    lease = store.acquire(CLEARED, keys(2), owner="reader")
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
    store.release(lease.lease_id, owner="reader")
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
        return {info.session_id: s.resume_session("bob", info.session_id).token_ids
                for info in s.list_sessions("bob")}

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
    located = store.locate(CLEARED, keys(12))
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
