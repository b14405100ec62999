"""What ``Client`` and ``AsyncClient`` share: settings, errors, retries, the slab mapping and the
byte shuffling between caller tensors, wire chunks and leased slab extents."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from tierkv.codec import encode_put_chunk, namespace_to_wire
from tierkv.config import Priority, WritePolicy
from tierkv.errors import (
    AuthenticationError,
    CapacityError,
    DeadlineExceededError,
    InvalidArgumentError,
    LeaseStateError,
    NotFoundError,
    ServiceUnavailableError,
    TierKVError,
)
from tierkv.keys import Namespace
from tierkv.paging import BlockExtents, copy_spans
from tierkv.store.presence import PresenceView
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

DEFAULT_TARGET = "unix:///tmp/tierkv.sock"
CHUNK_BYTES = 1024 * 1024
MAX_MESSAGE_BYTES = 4 * 1024 * 1024

_ERRORS: dict[grpc.StatusCode, type[TierKVError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: LeaseStateError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}
_POLICIES: dict[WritePolicy | None, pb.WritePolicy] = {
    None: pb.WRITE_POLICY_UNSPECIFIED,
    WritePolicy.WRITE_BACK: pb.WRITE_POLICY_WRITE_BACK,
    WritePolicy.WRITE_THROUGH: pb.WRITE_POLICY_WRITE_THROUGH,
}
_PRIORITIES: dict[Priority, pb.Priority] = {
    Priority.LOW: pb.PRIORITY_LOW,
    Priority.NORMAL: pb.PRIORITY_NORMAL,
    Priority.HIGH: pb.PRIORITY_HIGH,
    Priority.SESSION: pb.PRIORITY_SESSION,
}


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """How a client connects and behaves.

    ``use_shm``: None picks the shared-memory path automatically when the server is on this host;
    False forces the stream path; True requires shared memory. ``retries`` re-sends a call that
    got UNAVAILABLE, after ``backoff_s``, doubling each time.
    """

    target: str = DEFAULT_TARGET
    token: str | None = None
    root_certificates: bytes | None = None
    timeout_s: float = 30.0
    retries: int = 3
    backoff_s: float = 0.05
    use_shm: bool | None = None
    client_id: str = field(default_factory=lambda: secrets.token_hex(8))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Sent with every call: the bearer token and the client id (leases are per client)."""
        items = [("x-tierkv-client", self.client_id)]
        if self.token:
            items.append(("authorization", f"Bearer {self.token}"))
        return tuple(items)

    @property
    def channel_options(self) -> list[tuple[str, int]]:
        """Message limits matching the server's."""
        return [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]


def error_from(exc: grpc.RpcError) -> TierKVError:
    """The tierkv exception a failed call stands for."""
    code = exc.code()
    kind = _ERRORS.get(code, TierKVError)
    return kind(f"{code.name}: {exc.details()}")


def is_retryable(exc: grpc.RpcError) -> bool:
    """Only UNAVAILABLE is retried: the call did not reach a serving server."""
    return bool(exc.code() == grpc.StatusCode.UNAVAILABLE)


def namespace_wire(namespace: Namespace) -> pb.Namespace:
    """The wire namespace (its tenant is the server's to decide)."""
    return namespace_to_wire(namespace)


def policy_wire(policy: WritePolicy | None) -> pb.WritePolicy:
    """The wire enum of a write policy (None: the server's default)."""
    return _POLICIES[policy]


def priority_wire(priority: Priority) -> pb.Priority:
    """The wire enum of a priority."""
    return _PRIORITIES[Priority(priority)]


def block_bytes_of(blocks: torch.Tensor, namespace: Namespace) -> torch.Tensor:
    """``blocks`` checked against the namespace's layout, as one flat CPU uint8 tensor."""
    layout = namespace.layout
    if tuple(blocks.shape[1:]) != layout.block_shape or blocks.dtype != layout.torch_dtype:
        raise InvalidArgumentError(
            f"blocks of shape {tuple(blocks.shape)} and dtype {blocks.dtype} do not match the "
            f"layout's [n, *{layout.block_shape}] {layout.torch_dtype}"
        )
    return blocks.contiguous().view(torch.uint8).reshape(-1).cpu()


