"""Chat sessions: save, resume (with the cached prefix), list, delete, TTL, restarts, bad input.

Everything goes through ``TieredStore``'s public API on real LMDB files in ``tmp_path``; the only
direct LMDB access is from a second process, to see that a save is committed when it returns.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.tiny_blocks import BLOCK_BYTES, PAGE_BYTES, TINY_LAYOUT, StoreFactory, blocks, same_bytes
from tierkv import (
    DiskFullError,
    DiskTierConfig,
    HostTierConfig,
    InvalidArgumentError,
    Namespace,
    Priority,
    StoreConfig,
    TieredStore,
    UnknownNamespaceError,
    WritePolicy,
    block_hashes,
)
from tierkv.errors import SessionNotFoundError
from tierkv.types import ResumedSession, SessionInfo

BLOCK_SIZE = TINY_LAYOUT.block_size  # 4 tokens a block
WRITE_THROUGH = WritePolicy.WRITE_THROUGH


def chat_tokens(n: int, start: int = 1000) -> list[int]:
    """``n`` distinct token ids."""
    return list(range(start, start + n))


def put_session_blocks(
    store: TieredStore, namespace: Namespace, token_ids: list[int], num_blocks: int,
    seed: str | None = None,
) -> list[bytes]:
    """Store the first ``num_blocks`` blocks of ``token_ids`` as a session's blocks are stored."""
    hashes: list[bytes] = [bytes(h) for h in block_hashes(token_ids, BLOCK_SIZE, seed)][:num_blocks]
    assert len(hashes) == num_blocks
    stored = store.put(namespace, hashes, blocks(num_blocks, seed=len(token_ids)),
                       priority=Priority.SESSION, write_policy=WRITE_THROUGH)
    assert stored == num_blocks
    return hashes


def ids(store: TieredStore, tenant: str = "default") -> list[str]:
    return [info.session_id for info in store.list_sessions(tenant=tenant)]


# --- save and resume ---------------------------------------------------------------------------


