"""Review of the REMOTE tier's fixes (97cfc72 and later): bugs a second review showed against a
real redis-server (each an expected failure until its fix): tombstones that refused legitimate
demotions after a clear or a re-put, a demotion's check racing a delete, a fill leaking its
pages when it raises, a large forget trimming its own tombstones.

Where a race needs one side to be slow, the test holds it at a gate on the store's own object;
the gate stands for ordinary scheduling delay (a GIL switch), never for other bytes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_cluster import RedisServer, connected
from tests.support.redis_cluster import remote_config as remote
from tests.support.tiny_blocks import TINY_LAYOUT, StoreFactory, blocks, keys
from tierkv import Namespace, WritePolicy
from tierkv.config import Tier
from tierkv.keys import NAMESPACE_ID_BYTES
from tierkv.store import remote_link
from tierkv.store.remote_forget import Forgotten
from tierkv.tiers.remote_keys import remote_key


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis-fixes")) as redis_server:
        yield redis_server


def held_in_redis(server: RedisServer, namespace: Namespace, block_hash: bytes) -> bool:
    with server.client() as client:
        return bool(client.exists(remote_key(namespace.id + block_hash)))


def test_blocks_put_after_a_clear_are_still_demoted(
        make_store: StoreFactory, server: RedisServer) -> None:
    namespace = Namespace("clear-then-put", TINY_LAYOUT, tenant="fixes")
    store = connected(make_store(host_blocks=8, remote=remote(server.url)))
    store.register(namespace)
    store.put(namespace, keys(4, salt="old"), blocks(4, seed=1))
    store.clear(namespace=namespace)
    hashes, data = keys(32, salt="new"), blocks(32, seed=2)
    for start in range(0, 32, 4):  # write_back: only evictions reach REMOTE
        store.put(namespace, hashes[start : start + 4], data[start : start + 4])
    assert store.flush_remote(10)
    assert store.stats().tiers[Tier.HOST].evictions >= 24
    stats = store.stats().remote
    assert stats is not None and stats.demoted >= 24
    assert held_in_redis(server, namespace, hashes[0])


def test_a_block_put_again_after_its_delete_is_demoted(
        make_store: StoreFactory, server: RedisServer) -> None:
    namespace = Namespace("delete-then-put", TINY_LAYOUT, tenant="fixes")
    store = connected(make_store(host_blocks=8, remote=remote(server.url)))
    store.register(namespace)
    hashes, data = keys(1, salt="again"), blocks(1, seed=3)
    assert store.put(namespace, hashes, data) == 1
    assert store.delete(namespace, hashes) == 1
    assert store.put(namespace, hashes, data) == 1  # a legitimate new put of the same block
    others, other_data = keys(16, salt="push"), blocks(16, seed=4)
    for start in range(0, 16, 4):
        store.put(namespace, others[start : start + 4], other_data[start : start + 4])
    assert store.flush_remote(10)
    assert store.stats().tiers[Tier.HOST].evictions >= 9  # the re-put block among them
    assert held_in_redis(server, namespace, hashes[0])


def test_a_demotion_checked_just_before_a_delete_does_not_write_it_back(
        make_store: StoreFactory, server: RedisServer) -> None:
    namespace = Namespace("toctou", TINY_LAYOUT, tenant="fixes")
    store = connected(make_store(host_blocks=4, remote=remote(server.url)))
    store.register(namespace)
    victim, victim_data = keys(1, salt="victim"), blocks(1, seed=5)
    assert store.put(namespace, victim, victim_data) == 1
    link = store._remote
    assert link is not None
    forgotten = link.forgotten
    real_check = forgotten.forbids_locked
    raw_victim = namespace.id + victim[0]
    checked, go = threading.Event(), threading.Event()

    def slow_check(raw_key: bytes, seen_s: float) -> bool:
        answer = real_check(raw_key, seen_s)
        if raw_key == raw_victim and not checked.is_set():
            checked.set()
            go.wait(10)  # the putting thread is descheduled after the check
        return answer

    forgotten.forbids_locked = slow_check  # type: ignore[method-assign]
    pushing = threading.Thread(target=store.put,
                               args=(namespace, keys(4, salt="push2"), blocks(4, seed=6)))
    pushing.start()
    assert checked.wait(10)
    # The delete runs while the demotion sits between its check and its enqueue; it may wait
    # for the enqueue (that is the fix), so it runs on its own thread.
    deleted: list[int] = []
    deleting = threading.Thread(target=lambda: deleted.append(store.delete(namespace, victim)))
    deleting.start()
    time.sleep(0.3)
    go.set()
    pushing.join(10)
    deleting.join(10)
    forgotten.forbids_locked = real_check  # type: ignore[method-assign]
    assert deleted in ([0], [1])  # 0: the eviction dropped it from HOST first (it is then
    # only in REMOTE's queue, which the delete purges)
    assert store.flush_remote(10)
    assert not held_in_redis(server, namespace, victim[0])
    assert store.lookup(namespace, victim) == 0


def test_a_fill_that_fails_midway_gives_its_pages_back(
        make_store: StoreFactory, server: RedisServer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    namespace = Namespace("fill-leak", TINY_LAYOUT, tenant="fixes")
    hashes, data = keys(4, salt="leak"), blocks(4, seed=7)
    writer = connected(make_store(host_blocks=16, disk_blocks=16, disk_path=tmp_path / "w",
                                  remote=remote(server.url)))
    writer.register(namespace)
    assert writer.put(namespace, hashes, data, write_policy=WritePolicy.WRITE_THROUGH) == 4
    assert writer.flush_remote(10)
    reader = connected(make_store(host_blocks=8, remote=remote(server.url)))
    reader.register(namespace)
    host = reader._core.paged[Tier.HOST]
    free_before = host.allocator.num_free_pages

    def broken(*args: object, **kwargs: object) -> object:
        raise MemoryError("hashing thread could not start")

    monkeypatch.setattr(remote_link, "copy_with_checksums", broken)
    with contextlib.suppress(MemoryError):  # raised to the reader today
        reader.get(namespace, hashes)
    monkeypatch.undo()
    assert host.allocator.num_free_pages == free_before


def test_every_key_of_a_large_forget_blocks_demotion() -> None:
    forgotten = Forgotten(max_keys=4)
    raw = [bytes(NAMESPACE_ID_BYTES) + bytes([i]) * 8 for i in range(6)]
    seen_s = time.monotonic()
    forgetting = forgotten.begin(raw)
    try:
        assert all(forgotten.forbids(key, seen_s) for key in raw)
    finally:
        forgotten.end(forgetting)
