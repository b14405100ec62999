"""Reopening a large disk store draws a progress bar over the blocks it recovers, when asked
(``tierkv serve`` asks only when stderr is a terminal), and never for a small one."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support.tiny_blocks import TINY_LAYOUT, blocks, keys
from tierkv import Namespace, TieredStore, WritePolicy

NUM_BLOCKS = 10_000  # the store's threshold for a bar: fewer recover in well under a second
NAMESPACE = Namespace("progress-model", TINY_LAYOUT)


def test_recovering_a_large_disk_index_shows_a_progress_bar_when_asked(
    make_store: Callable[..., TieredStore], capfd: pytest.CaptureFixture[str]
) -> None:
    store = make_store(host_blocks=64, disk_blocks=NUM_BLOCKS + 64,
                       write_policy=WritePolicy.WRITE_THROUGH)
    store.register(NAMESPACE)
    hashes = keys(NUM_BLOCKS)
    data = blocks(64)
    for start in range(0, NUM_BLOCKS, 64):
        batch = hashes[start:start + 64]
        store.put(NAMESPACE, batch, data[: len(batch)])
    config = store.config
    store.close()
    capfd.readouterr()

    with TieredStore(config, show_progress=True) as reopened:
        assert reopened.num_recovered_blocks == NUM_BLOCKS
    shown = capfd.readouterr().err
    assert "recovering disk index" in shown and "10.0k/10.0k" in shown

    with TieredStore(config) as quiet:
        assert quiet.num_recovered_blocks == NUM_BLOCKS
    assert "recovering" not in capfd.readouterr().err


def test_a_small_disk_index_recovers_without_a_bar(
    make_store: Callable[..., TieredStore], capfd: pytest.CaptureFixture[str]
) -> None:
    store = make_store(host_blocks=64, disk_blocks=128, write_policy=WritePolicy.WRITE_THROUGH)
    store.register(NAMESPACE)
    store.put(NAMESPACE, keys(64), blocks(64))
    config = store.config
    store.close()
    capfd.readouterr()
    with TieredStore(config, show_progress=True) as reopened:
        assert reopened.num_recovered_blocks == 64
    assert "recovering" not in capfd.readouterr().err
