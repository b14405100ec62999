"""``write_through`` to a REMOTE tier without a disk tier: the put queues its blocks' records
for REMOTE (nothing local to write through), and the record buffers REMOTE's writer hands back
are reused for later records without ever mixing two records' bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.redis_cluster import RedisServer
from tests.support.tiny_blocks import BLOCK_BYTES, PAGE_BYTES, TINY_LAYOUT, blocks, keys
from tierkv import ConfigError, Namespace, TieredStore, WritePolicy
from tierkv.config import HostTierConfig, RemoteTierConfig, StoreConfig, Tier


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


def _store(url: str | None, host_blocks: int = 64) -> TieredStore:
    remote = RemoteTierConfig.from_url(url) if url else None
    store = TieredStore(StoreConfig(host=HostTierConfig(host_blocks * BLOCK_BYTES, PAGE_BYTES),
                                    remote=remote))
    if remote is not None:
        assert store._remote is not None and store._remote.remote.wait_connected(10)
    return store


def test_write_through_without_a_disk_reaches_remote_and_reused_buffers_stay_exact(
    redis_url: str,
) -> None:
    namespace = Namespace("wt-model", TINY_LAYOUT)
    with _store(redis_url) as writer, _store(redis_url, host_blocks=256) as reader:
        writer.register(namespace)
        reader.register(namespace)
        batches = [(keys(8, salt=f"wt-{i}"), blocks(8, seed=100 + i)) for i in range(12)]
        for hashes, data in batches:
            assert writer.put(namespace, hashes, data, write_policy=WritePolicy.WRITE_THROUGH) == 8
            assert writer.flush_remote(10)  # each batch sent: the next reuses its buffers
        remote = writer.stats().remote
        assert remote is not None and remote.written == 96 and remote.write_failures == 0
        assert writer._core.spill is not None and writer._core.spill.record_buffers.idle_bytes > 0
        for hashes, data in batches:
            got = reader.get(namespace, hashes)
            assert torch.equal(got.view(torch.uint8), data.view(torch.uint8))
        # Puts of blocks held already (the last batch is still in HOST) send nothing again.
        writer.put(namespace, *batches[-1], write_policy=WritePolicy.WRITE_THROUGH)
        assert writer.flush_remote(10)
        again = writer.stats().remote
        assert again is not None and again.written == 96


def test_write_through_needs_a_disk_or_a_remote_tier(tmp_path: Path) -> None:
    namespace = Namespace("wt-model", TINY_LAYOUT)
    with _store(None) as store:
        store.register(namespace)
        with pytest.raises(ConfigError, match=r"disk tier .* or a REMOTE tier"):
            store.put(namespace, keys(1), blocks(1), write_policy=WritePolicy.WRITE_THROUGH)


def test_without_a_disk_host_evictions_are_demoted_to_remote(redis_url: str) -> None:
    namespace = Namespace("demote-model", TINY_LAYOUT)
    with _store(redis_url, host_blocks=8) as small, _store(redis_url, host_blocks=64) as reader:
        small.register(namespace)
        reader.register(namespace)
        hashes, data = keys(32, salt="host-demote"), blocks(32, seed=77)
        for start in range(0, 32, 4):  # write_back: only evictions reach REMOTE
            small.put(namespace, hashes[start : start + 4], data[start : start + 4])
        assert small.flush_remote(10)
        remote = small.stats().remote
        assert remote is not None and remote.demoted >= 24 and remote.written == 0
        assert small.stats().tiers[Tier.HOST].evictions >= 24
        got = reader.get(namespace, hashes[:24])  # the evicted ones, from REMOTE alone
        assert torch.equal(got.view(torch.uint8), data[:24].view(torch.uint8))
        # A block deleted meanwhile is not demoted afterwards.
        small.delete(namespace, hashes[24:25])
        small.put(namespace, keys(8, salt="push"), blocks(8, seed=78))
        assert small.flush_remote(10)
        assert reader.lookup(namespace, hashes[24:25]) == 0
