"""FrequencySketch: never below a key's true count, saturating at 15, halved on reset."""

from __future__ import annotations

import random

from tierkv.frequency import MAX_COUNT, FrequencySketch


def test_estimates_are_never_below_the_true_counts_and_mostly_exact() -> None:
    sketch = FrequencySketch(1024, reset_uses=1 << 30)
    rnd = random.Random(1)
    keys = [rnd.getrandbits(64) for _ in range(500)]
    counts = {k: rnd.randint(0, 6) for k in keys}
    for k, n in counts.items():
        for _ in range(n):
            sketch.increment(k)
    estimates = {k: sketch.estimate(k) for k in keys}
    assert all(estimates[k] >= counts[k] for k in keys)
    assert sum(estimates[k] == counts[k] for k in keys) >= 0.95 * len(keys)
    assert sketch.estimate(rnd.getrandbits(64)) <= 1  # a key never seen: 0, rarely a collision


def test_counters_saturate_and_halve_every_reset_period() -> None:
    sketch = FrequencySketch(64, reset_uses=40)
    hot, warm = 12345678901, 98765432101
    for _ in range(30):
        sketch.increment(hot)
    assert sketch.estimate(hot) == MAX_COUNT
    for _ in range(6):
        sketch.increment(warm)
    assert sketch.estimate(warm) == 6 and sketch.num_uses == 36
    for _ in range(4):  # the 40th use halves everything
        sketch.increment(warm)
    assert sketch.num_uses == 0
    assert (sketch.estimate(hot), sketch.estimate(warm)) == (MAX_COUNT // 2, 5)


def test_width_is_a_power_of_two_at_least_what_was_asked() -> None:
    assert FrequencySketch(1000).width == 1024
    assert FrequencySketch(1).width == 64
    assert FrequencySketch(1000).reset_uses == 10 * 1024


def test_counting_a_run_at_once_counts_as_one_by_one() -> None:
    import numpy as np

    rnd = random.Random(2)
    keys = [rnd.getrandbits(64) for _ in range(1000)] * 3
    one, many = FrequencySketch(512, 1 << 30), FrequencySketch(512, 1 << 30)
    for key in keys:
        one.increment(key)
    many.increment_all(np.array(keys, dtype=np.uint64))  # colliding counters, over 255 uses
    assert [one.estimate(k) for k in keys] == [many.estimate(k) for k in keys]
    assert many.num_uses == 3000
