"""Review of the REMOTE tier's fixes (97cfc72 and later): bugs shown against a real redis-server
as strict xfails.

Where a race needs one side to be slow, the test holds it at a gate on the store's own object;
the gate stands for ordinary scheduling delay (a GIL switch), never for other bytes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_cluster import RedisServer, connected
from redis_cluster import remote_config as remote

from tierkv import Namespace, WritePolicy
from tierkv.config import Tier
from tierkv.keys import NAMESPACE_ID_BYTES
from tierkv.store import remote_link
from tierkv.store.remote_forget import Forgotten
from tierkv.tiers.remote_keys import remote_key
from tiny_blocks import TINY_LAYOUT, StoreFactory, blocks, keys


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis-fixes")) as redis_server:
        yield redis_server


def held_in_redis(server: RedisServer, namespace: Namespace, block_hash: bytes) -> bool:
    with server.client() as client:
        return bool(client.exists(remote_key(namespace.id + block_hash)))


@pytest.mark.xfail(strict=True, reason="a clear's namespace tombstone is never revived: for "
                   "keep_s (60 s) every HOST/DISK eviction of the namespace's NEW blocks is "
                   "dropped instead of demoted (remote_forget.py blocks_demotion/revive)")
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


@pytest.mark.xfail(strict=True, reason="only a write_through put revives a deleted key: a "
                   "write_back put of it again is refused by REMOTE on eviction for keep_s, "
                   "and without a disk the block is lost (remote_link.py offer/revive)")
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


@pytest.mark.xfail(strict=True, reason="offer() checks the tombstones, then queues without "
                   "holding forgotten.lock: a delete that begins and purges in between has its "
                   "block written back to REMOTE (remote_link.py offer, demoted branch)")
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
    real_check = forgotten.blocks_demotion
    raw_victim = namespace.id + victim[0]
    checked, go = threading.Event(), threading.Event()

    def slow_check(raw_key: bytes) -> bool:
        answer = real_check(raw_key)
        if raw_key == raw_victim and not checked.is_set():
            checked.set()
            go.wait(10)  # the putting thread is descheduled after the check
        return answer

    forgotten.blocks_demotion = slow_check  # type: ignore[method-assign]
    pushing = threading.Thread(target=store.put,
                               args=(namespace, keys(4, salt="push2"), blocks(4, seed=6)))
    pushing.start()
    assert checked.wait(10)
    assert store.delete(namespace, victim) == 1  # returns: REMOTE has no copy now
    go.set()
    pushing.join(10)
    forgotten.blocks_demotion = real_check  # type: ignore[method-assign]
    assert store.flush_remote(10)
    assert not held_in_redis(server, namespace, victim[0])
    assert store.lookup(namespace, victim) == 0


@pytest.mark.xfail(strict=True, reason="_bring_into_host reserves HOST pages, then an "
                   "exception in copy_with_checksums/write_block/publish leaks them for good "
                   "(remote_link.py _bring_into_host: no try/finally release)")
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


@pytest.mark.xfail(strict=True, reason="a forget of more than max_keys keys trims its own "
                   "oldest tombstones at begin(), and blocks_demotion never looks at the active "
                   "forgets: a demoted record of such a deleted key is accepted "
                   "(remote_forget.py begin/blocks_demotion)")
def test_every_key_of_a_large_forget_blocks_demotion() -> None:
    forgotten = Forgotten(max_keys=4)
    raw = [bytes(NAMESPACE_ID_BYTES) + bytes([i]) * 8 for i in range(6)]
    forgetting = forgotten.begin(raw)
    try:
        assert all(forgotten.blocks_demotion(key) for key in raw)
    finally:
        forgotten.end(forgetting)
