"""PriorityLru: O(1) LRU order within a class, lower classes first, unlinking."""

from __future__ import annotations

from tierkv.config import Priority
from tierkv.eviction import PriorityLru, Residency


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