PUT_METHOD = "/tierkv.v1.TierKV/Put"


def open_channel(channels: Any, target: str, settings: ClientSettings) -> tuple[Any, Any, Any]:
    """``(channel, stub, put stream)`` to ``target``; ``channels`` is the ``grpc`` or the
    ``grpc.aio`` module (the same factories). TLS when ``settings`` has root certificates."""
    if settings.root_certificates is not None:
        credentials = grpc.ssl_channel_credentials(settings.root_certificates)
        channel = channels.secure_channel(target, credentials, settings.channel_options)
    else:
        channel = channels.insecure_channel(target, settings.channel_options)
    stub = pb_grpc.TierKVStub(channel)  # type: ignore[no-untyped-call]
    # Put streams pre-serialized chunks (no protobuf copy of the bulk bytes).
    put_stream = channel.stream_unary(
        PUT_METHOD, request_serializer=None, response_deserializer=pb.CountResponse.FromString
    )
    return channel, stub, put_stream


def put_chunks(
    namespace: Namespace, hashes: Sequence[bytes], flat: torch.Tensor, policy: WritePolicy | None,
    priority: Priority,
) -> Iterator[bytes]:
    """The Put stream, serialized (see ``tierkv.codec.encode_put_chunk``): the header with the
    first slice, then slices of ``CHUNK_BYTES``."""
    data = flat.numpy().data
    header = pb.PutHeader(namespace=namespace_wire(namespace), hashes=list(hashes),
                          write_policy=policy_wire(policy), priority=priority_wire(priority))
    yield encode_put_chunk(header, data[:CHUNK_BYTES])
    for start in range(CHUNK_BYTES, len(data), CHUNK_BYTES):
        yield encode_put_chunk(None, data[start : start + CHUNK_BYTES])


def extents_of(blocks: Sequence[pb.BlockExtents]) -> list[BlockExtents]:
    """The leased extents of each block."""
    return [[(e.offset, e.length) for e in block.extents] for block in blocks]


def local_host_id() -> str:
    """This machine's boot id (what the server reports as ``host_id``)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class SlabMapping:
    """The server's HOST slab mapped into this process (shared memory, read and write).

    Mapped with ``mmap`` on ``/dev/shm/<name>`` rather than ``SharedMemory``, whose resource
    tracker would unlink the server's segment when this process exits.
    """

    def __init__(self, name: str, size_bytes: int) -> None:
        path = f"/dev/shm/{name}"
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size_bytes:
                raise ServiceUnavailableError(f"{path} is not the server's slab (size differs)")
            self._map = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def read(self, spans: Sequence[tuple[int, int, int]], out: torch.Tensor) -> None:
        """Copy slab spans into the flat uint8 ``out``."""
        for slab_offset, buffer_offset, length in spans:
            out[buffer_offset : buffer_offset + length].copy_(
                self.tensor[slab_offset : slab_offset + length]
            )

    def write(self, spans: Sequence[tuple[int, int, int]], source: torch.Tensor) -> None:
        """Copy the flat uint8 ``source`` into slab spans."""
        for slab_offset, buffer_offset, length in spans:
            self.tensor[slab_offset : slab_offset + length].copy_(
                source[buffer_offset : buffer_offset + length]
            )

    def close(self) -> None:
        """Unmap (once no tensor views are left)."""
        del self.tensor
        with contextlib.suppress(BufferError):  # a view is still alive: it goes with that view
            self._map.close()


def presence_view_for(info: pb.DescribeResponse, slab: SlabMapping | None) -> PresenceView | None:
    """The server's presence table, when the shared-memory path is on and the table too."""
    if slab is None or not info.presence_shm_name:
        return None
    try:
        return PresenceView(info.presence_shm_name, info.presence_key)
    except (OSError, ValueError):
        return None


# Lookups of up to this many hashes are answered from the presence table (a probe each);
# longer chains go over RPC, where the server walks them in one loop.
MAX_PRESENCE_HASHES = 64


