"""Admission: the miniatures decide whether frequency filters a tier's window."""

from __future__ import annotations

import random

from tierkv.admission import Admission, MiniatureTinyLfu, count_uses, sampled, window_room
from tierkv.frequency import FrequencySketch


def test_a_miniature_hits_what_it_holds_and_keeps_its_capacity() -> None:
    sketch = FrequencySketch(1024)
    mini = MiniatureTinyLfu(filtered=False, capacity=100)
    assert not mini.access(1, sketch) and mini.access(1, sketch)
    for key in range(2, 300):
        mini.access(key, sketch)
    assert len(mini.window) + len(mini.main) == 100
    assert len(mini.window) == window_room(100) == 1
    assert mini.access(299, sketch) and not mini.access(1, sketch)  # LRU: 1 went long ago
    mini.resize(50)
    mini.access(1000, sketch)
    assert len(mini.window) + len(mini.main) == 50


def test_a_filtered_miniature_keeps_a_hot_set_through_a_scan() -> None:
    sketch = FrequencySketch(4096)
    plain, filtered = MiniatureTinyLfu(False, 100), MiniatureTinyLfu(True, 100)
    hot = list(range(50))
    for _ in range(5):
        for key in hot:
            sketch.increment(key)
            plain.access(key, sketch)
            filtered.access(key, sketch)
    for key in range(1000, 1300):  # a scan of blocks used once
        sketch.increment(key)
        plain.access(key, sketch)
        filtered.access(key, sketch)
    assert sum(filtered.access(key, sketch) for key in hot) == 50
    assert sum(plain.access(key, sketch) for key in hot) == 0


def _keys_sampled(count: int, sample: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    keys: list[int] = []
    while len(keys) < count:
        key = rnd.getrandbits(64)
        if sampled(key, sample):
            keys.append(key)
    return keys


def _admission(capacity_blocks: int) -> tuple[Admission[int], FrequencySketch]:
    sketch = FrequencySketch(16 * capacity_blocks)
    return Admission(sketch, lambda key: key, lambda: capacity_blocks), sketch


def test_the_filter_turns_on_for_a_hot_set_among_scans_and_stays_off_for_recency() -> None:
    # Frequency pays: a hot set used again and again, between long scans of keys used once.
    admission, sketch = _admission(1600)  # miniatures of 100 keys
    hot = _keys_sampled(60, 16, seed=1)
    scans = iter(_keys_sampled(20000, 16, seed=2))
    for _ in range(40):
        for key in [*hot, *(next(scans) for _ in range(300))]:
            sketch.increment(key)
            admission.observe(key)
    assert admission.on and admission.hits[1] > admission.hits[0]
    # Recency pays: each key used twice, a short while apart (a chat's next turn), never again.
    admission, sketch = _admission(1600)
    fresh = iter(_keys_sampled(20000, 16, seed=3))
    recent: list[int] = []
    for _ in range(6000):
        key = next(fresh)
        recent.append(key)
        for used in (key, *recent[-20:-19]):
            sketch.increment(used)
            admission.observe(used)
    assert not admission.on and admission.hits[0] > admission.hits[1]


def test_one_key_in_sixteen_is_sampled() -> None:
    rnd = random.Random(4)
    share = sum(sampled(rnd.getrandbits(64), 16) for _ in range(32000)) / 32000
    assert 0.055 < share < 0.07


def test_counting_uses_one_by_one_or_vectorised_is_the_same() -> None:
    rnd = random.Random(5)
    keys = [rnd.getrandbits(64) for _ in range(400)]
    one, one_sketch = _admission(1600)
    many, many_sketch = _admission(1600)
    for key in keys:
        count_uses(one_sketch, [one], [key])
    for start in range(0, 400, 100):
        count_uses(many_sketch, [many], keys[start : start + 100])
    assert [one_sketch.estimate(k) for k in keys] == [many_sketch.estimate(k) for k in keys]
    assert one.hits == many.hits and one.on == many.on
    assert [m.main for m in one.miniatures] == [m.main for m in many.miniatures]
    seen = sum(sampled(key, 16) for key in keys)
    assert seen and len(one.miniatures[0].window) + len(one.miniatures[0].main) == min(seen, 100)
