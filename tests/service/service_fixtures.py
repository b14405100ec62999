"""Shared helpers for the gRPC service tests: real servers around real stores, wire namespaces,
block payloads, and a server running on its own event loop for synchronous (hypothesis) tests.

Every server here is a real ``create_server`` on a Unix socket and ``127.0.0.1:0`` in front of
a ``TieredStore`` with a shared-memory HOST slab and an LMDB disk tier in a temporary folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from tierkv import DiskTierConfig, HostTierConfig, KVLayout, StoreConfig, TieredStore
from tierkv.checksums import checksum
from tierkv.service.config import ServiceConfig
from tierkv.service.server import TierKVServer, create_server
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc
from tiny_blocks import BLOCK_BYTES, PAGE_BYTES, TINY_LAYOUT, blocks

ALICE_TOKEN = "t" * 32
BOB_TOKEN = "u" * 32
TOKENS = {ALICE_TOKEN: "alice", BOB_TOKEN: "bob"}

# What a call may answer with besides OK (the proto's error rules). UNKNOWN and INTERNAL mean a
# handler raised something nobody mapped: always a server bug.
ALLOWED_ERRORS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
})

# Client channels: let the client send and receive more than 4 MiB, so that the *server's*
# limits are what a test sees.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token``."""
    return (("authorization", f"Bearer {token}"),)


ALICE = bearer(ALICE_TOKEN)
BOB = bearer(BOB_TOKEN)


def wire_namespace(
    layout: KVLayout = TINY_LAYOUT, model_id: str = "test-model", **overrides: Any
) -> pb.Namespace:
    """The wire namespace of ``layout`` (fields in ``overrides`` win)."""
    fields: dict[str, Any] = {
        "model_id": model_id,
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "block_size": layout.block_size,
        "dtype": layout.dtype.value,
        "tp_rank": 0,
        "tp_size": 1,
    }
    fields.update(overrides)
    return pb.Namespace(**fields)


def payload(n: int, seed: int = 0, layout: KVLayout = TINY_LAYOUT) -> bytes:
    """The raw bytes of ``n`` random blocks (every bit pattern, NaNs included)."""
    return bytes(blocks(n, seed, layout).contiguous().view(torch.uint8).reshape(-1).numpy())


def commit_request(lease: pb.LeaseResponse, data: bytes, block_bytes: int = BLOCK_BYTES
                   ) -> pb.LeaseRequest:
    """The Commit of a write lease whose blocks were written from ``data`` (every block of the
    request, back to back): with the checksum of each block written, as the SDK sends it."""
    return pb.LeaseRequest(lease_id=lease.lease_id, checksums=[
        checksum(data[i * block_bytes : (i + 1) * block_bytes]) for i in lease.write_indices
    ])


def split(data: bytes, sizes: Iterable[int]) -> list[bytes]:
    """``data`` cut into pieces of ``sizes`` (cycled); the last piece takes what is left."""
    pieces: list[bytes] = []
    sizes = list(sizes)
    start = index = 0
    while start < len(data):
        size = sizes[index % len(sizes)]
        pieces.append(data[start : start + size])
        start += size
        index += 1
    return pieces


def put_chunks(
    namespace: pb.Namespace, hashes: list[bytes], data: bytes, sizes: Iterable[int] = (1 << 20,),
    **header_fields: Any,
) -> list[pb.PutChunk]:
    """The messages of one Put: the header rides with the first slice of ``data``."""
    pieces = split(data, sizes) or [b""]
    header = pb.PutHeader(namespace=namespace, hashes=hashes, **header_fields)
    return [pb.PutChunk(header=header, data=pieces[0])] + [pb.PutChunk(data=p) for p in pieces[1:]]


def store_config(
    root: Path, host_blocks: int = 64, disk_blocks: int = 1024, page_bytes: int = PAGE_BYTES,
    host_bytes: int | None = None, disk_bytes: int | None = None,
) -> StoreConfig:
    """A store with ``host_blocks`` tiny blocks of HOST (or ``host_bytes``) and a disk tier of
    ``disk_blocks`` tiny blocks (or ``disk_bytes``; no disk tier when both are 0)."""
    disk = None
    if disk_bytes or disk_blocks:
        disk = DiskTierConfig(root / "disk", disk_bytes or disk_blocks * (BLOCK_BYTES + 128),
                              map_slack_bytes=16 << 20)
    host = HostTierConfig(host_bytes or host_blocks * BLOCK_BYTES, page_bytes)
    return StoreConfig(host=host, disk=disk)


