"""What the gRPC service tests send and check: wire namespaces, block payloads, Put streams,
a plausible request of every RPC, status codes, and the shared-memory slab as a same-host client
maps it. The servers themselves are in ``harness``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

import grpc
import torch

from tests.support.harness import ALICE_TOKEN, BOB_TOKEN
from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, blocks
from tierkv import KVLayout, Namespace, TieredStore
from tierkv.checksums import checksum
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

# What a call may answer with besides OK (the proto's error rules). UNKNOWN and INTERNAL mean a
# handler raised something nobody mapped: always a server bug.
ALLOWED_ERRORS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,  # an operator call (Clear) naming another tenant
})

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


# --- every RPC, uniformly ----------------------------------------------------------------------

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
        "Publish": lambda: pb.PublishRequest(**blocks_request, **fields),
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
        "Clear": lambda: pb.ClearRequest(**({"namespace": ns} | fields)),
    }
    return builders[rpc]()


async def invoke(stub: pb_grpc.TierKVStub, rpc: str, request: Any, metadata: Any = ALICE) -> Any:
    """Call ``rpc`` on an aio stub (Put takes a list of messages; Get's are collected)."""
    if rpc in ("Get", "Clear"):  # stream-out calls: every message
        return [message async for message in getattr(stub, rpc)(request, metadata=metadata)]
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


# --- the shared-memory slab, as a same-host client maps it -------------------------------------


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


def flip_every_page(shm_name: str, page_bytes: int = 4096) -> None:
    """A stray write: one byte of every ``page_bytes`` of a server's HOST slab flipped."""
    with mapped_slab(shm_name) as slab:
        for offset in range(0, len(slab), page_bytes):
            slab[offset] ^= 0x5A


def commit_after_a_late_write(store: TieredStore, namespace: Namespace,
                              hashes: Sequence[bytes], data: torch.Tensor, changed: int) -> None:
    """Write ``data`` into a write lease of ``store`` through its mapped slab, as a same-host
    client does, flip a bit of block ``changed`` after the client's hash, and commit the
    checksums of ``data``: the pages then differ from what the client hashed."""
    lease = store.sidecar.allocate(namespace, hashes, slab_id=store.sidecar.host_slab_id)
    raw = data.contiguous().view(torch.uint8).reshape(len(hashes), -1).numpy()
    with mapped_slab(store.sidecar.host_shm_name) as slab:
        for index, extents in zip(lease.write_indices, lease.blocks, strict=True):
            start = 0
            for offset, length in extents:
                slab[offset : offset + length] = raw[index, start : start + length].tobytes()
                start += length
        slab[lease.blocks[lease.write_indices.index(changed)][0][0]] ^= 0x40
    store.sidecar.commit(lease.lease_id, checksums=[checksum(raw[i]) for i in lease.write_indices])


def read_extents(slab: mmap.mmap, block: pb.BlockExtents) -> bytes:
    return b"".join(slab[e.offset : e.offset + e.length] for e in block.extents)


def write_extents(slab: mmap.mmap, block: pb.BlockExtents, data: bytes) -> None:
    start = 0
    for extent in block.extents:
        slab[extent.offset : extent.offset + extent.length] = data[start : start + extent.length]
        start += extent.length
    assert start == len(data), "a block's extents cover exactly its bytes"
