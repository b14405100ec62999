"""The client SDK (``Client`` and ``AsyncClient``): lookup, prefetch, pin, delete, stats and
sessions.

Every test starts its own server: ``create_server`` on a background event loop, listening on a
Unix socket and ``127.0.0.1:0``, in front of a real ``TieredStore`` (shared-memory HOST slab,
LMDB disk tier in ``tmp_path``) with bearer tokens. Clients take one of two data paths:

* ``shm``: the Unix socket with ``use_shm`` left to the client (same host: the slab is mapped,
  bulk bytes go through leases: Allocate/Commit, Acquire/Release);
* ``stream``: TCP with ``use_shm=False`` (bulk bytes go through the Put and Get streams).

The server's servicer is a spy that records which RPCs each client id made, so a test can tell
which path a client really took, and that a call refused client side sent nothing. The
``AsyncClient`` runs the same test bodies through ``AsyncFacade`` (each call awaited on a
private event loop); a few tests drive it natively with ``async with`` and ``asyncio.gather``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.client_harness import (
    AnyClient,
    LiveServer,
    ServerFactory,
    ns,
    patterned_blocks,
)
from tests.support.harness import BOB_TOKEN
from tests.support.tiny_blocks import BLOCK_BYTES, PAGE_BYTES, RECORD_BYTES, TINY_LAYOUT, keys, same_bytes
from tierkv import (
    Namespace,
    Priority,
    Tier,
    WritePolicy,
    block_hashes,
)
from tierkv.errors import (
    NotFoundError,
)
from tierkv.hashing import default_seed
from tierkv.store import SessionInfo

# --- lookup, prefetch, pin, delete, stats ------------------------------------------------------


def test_lookup_detail_counts_each_tier_and_prefetch_brings_blocks_into_host(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    server = make_server(host_bytes=16 * BLOCK_BYTES, gpu_bytes=8 * BLOCK_BYTES)
    client = open_client(server, path, kind)
    namespace, hashes = ns(), keys(24, salt="tiers")
    data = patterned_blocks(24, seed=9)
    for start in range(0, 24, 6):  # oldest first: the HOST tier keeps the last ones
        assert client.put(namespace, hashes[start : start + 6], data[start : start + 6]) == 6
    detail = client.lookup_detail(namespace, hashes)
    assert detail.num_cached == 24 == detail.num_gpu + detail.num_host + detail.num_disk
    assert detail.num_gpu == 0 and detail.num_host <= 16 and detail.num_disk >= 8
    assert client.lookup(namespace, hashes) == 24
    assert client.lookup(namespace, [*hashes[:5], keys(1, salt="gap")[0], *hashes[6:]]) == 5
    on_disk = client.lookup_detail(namespace, hashes[:6])
    assert on_disk.num_disk == 6, "the oldest put should have been demoted"

    assert client.prefetch(namespace, hashes[:6]) == 6
    after = client.lookup_detail(namespace, hashes[:6])
    assert (after.num_cached, after.num_host, after.num_disk) == (6, 6, 0)

    # Move two blocks into the (emulated) GPU tier on the server: the fastest tier is reported.
    server_ns = Namespace("test-model", TINY_LAYOUT, tenant="alice")
    assert server.store.prefetch_async(server_ns, hashes[:2], Tier.GPU).result() == 2
    top = client.lookup_detail(namespace, hashes[:6])
    assert (top.num_gpu, top.num_host, top.num_disk) == (2, 4, 0)

    pinned = client.lookup_detail(namespace, hashes[:3], pin_ttl_s=60.0)
    assert pinned.num_cached == 3 and pinned.num_pinned == 3
    assert client.unpin(namespace, hashes[:3]) == 3
    # Whatever tier each block's fastest copy is in, a get returns exactly its bytes (chains
    # that fit the HOST tier: see the test of chains bigger than HOST for the rest).
    for start in (0, 6, 12, 18, 3, 9):
        got = client.get(namespace, hashes[start : start + 6])
        assert got.shape[0] == 6 and same_bytes(got, data[start : start + 6])


def test_pin_keeps_blocks_in_host_until_unpin(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    server = make_server(host_bytes=16 * BLOCK_BYTES)
    client = open_client(server, path, kind)
    namespace = ns()
    kept, data = keys(4, salt="kept"), patterned_blocks(4, seed=10)
    assert client.put(namespace, kept, data) == 4
    assert client.pin(namespace, kept) == 4
    assert client.pin(namespace, [keys(1, salt="absent")[0], *kept]) == 0  # the prefix only
    assert client.stats().num_pinned == 4

    def churn(salt: str) -> None:
        for start in range(0, 32, 4):
            filler = keys(4, start, salt=salt)
            assert client.put(namespace, filler, patterned_blocks(4, seed=start)) == 4

    churn("filler-1")
    held = client.lookup_detail(namespace, kept)
    assert (held.num_cached, held.num_host) == (4, 4), "pinned blocks were evicted"
    assert client.unpin(namespace, kept) == 4
    assert client.unpin(namespace, kept) == 0
    assert client.stats().num_pinned == 0
    churn("filler-2")
    gone = client.lookup_detail(namespace, kept)
    assert (gone.num_cached, gone.num_host, gone.num_disk) == (4, 0, 4)
    assert same_bytes(client.get(namespace, kept), data)


def test_delete_makes_blocks_misses(client: AnyClient) -> None:
    namespace, hashes = ns(), keys(6, salt="delete")
    data = patterned_blocks(6, seed=11)
    assert client.put(namespace, hashes, data) == 6
    assert client.delete(namespace, hashes[2:4]) == 2
    assert client.delete(namespace, hashes[2:4]) == 0
    assert client.lookup(namespace, hashes) == 2
    assert same_bytes(client.get(namespace, hashes), data[:2])
    assert client.lookup(namespace, hashes[4:]) == 2
    assert client.delete(namespace, hashes) == 4
    assert client.lookup(namespace, hashes[4:]) == 0
    assert client.put(namespace, hashes, data) == 6  # stored anew
    assert same_bytes(client.get(namespace, hashes), data)


def test_stats_report_the_server_tiers_and_counters(
    server: LiveServer, client: AnyClient
) -> None:
    before = client.stats()
    tiers = {tier.label: t for tier, t in before.tiers.items()}
    assert set(tiers) == {"host", "disk"}
    assert tiers["host"].capacity_bytes == 64 * BLOCK_BYTES
    assert tiers["disk"].capacity_bytes == 4096 * RECORD_BYTES
    assert tiers["host"].used_bytes == 0 and tiers["host"].num_blocks == 0
    namespace, hashes = ns(), keys(5, salt="stats")
    client.put(namespace, hashes, patterned_blocks(5, seed=12))
    client.get(namespace, hashes)
    after = client.stats()
    host = after.tiers[Tier.HOST]
    assert host.num_blocks == 5 and host.used_bytes == 5 * BLOCK_BYTES
    assert after.puts == before.puts + 1 and after.num_namespaces == 1
    assert after.num_leases == 0
    snapshot = server.store.stats()
    assert snapshot.tiers[Tier.HOST].num_blocks == 5 and snapshot.puts == after.puts


def test_describe_reports_the_server_and_its_slab(server: LiveServer, client: AnyClient) -> None:
    info = client.describe()
    assert info.shm_name == server.store.sidecar.host_shm_name
    assert info.shm_size_bytes == 64 * BLOCK_BYTES and info.page_bytes == PAGE_BYTES
    assert info.hash_seed == default_seed() and info.max_hashes_per_call == 65536
    assert info.host_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert client.describe() is info  # fetched once
    assert server.spy.methods_of(client.settings.client_id)["Describe"] == 1


# --- sessions ----------------------------------------------------------------------------------


def test_sessions_save_resume_list_delete(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    server = make_server(hash_seed="session-seed-1234")
    client = open_client(server, path, kind)
    bob = open_client(server, path, kind, token=BOB_TOKEN)
    namespace = ns("chat-model")
    assert client.describe().hash_seed == "session-seed-1234"
    token_ids = list(range(5000, 5042))  # 10 full blocks of 4 tokens and 2 more tokens
    hashes = [bytes(h) for h in block_hashes(token_ids, TINY_LAYOUT.block_size, "session-seed-1234")]
    assert len(hashes) == 10
    assert client.put(namespace, hashes[:6], patterned_blocks(6, seed=13), priority=Priority.SESSION,
                      write_policy=WritePolicy.WRITE_THROUGH) == 6
    disk = client.stats().tiers[Tier.DISK]
    assert disk.num_blocks == 6, "write_through puts are on disk when acknowledged"

    assert client.save_session(namespace, "chat-1", token_ids) == 42
    assert client.save_session(namespace, "chat-2", token_ids[:8], ttl_s=3600) == 8
    resumed = client.resume_session("chat-1")
    assert list(resumed.token_ids) == token_ids and resumed.num_cached_tokens == 24
    assert (resumed.namespace.model_id, resumed.namespace.layout) == ("chat-model", TINY_LAYOUT)
    short = client.resume_session("chat-2")
    assert (list(short.token_ids), short.num_cached_tokens) == (token_ids[:8], 8)
    listed = {s.session_id: s for s in client.list_sessions()}
    assert set(listed) == {"chat-1", "chat-2"}
    assert all(isinstance(s, SessionInfo) for s in listed.values())  # typed, not protobuf
    assert (listed["chat-1"].model_id, listed["chat-1"].num_tokens) == ("chat-model", 42)
    assert abs(listed["chat-1"].last_use_unix_s - time.time()) < 60

    assert bob.list_sessions() == []  # another tenant
    with pytest.raises(NotFoundError):
        bob.resume_session("chat-1")

    assert client.delete_session("chat-1") is True
    assert client.delete_session("chat-1") is False
    with pytest.raises(NotFoundError):
        client.resume_session("chat-1")
    assert [s.session_id for s in client.list_sessions()] == ["chat-2"]
