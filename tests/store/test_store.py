"""TieredStore behaviour: eviction order, demotion and promotion, pins, policies, bad input."""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.fake_clock import FakeClock
from tests.support.tiny_blocks import TINY_LAYOUT, StoreFactory, blocks, keys, same_bytes
from tierkv import (
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    KVLayout,
    Namespace,
    Priority,
    StoreClosedError,
    Tier,
    TieredStore,
    UnknownNamespaceError,
    WritePolicy,
)


def wait_for(condition: object, timeout_s: float = 5.0) -> None:
    """Wait until ``condition()`` is true (background promotions), or fail."""
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting for background work"
        time.sleep(0.01)


def test_eviction_takes_the_least_recently_used(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=4)
    store.register(namespace)
    data = blocks(6, seed=1)
    for i in range(4):  # four separate puts: 0 is the oldest
        store.put(namespace, keys(1, start=i), data[i : i + 1])
    store.get(namespace, keys(1))  # block 0 is now the most recently used
    store.put(namespace, keys(2, start=4), data[4:])
    present = [store.lookup(namespace, [k]) for k in keys(6)]
    assert present == [1, 0, 0, 1, 1, 1]


def test_a_chain_is_evicted_tail_first(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=4)
    store.register(namespace)
    chain = keys(4)
    store.put(namespace, chain, blocks(4, seed=2))
    store.put(namespace, keys(2, start=10), blocks(2, seed=3))
    # Under pressure the head of the prefix survives and the tail goes.
    assert store.lookup(namespace, chain) == 2
    assert [store.lookup(namespace, [k]) for k in chain] == [1, 1, 0, 0]


def test_lower_priority_goes_first(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=4)
    store.register(namespace)
    store.put(namespace, keys(2), blocks(2), priority=Priority.HIGH)
    store.put(namespace, keys(2, start=2), blocks(2), priority=Priority.LOW)
    store.put(namespace, keys(2, start=4), blocks(2))
    assert store.lookup(namespace, keys(2)) == 2
    assert store.lookup(namespace, keys(2, start=2)) == 0


