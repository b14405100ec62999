"""Pins of one block share one deadline: the latest of the pins added since its count was last
zero. An unpin keeps it; a pin after the count reached zero starts afresh. (The property
machine in ``test_store_property.py`` models exactly this.)"""

from __future__ import annotations

import pytest

from tests.support.fake_clock import FakeClock
from tests.support.tiny_blocks import StoreFactory, blocks, keys
from tierkv import CapacityError, Namespace


def test_a_pin_after_the_last_unpin_lasts_only_its_own_ttl(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    """A pin without a TTL, unpinned, then a pin of 2 s: the old pin's deadline is gone with it,
    so 3 s later the block is no longer pinned and can be evicted."""
    clock = FakeClock()
    store = make_store(host_blocks=1, clock=clock)
    store.register(namespace)
    store.put(namespace, keys(1), blocks(1))
    assert store.pin(namespace, keys(1)) == 1
    assert store.unpin(namespace, keys(1)) == 1
    assert store.pin(namespace, keys(1), ttl_s=2.0) == 1
    with pytest.raises(CapacityError):
        store.put(namespace, keys(1, start=5), blocks(1))
    clock.now_s += 3
    assert store.stats().num_pinned == 0
    store.put(namespace, keys(1, start=5), blocks(1))
    assert store.lookup(namespace, keys(1)) == 0
    assert store.lookup(namespace, keys(1, start=5)) == 1


def test_an_unpin_keeps_the_latest_deadline_of_the_pins_left(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    """A pin of 2 s, then one without a TTL, then one unpin: the block stays pinned (its pins
    share the later deadline, which an unpin does not move), also after the 2 s."""
    clock = FakeClock()
    store = make_store(host_blocks=1, clock=clock)
    store.register(namespace)
    store.put(namespace, keys(1), blocks(1))
    assert store.pin(namespace, keys(1), ttl_s=2.0) == 1
    assert store.pin(namespace, keys(1)) == 1
    assert store.unpin(namespace, keys(1)) == 1
    clock.now_s += 3
    assert store.stats().num_pinned == 1
    with pytest.raises(CapacityError):
        store.put(namespace, keys(1, start=5), blocks(1))
    assert store.lookup(namespace, keys(1)) == 1
    assert store.unpin(namespace, keys(1)) == 1
    assert store.stats().num_pinned == 0
