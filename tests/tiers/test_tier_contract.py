"""One contract, every tier: GPU (emulated here), HOST and DISK pass the same tests.

Each case stores into one tier through the public API (``put(..., tier=...)``) with promotion
off, so that every read is served by the tier under test.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, StoreFactory, blocks, keys, same_bytes
from tierkv import InvalidArgumentError, Namespace, Tier, TieredStore

CAPACITY_BLOCKS = 6


@dataclass(frozen=True)
class Case:
    tier: Tier

    def build(self, make_store: StoreFactory) -> TieredStore:
        if self.tier is Tier.GPU:
            return make_store(host_blocks=2, gpu_blocks=CAPACITY_BLOCKS, promote_on_read=False)
        if self.tier is Tier.HOST:
            return make_store(host_blocks=CAPACITY_BLOCKS, promote_on_read=False)
        return make_store(host_blocks=2, disk_blocks=CAPACITY_BLOCKS, promote_on_read=False)


@pytest.fixture(params=[Tier.GPU, Tier.HOST, Tier.DISK], ids=lambda t: t.label)
def case(request: pytest.FixtureRequest) -> Case:
    return Case(request.param)


@pytest.fixture
def store(case: Case, make_store: StoreFactory, namespace: Namespace) -> TieredStore:
    built = case.build(make_store)
    built.register(namespace)
    return built


def test_put_then_get_is_bit_exact(case: Case, store: TieredStore, namespace: Namespace) -> None:
    data = blocks(4, seed=1)
    assert store.put(namespace, keys(4), data, tier=case.tier) == 4
    assert store.lookup(namespace, keys(4)) == 4
    assert same_bytes(store.get(namespace, keys(4)), data)
    stats = store.stats().tiers[case.tier]
    assert stats.num_blocks == 4 and stats.hits == 4


def test_every_bit_pattern_round_trips(case: Case, store: TieredStore, namespace: Namespace) -> None:
    # NaNs, infinities and negative zeros are just bytes to the store.
    raw = torch.arange(BLOCK_BYTES * 2, dtype=torch.int64).remainder(256).to(torch.uint8)
    data = raw.view(TINY_LAYOUT.torch_dtype).reshape(2, *TINY_LAYOUT.block_shape)
    store.put(namespace, keys(2), data, tier=case.tier)
    assert same_bytes(store.get(namespace, keys(2)), data)


def test_put_is_idempotent(case: Case, store: TieredStore, namespace: Namespace) -> None:
    data = blocks(3, seed=2)
    assert store.put(namespace, keys(3), data, tier=case.tier) == 3
    assert store.put(namespace, keys(3), data, tier=case.tier) == 0
    twice = torch.cat([data[:1], data[:1]])
    assert store.put(namespace, [keys(1)[0]] * 2, twice, tier=case.tier) == 0
    assert store.stats().tiers[case.tier].num_blocks == 3


def test_get_returns_the_leading_run(case: Case, store: TieredStore, namespace: Namespace) -> None:
    data = blocks(4, seed=3)
    store.put(namespace, keys(2), data[:2], tier=case.tier)
    store.put(namespace, keys(1, start=3), data[3:], tier=case.tier)
    assert store.lookup(namespace, keys(4)) == 2
    got = store.get(namespace, keys(4))
    assert got.shape[0] == 2 and same_bytes(got, data[:2])
    assert store.get(namespace, keys(2, start=10)).shape[0] == 0


def test_get_into_reuses_the_callers_buffer(
    case: Case, store: TieredStore, namespace: Namespace
) -> None:
    data = blocks(3, seed=4)
    store.put(namespace, keys(3), data, tier=case.tier)
    out = torch.zeros((5, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype)
    assert store.get_into(namespace, keys(3), out) == 3
    assert same_bytes(out[:3], data)
    with pytest.raises(InvalidArgumentError, match="holds 5 blocks"):
        store.get_into(namespace, keys(6), out)


def test_delete_frees_room_and_misses(case: Case, store: TieredStore, namespace: Namespace) -> None:
    store.put(namespace, keys(3), blocks(3, seed=5), tier=case.tier)
    assert store.delete(namespace, keys(2)) == 2
    assert store.delete(namespace, keys(2)) == 0
    assert store.lookup(namespace, keys(3)) == 0
    assert store.lookup(namespace, keys(1, start=2)) == 1
    tier_stats = store.stats().tiers[case.tier]
    assert tier_stats.num_blocks == 1
    assert tier_stats.used_bytes <= tier_stats.capacity_bytes // CAPACITY_BLOCKS


def test_filling_past_capacity_never_exceeds_it(
    case: Case, store: TieredStore, namespace: Namespace
) -> None:
    data = blocks(20, seed=6)
    for i in range(0, 20, 2):
        store.put(namespace, keys(2, start=i), data[i : i + 2], tier=case.tier)
        tier_stats = store.stats().tiers[case.tier]
        assert tier_stats.used_bytes <= tier_stats.capacity_bytes
        assert tier_stats.num_blocks <= CAPACITY_BLOCKS
    for i in range(20):
        got = store.get(namespace, keys(1, start=i))
        assert got.shape[0] == 0 or same_bytes(got, data[i : i + 1])
    # The most recent puts are the ones kept.
    assert store.lookup(namespace, keys(2, start=18)) == 2


def test_namespaces_never_share_blocks(
    case: Case, store: TieredStore, namespace: Namespace
) -> None:
    other = namespace.with_tenant("someone-else")
    store.register(other)
    store.put(namespace, keys(2), blocks(2, seed=7), tier=case.tier)
    assert store.lookup(other, keys(2)) == 0
    assert store.get(other, keys(2)).shape[0] == 0
