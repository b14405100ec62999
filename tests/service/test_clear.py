"""Clear and the operator's Stats through a real server: who may clear what (tokens, admin
tenants, a server without tokens), what a clear removes and reports, and a clear racing puts.

Every request shape a tenant that is no admin can send (raw, past what the SDK forms) reaches
only its own namespaces; an admin's clear leaves other tenants bit-exact, on disk too, across a
restart; same-host lookups answer from the presence table, which a clear empties too.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.support.harness import ALICE_TOKEN, BOB_TOKEN, BackgroundServer
from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, blocks, keys, same_bytes
from tierkv import (
    AsyncClient,
    Client,
    InvalidArgumentError,
    KVLayout,
    Namespace,
    Tier,
    WritePolicy,
)
from tierkv.errors import PermissionDeniedError
from tierkv.store import ClearResult
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc
from tierkv.wire.namespaces import namespace_to

ADMIN_TOKEN = "v" * 32
TOKENS = {ALICE_TOKEN: "alice", BOB_TOKEN: "bob", ADMIN_TOKEN: "ops"}
MODEL_A = Namespace("model-a", TINY_LAYOUT)
MODEL_B = Namespace("model-b", KVLayout(2, 2, 8, 4))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BackgroundServer]:
    background = BackgroundServer(tmp_path / "store", tokens=TOKENS, admin_tenants=("ops",),
                                  host_blocks=64, disk_blocks=256)
    try:
        yield background
    finally:
        background.close()


def client(server: BackgroundServer, token: str | None) -> Client:
    return Client(server.target, token=token, use_shm=False)


def fill(server: BackgroundServer, token: str, seed: int) -> None:
    """Three blocks in each of MODEL_A and MODEL_B (write_through) and a session."""
    with client(server, token) as c:
        for index, ns in enumerate((MODEL_A, MODEL_B)):
            c.put(ns, keys(3), blocks(3, seed=seed + index), write_policy=WritePolicy.WRITE_THROUGH)
        c.save_session(MODEL_A, "chat", [1, 2, 3])


def held(server: BackgroundServer, token: str) -> list[int]:
    with client(server, token) as c:
        return [c.lookup(ns, keys(3)) for ns in (MODEL_A, MODEL_B)]


def test_a_tenant_clears_its_own_namespaces_and_never_another_tenants(
        server: BackgroundServer) -> None:
    fill(server, ALICE_TOKEN, 0)
    fill(server, BOB_TOKEN, 10)
    with client(server, BOB_TOKEN) as bob:
        with pytest.raises(PermissionDeniedError, match="alice"):
            bob.clear(tenant="alice")
        with pytest.raises(PermissionDeniedError):
            bob.clear(tenant="alice", model_id="model-a")
        assert held(server, ALICE_TOKEN) == [3, 3]  # the refusal changed nothing
        assert bob.clear(all_namespaces=True) == ClearResult(2, 6, 6 * BLOCK_BYTES, 1, 0)
        assert bob.list_sessions() == []
        assert bob.clear(tenant="bob", model_id="model-a").num_blocks == 0  # its own: allowed
    assert held(server, BOB_TOKEN) == [0, 0]
    assert held(server, ALICE_TOKEN) == [3, 3]
    with client(server, ALICE_TOKEN) as alice:
        assert same_bytes(alice.get(MODEL_A, keys(3)), blocks(3, seed=0))
        assert [s.session_id for s in alice.list_sessions()] == ["chat"]


def test_an_admin_clears_any_tenant_and_sees_every_namespace(server: BackgroundServer) -> None:
    fill(server, ALICE_TOKEN, 0)
    fill(server, BOB_TOKEN, 10)
    with client(server, ADMIN_TOKEN) as ops, client(server, BOB_TOKEN) as bob:
        tenants = {(n.namespace.tenant, n.namespace.model_id) for n in ops.stats().namespaces}
        assert tenants == {(t, m) for t in ("alice", "bob") for m in ("model-a", "model-b")}
        assert {n.namespace.tenant for n in bob.stats().namespaces} == {"bob"}
        assert ops.clear(tenant="alice", model_id="model-a") == ClearResult(
            1, 3, 3 * BLOCK_BYTES, 1, 0)
        assert held(server, ALICE_TOKEN) == [0, 3] and held(server, BOB_TOKEN) == [3, 3]
        assert ops.clear(model_id="model-b").num_blocks == 6  # every tenant's model-b
        assert held(server, ALICE_TOKEN) == [0, 0] and held(server, BOB_TOKEN) == [3, 0]
        stats = ops.stats()
        assert [(n.namespace.tenant, n.namespace.model_id) for n in stats.namespaces] == [
            ("bob", "model-a")]
        assert (stats.num_sessions, stats.namespaces[0].stored_bytes) == (1, 3 * BLOCK_BYTES)
        assert ops.clear(all_namespaces=True).num_blocks == 3
        assert ops.stats().namespaces == ()


def test_a_clear_names_a_filter_or_all_but_not_both(server: BackgroundServer) -> None:
    fill(server, ALICE_TOKEN, 0)
    with client(server, ALICE_TOKEN) as alice:
        with pytest.raises(InvalidArgumentError, match="name a tenant"):
            alice.clear()
        with pytest.raises(InvalidArgumentError, match="no tenant"):
            alice.clear(all_namespaces=True, model_id="model-a")
        assert alice.clear(namespace=MODEL_B).num_blocks == 3
    assert held(server, ALICE_TOKEN) == [3, 0]


def test_arguments_past_the_wires_bounds_are_invalid_arguments_not_protobuf_errors(
    server: BackgroundServer,
) -> None:
    too_deep = Namespace("m", KVLayout(num_layers=2**32, num_kv_heads=2, head_dim=8, block_size=4))
    with client(server, ALICE_TOKEN) as alice:
        for bad in (-1, 2**32, 1.5):
            with pytest.raises(InvalidArgumentError, match="max_namespaces"):
                alice.stats(max_namespaces=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="clear"):
            alice.clear(namespace=too_deep)
        assert alice.stats(max_namespaces=2**32 - 1).num_namespaces >= 0


def test_progress_is_reported_and_the_async_client_clears_too(server: BackgroundServer) -> None:
    fill(server, ALICE_TOKEN, 0)
    seen: list[tuple[int, int]] = []

    async def run() -> ClearResult:
        async with AsyncClient(server.target, token=ALICE_TOKEN, use_shm=False) as alice:
            return await alice.clear(model_id="model-a",
                                     progress=lambda done, total: seen.append((done, total)))

    assert asyncio.run(run()) == ClearResult(1, 3, 3 * BLOCK_BYTES, 1, 0)
    assert seen[0] == (0, 3) and seen[-1] == (3, 3)


def test_a_server_without_tokens_lets_its_one_tenant_clear_everything(tmp_path: Path) -> None:
    background = BackgroundServer(tmp_path / "store", tokens={})
    try:
        with client(background, None) as anyone:
            anyone.put(MODEL_A, keys(2), blocks(2))
            assert anyone.stats().namespaces[0].namespace.tenant == "default"
            assert anyone.clear(tenant="default").num_blocks == 2
            anyone.put(MODEL_A, keys(2), blocks(2))
            assert anyone.clear(all_namespaces=True).num_blocks == 2
            assert anyone.lookup(MODEL_A, keys(2)) == 0
    finally:
        background.close()


def test_a_clear_racing_puts_keeps_every_hit_exact(server: BackgroundServer) -> None:
    fill(server, BOB_TOKEN, 10)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with client(server, ALICE_TOKEN) as alice:
                round_ = 0
                while not stop.is_set():
                    chain = keys(4, start=4 * (round_ % 3), salt="race")
                    data = blocks(4, seed=round_ % 3)
                    alice.put(MODEL_A, chain, data)
                    got = alice.get(MODEL_A, chain)
                    assert same_bytes(got, data[: len(got)])
                    round_ += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        with client(server, ALICE_TOKEN) as alice:
            for _ in range(15):
                alice.clear(tenant="alice")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
    assert held(server, BOB_TOKEN) == [3, 3]  # zero cross-tenant effect
    with client(server, ALICE_TOKEN) as alice:
        alice.clear(all_namespaces=True)
        assert alice.stats().namespaces == ()


# --- raw requests of every shape, an admin clear across a restart, same-host lookups -----------


MODEL_B8 = Namespace("model-b", KVLayout(2, 2, 8, 8))
SEEDS = {ALICE_TOKEN: 0, BOB_TOKEN: 10, ADMIN_TOKEN: 20}


def start(root: Path) -> BackgroundServer:
    return BackgroundServer(root, tokens=TOKENS, admin_tenants=("ops",), host_blocks=64,
                            disk_blocks=256)


def fill_seeded(server: BackgroundServer, token: str) -> None:
    """MODEL_A: 3 blocks write-through (HOST and DISK); MODEL_B: 2 write-back (HOST only,
    flushed at close); a session."""
    seed = SEEDS[token]
    with Client(server.target, token=token, use_shm=False) as c:
        c.put(MODEL_A, keys(3), blocks(3, seed=seed), write_policy=WritePolicy.WRITE_THROUGH)
        c.put(MODEL_B8, keys(2), blocks(2, seed=seed, layout=MODEL_B8.layout))
        c.save_session(MODEL_A, "chat", [1, 2, 3])


def intact(server: BackgroundServer, token: str) -> bool:
    """Every block of ``fill`` is a hit with its exact bytes, and the session is there."""
    seed = SEEDS[token]
    with Client(server.target, token=token, use_shm=False) as c:
        return (same_bytes(c.get(MODEL_A, keys(3)), blocks(3, seed=seed))
                and same_bytes(c.get(MODEL_B8, keys(2)), blocks(2, seed=seed, layout=MODEL_B8.layout))
                and [s.session_id for s in c.list_sessions()] == ["chat"])


def gone(server: BackgroundServer, token: str) -> bool:
    with Client(server.target, token=token, use_shm=False) as c:
        return (c.lookup(MODEL_A, keys(3)), c.lookup(MODEL_B8, keys(2)),
                c.list_sessions()) == (0, 0, [])


def test_no_clear_or_stats_request_of_a_tenant_reaches_another(tmp_path: Path) -> None:
    """Bob (no admin) sends every combination of tenant (others', look-alikes, empty), model
    (others' too), namespace and ``all``, as raw requests: each is refused or clears his own;
    alice's and the admin tenant's blocks and sessions stay bit-exact, and his Stats never
    names them, however many namespaces he asks for."""
    server = start(tmp_path / "store")
    try:
        for token in (ALICE_TOKEN, ADMIN_TOKEN, BOB_TOKEN):
            fill_seeded(server, token)
        metadata = (("authorization", f"Bearer {BOB_TOKEN}"),)
        codes: set[grpc.StatusCode] = set()
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.TierKVStub(channel)
            shapes = itertools.product(
                ["", "alice", "ops", "bob", "ALICE", "alice\x00", " alice"],
                ["", "model-a", "model-b", "other"],
                [None, namespace_to(MODEL_A), namespace_to(MODEL_B8)],
                [False, True],
            )
            for tenant, model_id, namespace, everything in shapes:
                request = pb.ClearRequest(tenant=tenant, model_id=model_id, all=everything)
                if namespace is not None:
                    request.namespace.CopyFrom(namespace)
                try:
                    for _ in stub.Clear(request, metadata=metadata, timeout=30):
                        pass
                    codes.add(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.add(exc.code())
            for max_namespaces in (0, 1, 2**32 - 1):
                stats = stub.Stats(pb.StatsRequest(max_namespaces=max_namespaces),
                                   metadata=metadata, timeout=30)
                assert {n.tenant for n in stats.namespaces} <= {"bob"}
        assert codes == {grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED,
                         grpc.StatusCode.INVALID_ARGUMENT}
        assert intact(server, ALICE_TOKEN) and intact(server, ADMIN_TOKEN)
    finally:
        server.close()


def test_an_admin_clear_of_one_tenant_stays_cleared_and_the_others_exact_after_a_restart(
        tmp_path: Path) -> None:
    """Cleared write-back blocks are not flushed at close and cleared records do not come back
    at the next start; the other tenants' blocks (HOST-only ones flushed at close) come back
    bit-exact from disk."""
    server = start(tmp_path / "store")
    try:
        for token in (ALICE_TOKEN, BOB_TOKEN, ADMIN_TOKEN):
            fill_seeded(server, token)
        with Client(server.target, token=ADMIN_TOKEN, use_shm=False) as ops:
            result = ops.clear(tenant="alice")
        assert (result.num_blocks, result.num_sessions, result.num_busy) == (5, 1, 0)
        assert gone(server, ALICE_TOKEN) and intact(server, BOB_TOKEN)
    finally:
        server.close()
    server = start(tmp_path / "store")
    try:
        assert gone(server, ALICE_TOKEN)
        assert intact(server, BOB_TOKEN) and intact(server, ADMIN_TOKEN)
        with Client(server.target, token=ADMIN_TOKEN, use_shm=False) as ops:
            tenants = {n.namespace.tenant for n in ops.stats().namespaces}
        assert tenants == {"bob", "ops"}
    finally:
        server.close()


def test_same_host_lookups_miss_at_once_after_a_clear(tmp_path: Path) -> None:
    """The shared-memory presence table answers short lookups without a call: a clear takes
    the tenant's blocks out of it (a stale entry would be a hit the server no longer has),
    and leaves the other tenant's in it."""
    server = start(tmp_path / "store")
    try:
        for token in (ALICE_TOKEN, BOB_TOKEN):
            fill_seeded(server, token)
        with Client(server.unix_target, token=ALICE_TOKEN) as alice, \
                Client(server.unix_target, token=BOB_TOKEN) as bob, \
                Client(server.target, token=ADMIN_TOKEN, use_shm=False) as ops:
            assert alice.uses_shared_memory and bob.uses_shared_memory
            assert (alice.lookup(MODEL_A, keys(3)), bob.lookup(MODEL_A, keys(3))) == (3, 3)
            ops.clear(tenant="alice", model_id="model-a")
            assert (alice.lookup(MODEL_A, keys(3)), bob.lookup(MODEL_A, keys(3))) == (0, 3)
            assert alice.get(MODEL_A, keys(3)).shape[0] == 0
            assert alice.lookup(MODEL_B8, keys(2)) == 2
            alice.put(MODEL_A, keys(3), blocks(3, seed=99))  # new bytes under the old keys
            assert alice.lookup(MODEL_A, keys(3)) == 3
            assert same_bytes(alice.get(MODEL_A, keys(3)), blocks(3, seed=99))
        assert intact(server, BOB_TOKEN)
    finally:
        server.close()


def test_stats_show_a_tenant_its_own_shares_and_an_admin_everyones(
    server: BackgroundServer,
) -> None:
    fill(server, ALICE_TOKEN, seed=1)
    fill(server, BOB_TOKEN, seed=2)
    with client(server, ALICE_TOKEN) as alice, client(server, ADMIN_TOKEN) as ops:
        own = alice.stats().tenants
        assert {t.tenant for t in own} == {"alice"}
        assert {t.tier for t in own} == set(server.store.stats().tiers)
        assert all(t.used_bytes > 0 for t in own)
        assert {t.tenant for t in ops.stats().tenants} >= {"alice", "bob"}
        assert alice.stats().as_dict()["tenants"][0]["tenant"] == "alice"


def test_stats_show_a_tenant_only_its_own_figures_and_an_admin_the_servers(
    server: BackgroundServer,
) -> None:
    """Bob's view (tiers, counters, namespaces, sessions, pins, leases) is his alone: Alice's
    puts, reads, misses and pins change none of it, and the server-wide figures (checksum
    failures, bytes moved) are not shown to him; the admin sees the whole server's."""
    fill(server, BOB_TOKEN, seed=2)
    with client(server, BOB_TOKEN) as bob, client(server, ALICE_TOKEN) as alice, \
            client(server, ADMIN_TOKEN) as ops:
        assert same_bytes(bob.get(MODEL_A, keys(3)), blocks(3, seed=2))
        assert bob.lookup(MODEL_A, keys(5)) == 3
        before = bob.stats()
        assert before.tenant == "bob"
        assert (before.puts, before.gets, before.num_namespaces, before.num_sessions) == (2, 1, 2, 1)
        host = before.tiers[Tier.HOST]
        assert (host.num_blocks, host.hits, host.misses) == (6, 3, 0)
        assert host.stored_bytes == 6 * BLOCK_BYTES
        assert host.capacity_bytes == server.store.stats().tiers[Tier.HOST].capacity_bytes
        fill(server, ALICE_TOKEN, seed=1)
        assert alice.pin(MODEL_A, keys(3)) == 3
        assert same_bytes(alice.get(MODEL_A, keys(3)), blocks(3, seed=1))
        assert len(alice.get(MODEL_A, [b"\x07" * 32])) == 0  # a miss of Alice's
        after = bob.stats()
        assert after.as_dict() | {"namespaces": None} == before.as_dict() | {"namespaces": None}
        assert (after.checksum_failures, after.bytes_moved, after.remote) == (0, {}, None)
        mine = alice.stats()
        assert (mine.tenant, mine.num_pinned, mine.puts, mine.gets) == ("alice", 3, 2, 2)
        assert mine.tiers[Tier.HOST].misses == 1
        whole = ops.stats()
        assert whole.tenant is None
        assert (whole.puts, whole.num_namespaces, whole.num_sessions) == (4, 4, 2)
        assert whole.tiers[Tier.HOST].num_blocks == 12
        by_tenant = {(t.tenant, t.tier): t for t in whole.tenants}
        assert by_tenant["alice", Tier.HOST].hits == 3
        assert by_tenant["bob", Tier.HOST].hits == 3
        assert sum(t.num_blocks for t in whole.tenants if t.tier is Tier.HOST) == 12
