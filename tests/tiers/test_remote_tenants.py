"""The REMOTE tier's memory is shared by every tenant of every node: what one tenant's records
may take of a node's REMOTE writes is bounded per interval (``tenant_write_bytes``), without
touching another tenant's, and a tenant's keys can carry their own TTL (``tenant_ttl_s``).
Against a real ``redis-server``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis
import torch

from tests.support.redis_cluster import RedisServer
from tests.support.tiny_blocks import BLOCK_BYTES, PAGE_BYTES, TINY_LAYOUT, blocks, keys
from tierkv import ConfigError, Namespace, TieredStore, WritePolicy
from tierkv.config import HostTierConfig, RemoteTierConfig, StoreConfig
from tierkv.types import RemoteStats

ALICE = Namespace("shared-model", TINY_LAYOUT, tenant="alice")
BOB = Namespace("shared-model", TINY_LAYOUT, tenant="bob")


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


def _store(url: str, **remote: object) -> TieredStore:
    config = replace(RemoteTierConfig.from_url(url), **remote)  # type: ignore[arg-type]
    store = TieredStore(StoreConfig(host=HostTierConfig(64 * BLOCK_BYTES, PAGE_BYTES),
                                    remote=config))
    assert store._remote is not None and store._remote.remote.wait_connected(10)
    for namespace in (ALICE, BOB):
        store.register(namespace)
    return store


def _remote(store: TieredStore) -> RemoteStats:
    assert store.flush_remote(10)
    remote = store.stats().remote
    assert remote is not None
    return remote


def _record_bytes(url: str) -> int:
    with _store(url) as store:
        store.put(ALICE, keys(1, salt="measure"), blocks(1), write_policy=WritePolicy.WRITE_THROUGH)
        return _remote(store).bytes_written


def test_a_tenant_past_its_remote_budget_drops_its_own_records_only(
    redis_server: RedisServer,
) -> None:
    record_bytes = _record_bytes(redis_server.url)
    with _store(redis_server.url, tenant_write_bytes=4 * record_bytes,
                tenant_write_interval_s=3600.0) as store, _store(redis_server.url) as reader:
        alice_keys, bob_keys = keys(8, salt="alice"), keys(4, salt="bob")
        store.put(ALICE, alice_keys, blocks(8, seed=1), write_policy=WritePolicy.WRITE_THROUGH)
        store.put(BOB, bob_keys, blocks(4, seed=2), write_policy=WritePolicy.WRITE_THROUGH)
        remote = _remote(store)
        assert (remote.written, remote.budget_drops) == (8, 4)  # Alice's 4 + Bob's 4; 4 dropped
        # Bob's records all landed, whatever Alice wrote; Alice's first four did.
        assert torch.equal(reader.get(BOB, bob_keys).view(torch.uint8),
                           blocks(4, seed=2).view(torch.uint8))
        assert torch.equal(reader.get(ALICE, alice_keys).view(torch.uint8),
                           blocks(8, seed=1)[:4].view(torch.uint8))


def test_a_tenants_remote_budget_comes_back_with_the_next_interval(
    redis_server: RedisServer,
) -> None:
    record_bytes = _record_bytes(redis_server.url)
    with _store(redis_server.url, tenant_write_bytes=2 * record_bytes,
                tenant_write_interval_s=0.5) as store:
        store.put(ALICE, keys(3, salt="first"), blocks(3), write_policy=WritePolicy.WRITE_THROUGH)
        assert (_remote(store).written, _remote(store).budget_drops) == (2, 1)
        time.sleep(0.6)
        store.put(ALICE, keys(3, salt="second"), blocks(3), write_policy=WritePolicy.WRITE_THROUGH)
        assert (_remote(store).written, _remote(store).budget_drops) == (4, 2)


def test_a_tenants_keys_carry_its_own_ttl(redis_server: RedisServer) -> None:
    with _store(redis_server.url, ttl_s=0, tenant_ttl_s={"alice": 100}) as store:
        store.put(ALICE, keys(3, salt="ttl"), blocks(3), write_policy=WritePolicy.WRITE_THROUGH)
        store.put(BOB, keys(2, salt="ttl"), blocks(2), write_policy=WritePolicy.WRITE_THROUGH)
        assert _remote(store).written == 5
    client: redis.Redis = redis_server.client()
    ttls = sorted(int(client.ttl(key)) for key in client.scan_iter())
    assert ttls[:2] == [-1, -1] and all(0 < ttl <= 100 for ttl in ttls[2:]), ttls
    assert len(ttls) == 5


@pytest.mark.parametrize(("field", "value", "message"), [
    ("tenant_write_bytes", -1, "tenant_write_bytes"),
    ("tenant_write_interval_s", 0.0, "tenant_write_interval_s"),
    ("tenant_ttl_s", {"alice": -5}, "alice's TTL"),
    ("tenant_ttl_s", {"alice": 1.5}, "alice's TTL"),
])
def test_bad_tenant_remote_settings_are_config_errors(field: str, value: object,
                                                      message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replace(RemoteTierConfig.from_url("redis://127.0.0.1:1"), **{field: value})  # type: ignore[arg-type]
