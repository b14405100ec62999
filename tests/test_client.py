"""The client SDK (``Client`` and ``AsyncClient``) against a real server over real sockets.

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
import contextlib
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from service_fixtures import ALICE_TOKEN, BOB_TOKEN, TOKENS, short_socket_dir

from conftest import BLOCK_BYTES, PAGE_BYTES, TINY_LAYOUT, blocks, keys, same_bytes
from tierkv import (
    AsyncClient,
    CapacityError,
    Client,
    DiskTierConfig,
    GpuTierConfig,
    HostTierConfig,
    InvalidArgumentError,
    KVLayout,
    Namespace,
    Priority,
    StoreConfig,
    Tier,
    TieredStore,
    WritePolicy,
    block_hashes,
)
from tierkv.errors import (
    AuthenticationError,
    DeadlineExceededError,
    NotFoundError,
    ServiceUnavailableError,
    TierKVError,
)
from tierkv.hashing import default_seed
from tierkv.service import server as server_module
from tierkv.service.auth import client_id_of
from tierkv.service.config import ServiceConfig
from tierkv.service.server import TierKVServer, create_server
from tierkv.service.servicer import TierKVServicer
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

# 4 layers x 2 (K,V) x 16 tokens x 8 heads x 64 dims x fp16 = 128 KiB a block: 40 of them are
# 5 MiB, more than one stream chunk (1 MiB) and than one gRPC message (4 MiB).
BIG_LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16)
BIG_BLOCK_BYTES = BIG_LAYOUT.bytes_per_block
BIG_PAGE_BYTES = 64 * 1024
RECORD_OVERHEAD = 128  # a disk record is a block plus a header of under 128 bytes

PATHS = ("shm", "stream")
KINDS = ("sync", "async")
LEASE_METHODS = frozenset({"Allocate", "Commit", "Abort", "Acquire", "Release"})
STREAM_METHODS = frozenset({"Put", "Get"})


# --- a server whose servicer records every call ------------------------------------------------


class SpyServicer(TierKVServicer):
    """The real servicer, recording ``(client id, method)`` of every call before serving it."""

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__(config)
        self.calls: list[tuple[str, str]] = []
        self._calls_lock = threading.Lock()

    def note(self, context: Any, method: str) -> None:
        with self._calls_lock:
            self.calls.append((client_id_of(context.invocation_metadata()), method))

    def methods_of(self, client_id: str) -> collections.Counter[str]:
        """How often the client with ``client_id`` called each method."""
        with self._calls_lock:
            return collections.Counter(m for c, m in self.calls if c == client_id)

    async def Get(self, request: Any, context: Any) -> Any:
        self.note(context, "Get")
        async for chunk in super().Get(request, context):
            yield chunk


def _spied(name: str) -> Callable[..., Any]:
    served = getattr(TierKVServicer, name)

    async def method(self: SpyServicer, request: Any, context: Any) -> Any:
        self.note(context, name)
        return await served(self, request, context)

    method.__name__ = name
    return method


for _name in ("Describe", "Lookup", "Pin", "Unpin", "Delete", "Stats", "Put", "Acquire", "Release",
              "Allocate", "Commit", "Abort", "SaveSession", "ResumeSession", "DeleteSession",
              "ListSessions"):
    setattr(SpyServicer, _name, _spied(_name))


class LiveServer:
    """A real server (spy servicer) on its own event loop in a background thread."""

    def __init__(self, root: Path, store_config: StoreConfig, **service_fields: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.socket_dir = short_socket_dir()
        self.store = TieredStore(store_config)
        service_fields.setdefault("tokens", TOKENS)
        config = ServiceConfig(listen=(f"unix://{self.socket_dir}/s.sock", "127.0.0.1:0"),
                               **service_fields)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(server_module, "TierKVServicer", SpyServicer)
            self.server: TierKVServer
            self.server, self.port = self.call(create_server(config, self.store))
        assert isinstance(self.server.servicer, SpyServicer)
        self.spy: SpyServicer = self.server.servicer
        self.root = root

    def call(self, coroutine: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    @property
    def unix_target(self) -> str:
        return f"unix://{self.socket_dir}/s.sock"

    @property
    def tcp_target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        try:
            self.call(self.server.stop())
        finally:
            self.store.close(flush=False)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            with contextlib.suppress(RuntimeError):
                self.loop.close()
            shutil.rmtree(self.socket_dir, ignore_errors=True)


ServerFactory = Callable[..., LiveServer]


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """Start servers: ``host_bytes``, ``page_bytes``, ``disk_bytes`` (0: no disk tier),
    ``gpu_bytes`` (an emulated GPU tier), and any ``ServiceConfig`` field."""
    servers: list[LiveServer] = []

    def build(host_bytes: int = 64 * BLOCK_BYTES, page_bytes: int = PAGE_BYTES,
              disk_bytes: int = 4096 * (BLOCK_BYTES + RECORD_OVERHEAD), gpu_bytes: int = 0,
              **service_fields: Any) -> LiveServer:
        root = tmp_path / f"server-{len(servers)}"
        disk = DiskTierConfig(root / "disk", disk_bytes, map_slack_bytes=16 << 20) if disk_bytes else None
        config = StoreConfig(
            host=HostTierConfig(host_bytes, page_bytes),
            gpu=GpuTierConfig(gpu_bytes, page_bytes, "emulated"),
            disk=disk,
        )
        server = LiveServer(root, config, **service_fields)
        servers.append(server)
        return server

    yield build
    for server in servers:
        server.close()


# --- clients ----------------------------------------------------------------------------------


class AsyncFacade:
    """An ``AsyncClient`` driven from synchronous code: each call is awaited on a private loop.

    Lets one test body check both clients; ``client`` is the real ``AsyncClient``."""

    def __init__(self, target: str, **settings: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._closed = False

        async def open_client() -> AsyncClient:  # its channel belongs to the loop it runs on
            return AsyncClient(target, **settings)

        self.client = self._loop.run_until_complete(open_client())

    def run(self, coroutine: Any) -> Any:
        return self._loop.run_until_complete(coroutine)

    @property
    def settings(self) -> Any:
        return self.client.settings

    @property
    def uses_shared_memory(self) -> bool:
        return bool(self.run(self.client.uses_shared_memory()))

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.run(method(*args, **kwargs))

        return call

    def __enter__(self) -> AsyncFacade:
        assert self.run(self.client.__aenter__()) is self.client
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.run(self.client.__aexit__(*exc_info))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.run(self.client.close())
            self._loop.close()


AnyClient = Any  # Client or AsyncFacade: the same methods


def path_settings(server: LiveServer, path: str) -> tuple[str, dict[str, Any]]:
    """Target and settings of a client on ``path``."""
    if path == "shm":
        return server.unix_target, {"token": ALICE_TOKEN}  # use_shm left to the client
    return server.tcp_target, {"token": ALICE_TOKEN, "use_shm": False}


@pytest.fixture
def connect() -> Iterator[Callable[..., AnyClient]]:
    """``connect(target, kind, **settings)``: a ``Client`` or an ``AsyncFacade``, closed at the
    end of the test."""
    opened: list[AnyClient] = []

    def make(target: str, kind: str = "sync", **settings: Any) -> AnyClient:
        client = Client(target, **settings) if kind == "sync" else AsyncFacade(target, **settings)
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


@pytest.fixture
def open_client(connect: Callable[..., AnyClient]) -> Callable[..., AnyClient]:
    """``open_client(server, path, kind, **overrides)``: a client of ``server`` on ``path``."""

    def make(server: LiveServer, path: str, kind: str = "sync", **overrides: Any) -> AnyClient:
        target, settings = path_settings(server, path)
        return connect(target, kind, **{**settings, **overrides})

    return make


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server(make_server: ServerFactory) -> LiveServer:
    """The default server: 64 tiny blocks of HOST, a disk tier of 4096."""
    return make_server()


@pytest.fixture
def client(server: LiveServer, open_client: Callable[..., AnyClient], kind: str, path: str) -> AnyClient:
    """A client of the default server, of each kind, on each path."""
    return open_client(server, path, kind)


def check_path(server: LiveServer, client: AnyClient, path: str) -> None:
    """The client said it uses the path, and the server saw only that path's data calls."""
    assert client.uses_shared_memory is (path == "shm")
    methods = server.spy.methods_of(client.settings.client_id)
    data_calls = set(methods) & (LEASE_METHODS | STREAM_METHODS)
    assert data_calls, f"no data call reached the server: {methods}"
    if path == "shm":
        assert not data_calls & STREAM_METHODS, methods
    else:
        assert not data_calls & LEASE_METHODS, methods


