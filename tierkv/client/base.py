"""What ``Client`` and ``AsyncClient`` share: settings, errors, retries, the slab mapping and the
byte shuffling between caller tensors, wire chunks and leased slab extents."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import grpc
import numpy as np
import torch

from tierkv.checksums import CopyParts, checksum, checksums, copy_with_checksums
from tierkv.codec import encode_put_chunk
from tierkv.config import Priority, WritePolicy
from tierkv.errors import (
    IntegrityError,
    InvalidArgumentError,
    LeaseStateError,
    ServiceUnavailableError,
    StaleSlabError,
    TierKVError,
)
from tierkv.keys import Namespace
from tierkv.shm.liveness import ClientLock
from tierkv.shm.presence import PresenceView
from tierkv.types import PutDetail
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc
from tierkv.wire.convert import ServerInfo, lease_blocks_from, put_detail_to
from tierkv.wire.enums import priority_to, write_policy_to
from tierkv.wire.limits import (
    CHUNK_BYTES,
    DEFAULT_TARGET,
    MAX_CARRIED_RELEASES,
    MAX_MESSAGE_BYTES,
    host_id,
)
from tierkv.wire.namespaces import namespace_to
from tierkv.wire.status import RETRYABLE_CODES, error_of

# A write lease is not written into once this share of its TTL has passed (the copy itself
# takes time; a lease that expires under the copy is refused at commit anyway).
_LEASE_MARGIN = 0.8
# What the shared-memory path retries once after describing the server again: its slab was
# replaced (a restart), or what the client wrote did not arrive intact.
REMAP_ERRORS = (StaleSlabError, IntegrityError)
# The granule in which the client maps the slab's page tables ahead of a copy (see
# ``SlabMapping.populate``).
_POPULATE_GRANULE_BYTES = 2 << 20
# madvise(2) MADV_POPULATE_READ (Linux 5.14): map resident pages without touching them. Also
# for write leases: measured here, _WRITE takes 3.5x as long, more than the write faults that
# remain after _READ (fault-around maps 16 pages a fault).
_MADV_POPULATE_READ = 22


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """How a client connects and behaves.

    ``use_shm``: None picks the shared-memory path automatically when the server is on this host;
    False forces the stream path; True requires shared memory. ``retries`` re-sends a call that
    got UNAVAILABLE or CANCELLED, after ``backoff_s``, doubling each time (the defaults wait
    0.7 s in all: long enough for the channel's next reconnect, at most 250 ms away).
    ``release_delay_s``: how long the release of a read lease whose copy checked out waits to
    ride on this client's next Acquire or Allocate (a same-host get is then one round trip);
    past it, or before any other call, and at ``close``, it is sent on its own. Until then its
    pages stay leased (no put can reuse them). 0: each get sends its release at once.
    """

    target: str = DEFAULT_TARGET
    token: str | None = None
    root_certificates: bytes | None = None
    timeout_s: float = 30.0
    retries: int = 3
    backoff_s: float = 0.1
    use_shm: bool | None = None
    client_id: str = field(default_factory=lambda: secrets.token_hex(8))
    release_delay_s: float = 0.02

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Sent with every call: the bearer token and the client id (leases are per client)."""
        items = [("x-tierkv-client", self.client_id)]
        if self.token:
            items.append(("authorization", f"Bearer {self.token}"))
        return tuple(items)

    @property
    def channel_options(self) -> list[tuple[str, int]]:
        """Message limits matching the server's, and reconnects soon after a server restart
        (gRPC's default waits 1 s, then up to 120 s, before it tries again: a sidecar
        restarted under a live client would cost it more than its retries; a local sidecar is
        cheap to try every 250 ms)."""
        return [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 250),
        ]


def error_from(exc: grpc.RpcError) -> TierKVError:
    """The tierkv exception a failed call stands for (``tierkv.wire.status``)."""
    code = exc.code()
    return error_of(code)(f"{code.name}: {exc.details()}")


def is_retryable(exc: grpc.RpcError) -> bool:
    """Whether a failed call is sent again (``tierkv.wire.status.RETRYABLE_CODES``)."""
    return bool(exc.code() in RETRYABLE_CODES)


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