def shm_mapping_for(info: pb.DescribeResponse, use_shm: bool | None) -> SlabMapping | None:
    """The slab mapping when the shared-memory path can and should be used."""
    if use_shm is False:
        return None
    same_host = bool(info.host_id) and info.host_id == local_host_id()
    if same_host and info.shm_name and Path(f"/dev/shm/{info.shm_name}").exists():
        try:
            return SlabMapping(info.shm_name, info.shm_size_bytes)
        except (OSError, ServiceUnavailableError):
            if use_shm:
                raise
            return None
    if use_shm:
        raise ServiceUnavailableError("use_shm=True, but the server is not on this host")
    return None


class ClientBase:
    """What ``Client`` and ``AsyncClient`` hold and compute alike (no I/O here)."""

    def __init__(self, target: str, settings: dict[str, object]) -> None:
        self.settings = ClientSettings(target=target, **settings)  # type: ignore[arg-type]
        self._info: pb.DescribeResponse | None = None
        self._slab: SlabMapping | None = None
        self._presence: PresenceView | None = None
        self._core_ids: dict[Namespace, bytes] = {}
        self._wire_namespaces: dict[Namespace, pb.Namespace] = {}
        self._metadata = self.settings.metadata
        self._closed = False

    def _adopt(self, info: pb.DescribeResponse) -> None:
        """Take the server's facts: map its slab and presence table when on the same host."""
        self._info = info
        self._slab = shm_mapping_for(info, self.settings.use_shm)
        self._presence = presence_view_for(info, self._slab)

    def _unmap(self) -> None:
        self._closed = True
        if self._slab is not None:
            self._slab.close()
            self._slab = None
        if self._presence is not None:
            self._presence.close()
            self._presence = None

    def _wire(self, namespace: Namespace) -> pb.Namespace:
        wire = self._wire_namespaces.get(namespace)
        if wire is None:
            wire = self._wire_namespaces[namespace] = namespace_wire(namespace)
        return wire

    def _blocks_request(self, namespace: Namespace, hashes: Sequence[bytes]) -> pb.BlocksRequest:
        return pb.BlocksRequest(namespace=self._wire(namespace), hashes=list(hashes))

    def _lookup_locally(self, namespace: Namespace, hashes: Sequence[bytes]) -> int | None:
        """The cached prefix from the presence table, or None: ask the server."""
        if self._presence is None or len(hashes) > MAX_PRESENCE_HASHES or self._closed:
            return None
        if any(len(h) != 32 for h in hashes):
            return None  # let the server say what is wrong with them
        core_id = self._core_ids.get(namespace)
        if core_id is None:
            core_id = self._core_ids[namespace] = bytes(namespace.with_tenant("").id)
        return self._presence.count_leading(core_id, hashes)

    def _allocate_request(
        self, namespace: Namespace, hashes: Sequence[bytes], priority: Priority,
        write_policy: WritePolicy | None,
    ) -> pb.AllocateRequest:
        return pb.AllocateRequest(
            namespace=self._wire(namespace), hashes=list(hashes),
            write_policy=policy_wire(write_policy), priority=priority_wire(priority),
        )

    def _lookup_request(self, namespace: Namespace, hashes: Sequence[bytes], prefetch: bool,
                        pin_ttl_s: float) -> pb.LookupRequest:
        return pb.LookupRequest(namespace=self._wire(namespace), hashes=list(hashes),
                                prefetch=prefetch, pin_ttl_s=pin_ttl_s)

    def _write_spans(self, lease: pb.LeaseResponse, namespace: Namespace,
                     ) -> list[tuple[int, int, int]]:
        return copy_spans(extents_of(lease.blocks), list(lease.write_indices),
                          namespace.layout.bytes_per_block)

    def _read_spans(self, lease: pb.LeaseResponse, namespace: Namespace, done: int,
                    ) -> list[tuple[int, int, int]]:
        count = len(lease.blocks)
        return copy_spans(extents_of(lease.blocks), range(done, done + count),
                          namespace.layout.bytes_per_block)