def ns(model: str = "test-model", layout: KVLayout = TINY_LAYOUT) -> Namespace:
    return Namespace(model, layout)


def patterned_blocks(n: int, seed: int = 0, layout: KVLayout = TINY_LAYOUT) -> torch.Tensor:
    """``n`` blocks: all zeros, all ones (0xFF: NaN fp16s), every byte value in order and
    reversed, then random bits."""
    raw = blocks(n, seed, layout).view(torch.uint8).reshape(n, -1).clone()
    size = raw.shape[1]
    every_byte = torch.arange(256, dtype=torch.uint8).repeat(size // 256 + 1)[:size]
    fixed = [torch.zeros(size, dtype=torch.uint8), torch.full((size,), 255, dtype=torch.uint8),
             every_byte, every_byte.flip(0)]
    for row, pattern in enumerate(fixed[:n]):
        raw[row] = pattern
    return raw.view(layout.torch_dtype).reshape(n, *layout.block_shape)


def shm_mappings(shm_name: str) -> int:
    """How many mappings of the slab ``shm_name`` this process holds."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return sum(line.endswith(f"/dev/shm/{shm_name}") for line in lines)


def raw_stub(server: LiveServer) -> tuple[grpc.Channel, pb_grpc.TierKVStub]:
    channel = grpc.insecure_channel(server.unix_target)
    return channel, pb_grpc.TierKVStub(channel)


def wire_ns(layout: KVLayout = TINY_LAYOUT, model: str = "test-model") -> pb.Namespace:
    return pb.Namespace(model_id=model, num_layers=layout.num_layers,
                        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                        block_size=layout.block_size, dtype=layout.dtype.value, tp_size=1)


# --- round trips ------------------------------------------------------------------------------


def test_put_get_and_get_into_round_trip_bit_exact(
    server: LiveServer, client: AnyClient, path: str
) -> None:
    namespace, hashes = ns(), keys(12, salt="round-trip")
    data = patterned_blocks(12, seed=1)
    assert client.put(namespace, hashes, data) == 12
    assert client.put(namespace, hashes, data) == 0  # idempotent: nothing new
    got = client.get(namespace, hashes)
    assert got.shape == (12, *TINY_LAYOUT.block_shape) and got.dtype == TINY_LAYOUT.torch_dtype
    assert same_bytes(got, data)
    out = torch.zeros((15, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype)
    assert client.get_into(namespace, hashes, out) == 12
    assert same_bytes(out[:12], data)
    for index in (0, 5, 11):  # any single block, any sub-chain
        assert same_bytes(client.get(namespace, hashes[index : index + 1]), data[index : index + 1])
    assert same_bytes(client.get(namespace, hashes[3:9]), data[3:9])
    check_path(server, client, path)


def test_a_put_from_one_path_is_read_exactly_from_the_other(
    server: LiveServer, open_client: Callable[..., AnyClient], kind: str
) -> None:
    shm = open_client(server, "shm", kind)
    stream = open_client(server, "stream", kind)
    namespace = ns()
    first, second = keys(6, salt="shm-put"), keys(6, salt="stream-put")
    data_a, data_b = patterned_blocks(6, seed=2), patterned_blocks(6, seed=3)
    assert shm.put(namespace, first, data_a) == 6
    assert stream.put(namespace, second, data_b) == 6
    assert same_bytes(stream.get(namespace, first), data_a)
    assert same_bytes(shm.get(namespace, second), data_b)
    check_path(server, shm, "shm")
    check_path(server, stream, "stream")


def test_get_of_a_partly_cached_chain_returns_the_leading_run(client: AnyClient) -> None:
    namespace, hashes = ns(), keys(6, salt="partial")
    data = patterned_blocks(6, seed=4)
    assert client.put(namespace, hashes[:3], data[:3]) == 3
    assert client.put(namespace, hashes[4:], data[4:]) == 2  # block 3 is missing
    assert client.lookup(namespace, hashes) == 3
    got = client.get(namespace, hashes)
    assert got.shape[0] == 3 and same_bytes(got, data[:3])
    out = torch.zeros((6, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype)
    assert client.get_into(namespace, hashes, out) == 3
    assert same_bytes(out[:3], data[:3])
    missing_head = client.get(namespace, hashes[3:])
    assert missing_head.shape == (0, *TINY_LAYOUT.block_shape)
    assert client.get(namespace, keys(4, salt="never-stored")).shape[0] == 0


def test_blocks_of_other_namespaces_and_tenants_are_misses(
    server: LiveServer, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    alice = open_client(server, path, kind)
    bob = open_client(server, path, kind, token=BOB_TOKEN)
    hashes, data = keys(4, salt="tenancy"), patterned_blocks(4, seed=5)
    assert alice.put(ns("model-a"), hashes, data) == 4
    assert alice.lookup(ns("model-b"), hashes) == 0
    assert alice.get(ns("model-b"), hashes).shape[0] == 0
    assert bob.lookup(ns("model-a"), hashes) == 0  # same model and keys, another tenant
    assert bob.get(ns("model-a"), hashes).shape[0] == 0
    assert same_bytes(alice.get(ns("model-a"), hashes), data)


def test_batches_bigger_than_a_stream_chunk_round_trip_in_one_call(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    server = make_server(host_bytes=16 << 20, page_bytes=BIG_PAGE_BYTES, disk_bytes=0)
    client = open_client(server, path, kind)
    namespace, hashes = ns("big-model", BIG_LAYOUT), keys(40, salt="big")
    data = patterned_blocks(40, seed=6, layout=BIG_LAYOUT)
    assert data.numel() * data.element_size() == 40 * BIG_BLOCK_BYTES == 5 << 20
    assert client.put(namespace, hashes, data) == 40
    assert same_bytes(client.get(namespace, hashes), data)
    check_path(server, client, path)
    methods = server.spy.methods_of(client.settings.client_id)
    assert methods["Put" if path == "stream" else "Allocate"] == 1  # one call, not a split
    assert methods["Get" if path == "stream" else "Acquire"] == 1


def test_get_of_a_chain_bigger_than_the_host_tier_round_trips_exactly(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    # 1 MiB of HOST holds 8 of the 40 blocks; the rest are demoted to disk. On the shm path the
    # client must acquire, copy and release HOST-sized parts of the chain in turn.
    server = make_server(host_bytes=1 << 20, page_bytes=BIG_PAGE_BYTES,
                         disk_bytes=64 * (BIG_BLOCK_BYTES + RECORD_OVERHEAD))
    client = open_client(server, path, kind)
    namespace, hashes = ns("big-model", BIG_LAYOUT), keys(40, salt="bigger-than-host")
    data = patterned_blocks(40, seed=7, layout=BIG_LAYOUT)
    for start in range(0, 40, 4):
        assert client.put(namespace, hashes[start : start + 4], data[start : start + 4]) == 4
    detail = client.lookup_detail(namespace, hashes)
    assert detail.num_cached == 40 and detail.num_host <= 8 and detail.num_disk >= 32
    got = client.get(namespace, hashes)
    assert got.shape[0] == 40, f"got {got.shape[0]} of 40 cached blocks"
    assert same_bytes(got, data)
    assert client.stats().num_leases == 0
    check_path(server, client, path)


def test_get_acquires_the_rest_of_the_chain_after_releasing_the_first_part(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    # HOST holds 8 blocks: blocks 0-7 are there, 8-11 were demoted to disk. The first lease can
    # only cover 0-7 (they are being read, nothing can make room for 8-11); the second, after
    # the release, covers 8-11.
    server = make_server(host_bytes=8 * BLOCK_BYTES)
    client = open_client(server, path, kind)
    namespace, hashes = ns(), keys(12, salt="two-leases")
    data = patterned_blocks(12, seed=8)
    assert client.put(namespace, hashes[8:], data[8:]) == 4
    assert client.put(namespace, hashes[:8], data[:8]) == 8
    detail = client.lookup_detail(namespace, hashes)
    assert (detail.num_cached, detail.num_host, detail.num_disk) == (12, 8, 4)
    assert same_bytes(client.get(namespace, hashes), data)
    methods = server.spy.methods_of(client.settings.client_id)
    if path == "shm":
        assert methods["Acquire"] == methods["Release"] == 2
    assert client.stats().num_leases == 0


# --- lookup, prefetch, pin, delete, stats -----------------------------------------------------


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
    assert server.store.prefetch(server_ns, hashes[:2], Tier.GPU).result() == 2
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
    tiers = {t.tier: t for t in before.tiers}
    assert set(tiers) == {"host", "disk"}
    assert tiers["host"].capacity_bytes == 64 * BLOCK_BYTES
    assert tiers["disk"].capacity_bytes == 4096 * (BLOCK_BYTES + RECORD_OVERHEAD)
    assert tiers["host"].used_bytes == 0 and tiers["host"].num_blocks == 0
    namespace, hashes = ns(), keys(5, salt="stats")
    client.put(namespace, hashes, patterned_blocks(5, seed=12))
    client.get(namespace, hashes)
    after = client.stats()
    host = {t.tier: t for t in after.tiers}["host"]
    assert host.num_blocks == 5 and host.used_bytes == 5 * BLOCK_BYTES
    assert after.puts == before.puts + 1 and after.num_namespaces == 1
    assert after.num_leases == 0
    snapshot = server.store.stats()
    assert snapshot.tiers[Tier.HOST].num_blocks == 5 and snapshot.puts == after.puts


def test_describe_reports_the_server_and_its_slab(server: LiveServer, client: AnyClient) -> None:
    info = client.describe()
    assert info.shm_name == server.store.host_shm_name
    assert info.shm_size_bytes == 64 * BLOCK_BYTES and info.page_bytes == PAGE_BYTES
    assert info.hash_seed == default_seed() and info.max_hashes_per_call == 65536
    assert info.host_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert client.describe() is info  # fetched once
    assert server.spy.methods_of(client.settings.client_id)["Describe"] == 1


# --- sessions ---------------------------------------------------------------------------------


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
    disk = {t.tier: t for t in client.stats().tiers}["disk"]
    assert disk.num_blocks == 6, "write_through puts are on disk when acknowledged"

    assert client.save_session(namespace, "chat-1", token_ids) == 42
    assert client.save_session(namespace, "chat-2", token_ids[:8], ttl_s=3600) == 8
    resumed_ns, resumed_ids, num_cached = client.resume_session("chat-1")
    assert resumed_ids == token_ids and num_cached == 24
    assert (resumed_ns.model_id, resumed_ns.layout) == ("chat-model", TINY_LAYOUT)
    assert client.resume_session("chat-2")[1:] == (token_ids[:8], 8)
    listed = {s.session_id: s for s in client.list_sessions()}
    assert set(listed) == {"chat-1", "chat-2"}
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


# --- context managers -------------------------------------------------------------------------


def test_client_context_manager_maps_the_slab_and_unmaps_it(server: LiveServer, path: str) -> None:
    name = server.store.host_shm_name
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
    name = server.store.host_shm_name
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


# --- typed errors -----------------------------------------------------------------------------


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


def _closed_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("target_kind", ["unix", "tcp"])
def test_no_server_raises_service_unavailable_after_the_configured_retries(
    connect: Callable[..., AnyClient], kind: str, target_kind: str
) -> None:
    target = (f"unix:///tmp/tierkv-test-{secrets.token_hex(6)}.sock" if target_kind == "unix"
              else f"127.0.0.1:{_closed_tcp_port()}")
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