@dataclass(frozen=True, slots=True)
class Connection:
    """What a call goes through: the stub, the Put stream of pre-serialized chunks (no
    protobuf copy of the bulk bytes) and the metadata every call carries."""

    stub: Any
    put_stream: Any
    metadata: tuple[tuple[str, str], ...]


def open_channel(channels: Any, target: str, settings: ClientSettings) -> tuple[Any, Connection]:
    """``(channel, connection)`` to ``target``; ``channels`` is the ``grpc`` or the
    ``grpc.aio`` module (the same factories). TLS when ``settings`` has root certificates."""
    if settings.root_certificates is not None:
        credentials = grpc.ssl_channel_credentials(settings.root_certificates)
        channel = channels.secure_channel(target, credentials, settings.channel_options)
    else:
        channel = channels.insecure_channel(target, settings.channel_options)
    stub = pb_grpc.TierKVStub(channel)  # type: ignore[no-untyped-call]
    put_stream = channel.stream_unary(
        PUT_METHOD, request_serializer=None, response_deserializer=pb.CountResponse.FromString
    )
    return channel, Connection(stub, put_stream, settings.metadata)


def put_chunks(
    namespace: Namespace, hashes: Sequence[bytes], flat: torch.Tensor, policy: WritePolicy | None,
    priority: Priority, detail: PutDetail | None = None,
) -> Iterator[bytes]:
    """The Put stream, serialized (see ``tierkv.codec.encode_put_chunk``): the header with the
    first slice, then slices of ``CHUNK_BYTES``."""
    data = flat.numpy().data
    header = pb.PutHeader(namespace=namespace_to(namespace), hashes=list(hashes),
                          write_policy=write_policy_to(policy), priority=priority_to(priority),
                          detail=put_detail_to(detail))
    yield encode_put_chunk(header, data[:CHUNK_BYTES])
    for start in range(CHUNK_BYTES, len(data), CHUNK_BYTES):
        yield encode_put_chunk(None, data[start : start + CHUNK_BYTES])


BlockFill = Callable[[Sequence[int], torch.Tensor], None]
"""What ``put_with`` calls to write blocks: ``fill(indices, out)`` writes the blocks at
``indices`` (positions in the call's hashes, ascending) into ``out``, a ``[len(indices),
block_bytes]`` uint8 tensor, one row a block, every byte of it (the slab's pages when the server
is on this host, so there is no other copy). It runs on the calling thread (``Client``) or a
worker thread (``AsyncClient``). On the same host it is called for the blocks the server does
not have yet only, in one or more runs, and again for a block the put writes a second time
(into a restarted server's slab); over a stream, once for every block.
An exception from it aborts the put and propagates."""

BlockUse = Callable[[Sequence[int], torch.Tensor], None]
"""What ``get_with`` calls to hand blocks over: ``use(indices, blocks)`` gets the blocks at
``indices`` (consecutive positions in the call's hashes, ascending) as ``blocks``, a
``[len(indices), block_bytes]`` uint8 tensor, one row a block, to copy out before it returns.
On the same host it is the server's slab pages themselves (no other copy): valid only during the
call, never to be written. Their checksums are checked once it returned, so a change to the
pages before or during its copy shows: the blocks from the first that fails on count as never
received (``get_with`` returns how many leading blocks were), whatever ``use`` did with them. It
runs on the calling thread (``Client``) or a worker thread (``AsyncClient``), in block order, in
one or more runs; a block may be handed over again (a get read again from a restarted server);
over a stream, once, from a buffer already checked. An exception from it ends the get (the
blocks it was handed count as not received) and propagates."""