def test_demotion_cascades_gpu_host_disk(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(gpu_blocks=2, host_blocks=2, disk_blocks=8, promote_on_read=False)
    store.register(namespace)
    data = blocks(6, seed=4)
    for i in range(0, 6, 2):
        store.put(namespace, keys(2, start=i), data[i : i + 2], tier=Tier.GPU)
    stats = store.stats()
    assert [stats.tiers[t].num_blocks for t in Tier] == [2, 2, 2]
    assert stats.demotions == 6 and stats.failed_demotions == 0  # 0,1 twice; 2,3 once
    assert store.lookup(namespace, keys(6)) == 6
    assert same_bytes(store.get(namespace, keys(6)), data)
    hits = store.stats().tiers
    assert (hits[Tier.GPU].hits, hits[Tier.HOST].hits, hits[Tier.DISK].hits) == (2, 2, 2)


def test_reads_from_lower_tiers_are_promoted(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=4, disk_blocks=8)
    store.register(namespace)
    data = blocks(2, seed=5)
    store.put(namespace, keys(2), data, tier=Tier.DISK)
    assert store.stats().tiers[Tier.HOST].num_blocks == 0
    assert same_bytes(store.get(namespace, keys(2)), data)
    wait_for(lambda: store.stats().tiers[Tier.HOST].num_blocks == 2)
    assert store.stats().promotions == 2
    assert same_bytes(store.get(namespace, keys(2)), data)
    assert store.stats().tiers[Tier.HOST].hits == 2


def test_prefetch_brings_blocks_up(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=4, disk_blocks=8, promote_on_read=False)
    store.register(namespace)
    store.put(namespace, keys(3), blocks(3, seed=6), tier=Tier.DISK)
    assert store.prefetch_async(namespace, keys(4)).result(timeout=10) == 3
    assert store.stats().tiers[Tier.HOST].num_blocks == 3


def test_write_back_reaches_disk_only_on_eviction(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store(host_blocks=2, disk_blocks=8)
    store.register(namespace)
    store.put(namespace, keys(2), blocks(2, seed=7))
    assert store.stats().tiers[Tier.DISK].num_blocks == 0
    store.put(namespace, keys(2, start=2), blocks(2, seed=8))
    assert store.stats().tiers[Tier.DISK].num_blocks == 2
    assert same_bytes(store.get(namespace, keys(2)), blocks(2, seed=7))


def test_write_through_is_on_disk_when_put_returns(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store(host_blocks=4, disk_blocks=8)
    store.register(namespace)
    store.put(namespace, keys(2), blocks(2, seed=9), write_policy=WritePolicy.WRITE_THROUGH)
    tiers = store.stats().tiers
    assert tiers[Tier.HOST].num_blocks == 2 and tiers[Tier.DISK].num_blocks == 2


def test_write_through_needs_a_disk(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store()
    store.register(namespace)
    with pytest.raises(ConfigError, match="write_through needs a disk"):
        store.put(namespace, keys(1), blocks(1), write_policy=WritePolicy.WRITE_THROUGH)
    assert store.lookup(namespace, keys(1)) == 0


def test_pinned_blocks_are_never_evicted(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=4)
    store.register(namespace)
    store.put(namespace, keys(2), blocks(2))
    assert store.pin(namespace, keys(3)) == 2
    for i in range(2, 12, 2):
        store.put(namespace, keys(2, start=i), blocks(2, seed=i))
    assert store.lookup(namespace, keys(2)) == 2
    assert store.stats().num_pinned == 2
    assert store.unpin(namespace, keys(2)) == 2
    store.put(namespace, keys(4, start=20), blocks(4))
    assert store.lookup(namespace, keys(2)) == 0


def test_everything_pinned_means_capacity_error_and_nothing_stored(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store(host_blocks=4)
    store.register(namespace)
    store.put(namespace, keys(4), blocks(4))
    store.pin(namespace, keys(4))
    started = time.monotonic()
    with pytest.raises(CapacityError, match="pinned or in use"):
        store.put(namespace, keys(1, start=9), blocks(1))
    assert time.monotonic() - started < 1.0
    assert store.lookup(namespace, keys(1, start=9)) == 0
    assert store.stats().tiers[Tier.HOST].used_bytes <= store.stats().tiers[Tier.HOST].capacity_bytes


def test_pin_ttl_runs_out(make_store: StoreFactory, namespace: Namespace) -> None:
    clock = FakeClock()
    store = make_store(host_blocks=2, clock=clock)
    store.register(namespace)
    store.put(namespace, keys(2), blocks(2))
    store.pin(namespace, keys(2), ttl_s=30)
    with pytest.raises(CapacityError):
        store.put(namespace, keys(1, start=5), blocks(1))
    clock.now_s += 31
    store.put(namespace, keys(1, start=5), blocks(1))
    assert store.lookup(namespace, keys(1, start=5)) == 1
    assert store.stats().num_pinned == 0


@pytest.mark.parametrize("ttl_s", [0, -1, float("nan"), float("inf"), 1e12, "10"])
def test_bad_ttl_is_rejected(make_store: StoreFactory, namespace: Namespace, ttl_s: object) -> None:
    store = make_store()
    store.register(namespace)
    store.put(namespace, keys(1), blocks(1))
    with pytest.raises(InvalidArgumentError, match="ttl_s"):
        store.pin(namespace, keys(1), ttl_s=ttl_s)  # type: ignore[arg-type]
    assert store.stats().num_pinned == 0


def test_delete_of_a_block_in_every_tier(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(gpu_blocks=2, host_blocks=2, disk_blocks=4)
    store.register(namespace)
    store.put(namespace, keys(1), blocks(1), tier=Tier.GPU, write_policy=WritePolicy.WRITE_THROUGH)
    assert store.delete(namespace, keys(1)) == 1
    assert all(s.num_blocks == 0 and s.used_bytes == 0 for s in store.stats().tiers.values())


# --- bad input: a clear error naming what is wrong, and nothing stored -------------------------


def assert_nothing_stored(store: TieredStore) -> None:
    assert all(s.num_blocks == 0 and s.used_bytes == 0 for s in store.stats().tiers.values())


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda: (keys(2), blocks(3)), "2 hashes but 3 blocks"),
        (lambda: (keys(2), blocks(2).float()), "dtype"),
        (lambda: (keys(2), blocks(2).reshape(2, -1)), "shape"),
        (lambda: (keys(2), blocks(2)[:, :1]), "shape"),
        (lambda: ([b"short", *keys(1)], blocks(2)), "hashes\\[0\\] is 5 bytes"),
        (lambda: (keys(1)[0], blocks(1)), "sequence of 32-byte"),
        (lambda: (keys(1), blocks(1).numpy()), "torch.Tensor"),
    ],
)
def test_bad_put_is_rejected_and_stores_nothing(
    make_store: StoreFactory, namespace: Namespace, make_args: object, message: str
) -> None:
    store = make_store(disk_blocks=4)
    store.register(namespace)
    hashes, data = make_args()  # type: ignore[operator]
    with pytest.raises(InvalidArgumentError, match=message):
        store.put(namespace, hashes, data, write_policy=WritePolicy.WRITE_THROUGH)
    assert_nothing_stored(store)


def test_unknown_namespace_is_a_clear_error(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store()
    with pytest.raises(UnknownNamespaceError, match="register"):
        store.put(namespace, keys(1), blocks(1))
    with pytest.raises(ValueError, match="not registered"):
        store.lookup(namespace, keys(1))
    assert_nothing_stored(store)


def test_a_budget_smaller_than_one_block_is_refused(make_store: StoreFactory) -> None:
    store = make_store(host_blocks=1)
    big = Namespace("big-model", KVLayout(4, 2, 8, block_size=4))  # 1 KiB blocks
    with pytest.raises(ConfigError, match=r"host tier budget .* smaller than one block"):
        store.register(big)
    with pytest.raises(UnknownNamespaceError):
        store.lookup(big, keys(1))


def test_a_batch_larger_than_the_tier_fails_whole(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store(host_blocks=3)
    store.register(namespace)
    with pytest.raises(CapacityError):
        store.put(namespace, keys(4), blocks(4))
    assert_nothing_stored(store)


def test_a_closed_store_refuses_calls(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store()
    store.register(namespace)
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreClosedError):
        store.lookup(namespace, keys(1))


def test_get_onto_another_dtype_buffer_is_refused(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store()
    store.register(namespace)
    store.put(namespace, keys(1), blocks(1))
    wrong = torch.empty((1, *TINY_LAYOUT.block_shape), dtype=torch.float32)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        store.get_into(namespace, keys(1), wrong)
    not_contiguous = torch.empty((1, *TINY_LAYOUT.block_shape[::-1]), dtype=torch.float16)
    with pytest.raises(InvalidArgumentError):
        store.get_into(namespace, keys(1), not_contiguous.permute(0, 5, 4, 3, 2, 1))


def test_write_through_into_gpu_whose_room_pushes_the_chain_itself_to_disk(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store(gpu_blocks=2, host_blocks=2, disk_blocks=3, promote_on_read=False)
    store.register(namespace)
    chain, others = keys(2), keys(3, start=10)
    store.put(namespace, others[:2], blocks(2, seed=1), tier=Tier.GPU)
    store.put(namespace, chain, blocks(2, seed=2), tier=Tier.HOST)
    store.put(namespace, others[2:], blocks(1, seed=3), tier=Tier.DISK)
    # Room in GPU demotes the others to HOST, which demotes the chain's own blocks to DISK:
    # their records exist by the time the write-through wants to write them.
    assert store.put(namespace, chain, blocks(2, seed=2), tier=Tier.GPU,
                     write_policy=WritePolicy.WRITE_THROUGH) == 2
    assert same_bytes(store.get(namespace, chain), blocks(2, seed=2))
    tiers = store.stats().tiers
    assert tiers[Tier.DISK].used_bytes <= tiers[Tier.DISK].capacity_bytes


def test_demoting_a_batch_one_by_one_never_waits_on_itself(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store(gpu_blocks=3, host_blocks=4, disk_blocks=7)
    store.register(namespace)
    k = keys(10)
    store.put(namespace, k[7:10], blocks(3, seed=1), tier=Tier.GPU)
    store.put(namespace, k[1:4], blocks(3, seed=2), tier=Tier.HOST)
    store.pin(namespace, k[2:4])  # HOST: two pinned, room for two more
    store.put(namespace, k[6:7], blocks(1, seed=3), tier=Tier.HOST)
    # The three GPU victims do not fit HOST together; one by one, the ones already demoted are
    # busy (ours) and must not be waited for (that was a 5 s stall).
    started = time.monotonic()
    assert store.put(namespace, k[1:4], blocks(3, seed=2), tier=Tier.GPU) == 3
    assert time.monotonic() - started < 2.5
    assert same_bytes(store.get(namespace, k[1:4]), blocks(3, seed=2))
    # The victim that did not fit HOST went on to DISK: none was lost.
    assert store.stats().failed_demotions == 0
    assert same_bytes(store.get(namespace, k[7:10]), blocks(3, seed=1))
