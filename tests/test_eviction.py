"""PriorityLru: O(1) LRU order within a class, lower classes first, unlinking."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest

from tests.support.tiny_blocks import BLOCK_BYTES, PAGE_BYTES, block_for, key, same_bytes
from tierkv import Namespace, TieredStore
from tierkv.admission import Admission
from tierkv.config import HostTierConfig, Priority, StoreConfig
from tierkv.eviction import (
    MAIN,
    WINDOW,
    EvictionPolicy,
    PriorityLru,
    Residency,
    TinyLfuEviction,
    Victims,
)
from tierkv.frequency import FrequencySketch

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


def _windowed(on: bool, frequency: dict[str, int]) -> PriorityLru[str]:
    """A windowed list whose filter is ``on`` and whose owners were used ``frequency`` times."""
    sketch = FrequencySketch(1024)
    admission: Admission[str] = Admission(sketch, hash, lambda: 100)
    admission.on = on
    for owner, uses in frequency.items():
        for _ in range(uses):
            sketch.increment(hash(owner))
    return PriorityLru(admission)


def segments(lru: PriorityLru[str]) -> tuple[list[str], list[str]]:
    return ([n.owner for n in lru.iter_segment(WINDOW, Priority.NORMAL)],
            [n.owner for n in lru.iter_segment(MAIN, Priority.NORMAL)])


def test_a_windowed_list_takes_new_copies_in_its_window_and_admits_them_to_main() -> None:
    lru = _windowed(True, {})
    nodes = {name: Residency(name, 0) for name in "abcxy"}
    for name in "abc":
        lru.push_mru(nodes[name], Priority.NORMAL)
    assert segments(lru) == (["a", "b", "c"], []) and lru.num_window == 3
    lru.admit(nodes["a"])
    lru.admit(nodes["b"])
    assert segments(lru) == (["c"], ["a", "b"]) and (lru.num_window, lru.num_linked) == (1, 3)
    lru.touch(nodes["a"], Priority.NORMAL)  # within its own segment
    assert segments(lru) == (["c"], ["b", "a"])
    lru.push_before(nodes["x"], nodes["c"])  # behind a window anchor: in the window
    lru.push_before(nodes["y"], nodes["a"])  # behind a main anchor: the window's newest
    assert segments(lru) == (["x", "c", "y"], ["b", "a"]) and lru.num_window == 3
    lru.touch_before(nodes["b"], Priority.NORMAL, nodes["c"])  # other segment: plain touch
    assert segments(lru) == (["x", "c", "y"], ["a", "b"])
    assert order(lru) == ["x", "c", "y", "a", "b"]
    lru.remove(nodes["c"])
    assert lru.num_window == 2 and lru.num_linked == 4


def test_the_adaptive_policy_lets_the_more_frequent_of_candidate_and_victim_stay() -> None:
    lru = _windowed(True, {"hot": 5, "old": 2})
    nodes = {name: Residency(name, 0) for name in ("old", "cold", "hot", "new")}
    for node in nodes.values():
        lru.push_mru(node, Priority.NORMAL)
    lru.admit(nodes["old"])  # main: [old]; window: [cold, hot, new], over its target of 1
    policy = TinyLfuEviction()
    picked = policy.pick_victims(lru, 2, lambda node: 1, lambda o: False, lambda o: False)
    # cold (used 0 times) loses to old (2); hot (5) beats old: old leaves, hot is admitted.
    assert picked.owners == ["cold", "old"]
    assert [node.owner for node in picked.admitted] == ["hot"]
    # The filter off: every candidate enters main, and main's oldest leaves.
    assert lru.admission is not None
    lru.admission.on = False
    picked = policy.pick_victims(lru, 1, lambda node: 1, lambda o: False, lambda o: False)
    assert picked.owners == ["old"] and [n.owner for n in picked.admitted] == ["cold"]


def test_the_adaptive_policy_passes_over_busy_and_excluded_copies_and_asks_only_takers() -> None:
    lru = _windowed(True, {"w2": 9})
    nodes = {name: Residency(name, 0) for name in ("m1", "m2", "m3", "w1", "w2", "w3")}
    for node in nodes.values():
        lru.push_mru(node, Priority.NORMAL)
    for name in ("m1", "m2", "m3"):
        lru.admit(nodes[name])
    asked: list[str] = []

    def excluded(owner: str) -> bool:
        asked.append(owner)
        return owner == "m2"

    picked = TinyLfuEviction().pick_victims(lru, 3, lambda node: 1, excluded,
                                            lambda o: o == "w1")
    # w1 is busy; w2 (9 uses) beats m1: m1 leaves, w2 is admitted; w3 (never used) does not
    # beat m2 and leaves; the window is at its target then, so main's oldest go: m2 is
    # excluded, m3 leaves. Only the copies about to be taken were asked about.
    assert picked.owners == ["m1", "w3", "m3"]
    assert [node.owner for node in picked.admitted] == ["w2"]
    assert asked == ["m1", "w3", "m2", "m3"]
    assert picked.busy_size == 1


def test_a_list_without_a_window_is_picked_as_lru() -> None:
    lru: PriorityLru[str] = PriorityLru()
    for name in "abc":
        lru.push_mru(Residency(name, 0), Priority.NORMAL)
    picked = TinyLfuEviction().pick_victims(lru, 2, lambda node: 1, lambda o: False,
                                            lambda o: False)
    assert picked.owners == ["a", "b"] and picked.admitted == []