def test_resume_gives_back_tokens_and_the_cached_prefix(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store(disk_blocks=32)
    store.register(namespace)
    tokens = chat_tokens(22)  # 5 full blocks and 2 tokens more
    put_session_blocks(store, namespace, tokens, 3)
    assert store.save_session(namespace, "chat-1", tokens) == 22

    resumed = store.resume_session("chat-1")
    assert isinstance(resumed, ResumedSession)
    assert resumed.namespace == namespace
    assert list(resumed.token_ids) == tokens
    assert resumed.num_cached_tokens == 3 * BLOCK_SIZE

    # Another seed hashes other blocks: nothing of them is cached.
    assert store.resume_session("chat-1", tenant="default", seed="other").num_cached_tokens == 0
    # Once every full block is stored, all but the partial tail is cached.
    hashes = list(block_hashes(tokens, BLOCK_SIZE))
    store.put(namespace, hashes[3:], blocks(2, seed=7), priority=Priority.SESSION,
              write_policy=WRITE_THROUGH)
    assert store.resume_session("chat-1").num_cached_tokens == 20
    # A missing block in the middle ends the cached prefix there.
    assert store.delete(namespace, [hashes[1]]) == 1
    assert store.resume_session("chat-1").num_cached_tokens == BLOCK_SIZE


def test_token_ids_may_be_numpy_or_torch_and_round_trip_as_uint32(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store(disk_blocks=8)
    store.register(namespace)
    edge = [0, 1, 2**31, 2**32 - 1]
    store.save_session(namespace, "list", edge)
    store.save_session(namespace, "numpy", np.array(edge, dtype=np.uint64))
    store.save_session(namespace, "torch", torch.tensor([5, 6, 7], dtype=torch.int64))
    store.save_session(namespace, "empty", [])
    assert list(store.resume_session("list").token_ids) == edge
    assert list(store.resume_session("numpy").token_ids) == edge
    assert list(store.resume_session("torch").token_ids) == [5, 6, 7]
    empty = store.resume_session("empty")
    assert list(empty.token_ids) == [] and empty.num_cached_tokens == 0


def test_save_is_committed_when_it_returns(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    """Another process sees the record while the store is still open (no close, no flush)."""
    disk = tmp_path / "disk"
    store = make_store(disk_blocks=8, disk_path=disk)
    store.register(namespace)
    store.save_session(namespace, "durable", [1, 2, 3])
    reader = (
        "import lmdb, sys\n"
        "env = lmdb.open(sys.argv[1], max_dbs=4, readonly=True)\n"
        "db = env.open_db(b'sessions', create=False)\n"
        "with env.begin(db=db) as txn:\n"
        "    print(*sorted(bytes(k).hex() for k, _ in txn.cursor()))\n"
    )
    out = subprocess.run([sys.executable, "-c", reader, str(disk)], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == [(b"default\x00durable").hex()]


def test_sessions_and_their_blocks_survive_a_restart(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    store = make_store(disk_blocks=32, disk_path=disk)
    store.register(namespace)
    tokens = chat_tokens(30)
    hashes = put_session_blocks(store, namespace, tokens, 5)
    store.save_session(namespace, "chat", tokens, ttl_s=3600)
    store.save_session(namespace, "other", chat_tokens(3, start=7))
    saved = {info.session_id: info for info in store.list_sessions()}
    store.close()

    store = make_store(disk_blocks=32, disk_path=disk)
    resumed = store.resume_session("chat")
    assert resumed.namespace == namespace
    assert list(resumed.token_ids) == tokens
    assert resumed.num_cached_tokens == 5 * BLOCK_SIZE
    assert same_bytes(store.get(namespace, hashes), blocks(5, seed=len(tokens)))
    listed = store.list_sessions()
    assert [info.session_id for info in listed] == ["chat", "other"]
    assert listed[1] == saved["other"]  # untouched: last use survives the restart exactly
    assert listed[0].last_use_unix_s >= saved["chat"].last_use_unix_s  # resumed: updated


# --- tenants, list, delete, replace ------------------------------------------------------------


def test_tenants_are_isolated(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(disk_blocks=32)
    other = namespace.with_tenant("acme")
    store.register(namespace)
    store.register(other)
    mine, theirs = chat_tokens(12), chat_tokens(12, start=5000)
    put_session_blocks(store, namespace, mine, 3)
    put_session_blocks(store, other, theirs, 1)
    store.save_session(namespace, "chat", mine)
    store.save_session(other, "chat", theirs)
    store.save_session(other, "acme-only", [1])

    a = store.resume_session("chat")
    b = store.resume_session("chat", tenant="acme")
    assert (a.namespace, list(a.token_ids), a.num_cached_tokens) == (namespace, mine, 12)
    assert (b.namespace, list(b.token_ids), b.num_cached_tokens) == (other, theirs, 4)
    assert b.namespace.tenant == "acme"
    with pytest.raises(SessionNotFoundError):
        store.resume_session("acme-only")
    with pytest.raises(SessionNotFoundError):
        store.resume_session("chat", tenant="nobody")
    assert ids(store) == ["chat"]
    assert ids(store, "acme") == ["acme-only", "chat"]
    assert ids(store, "nobody") == []
    # Deleting one tenant's session leaves the other's.
    assert store.delete_session("chat", tenant="acme")
    assert list(store.resume_session("chat").token_ids) == mine
    assert not store.delete_session("chat", tenant="nobody")


def test_list_sessions_reports_each_session_sorted(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store(disk_blocks=8)
    other_model = Namespace("other-model", TINY_LAYOUT)
    store.register(namespace)
    store.register(other_model)
    before = time.time()
    store.save_session(namespace, "b", chat_tokens(7))
    store.save_session(other_model, "a", chat_tokens(3))
    store.save_session(namespace, "c", [])
    after = time.time()
    listed = store.list_sessions()
    assert all(isinstance(info, SessionInfo) for info in listed)
    assert [(i.session_id, i.model_id, i.num_tokens) for i in listed] == [
        ("a", "other-model", 3), ("b", "test-model", 7), ("c", "test-model", 0)
    ]
    assert all(before <= i.last_use_unix_s <= after for i in listed)
    time.sleep(0.01)
    store.resume_session("b")
    assert store.list_sessions()[1].last_use_unix_s > after


def test_delete_session_is_durable(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    store = make_store(disk_blocks=8, disk_path=disk)
    store.register(namespace)
    store.save_session(namespace, "gone", [1, 2])
    store.save_session(namespace, "kept", [3, 4])
    assert store.delete_session("gone") is True
    with pytest.raises(SessionNotFoundError) as info:
        store.resume_session("gone")
    assert isinstance(info.value, LookupError)
    assert str(info.value) == "no session 'gone' for tenant 'default'"  # not quoted like KeyError
    assert store.delete_session("gone") is False
    assert ids(store) == ["kept"]
    store.close()

    store = make_store(disk_blocks=8, disk_path=disk)
    with pytest.raises(SessionNotFoundError):
        store.resume_session("gone")
    assert ids(store) == ["kept"]
    assert store.delete_session("kept") is True
    store.close()
    store = make_store(disk_blocks=8, disk_path=disk)
    assert ids(store) == []


def test_saving_again_replaces_the_session(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    store = make_store(disk_blocks=8, disk_path=disk)
    other_model = Namespace("other-model", TINY_LAYOUT)
    store.register(namespace)
    store.register(other_model)
    store.save_session(namespace, "chat", chat_tokens(10), ttl_s=60)
    assert store.save_session(other_model, "chat", chat_tokens(5, start=9)) == 5
    resumed = store.resume_session("chat")
    assert (resumed.namespace, list(resumed.token_ids)) == (other_model, chat_tokens(5, start=9))
    assert [(i.session_id, i.model_id, i.num_tokens) for i in store.list_sessions()] == [
        ("chat", "other-model", 5)
    ]
    store.close()
    store = make_store(disk_blocks=8, disk_path=disk)
    resumed = store.resume_session("chat")
    assert (resumed.namespace, list(resumed.token_ids)) == (other_model, chat_tokens(5, start=9))


def test_ttl_counts_from_last_use_and_expired_sessions_are_absent(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    """Wall-clock TTL: it survives a restart, a resume renews it, and once it runs out the
    session is gone from resume, list and delete."""
    disk = tmp_path / "disk"
    store = make_store(disk_blocks=8, disk_path=disk)
    store.register(namespace)
    store.save_session(namespace, "short", [1, 2, 3], ttl_s=0.8)
    store.save_session(namespace, "forever", [4])
    time.sleep(0.5)
    store.resume_session("short")  # 0.5 s after the save: alive; renews the TTL
    store.close()
    time.sleep(0.5)  # over 0.8 s since the save, about 0.5 s since the resume

    store = make_store(disk_blocks=8, disk_path=disk)
    assert ids(store) == ["forever", "short"]
    time.sleep(0.9)
    assert ids(store) == ["forever"]
    with pytest.raises(SessionNotFoundError):
        store.resume_session("short")
    assert store.delete_session("short") is False
    # The expired record is not resurrected by a restart either.
    store.close()
    store = make_store(disk_blocks=8, disk_path=disk)
    assert ids(store) == ["forever"]


# --- bad input ---------------------------------------------------------------------------------


BAD_SAVES: list[tuple[str, dict[str, Any]]] = [
    ("empty id", {"session_id": ""}),
    ("NUL in id", {"session_id": "a\x00b"}),
    ("300-byte id", {"session_id": "é" * 150}),
    ("id not a str", {"session_id": b"chat"}),
    ("unencodable id", {"session_id": "\ud800"}),
    ("negative token", {"token_ids": [1, -1, 2]}),
    ("token 2**32", {"token_ids": [1, 2**32]}),
    ("token 2**64", {"token_ids": [2**64]}),
    ("float token", {"token_ids": [1, 2.0]}),
    ("numpy negative token", {"token_ids": np.array([3, -4])}),
    ("numpy float tokens", {"token_ids": np.array([3.0])}),
    ("torch float tokens", {"token_ids": torch.tensor([3.0])}),
    ("2-D tokens", {"token_ids": np.zeros((2, 2), dtype=np.int64)}),
    ("a str of tokens", {"token_ids": "123"}),
    ("too many tokens", {"token_ids": np.zeros(2**20 + 1, dtype=np.uint32)}),
    ("ttl 0", {"ttl_s": 0}),
    ("ttl -1", {"ttl_s": -1}),
    ("ttl nan", {"ttl_s": math.nan}),
    ("ttl inf", {"ttl_s": math.inf}),
    ("ttl over 30 days", {"ttl_s": 30 * 24 * 3600 + 1}),
    ("unregistered namespace", {"namespace": Namespace("unregistered", TINY_LAYOUT)}),
    ("tenant too long", {"namespace": Namespace("test-model", TINY_LAYOUT, tenant="t" * 300),
                         "session_id": "x" * 256}),
]


@pytest.mark.parametrize("bad", [b for _, b in BAD_SAVES], ids=[name for name, _ in BAD_SAVES])
def test_bad_input_raises_value_error_and_stores_nothing(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path, bad: dict[str, Any]
) -> None:
    disk = tmp_path / "disk"
    store = make_store(disk_blocks=8, disk_path=disk)
    store.register(namespace)
    store.register(namespace.with_tenant("t" * 300))
    store.save_session(namespace, "chat", [7, 8])  # an existing session a bad save must not touch
    args: dict[str, Any] = {"namespace": namespace, "session_id": "chat", "token_ids": [1, 2],
                            "ttl_s": None, **bad}
    with pytest.raises(ValueError) as info:
        store.save_session(**args)
    assert isinstance(info.value, InvalidArgumentError)
    if "namespace" in bad and bad["namespace"].model_id == "unregistered":
        assert isinstance(info.value, UnknownNamespaceError)
    tenant = args["namespace"].tenant
    assert ids(store) == ["chat"] and (tenant == "default" or ids(store, tenant) == [])
    assert list(store.resume_session("chat").token_ids) == [7, 8]
    store.close()
    store = make_store(disk_blocks=8, disk_path=disk)
    assert ids(store) == ["chat"]
    assert list(store.resume_session("chat").token_ids) == [7, 8]


def test_limits_are_inclusive(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(disk_blocks=8)
    store.register(namespace)
    longest = "é" * 128  # 256 UTF-8 bytes
    assert store.save_session(namespace, longest, np.arange(2**20, dtype=np.uint32),
                              ttl_s=30 * 24 * 3600) == 2**20
    assert store.list_sessions()[0].num_tokens == 2**20


@pytest.mark.parametrize("session_id", ["", "a\x00b", "x" * 257, 5])
def test_bad_ids_are_refused_by_resume_and_delete(
    make_store: StoreFactory, session_id: Any
) -> None:
    store = make_store(disk_blocks=8)
    with pytest.raises(InvalidArgumentError):
        store.resume_session(session_id)
    with pytest.raises(InvalidArgumentError):
        store.delete_session(session_id)
    not_a_tenant: Any = b"default"
    with pytest.raises(InvalidArgumentError):
        store.resume_session("chat", tenant=not_a_tenant)
    with pytest.raises(InvalidArgumentError):
        store.list_sessions(tenant=not_a_tenant)


# --- a full disk, no disk, threads -------------------------------------------------------------


def test_a_save_the_disk_cannot_hold_fails_whole_and_keeps_the_old_session(
    namespace: Namespace, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"

    def open_store() -> TieredStore:  # a 1 MiB LMDB map: a 1 MiB session cannot fit
        return TieredStore(StoreConfig(
            host=HostTierConfig(8 * BLOCK_BYTES, PAGE_BYTES),
            disk=DiskTierConfig(disk, capacity_bytes=512 << 10, map_overhead_factor=1.0,
                                map_slack_bytes=512 << 10),
        ))

    store = open_store()
    try:
        store.register(namespace)
        store.save_session(namespace, "chat", [1, 2, 3])
        with pytest.raises(DiskFullError):
            store.save_session(namespace, "chat", np.zeros(2**18, dtype=np.uint32))
        with pytest.raises(DiskFullError):
            store.save_session(namespace, "new", np.zeros(2**18, dtype=np.uint32))
        assert list(store.resume_session("chat").token_ids) == [1, 2, 3]
        assert ids(store) == ["chat"]
    finally:
        store.close(flush=False)
    store = open_store()
    try:
        assert ids(store) == ["chat"]
        assert list(store.resume_session("chat").token_ids) == [1, 2, 3]
        assert store.delete_session("chat")
    finally:
        store.close(flush=False)


def test_without_a_disk_tier_sessions_live_in_memory(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store()  # HOST only
    store.register(namespace)
    tokens = chat_tokens(9)
    hashes = list(block_hashes(tokens, BLOCK_SIZE))
    store.put(namespace, hashes, blocks(2), priority=Priority.SESSION)
    assert store.save_session(namespace, "chat", tokens, ttl_s=60) == 9
    resumed = store.resume_session("chat")
    assert (list(resumed.token_ids), resumed.num_cached_tokens) == (tokens, 8)
    assert ids(store) == ["chat"]
    assert store.delete_session("chat")
    with pytest.raises(SessionNotFoundError):
        store.resume_session("chat")
    # A second store (no disk to share) has none of the first one's sessions.
    store.save_session(namespace, "chat", tokens)
    assert ids(make_store()) == []


def test_concurrent_operations_leave_memory_equal_to_disk(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    """Threads save, resume and delete a few shared session ids; afterwards what the store
    reports is exactly what a restart reads back from disk."""
    disk = tmp_path / "disk"
    store = make_store(disk_blocks=8, disk_path=disk)
    store.register(namespace)
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            for i in range(12):
                session_id = f"s{(thread + i) % 3}"
                if i % 4 == 3:
                    store.delete_session(session_id)
                else:
                    store.save_session(namespace, session_id, [thread, i])
                    with contextlib.suppress(SessionNotFoundError):  # deleted meanwhile
                        store.resume_session(session_id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

    def state(s: TieredStore) -> dict[str, list[int]]:
        return {sid: list(s.resume_session(sid).token_ids) for sid in ids(s)}

    before = state(store)
    store.close()
    assert state(make_store(disk_blocks=8, disk_path=disk)) == before
