"""Review attacks on Clear and the operator's Stats through a real server: every request shape
a tenant that is no admin can send (raw, past what the SDK forms) reaches only its own
namespaces; an admin's clear leaves other tenants bit-exact, on disk too, across a restart;
same-host lookups answer from the presence table, which a clear empties too."""

from __future__ import annotations

import itertools
from pathlib import Path

import grpc

from tests.support.harness import ALICE_TOKEN, BOB_TOKEN, BackgroundServer
from tests.support.tiny_blocks import TINY_LAYOUT, blocks, keys, same_bytes
from tierkv import Client, KVLayout, Namespace, WritePolicy
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc
from tierkv.wire.namespaces import namespace_to

ADMIN_TOKEN = "v" * 32
TOKENS = {ALICE_TOKEN: "alice", BOB_TOKEN: "bob", ADMIN_TOKEN: "ops"}
MODEL_A = Namespace("model-a", TINY_LAYOUT)
MODEL_B = Namespace("model-b", KVLayout(2, 2, 8, 8))
SEEDS = {ALICE_TOKEN: 0, BOB_TOKEN: 10, ADMIN_TOKEN: 20}


def start(root: Path) -> BackgroundServer:
    return BackgroundServer(root, tokens=TOKENS, admin_tenants=("ops",), host_blocks=64,
                            disk_blocks=256)


def fill(server: BackgroundServer, token: str) -> None:
    """MODEL_A: 3 blocks write-through (HOST and DISK); MODEL_B: 2 write-back (HOST only,
    flushed at close); a session."""
    seed = SEEDS[token]
    with Client(server.target, token=token, use_shm=False) as c:
        c.put(MODEL_A, keys(3), blocks(3, seed=seed), write_policy=WritePolicy.WRITE_THROUGH)
        c.put(MODEL_B, keys(2), blocks(2, seed=seed, layout=MODEL_B.layout))
        c.save_session(MODEL_A, "chat", [1, 2, 3])


def intact(server: BackgroundServer, token: str) -> bool:
    """Every block of ``fill`` is a hit with its exact bytes, and the session is there."""
    seed = SEEDS[token]
    with Client(server.target, token=token, use_shm=False) as c:
        return (same_bytes(c.get(MODEL_A, keys(3)), blocks(3, seed=seed))
                and same_bytes(c.get(MODEL_B, keys(2)), blocks(2, seed=seed, layout=MODEL_B.layout))
                and [s.session_id for s in c.list_sessions()] == ["chat"])


def gone(server: BackgroundServer, token: str) -> bool:
    with Client(server.target, token=token, use_shm=False) as c:
        return (c.lookup(MODEL_A, keys(3)), c.lookup(MODEL_B, keys(2)),
                c.list_sessions()) == (0, 0, [])


def test_no_clear_or_stats_request_of_a_tenant_reaches_another(tmp_path: Path) -> None:
    """Bob (no admin) sends every combination of tenant (others', look-alikes, empty), model
    (others' too), namespace and ``all``, as raw requests: each is refused or clears his own;
    alice's and the admin tenant's blocks and sessions stay bit-exact, and his Stats never
    names them, however many namespaces he asks for."""
    server = start(tmp_path / "store")
    try:
        for token in (ALICE_TOKEN, ADMIN_TOKEN, BOB_TOKEN):
            fill(server, token)
        metadata = (("authorization", f"Bearer {BOB_TOKEN}"),)
        codes: set[grpc.StatusCode] = set()
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.TierKVStub(channel)
            shapes = itertools.product(
                ["", "alice", "ops", "bob", "ALICE", "alice\x00", " alice"],
                ["", "model-a", "model-b", "other"],
                [None, namespace_to(MODEL_A), namespace_to(MODEL_B)],
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
            fill(server, token)
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
            fill(server, token)
        with Client(server.unix_target, token=ALICE_TOKEN) as alice, \
                Client(server.unix_target, token=BOB_TOKEN) as bob, \
                Client(server.target, token=ADMIN_TOKEN, use_shm=False) as ops:
            assert alice.uses_shared_memory and bob.uses_shared_memory
            assert (alice.lookup(MODEL_A, keys(3)), bob.lookup(MODEL_A, keys(3))) == (3, 3)
            ops.clear(tenant="alice", model_id="model-a")
            assert (alice.lookup(MODEL_A, keys(3)), bob.lookup(MODEL_A, keys(3))) == (0, 3)
            assert alice.get(MODEL_A, keys(3)).shape[0] == 0
            assert alice.lookup(MODEL_B, keys(2)) == 2
            alice.put(MODEL_A, keys(3), blocks(3, seed=99))  # new bytes under the old keys
            assert alice.lookup(MODEL_A, keys(3)) == 3
            assert same_bytes(alice.get(MODEL_A, keys(3)), blocks(3, seed=99))
        assert intact(server, BOB_TOKEN)
    finally:
        server.close()