class SlabMapping:
    """The server's HOST slab mapped into this process (shared memory, read and write).

    Mapped with ``mmap`` on ``/dev/shm/<name>`` rather than ``SharedMemory``, whose resource
    tracker would unlink the server's segment when this process exits.
    """

    def __init__(self, name: str, size_bytes: int, slab_id: bytes) -> None:
        path = f"/dev/shm/{name}"
        self.slab_id = slab_id
        # Kept open: its link count says whether the server still has this segment.
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(self._fd).st_size != size_bytes:
                raise ServiceUnavailableError(f"{path} is not the server's slab (size differs)")
            self._map = mmap.mmap(self._fd, size_bytes)
        except BaseException:
            os.close(self._fd)
            raise
        self.array = np.frombuffer(self._map, np.uint8)
        # Which granules of the mapping have their page tables filled (``populate``).
        num_granules = -(-size_bytes // _POPULATE_GRANULE_BYTES)
        self._populated = np.zeros(num_granules, np.bool_)
        self._can_populate = True

    def populate(self, extents: Sequence[tuple[int, int]]) -> None:
        """Fill this process's page tables for the slab ranges ``extents`` (start, length)
        before a copy touches them, in one ``madvise(MADV_POPULATE_READ)`` per run of granules
        not filled yet. The pages are resident (the server pre-faults its slab), but this
        process's first touch of each 4 KiB page of a fresh mapping faults: measured here,
        ~1 us a page, 16 ms for a 64 MiB batch, where populating it takes 2 ms. A kernel
        without the call (before 5.14) falls back to faulting. Safe from several threads."""
        if not self._can_populate:
            return
        granule, num_granules = _POPULATE_GRANULE_BYTES, len(self._populated)
        ranges = np.asarray(extents, np.int64).reshape(-1, 2)
        firsts = np.clip(ranges[:, 0] // granule, 0, num_granules)
        ends = np.clip(-(-(ranges[:, 0] + ranges[:, 1]) // granule), 0, num_granules)
        if not len(ranges) or (low := int(firsts.min())) >= (high := int(ends.max())):
            return
        # Work over the granules the lease spans, not the whole slab (this runs every copy).
        marks = np.zeros(high - low + 1, np.int64)
        np.add.at(marks, firsts - low, 1)
        np.add.at(marks, ends - low, -1)
        wanted = np.cumsum(marks[:-1]) > 0
        wanted &= ~self._populated[low:high]
        if not wanted.any():
            return
        edges = np.flatnonzero(np.diff(np.concatenate(([0], wanted.view(np.int8), [0])))) + low
        try:
            for first, end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
                start = first * granule
                self._map.madvise(_MADV_POPULATE_READ, start,
                                  min(end * granule, len(self._map)) - start)
        except (OSError, ValueError):
            self._can_populate = False  # an older kernel (EINVAL): first touches fault instead
            return
        self._populated[low:high] |= wanted

    def is_current(self) -> bool:
        """False once the server removed the segment (it stopped, or a restarted server swept
        it): the mapping is then of a slab nobody serves."""
        return self._fd is not None and os.fstat(self._fd).st_nlink > 0

    def parts(
        self, lease: pb.LeaseResponse, block_indices: Sequence[int], block_bytes: int,
        buffer: np.ndarray, *, into_slab: bool,
    ) -> list[CopyParts]:
        """The (destination, source) parts of each block of ``lease``, in block order: block
        ``block_indices[i]`` of the flat ``buffer`` and the lease's block ``i`` in the slab."""
        copies: list[CopyParts] = []
        all_extents = self._checked_extents(lease, block_indices, buffer.size // block_bytes)
        for extents, index in zip(all_extents, block_indices, strict=True):
            offset = index * block_bytes
            block: list[tuple[np.ndarray, np.ndarray]] = []
            for start, length in extents:
                in_slab = self.array[start : start + length]
                in_buffer = buffer[offset : offset + length]
                block.append((in_slab, in_buffer) if into_slab else (in_buffer, in_slab))
                offset += length
            if offset != (index + 1) * block_bytes:
                raise ServiceUnavailableError("a leased block's extents do not cover the block")
            copies.append(block)
        return copies

    def runs(self, lease: pb.LeaseResponse, block_indices: Sequence[int], block_bytes: int,
             num_blocks: int) -> list[tuple[list[int], list[np.ndarray]]]:
        """The lease's blocks (block ``block_indices[i]`` of a call of ``num_blocks`` is the
        lease's block ``i``) as runs, in block order: ``(indices, [pages])`` where ``pages`` is
        one slab range holding the blocks ``indices`` back to back, or, for a block whose own
        pages are apart, that one block's slab ranges in order."""
        all_extents = self._checked_extents(lease, block_indices, num_blocks)
        runs: list[tuple[list[int], list[np.ndarray]]] = []
        run_start = run_end = -1
        run_indices: list[int] = []
        for extents, index in zip(all_extents, block_indices, strict=True):
            if sum(length for _, length in extents) != block_bytes:
                raise ServiceUnavailableError("a leased block's extents do not cover the block")
            start = extents[0][0]  # (a block has bytes, so it has an extent)
            if any(extents[k][0] != extents[k - 1][0] + extents[k - 1][1]
                   for k in range(1, len(extents))):
                if run_indices:  # runs stay in block order: the checksums follow it
                    runs.append((run_indices, [self.array[run_start:run_end]]))
                    run_indices = []
                runs.append(([index], [self.array[a : a + n] for a, n in extents]))
                continue
            if start != run_end or not run_indices:
                if run_indices:
                    runs.append((run_indices, [self.array[run_start:run_end]]))
                run_start, run_end, run_indices = start, start, []
            run_indices.append(index)
            run_end += block_bytes
        if run_indices:
            runs.append((run_indices, [self.array[run_start:run_end]]))
        return runs

    def _checked_extents(self, lease: pb.LeaseResponse, block_indices: Sequence[int],
                         num_blocks: int) -> list[list[tuple[int, int]]]:
        """The lease's extents per block, once they are known to lie in the slab and to name
        blocks of the call (else ``ServiceUnavailableError``: never a short or stray copy), with
        this process's page tables filled for them."""
        try:
            all_extents = lease_blocks_from(lease)
        except ValueError as exc:
            raise ServiceUnavailableError(f"the server sent a malformed lease: {exc}") from exc
        slab_bytes = self.array.size
        if any(start < 0 or length < 0 or start + length > slab_bytes
               for extents in all_extents for start, length in extents):
            raise ServiceUnavailableError("the server sent a lease that reaches past its slab")
        if any(not 0 <= index < num_blocks for index in block_indices):
            raise ServiceUnavailableError("the server sent a lease of blocks the call has not")
        if len(all_extents) != len(block_indices):
            raise ServiceUnavailableError("the server sent a lease of another number of blocks")
        self.populate([extent for extents in all_extents for extent in extents])
        return [list(extents) for extents in all_extents]

    def close(self) -> None:
        """Unmap (once no array views are left)."""
        del self.array
        with contextlib.suppress(BufferError):  # a view is still alive: it goes with that view
            self._map.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def presence_view_for(info: ServerInfo, slab: SlabMapping | None) -> PresenceView | None:
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


def shm_mapping_for(info: ServerInfo, use_shm: bool | None) -> SlabMapping | None:
    """The slab mapping when the shared-memory path can and should be used."""
    if use_shm is False:
        return None
    same_host = bool(info.host_id) and info.host_id == host_id()
    if same_host and info.shm_name and Path(f"/dev/shm/{info.shm_name}").exists():
        try:
            return SlabMapping(info.shm_name, info.shm_size_bytes, info.slab_id)
        except (OSError, ServiceUnavailableError):
            if use_shm:
                raise
            return None
    if use_shm:
        raise ServiceUnavailableError("use_shm=True, but the server is not on this host")
    return None


class ClientOptions(TypedDict, total=False):
    """The keywords of ``Client`` and ``AsyncClient``: every field of ``ClientSettings`` but
    ``target`` (their defaults and meaning are there)."""

    token: str | None
    root_certificates: bytes | None
    timeout_s: float
    retries: int
    backoff_s: float
    use_shm: bool | None
    client_id: str
    release_delay_s: float


class ClientBase:
    """What ``Client`` and ``AsyncClient`` hold and compute alike (no I/O here)."""

    def __init__(self, target: str, settings: ClientOptions) -> None:
        self.settings = ClientSettings(target=target, **settings)
        self._info: ServerInfo | None = None
        self._slab: SlabMapping | None = None
        self._lock: ClientLock | None = None
        self._presence: PresenceView | None = None
        self._core_ids: dict[Namespace, bytes] = {}
        self._wire_namespaces: dict[Namespace, pb.Namespace] = {}
        self._closed = False
        # Lease calls in progress: a client closed under one leaves its lock file behind, so
        # that the server sees the lock free (not the file gone) and takes the lease back.
        self._num_leasing = 0
        self._leasing_lock = threading.Lock()
        # Releases of read leases whose copy checked out, waiting to ride on the next Acquire
        # or Allocate (``ClientSettings.release_delay_s``); the time the oldest was queued.
        self._releases: list[pb.LeaseRequest] = []
        self._releases_since_s = 0.0
        self._releases_lock = threading.Lock()
        # Releases taken off the queue to be sent on their own and not answered yet (by the
        # sender of due releases, say): a call that reads what releases change waits for them.
        self._num_releases_sending = 0

    def _defer_release(self, release: pb.LeaseRequest) -> None:
        """Queue ``release`` for the next call that carries releases."""
        with self._releases_lock:
            if not self._releases:
                self._releases_since_s = time.monotonic()
            self._releases.append(release)

    def _carries_releases(self) -> bool:
        """Whether this client's Acquire and Allocate may carry queued releases."""
        return (self._info is not None and self._info.carries_releases
                and self.settings.release_delay_s > 0)

    def _requeue_releases(self, releases: Sequence[pb.LeaseRequest]) -> None:
        """Put back, oldest first, releases a failed call carried (the server may not have
        done them; one done already is skipped when it comes again)."""
        if releases:
            with self._releases_lock:
                if not self._releases:
                    self._releases_since_s = time.monotonic()
                self._releases[:0] = list(releases)

    def _take_releases(self, limit: int = MAX_CARRIED_RELEASES) -> list[pb.LeaseRequest]:
        """Up to ``limit`` queued releases, oldest first, off the queue (the caller sends them)."""
        with self._releases_lock:
            taken, self._releases = self._releases[:limit], self._releases[limit:]
            if self._releases:
                self._releases_since_s = time.monotonic()
            return taken

    def _sending_releases(self, num_releases: int) -> None:
        """Count ``num_releases`` (negative: answered) as taken and being sent on their own."""
        with self._releases_lock:
            self._num_releases_sending += num_releases

    def _releases_sending(self) -> bool:
        """Whether releases taken to be sent on their own are still unanswered."""
        with self._releases_lock:
            return self._num_releases_sending > 0

    def _releases_due_in_s(self) -> float | None:
        """Seconds until the queued releases are due on their own (None: none queued)."""
        with self._releases_lock:
            if not self._releases:
                return None
            return self._releases_since_s + self.settings.release_delay_s - time.monotonic()

    def _adopt(self, info: ServerInfo) -> None:
        """Take the server's facts: map its slab and presence table when on the same host, and
        hold this client's lock file while the slab is mapped (``tierkv.shm.liveness``)."""
        self._info = info
        self._slab = shm_mapping_for(info, self.settings.use_shm)
        self._presence = presence_view_for(info, self._slab)
        if self._slab is not None and info.client_lock_prefix:
            try:
                self._lock = ClientLock(info.client_lock_prefix, self.settings.client_id)
            except (OSError, ValueError):
                self._lock = None  # the server then goes by lease TTLs alone

    def _check_mapping(self) -> None:
        """Forget the server's facts when its slab is gone (it stopped or restarted): the next
        call describes it again and maps the new slab."""
        if self._slab is not None and not self._slab.is_current():
            self._forget_server()

    def _forget_server(self) -> None:
        """Drop the slab mapping and what was learned with it (not the queued releases: a
        remap does not always mean a new server, and a new one skips what it does not know)."""
        self._info = None
        if self._slab is not None:
            self._slab.close()
            self._slab = None
        if self._presence is not None:
            self._presence.close()
            self._presence = None
        if self._lock is not None:  # after the unmap: the server may reuse our pages now
            with self._leasing_lock:
                self._lock.close(unlink=self._num_leasing == 0)
            self._lock = None

    @contextlib.contextmanager
    def _leasing(self) -> Iterator[None]:
        """Around a put or get through the slab (see ``_num_leasing``)."""
        with self._leasing_lock:
            self._num_leasing += 1
        try:
            yield
        finally:
            with self._leasing_lock:
                self._num_leasing -= 1

    def _unmap(self) -> None:
        self._closed = True
        self._forget_server()

    def register(self, namespace: Namespace) -> None:
        """Check that ``namespace`` can be sent (``InvalidArgumentError`` if not): the server
        registers it on the first write (``tierkv.block_store`` note 2). Makes no call."""
        self._wire(namespace)

    def _wire(self, namespace: Namespace) -> pb.Namespace:
        wire = self._wire_namespaces.get(namespace)
        if wire is None:
            wire = self._wire_namespaces[namespace] = namespace_to(namespace)
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
        num_found = self._presence.count_leading(core_id, hashes)
        info = self._info
        if num_found is not None and num_found < len(hashes) and info is not None \
                and info.has_remote_tier:
            return None  # the rest may be in the server's REMOTE tier: only it can say
        return num_found

    def _allocate_request(
        self, namespace: Namespace, hashes: Sequence[bytes], priority: Priority,
        write_policy: WritePolicy | None, detail: PutDetail | None = None,
    ) -> pb.AllocateRequest:
        assert self._slab is not None
        request = pb.AllocateRequest(
            namespace=self._wire(namespace), hashes=list(hashes),
            write_policy=write_policy_to(write_policy), priority=priority_to(priority),
            slab_id=self._slab.slab_id, packed_extents=True, detail=put_detail_to(detail),
        )
        if self._carries_releases():  # last: nothing after it can fail and lose them
            request.releases.extend(self._take_releases())
        return request

    def _acquire_request(self, namespace: Namespace, hashes: Sequence[bytes]
                         ) -> pb.AcquireRequest:
        assert self._slab is not None
        request = pb.AcquireRequest(namespace=self._wire(namespace), hashes=list(hashes),
                                    slab_id=self._slab.slab_id, packed_extents=True)
        if self._carries_releases():  # last: nothing after it can fail and lose them
            request.releases.extend(self._take_releases())
        return request

    def _lookup_request(self, namespace: Namespace, hashes: Sequence[bytes], prefetch: bool,
                        pin_ttl_s: float) -> pb.LookupRequest:
        return pb.LookupRequest(namespace=self._wire(namespace), hashes=list(hashes),
                                prefetch=prefetch, pin_ttl_s=pin_ttl_s)

    def _fill_lease(self, slab: SlabMapping, lease: pb.LeaseResponse, namespace: Namespace,
                    flat: torch.Tensor, granted_s: float) -> pb.LeaseRequest:
        """Copy the blocks a write lease asks for into the slab; returns the Commit request,
        which carries the checksum of every block as written (the server checks its pages
        against them). Runs on a worker thread in ``AsyncClient``."""
        _check_slab(slab, lease)
        if time.monotonic() - granted_s > _LEASE_MARGIN * lease.expires_in_s:
            raise LeaseStateError("the write lease is about to expire; nothing was written")
        checksums = copy_with_checksums(slab.parts(
            lease, lease.write_indices, namespace.layout.bytes_per_block, flat.numpy(),
            into_slab=True,
        ))
        return pb.LeaseRequest(lease_id=lease.lease_id, checksums=checksums)

    def _fill_lease_with(self, slab: SlabMapping, lease: pb.LeaseResponse,
                         namespace: Namespace, fill: BlockFill, num_blocks: int,
                         granted_s: float) -> pb.LeaseRequest:
        """Have ``fill`` write the blocks a write lease asks for straight into the slab, then
        hash them there; returns the Commit request. Runs on a worker thread in
        ``AsyncClient``."""
        _check_slab(slab, lease)
        if time.monotonic() - granted_s > _LEASE_MARGIN * lease.expires_in_s:
            raise LeaseStateError("the write lease is about to expire; nothing was written")
        block_bytes = namespace.layout.bytes_per_block
        blocks: list[list[np.ndarray]] = []
        for indices, pages in slab.runs(lease, lease.write_indices, block_bytes, num_blocks):
            if len(pages) == 1:  # back to back in one range: written where they stay
                fill(indices, torch.from_numpy(pages[0]).view(len(indices), block_bytes))
                blocks += [[pages[0][k * block_bytes : (k + 1) * block_bytes]]
                           for k in range(len(indices))]
                continue
            bounce = torch.empty((1, block_bytes), dtype=torch.uint8)  # one block, pages apart
            fill(indices, bounce)
            source, offset = bounce.numpy().reshape(-1), 0
            for page in pages:
                page[:] = source[offset : offset + page.size]
                offset += page.size
            blocks.append(pages)
        return pb.LeaseRequest(lease_id=lease.lease_id, checksums=checksums(blocks))

    def _read_lease(self, slab: SlabMapping, lease: pb.LeaseResponse, namespace: Namespace,
                    flat: torch.Tensor, done: int) -> int | None:
        """Copy a read lease's blocks into ``flat`` from block ``done`` on and check each
        against its checksum; returns the index (in the lease) of the first bad one, or None.
        Runs on a worker thread in ``AsyncClient``."""
        _check_slab(slab, lease)
        if len(lease.checksums) != lease.num_blocks:
            raise ServiceUnavailableError("the server gave no checksums with its read lease")
        got = copy_with_checksums(slab.parts(
            lease, range(done, done + lease.num_blocks),
            namespace.layout.bytes_per_block, flat.numpy(), into_slab=False,
        ))
        for index, (actual, expected) in enumerate(zip(got, lease.checksums, strict=True)):
            if actual != expected:
                return index
        return None


    def _read_lease_with(self, slab: SlabMapping, lease: pb.LeaseResponse,
                         namespace: Namespace, use: BlockUse, done: int, num_blocks: int
                         ) -> int | None:
        """Hand a read lease's blocks (blocks ``done`` on of a call of ``num_blocks``) to
        ``use`` where they lie in the slab, then check each against its checksum there; returns
        the index (in the lease) of the first bad one, or None. A block whose pages lie apart is
        copied into a buffer and checked before ``use`` sees it. Runs on a worker thread in
        ``AsyncClient``."""
        _check_slab(slab, lease)
        if len(lease.checksums) != lease.num_blocks:
            raise ServiceUnavailableError("the server gave no checksums with its read lease")
        block_bytes = namespace.layout.bytes_per_block
        expected, first = lease.checksums, 0
        for indices, pages in slab.runs(lease, range(done, done + lease.num_blocks),
                                        block_bytes, num_blocks):
            if len(pages) == 1:  # back to back in one range: handed over where they lie
                use(indices, torch.from_numpy(pages[0]).view(len(indices), block_bytes))
                # On this thread only: after a torch copy its idle OpenMP threads spin on the
                # other cores for a while, and a second hashing thread there ran slower than
                # one (32 MiB after an ``index_copy_``, here: 3.5-4.0 ms against 3.9-4.5).
                got = [checksum(pages[0][k * block_bytes : (k + 1) * block_bytes])
                       for k in range(len(indices))]
            else:
                bounce, offset = np.empty(block_bytes, np.uint8), 0
                parts = []
                for page in pages:
                    parts.append((bounce[offset : offset + page.size], page))
                    offset += page.size
                got = copy_with_checksums([parts])
                if got[0] == expected[first]:
                    use(indices, torch.from_numpy(bounce).view(1, block_bytes))
            for k, actual in enumerate(got):
                if actual != expected[first + k]:
                    return first + k
            first += len(indices)
        return None


def _check_slab(slab: SlabMapping, lease: pb.LeaseResponse) -> None:
    """A lease of another slab than the mapped one is never copied through."""
    if lease.slab_id != slab.slab_id:
        raise StaleSlabError("the lease is of another slab than this client's mapping")
