"""PriorityLru: O(1) LRU order within a class, lower classes first, unlinking."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest

from tests.support.tiny_blocks import BLOCK_BYTES, PAGE_BYTES, block_for, key, same_bytes
from tierkv import Namespace, TieredStore
from tierkv.config import HostTierConfig, Priority, StoreConfig
from tierkv.eviction import EvictionPolicy, PriorityLru, Residency, Victims

T = TypeVar("T")


def order(lru: PriorityLru[str]) -> list[str]:
    return [node.owner for node in lru.iter_lru()]


def test_lru_order_and_touch() -> None:
    lru: PriorityLru[str] = PriorityLru()
    nodes = {name: Residency(name, 0) for name in "abc"}
    for name in "abc":
        lru.push_mru(nodes[name], Priority.NORMAL)
    assert order(lru) == ["a", "b", "c"]
    lru.touch(nodes["a"], Priority.NORMAL)
    assert order(lru) == ["b", "c", "a"]
    assert lru.num_linked == 3


def test_a_node_goes_just_behind_its_anchor() -> None:
    lru: PriorityLru[str] = PriorityLru()
    nodes = {name: Residency(name, 0) for name in "abcxy"}
    for name in "abc":
        lru.push_mru(nodes[name], Priority.NORMAL)
    lru.push_before(nodes["x"], nodes["b"])  # a descendant of b: evicted before it
    lru.push_before(nodes["y"], nodes["b"])  # then its parent's other child... in order
    assert order(lru) == ["a", "x", "y", "b", "c"] and lru.num_linked == 5
    lru.touch_before(nodes["c"], Priority.NORMAL, nodes["a"])
    assert order(lru) == ["c", "a", "x", "y", "b"]
    lru.touch_before(nodes["a"], Priority.NORMAL, None)  # no anchor: most recently used
    assert order(lru) == ["c", "x", "y", "b", "a"]
    lru.remove(nodes["b"])  # an unlinked (pinned) anchor: most recently used too
    lru.touch_before(nodes["x"], Priority.NORMAL, nodes["b"])
    lru.touch_before(nodes["y"], Priority.NORMAL, nodes["y"])  # itself: stays
    assert order(lru) == ["c", "y", "a", "x"]


def test_lower_priority_classes_come_first() -> None:
    lru: PriorityLru[str] = PriorityLru()
    lru.push_mru(Residency("session", 0), Priority.SESSION)
    lru.push_mru(Residency("high", 0), Priority.HIGH)
    lru.push_mru(Residency("normal", 0), Priority.NORMAL)
    lru.push_mru(Residency("low", 0), Priority.LOW)
    assert order(lru) == ["low", "normal", "high", "session"]


def test_remove_is_idempotent_and_touch_skips_unlinked() -> None:
    lru: PriorityLru[str] = PriorityLru()
    a, b = Residency("a", 0), Residency("b", 0)
    lru.push_mru(a, Priority.NORMAL)
    lru.push_mru(b, Priority.NORMAL)
    lru.remove(a)
    lru.remove(a)
    assert not a.linked and order(lru) == ["b"] and lru.num_linked == 1
    lru.touch(a, Priority.NORMAL)  # unlinked (pinned) nodes stay unlinked
    assert order(lru) == ["b"]


def test_caller_may_unlink_the_node_it_was_given() -> None:
    lru: PriorityLru[str] = PriorityLru()
    nodes = [Residency(str(i), 0) for i in range(5)]
    for node in nodes:
        lru.push_mru(node, Priority.NORMAL)
    seen = []
    for node in lru.iter_lru():
        seen.append(node.owner)
        lru.remove(node)
    assert seen == ["0", "1", "2", "3", "4"] and lru.num_linked == 0


def test_the_default_policy_picks_lru_first_and_passes_over_excluded_and_busy() -> None:
    lru: PriorityLru[str] = PriorityLru()
    nodes = {name: Residency(name, 0) for name in "abcde"}
    for name in "abcde":
        lru.push_mru(nodes[name], Priority.NORMAL)
    picked = EvictionPolicy().pick_victims(lru, 2, lambda node: 1, lambda o: o == "a",
                                           lambda o: o == "b")
    assert (picked.owners, picked.size, picked.busy_size, picked.walked_size) == (
        ["c", "d"], 2, 1, 4)
    short = EvictionPolicy().pick_victims(lru, 10, lambda node: 1, lambda o: False,
                                          lambda o: False)
    assert (short.size, short.walked_size) == (5, 5)  # not enough: every node walked


class _NewestFirst(EvictionPolicy):
    """A replacement policy: the most recently used block goes first."""

    def pick_victims(self, lru: PriorityLru[T], needed: int, size_of: Callable[[Residency[T]], int],
                     excluded: Callable[[T], bool], busy: Callable[[T], bool]) -> Victims[T]:
        victims: Victims[T] = Victims()
        for node in reversed(list(lru.iter_lru())):
            victims.walked_size += size_of(node)
            if excluded(node.owner) or busy(node.owner):
                continue
            victims.owners.append(node.owner)
            victims.size += size_of(node)
            if victims.size >= needed:
                break
        return victims


@pytest.mark.parametrize("policy", [None, _NewestFirst()])
def test_the_store_evicts_with_the_policy_it_is_given(
        namespace: Namespace, policy: EvictionPolicy | None) -> None:
    config = StoreConfig(host=HostTierConfig(4 * BLOCK_BYTES, PAGE_BYTES))
    with TieredStore(config, eviction=policy) as store:
        store.register(namespace)
        for i in range(4):
            store.put(namespace, [key(i)], block_for(i)[None])
        store.put(namespace, [key(4)], block_for(4)[None])
        held = [i for i in range(5) if store.lookup(namespace, [key(i)])]
        # LRU drops the oldest (0); the replacement drops the newest before the put (3).
        assert held == ([1, 2, 3, 4] if policy is None else [0, 1, 2, 4])
        assert same_bytes(store.get(namespace, [key(4)]), block_for(4)[None])