def short_socket_dir() -> Path:
    """A short folder for a Unix socket (their paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="tkv-", dir="/tmp"))


@dataclass
class Served:
    """A running server, its store, and client channels to it (closed by ``close``)."""

    server: TierKVServer
    store: TieredStore
    port: int
    socket_dir: Path
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    @property
    def tcp_target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def unix_target(self) -> str:
        return f"unix://{self.socket_dir}/s.sock"

    def stub(self, unix: bool = False) -> pb_grpc.TierKVStub:
        """A TierKV stub on a new aio channel (TCP, or the Unix socket)."""
        return pb_grpc.TierKVStub(self.channel(unix))

    def channel(self, unix: bool = False) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(
            self.unix_target if unix else self.tcp_target, options=CHANNEL_OPTIONS
        )
        self.channels.append(channel)
        return channel

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        await self.server.stop()
        self.store.close(flush=False)  # idempotent: stop() closed it already
        shutil.rmtree(self.socket_dir, ignore_errors=True)


async def serve(
    root: Path, *, tokens: dict[str, str] | None = None, host_blocks: int = 64,
    disk_blocks: int = 1024, page_bytes: int = PAGE_BYTES, host_bytes: int | None = None,
    disk_bytes: int | None = None, **service_fields: Any,
) -> Served:
    """Start a real server on a Unix socket and ``127.0.0.1:0`` in front of a fresh store."""
    root.mkdir(parents=True, exist_ok=True)
    store = TieredStore(
        store_config(root, host_blocks, disk_blocks, page_bytes, host_bytes, disk_bytes)
    )
    socket_dir = short_socket_dir()
    config = ServiceConfig(
        listen=(f"unix://{socket_dir}/s.sock", "127.0.0.1:0"),
        tokens=dict(TOKENS if tokens is None else tokens),
        **service_fields,
    )
    try:
        server, port = await create_server(config, store)
    except BaseException:
        store.close(flush=False)
        shutil.rmtree(socket_dir, ignore_errors=True)
        raise
    assert port > 0
    return Served(server, store, port, socket_dir)


@contextlib.asynccontextmanager
async def serving(root: Path, **serve_args: Any) -> AsyncIterator[Served]:
    """``serve`` for ``async with``: the server is closed at the end."""
    handle = await serve(root, **serve_args)
    try:
        yield handle
    finally:
        await handle.close()


async def get_blocks(
    stub: pb_grpc.TierKVStub, namespace: pb.Namespace, hashes: list[bytes],
    metadata: Any = ALICE,
) -> tuple[int, bytes, list[int]]:
    """Get: (num_blocks of the first message, every byte, the size of each message)."""
    call = stub.Get(pb.BlocksRequest(namespace=namespace, hashes=hashes), metadata=metadata)
    num_blocks: int | None = None
    data = bytearray()
    sizes: list[int] = []
    async for chunk in call:
        if num_blocks is None:
            num_blocks = chunk.num_blocks
        else:
            assert chunk.num_blocks == 0, "only the first Get message says how many blocks"
        data += chunk.data
        sizes.append(len(chunk.data))
    assert num_blocks is not None, "Get must send at least its first message"
    return num_blocks, bytes(data), sizes


async def aiter_of(messages: Iterable[Any]) -> AsyncIterator[Any]:
    """An async iterator over ``messages`` (for stream-in calls)."""
    for message in messages:
        yield message


class BackgroundServer:
    """A server on its own event loop in a thread, for synchronous clients (hypothesis)."""

    def __init__(self, root: Path, **serve_args: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.served: Served = self.call(serve(root, **serve_args))

    def call(self, coroutine: Any, timeout_s: float = 60.0) -> Any:
        """Run ``coroutine`` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    @property
    def target(self) -> str:
        return self.served.tcp_target

    def close(self) -> None:
        try:
            self.call(self.served.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            with contextlib.suppress(RuntimeError):
                self.loop.close()


# --- every RPC, uniformly -----------------------------------------------------------------------

SERVICE = pb.DESCRIPTOR.services_by_name["TierKV"]
ALL_RPCS: tuple[str, ...] = tuple(method.name for method in SERVICE.methods)
# RPCs whose request names a namespace (and, but for SaveSession, block hashes).
HASH_RPCS = ("Lookup", "Pin", "Unpin", "Delete", "Put", "Get", "Acquire", "Allocate")
NAMESPACE_RPCS = (*HASH_RPCS, "SaveSession")
LEASE_RPCS = ("Release", "Commit", "Abort")


def request_for(
    rpc: str, namespace: pb.Namespace | None = None, hashes: list[bytes] | None = None,
    block_bytes: int = BLOCK_BYTES, **fields: Any,
) -> Any:
    """A plausible request of ``rpc`` (for Put: the list of its messages); ``fields`` are set on
    the request (for Put: on the header)."""
    ns = namespace if namespace is not None else wire_namespace()
    hs = list(hashes) if hashes is not None else []
    blocks_request = {"namespace": ns, "hashes": hs}
    builders: dict[str, Any] = {
        "Describe": pb.DescribeRequest,
        "Lookup": lambda: pb.LookupRequest(**blocks_request, **fields),
        "Pin": lambda: pb.PinRequest(**blocks_request, **fields),
        "Unpin": lambda: pb.BlocksRequest(**blocks_request),
        "Delete": lambda: pb.BlocksRequest(**blocks_request),
        "Stats": pb.StatsRequest,
        "Put": lambda: put_chunks(ns, hs, bytes(len(hs) * block_bytes), **fields),
        "Get": lambda: pb.BlocksRequest(**blocks_request),
        "Acquire": lambda: pb.AcquireRequest(**blocks_request, **fields),
        "Release": lambda: pb.LeaseRequest(**({"lease_id": bytes(16)} | fields)),
        "Allocate": lambda: pb.AllocateRequest(**blocks_request, **fields),
        "Commit": lambda: pb.LeaseRequest(**({"lease_id": bytes(16)} | fields)),
        "Abort": lambda: pb.LeaseRequest(**({"lease_id": bytes(16)} | fields)),
        "SaveSession": lambda: pb.SaveSessionRequest(
            **({"namespace": ns, "session_id": "session", "token_ids": [1, 2, 3, 4, 5]} | fields)
        ),
        "ResumeSession": lambda: pb.SessionRequest(**({"session_id": "session"} | fields)),
        "DeleteSession": lambda: pb.SessionRequest(**({"session_id": "session"} | fields)),
        "ListSessions": pb.ListSessionsRequest,
    }
    return builders[rpc]()


async def invoke(stub: pb_grpc.TierKVStub, rpc: str, request: Any, metadata: Any = ALICE) -> Any:
    """Call ``rpc`` on an aio stub (Put takes a list of messages; Get's are collected)."""
    if rpc == "Get":
        return [chunk async for chunk in stub.Get(request, metadata=metadata)]
    if rpc == "Put":
        return await stub.Put(aiter_of(request), metadata=metadata)
    return await getattr(stub, rpc)(request, metadata=metadata)


async def code_of(stub: pb_grpc.TierKVStub, rpc: str, request: Any, metadata: Any = ALICE
                  ) -> grpc.StatusCode:
    """The status code ``rpc`` answers ``request`` with."""
    try:
        await invoke(stub, rpc, request, metadata)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# --- the shared-memory slab, as a same-host client maps it ------------------------------------


@contextlib.contextmanager
def mapped_slab(shm_name: str) -> Iterator[mmap.mmap]:
    """The server's HOST slab, mapped by name the way a same-host client does."""
    fd = os.open(f"/dev/shm/{shm_name}", os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    try:
        yield mapping
    finally:
        mapping.close()


def read_extents(slab: mmap.mmap, block: pb.BlockExtents) -> bytes:
    return b"".join(slab[e.offset : e.offset + e.length] for e in block.extents)


def write_extents(slab: mmap.mmap, block: pb.BlockExtents, data: bytes) -> None:
    start = 0
    for extent in block.extents:
        slab[extent.offset : extent.offset + extent.length] = data[start : start + extent.length]
        start += extent.length
    assert start == len(data), "a block's extents cover exactly its bytes"
