"""The client SDK (``Client`` and ``AsyncClient``): context managers, concurrent calls, typed
errors, timeouts and retries.

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

import asyncio
import collections
import dataclasses
import secrets
import time
import typing
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch

from tests.support.client_harness import (
    AnyClient,
    LiveServer,
    ServerFactory,
    check_path,
    ns,
    path_settings,
    patterned_blocks,
    raw_stub,
    shm_mappings,
    wire_ns,
)
from tests.support.harness import ALICE_TOKEN, BOB_TOKEN, free_port
from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, keys, same_bytes
from tierkv import (
    AsyncClient,
    CapacityError,
    Client,
    InvalidArgumentError,
)
from tierkv.client.base import ClientOptions, ClientSettings
from tierkv.errors import (
    AuthenticationError,
    DeadlineExceededError,
    ServiceUnavailableError,
    TierKVError,
)
from tierkv.wire import tierkv_pb2 as pb

# --- context managers --------------------------------------------------------------------------


def test_client_context_manager_maps_the_slab_and_unmaps_it(server: LiveServer, path: str) -> None:
    name = server.store.sidecar.host_shm_name
    baseline = shm_mappings(name)  # the server's own mapping
    target, settings = path_settings(server, path)
    with Client(target, **settings) as client:
        assert isinstance(client, Client)
        client.put(ns(), keys(2, salt="cm"), patterned_blocks(2))
        assert client.get(ns(), keys(2, salt="cm")).shape[0] == 2
        assert shm_mappings(name) == baseline + (path == "shm")
    assert shm_mappings(name) == baseline
    with pytest.raises((ValueError, TierKVError)):  # a closed client refuses calls
        client.stats()


@pytest.mark.asyncio
async def test_async_client_context_manager_maps_the_slab_and_unmaps_it(
    make_server: ServerFactory, path: str
) -> None:
    server = make_server()
    name = server.store.sidecar.host_shm_name
    baseline = shm_mappings(name)
    target, settings = path_settings(server, path)
    hashes, data = keys(3, salt="acm"), patterned_blocks(3)
    async with AsyncClient(target, **settings) as client:
        assert isinstance(client, AsyncClient)
        assert await client.uses_shared_memory() is (path == "shm")
        assert await client.put(ns(), hashes, data) == 3
        assert same_bytes(await client.get(ns(), hashes), data)
        assert shm_mappings(name) == baseline + (path == "shm")
    assert shm_mappings(name) == baseline
    with pytest.raises((grpc.aio.UsageError, TierKVError)):  # a closed client refuses calls
        await client.stats()


@pytest.mark.asyncio
async def test_async_client_runs_concurrent_calls_exactly(
    make_server: ServerFactory, path: str
) -> None:
    server = make_server(host_bytes=256 * BLOCK_BYTES)
    target, settings = path_settings(server, path)
    namespace = ns()
    chains = [(keys(8, salt=f"gather-{i}"), patterned_blocks(8, seed=100 + i)) for i in range(12)]
    async with AsyncClient(target, **settings) as client:
        stored = await asyncio.gather(*(client.put(namespace, h, d) for h, d in chains))
        assert stored == [8] * 12
        got = await asyncio.gather(*(client.get(namespace, h) for h, _ in chains))
        for tensor, (_, data) in zip(got, chains, strict=True):
            assert same_bytes(tensor, data)
        assert (await client.stats()).num_leases == 0
        assert await client.uses_shared_memory() is (path == "shm")


# --- typed errors ------------------------------------------------------------------------------


def test_bad_shape_or_dtype_raise_invalid_argument_before_anything_is_sent(
    server: LiveServer, client: AnyClient
) -> None:
    namespace, hashes = ns(), keys(2, salt="bad")
    shape = TINY_LAYOUT.block_shape
    bad_puts = [
        torch.zeros((2, *shape[:-1]), dtype=TINY_LAYOUT.torch_dtype),  # a dimension short
        torch.zeros((2, *shape[:-1], shape[-1] + 1), dtype=TINY_LAYOUT.torch_dtype),
        torch.zeros((2, *shape), dtype=torch.float32),  # wrong dtype
        torch.zeros((2, *shape), dtype=torch.uint8),
        torch.zeros((3, *shape), dtype=TINY_LAYOUT.torch_dtype),  # 3 blocks, 2 hashes
    ]
    for bad in bad_puts:
        with pytest.raises(InvalidArgumentError):
            client.put(namespace, hashes, bad)
    bad_outs = [
        torch.zeros((1, *shape), dtype=TINY_LAYOUT.torch_dtype),  # room for 1 of 2 blocks
        torch.zeros((2, *shape), dtype=torch.float32),
        torch.zeros((2, *shape[:-1]), dtype=TINY_LAYOUT.torch_dtype),
    ]
    for out in bad_outs:
        with pytest.raises(InvalidArgumentError):
            client.get_into(namespace, hashes, out)
    assert server.spy.methods_of(client.settings.client_id) == collections.Counter()
    assert server.store.stats().puts == 0


def test_malformed_hashes_raise_invalid_argument_from_the_server(client: AnyClient) -> None:
    namespace, data = ns(), patterned_blocks(1)
    for bad in ([b"short"], [b"x" * 33]):
        with pytest.raises(InvalidArgumentError):
            client.lookup(namespace, bad)
        with pytest.raises(InvalidArgumentError):
            client.put(namespace, bad, data)
        with pytest.raises(InvalidArgumentError):
            client.get(namespace, bad)


def test_a_put_bigger_than_the_host_tier_raises_capacity_error_and_stores_nothing(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    server = make_server(host_bytes=8 * BLOCK_BYTES)
    client = open_client(server, path, kind)
    namespace, hashes = ns(), keys(9, salt="too-big")
    with pytest.raises(CapacityError):
        client.put(namespace, hashes, patterned_blocks(9))
    assert client.lookup(namespace, hashes) == 0
    assert client.stats().num_leases == 0


def test_missing_or_wrong_token_raises_authentication_error(
    server: LiveServer, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    namespace, hashes, data = ns(), keys(2, salt="auth"), patterned_blocks(2)
    for token in (None, "w" * 32, ALICE_TOKEN[:-1]):
        client = open_client(server, path, kind, token=token)
        for call in (
            lambda c=client: c.put(namespace, hashes, data),
            lambda c=client: c.get(namespace, hashes),
            lambda c=client: c.lookup(namespace, hashes),
            lambda c=client: c.stats(),
            lambda c=client: c.list_sessions(),
        ):
            with pytest.raises(AuthenticationError):
                call()
    assert server.store.stats().puts == 0
    assert open_client(server, path, kind).lookup(namespace, hashes) == 0


def test_a_tiny_timeout_on_a_slow_call_raises_deadline_exceeded(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    # Every HOST page is held by another client's read lease: a put waits for room (seconds),
    # longer than its 0.3 s deadline.
    server = make_server(host_bytes=8 * BLOCK_BYTES)
    client = open_client(server, path, kind)
    namespace, held = ns(), keys(8, salt="held")
    assert client.put(namespace, held, patterned_blocks(8)) == 8
    channel, stub = raw_stub(server)
    blocker = (("x-tierkv-client", "blocker"), ("authorization", f"Bearer {ALICE_TOKEN}"))
    with channel:
        lease = stub.Acquire(pb.AcquireRequest(namespace=wire_ns(), hashes=held), metadata=blocker)
        assert lease.num_blocks == 8
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            client.put(namespace, keys(1, salt="late"), patterned_blocks(1), timeout_s=0.3)
        elapsed = time.monotonic() - started
        stub.Release(pb.LeaseRequest(lease_id=lease.lease_id), metadata=blocker)
    assert 0.3 <= elapsed < 3.0
    assert issubclass(DeadlineExceededError, TimeoutError)
    assert client.lookup(namespace, held) == 8  # the server is fine afterwards


@pytest.mark.parametrize("target_kind", ["unix", "tcp"])
def test_no_server_raises_service_unavailable_after_the_configured_retries(
    connect: Callable[..., AnyClient], kind: str, target_kind: str
) -> None:
    target = (f"unix:///tmp/tierkv-test-{secrets.token_hex(6)}.sock" if target_kind == "unix"
              else f"127.0.0.1:{free_port()}")
    namespace, hashes = ns(), keys(1, salt="nobody")
    # retries=2, backoff 0.1 s doubling: sleeps of 0.1 + 0.2 s between three attempts.
    patient = connect(target, kind, retries=2, backoff_s=0.1)
    for call in (patient.stats, lambda: patient.lookup(namespace, hashes),
                 lambda: patient.put(namespace, hashes, patterned_blocks(1))):
        started = time.monotonic()
        with pytest.raises(ServiceUnavailableError):
            call()
        assert 0.3 <= time.monotonic() - started < 3.0
    impatient = connect(target, kind, retries=0, backoff_s=0.1)
    started = time.monotonic()
    with pytest.raises(ServiceUnavailableError):
        impatient.stats()
    assert time.monotonic() - started < 0.1


def test_use_shm_false_takes_the_stream_path_and_auto_takes_shared_memory(
    server: LiveServer, connect: Callable[..., AnyClient], kind: str
) -> None:
    namespace, hashes, data = ns(), keys(3, salt="paths"), patterned_blocks(3)
    clients = {
        ("unix", False): connect(server.unix_target, kind, token=ALICE_TOKEN, use_shm=False),
        ("tcp", False): connect(server.tcp_target, kind, token=ALICE_TOKEN, use_shm=False),
        ("unix", None): connect(server.unix_target, kind, token=ALICE_TOKEN),
        ("tcp", None): connect(server.tcp_target, kind, token=ALICE_TOKEN),  # same host
        ("unix", True): connect(server.unix_target, kind, token=ALICE_TOKEN, use_shm=True),
    }
    clients[("unix", None)].put(namespace, hashes, data)
    for (_, use_shm), client in clients.items():
        assert same_bytes(client.get(namespace, hashes), data)
        check_path(server, client, "stream" if use_shm is False else "shm")


def test_a_client_cannot_end_another_clients_leases(
    server: LiveServer, connect: Callable[..., AnyClient], kind: str
) -> None:
    a = connect(server.unix_target, kind, token=ALICE_TOKEN)
    b = connect(server.unix_target, kind, token=ALICE_TOKEN)
    bob = connect(server.unix_target, kind, token=BOB_TOKEN, client_id=a.settings.client_id)
    assert a.settings.client_id != b.settings.client_id
    namespace, hashes, data = ns(), keys(2, salt="owners"), patterned_blocks(2)
    a.put(namespace, hashes, data)
    channel, stub = raw_stub(server)

    def code_of(call: Callable[[], Any]) -> grpc.StatusCode | None:
        try:
            call()
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
        return None

    with channel:
        new = keys(1, salt="owners-new")
        lease = stub.Allocate(pb.AllocateRequest(namespace=wire_ns(), hashes=new),
                              metadata=a.settings.metadata)
        done = pb.LeaseRequest(lease_id=lease.lease_id)
        for other in (b, bob):  # another client of the tenant; the same client id, another tenant
            assert code_of(lambda o=other: stub.Commit(done, metadata=o.settings.metadata)) \
                == grpc.StatusCode.NOT_FOUND
            assert code_of(lambda o=other: stub.Abort(done, metadata=o.settings.metadata)) \
                == grpc.StatusCode.NOT_FOUND
        assert b.lookup(namespace, new) == 0
        assert stub.Abort(done, metadata=a.settings.metadata) == pb.LeaseDoneResponse()
        assert code_of(lambda: stub.Commit(done, metadata=a.settings.metadata)) \
            == grpc.StatusCode.FAILED_PRECONDITION  # already aborted
        assert a.lookup(namespace, new) == 0

        read = stub.Acquire(pb.AcquireRequest(namespace=wire_ns(), hashes=hashes),
                            metadata=b.settings.metadata)
        assert read.num_blocks == 2
        released = pb.LeaseRequest(lease_id=read.lease_id)
        assert code_of(lambda: stub.Release(released, metadata=a.settings.metadata)) \
            == grpc.StatusCode.NOT_FOUND
        assert a.stats().num_leases == 1
        stub.Release(released, metadata=b.settings.metadata)
        assert code_of(lambda: stub.Release(released, metadata=b.settings.metadata)) \
            == grpc.StatusCode.FAILED_PRECONDITION
    assert a.stats().num_leases == 0
    assert same_bytes(b.get(namespace, hashes), data)


def test_the_client_keywords_are_the_settings_fields() -> None:
    """``Client(target, **options)``'s keywords (``ClientOptions``, which mypy checks callers
    against) are exactly ``ClientSettings``' fields but the target, of the same types."""
    hints = typing.get_type_hints(ClientSettings)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(ClientSettings)
              if f.name != "target"}
    assert typing.get_type_hints(ClientOptions) == fields
    with pytest.raises(TypeError, match="timeout"):
        Client("unix:///nonexistent.sock", timeout=1)  # type: ignore[call-arg]
