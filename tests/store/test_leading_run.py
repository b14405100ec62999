"""The leading stored run of a chain (``tierkv.store.index.leading_run``/``leading_count``) and
the pin budget (``PinTable.num_affordable``), alone, on plain entries."""

from __future__ import annotations

from tests.support.tiny_blocks import TINY_LAYOUT, keys
from tierkv.config import Priority, Tier
from tierkv.eviction import Residency
from tierkv.keys import Namespace
from tierkv.store.index import Entry, leading_count, leading_run
from tierkv.store.namespaces import namespace_state
from tierkv.store.pins import PinTable

STATE = namespace_state(Namespace("run-model", TINY_LAYOUT))


def entries(n: int) -> dict[bytes, Entry]:
    """``n`` entries with a HOST copy each, by their keys ``keys(n)``."""
    found = {}
    for key in keys(n):
        entry = Entry(key, STATE, Priority.NORMAL)
        entry.host = Residency(entry, (0,))
        found[key] = entry
    return found


def test_the_run_ends_at_the_first_key_not_stored() -> None:
    blocks = entries(5)
    chain = [*keys(3), keys(1, start=9)[0], *keys(2, start=3)]
    assert leading_run(blocks, chain) == [blocks[k] for k in keys(3)]
    assert leading_count(blocks, chain) == 3
    assert leading_count(blocks, iter(chain)) == 3  # any iterable, consumed once
    assert leading_run(blocks, []) == [] and leading_count(blocks, []) == 0
    assert leading_count(blocks, keys(5)) == 5


def test_a_readable_run_ends_at_an_entry_without_a_copy() -> None:
    blocks = entries(4)
    blocks[keys(4)[2]].host = None  # going: no copy left
    assert len(leading_run(blocks, keys(4))) == 4
    assert leading_run(blocks, keys(4), readable=True) == [blocks[k] for k in keys(2)]


def test_the_pin_budget_stops_at_the_first_block_past_the_room_left() -> None:
    blocks, pins = entries(4), PinTable(lambda: 0.0)
    run = leading_run(blocks, keys(4))
    pins.pin(run[1], None)  # pinned already: costs nothing
    room = {Tier.HOST: 250}
    affordable = pins.num_affordable(run, room, lambda entry: {Tier.HOST: 100})
    assert affordable == 3 and room == {Tier.HOST: 50}  # 0 and 2 charged; 3 does not fit
    assert pins.num_affordable(run, {Tier.HOST: 0}, lambda entry: {Tier.HOST: 100}) == 0
    twice = [run[0], run[0], run[2]]  # a key named twice is charged once
    assert pins.num_affordable(twice, {Tier.HOST: 200}, lambda entry: {Tier.HOST: 100}) == 3
