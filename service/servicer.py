"""The TierKV gRPC servicer: convert, validate, call the store, map errors. Nothing else.

Every handler resolves the caller's tenant from its credentials first (UNAUTHENTICATED if they
are missing or wrong), then runs the store call on the servicer's worker threads, so the event
loop never waits on the disk or a bulk copy. What stays on the loop costs less than the hop to a
thread: plain lookups and lease releases (dict work under the store lock, which is never held
across copies or I/O) and the copy of each received 1 MiB Put chunk into its leased pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import torch

import tierkv
from tierkv.buffers import BufferPool
from tierkv.codec import RawPutChunk
from tierkv.config import Tier
from tierkv.errors import (
    CapacityError,
    DeadlineExceededError,
    InvalidArgumentError,
    LeaseNotFoundError,
    LeaseStateError,
    TierKVError,
)
from tierkv.keys import Namespace
from tierkv.service import convert
from tierkv.service.auth import Authenticator, client_id_of
from tierkv.service.calls import (
    CALLER_TENANT,
    REFUSALS,
    Caller,
    CallRefusedError,
    check_parsed,
    end_call,
    lenient,
    status_of_refusal,
    unary,
)
from tierkv.service.config import ServiceConfig
from tierkv.service.namespaces import NamespaceBook
from tierkv.store import LeaseWriter, TieredStore, WriteLease, check_ttl
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc
from tierkv.wire.convert import (
    ServerInfo,
    clear_progress_to,
    clear_result_to,
    lookup_to,
    put_detail_from,
    read_lease_to,
    server_info_to,
    sessions_to,
    stats_to,
    write_lease_to,
)
from tierkv.wire.enums import priority_from, write_policy_from
from tierkv.wire.limits import MAX_CARRIED_RELEASES, host_id
from tierkv.wire.namespaces import namespace_to

R = TypeVar("R")
# Plain lookups of up to this many hashes (a 128K-token prompt in blocks of 16) run on the event
# loop. Their work is dict probes under the store lock, which is never held across copies or
# I/O: Python under the GIL, which a worker thread would hold just the same, while the hop to a
# thread and back costs 0.3-0.6 ms here (8,192-hash lookups: p50 5.1-5.6 ms with the hop, 4.8-5.0
# without). Longer ones go to a thread, so that the GIL's switch interval lets the loop in.
_INLINE_LOOKUP_HASHES = 8192
MAX_PUBLISH_WAIT_S = 60.0  # a Publish holds one of the executor's threads while it waits

__all__ = ["Caller", "TierKVServicer", "lenient"]  # lenient: the server's deserializers


def _silent_stream(idle_s: float) -> DeadlineExceededError:
    """What a Put stream that sent nothing for ``idle_s`` ends with (before or after its
    first message)."""
    return DeadlineExceededError(
        f"no Put message for {idle_s:g} s: the stream is dropped, nothing of it is stored"
    )



DEFAULT_STATS_NAMESPACES = 20
"""Namespaces a Stats call reports when it does not say how many."""


class ClearProgress:
    """Carries a clear's ``progress(done, total)`` calls from its worker thread to the call's
    event loop, in order; iterating ends once ``finish`` was called (the clear ended)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()
        self.total = 0

    def put(self, num_blocks_done: int, num_blocks_total: int) -> None:
        """The clear's progress callback (any thread)."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (num_blocks_done, num_blocks_total))

    def finish(self, clearing: asyncio.Future[Any]) -> None:
        """The clear ended (its done callback, on the loop). Its error is marked retrieved
        here: the call awaits it, unless the caller went away first."""
        if not clearing.cancelled():
            clearing.exception()
        self._queue.put_nowait(None)

    def __aiter__(self) -> AsyncIterator[tuple[int, int]]:
        return self._items()

    async def _items(self) -> AsyncIterator[tuple[int, int]]:
        while (item := await self._queue.get()) is not None:
            self.total = item[1]
            yield item


class TierKVServicer(pb_grpc.TierKVServicer):
    """Serves one ``TieredStore`` (set with ``attach`` once its disk index is recovered)."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        # Who may call, and which callers are admins: replaced as one pair by ``set_access``.
        self._access = (Authenticator(config.tokens), frozenset(config.admin_tenants))
        self._store: TieredStore | None = None
        self._executor = ThreadPoolExecutor(config.num_workers, "tierkv-rpc")
        self._buffers = BufferPool(2 * config.max_put_bytes)
        self._host_id = host_id()
        self._namespaces = NamespaceBook(config)
        self._closing: set[asyncio.Future[None]] = set()  # Put streams closed after their answer

    def attach(self, store: TieredStore) -> None:
        """Start serving ``store``."""
        self._store = store

    def set_access(self, tokens: dict[str, str], admin_tenants: Sequence[str]) -> None:
        """Adopt reloaded tokens and admin tenants: every call checked from now on uses them
        (one assignment on the event loop: a call sees the old pair or the new, never half).
        A server started without tokens stays without (the caller checks it)."""
        assert bool(tokens) == self._access[0].required, "tokens cannot be turned on or off"
        self._access = (Authenticator(tokens), frozenset(admin_tenants))

    def close(self) -> None:
        """Stop the worker threads (after the server stopped)."""
        self._executor.shutdown(wait=True)

    @property
    def store(self) -> TieredStore:
        """The store (only valid inside handlers, after ``_caller``)."""
        assert self._store is not None
        return self._store

    async def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        metadata = context.invocation_metadata()
        auth, admin_tenants = self._access
        tenant = auth.tenant_of(metadata)
        if tenant is None:
            raise CallRefusedError(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")
        if self._store is None:
            raise CallRefusedError(grpc.StatusCode.UNAVAILABLE, "the store is still recovering")
        CALLER_TENANT.set(tenant)
        client_id = client_id_of(metadata)
        is_admin = not auth.required or tenant in admin_tenants
        return Caller(tenant, f"{tenant}/{client_id}", client_id, is_admin)

    async def _run(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def _known_namespace(self, spec: pb.Namespace, caller: Caller) -> Namespace | None:
        """The namespace of ``spec`` for this caller if it is cached and registered."""
        return self._namespaces.cached(self.store, spec, caller.tenant)

    def _existing_namespace(self, spec: pb.Namespace, caller: Caller) -> Namespace | None:
        """The namespace of ``spec`` for this caller if registered (read-only calls)."""
        return self._namespaces.existing(self.store, spec, caller.tenant)

    def _namespace(self, spec: pb.Namespace, caller: Caller) -> Namespace:
        """The namespace of ``spec`` for this caller, registered if it was not."""
        return self._namespaces.registered(self.store, spec, caller.tenant)

    def _blocks(self, request: Any, caller: Caller) -> tuple[Namespace, Sequence[bytes]]:
        namespace = self._namespace(request.namespace, caller)
        return namespace, convert.hashes_from(request.hashes, self.config.max_hashes_per_call)

    def _read_blocks(self, request: Any, caller: Caller
                     ) -> tuple[Namespace | None, Sequence[bytes]]:
        """``_blocks`` for read-only calls: the namespace is None when it is not registered."""
        hashes = convert.hashes_from(request.hashes, self.config.max_hashes_per_call)
        return self._existing_namespace(request.namespace, caller), hashes

    # --- control --------------------------------------------------------------------------

    @unary
    async def Describe(self, request: pb.DescribeRequest, context: Any, caller: Caller) -> Any:
        store = self.store
        presence_name, presence_key = store.sidecar.presence_info(caller.tenant)
        return server_info_to(ServerInfo(
            version=tierkv.__version__, shm_name=store.sidecar.host_shm_name,
            shm_size_bytes=store.sidecar.host_capacity_bytes, page_bytes=store.config.host.page_bytes,
            host_id=self._host_id, max_hashes_per_call=self.config.max_hashes_per_call,
            max_chunk_bytes=self.config.chunk_bytes, hash_seed=self.config.hash_seed,
            presence_shm_name=presence_name, presence_key=presence_key,
            slab_id=store.sidecar.host_slab_id, client_lock_prefix=store.sidecar.client_lock_prefix,
            has_remote_tier=store.has_remote_tier, carries_releases=True,
        ))

    @unary
    async def Lookup(self, request: pb.LookupRequest, context: Any, caller: Caller) -> Any:
        namespace = self._known_namespace(request.namespace, caller)
        simple = not request.prefetch and not request.pin_ttl_s
        inline_limit = min(_INLINE_LOOKUP_HASHES, self.config.max_hashes_per_call)
        if namespace is not None and simple and len(request.hashes) <= inline_limit:
            counts = self.store.sidecar.locate(namespace, request.hashes)
            # A miss may be a REMOTE hit: that call must not run on the event loop.
            if not self.store.has_remote_tier or sum(counts.values()) == len(request.hashes):
                return lookup_to(counts)
        return await self._run(self._lookup, request, caller)

    def _lookup(self, request: pb.LookupRequest, caller: Caller) -> pb.LookupResponse:
        namespace = self._existing_namespace(request.namespace, caller)
        # The store checks the hashes' lengths (``_blocks`` would do it twice) and takes the
        # repeated field as it is: a list of it would cost a pass.
        hashes = convert.hashes_within(request.hashes, self.config.max_hashes_per_call)
        store = self.store
        num_pinned = 0
        if request.pin_ttl_s:
            check_ttl(request.pin_ttl_s)  # refuse bad input before the prefetch moves anything
        if namespace is None:  # nothing stored under it: a miss, once the hashes are valid
            convert.hashes_from(hashes, self.config.max_hashes_per_call)
            return pb.LookupResponse()
        if request.prefetch:
            store.prefetch(namespace, hashes, Tier.HOST)
        if request.pin_ttl_s:
            num_pinned = store.pin(namespace, hashes, request.pin_ttl_s)
        counts = store.sidecar.locate(namespace, hashes)
        num_local = sum(counts.values())
        num_remote = store.sidecar.extend_lookup(namespace, hashes, num_local) - num_local
        return lookup_to(counts, num_pinned, num_remote)

    @unary
    async def Pin(self, request: pb.PinRequest, context: Any, caller: Caller) -> Any:
        ttl_s = convert.ttl_from(request.ttl_s)
        namespace, hashes = await self._run(self._read_blocks, request, caller)
        if namespace is None:
            return pb.CountResponse(count=0)
        return pb.CountResponse(count=await self._run(self.store.pin, namespace, hashes, ttl_s))

    @unary
    async def Unpin(self, request: pb.BlocksRequest, context: Any, caller: Caller) -> Any:
        namespace, hashes = await self._run(self._read_blocks, request, caller)
        if namespace is None:
            return pb.CountResponse(count=0)
        return pb.CountResponse(count=await self._run(self.store.unpin, namespace, hashes))

    @unary
    async def Delete(self, request: pb.BlocksRequest, context: Any, caller: Caller) -> Any:
        namespace, hashes = await self._run(self._read_blocks, request, caller)
        if namespace is None:
            return pb.CountResponse(count=0)
        return pb.CountResponse(count=await self._run(self.store.delete, namespace, hashes))

    @unary
    async def Publish(self, request: pb.PublishRequest, context: Any, caller: Caller) -> Any:
        timeout_s = request.timeout_s
        if not 0.0 <= timeout_s <= MAX_PUBLISH_WAIT_S:  # (NaN too)
            raise InvalidArgumentError(
                f"timeout_s must be in [0, {MAX_PUBLISH_WAIT_S:g}] s, got {timeout_s!r}")
        namespace, hashes = await self._run(self._read_blocks, request, caller)
        if namespace is None:
            return pb.CountResponse(count=0)
        return pb.CountResponse(
            count=await self._run(self.store.publish, namespace, hashes, wait_s=timeout_s))

    # --- stream data path -----------------------------------------------------------------

    @unary
    async def Put(self, request_iterator: Any, context: Any, caller: Caller) -> Any:
        chunks = aiter(request_iterator)
        try:
            return await self._put(chunks, caller)
        finally:
            self._close_after_answer(chunks)

    def _close_after_answer(self, chunks: AsyncIterator[RawPutChunk]) -> None:
        """Close a Put's request iterator on the loop's next turn, after the call has answered
        (docs/design/operations.md#refused-calls-hold-no-memory)."""
        close = getattr(chunks, "aclose", None)
        if close is None:
            return
        task = asyncio.ensure_future(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _put(self, chunks: AsyncIterator[RawPutChunk], caller: Caller) -> pb.CountResponse:
        first = await self._first_message(chunks)
        check_parsed(first)
        if first is None or first.header is None:
            raise InvalidArgumentError("the first Put message must carry the header")
        header = first.header
        namespace, hashes = await self._run(self._blocks, header, caller)
        block_bytes = namespace.layout.bytes_per_block
        total_bytes = len(hashes) * block_bytes
        if total_bytes > self.config.max_put_bytes:
            raise CapacityError(
                f"{total_bytes} bytes in one Put; at most {self.config.max_put_bytes} (split it)"
            )
        lease = await self._allocate_for_stream(namespace, hashes, header, caller)
        committing = False
        try:
            with self.store.sidecar.lease_writer(lease, caller.owner) as filler:
                await self._fill(filler, first, chunks)
            if not filler.complete:
                raise InvalidArgumentError(
                    f"got {filler.received_bytes} bytes for {len(hashes)} blocks of {block_bytes} B"
                )
            committing = True  # commit gives the pages back itself if it fails
            count = await self._run(self.store.sidecar.commit, lease.lease_id, caller.owner,
                                    filler.checksums)
        finally:
            if not committing:
                self._abort_quietly(lease.lease_id, caller.owner)
        return pb.CountResponse(count=count)

    async def _first_message(self, chunks: AsyncIterator[RawPutChunk]) -> RawPutChunk | None:
        """The stream's first message, under the same idle timeout as the rest: a stream that
        never sends anything must not hold a call (and its task) for good."""
        idle_s = self.config.put_idle_timeout_s
        try:
            async with asyncio.timeout(idle_s):
                return await anext(chunks, None)
        except TimeoutError:
            raise _silent_stream(idle_s) from None

    async def _fill(
        self, filler: LeaseWriter, first: RawPutChunk, chunks: AsyncIterator[RawPutChunk]
    ) -> None:
        """Copy the stream's chunks into the lease as they come; a stream silent for
        ``put_idle_timeout_s`` ends with ``DeadlineExceededError`` (its lease pages are HOST
        room nobody else can use meanwhile)."""
        idle_s = self.config.put_idle_timeout_s
        loop = asyncio.get_running_loop()
        chunk: RawPutChunk | None = first
        try:
            async with asyncio.timeout(idle_s) as idle:
                while chunk is not None:
                    check_parsed(chunk)
                    if chunk is not first and chunk.header is not None:
                        raise InvalidArgumentError("only the first Put message may carry a header")
                    filler.write(chunk.data)
                    chunk = await anext(chunks, None)
                    idle.reschedule(loop.time() + idle_s)
        except TimeoutError:
            raise _silent_stream(idle_s) from None

    async def _allocate_for_stream(
        self, namespace: Namespace, hashes: Sequence[bytes], header: pb.PutHeader, caller: Caller
    ) -> WriteLease:
        """A lease that never expires (its pages are written from this process, see
        ``TieredStore.sidecar.allocate_in_process``), aborted even when the call is cancelled
        mid-allocation."""
        allocation = asyncio.ensure_future(self._run(
            self.store.sidecar.allocate_in_process, namespace, hashes, caller.owner,
            priority=priority_from(header.priority),
            write_policy=write_policy_from(header.write_policy),
            detail=put_detail_from(header.detail, header.HasField("detail")),
        ))
        try:
            return await asyncio.shield(allocation)
        except asyncio.CancelledError:
            def abort_granted(done: asyncio.Future[WriteLease]) -> None:
                if not done.cancelled() and done.exception() is None:
                    self._abort_quietly(done.result().lease_id, caller.owner)

            allocation.add_done_callback(abort_granted)
            raise
        finally:
            # A refused allocation's future holds its exception, whose traceback holds this
            # frame, which holds the future: a cycle that kept every refused Put's chunks.
            del allocation

    def _abort_quietly(self, lease_id: bytes, owner: str) -> None:
        with contextlib.suppress(TierKVError):  # e.g. the store closed under a cancelled call
            self.store.sidecar.abort(lease_id, owner)

    async def Get(self, request: pb.BlocksRequest, context: Any) -> AsyncIterator[pb.GetChunk]:
        status: tuple[grpc.StatusCode, str] | None = None
        try:
            caller = await self._caller(context)
            check_parsed(request)
            num_bytes, num_blocks, more, buffer = await self._read(request, caller)
        except REFUSALS as exc:
            status = status_of_refusal(exc)
        if status is not None:
            end_call(context, status)
            return
        try:
            data = memoryview(buffer or b"")[:num_bytes]
            step = self.config.chunk_bytes
            yield pb.GetChunk(num_blocks=num_blocks, data=bytes(data[:step]), more=more)
            for start in range(step, len(data), step):
                yield pb.GetChunk(data=bytes(data[start : start + step]))
        finally:
            del data  # a view exports the buffer
            if buffer is not None:
                self._buffers.give(buffer)

    async def _read(self, request: pb.BlocksRequest, caller: Caller
                    ) -> tuple[int, int, bool, bytearray | None]:
        """``(bytes, blocks, more, buffer)``: the leading stored blocks of the request, read
        into a buffer of the pool (the caller gives it back; None when nothing was read);
        ``more``: the stored run goes on past them (cut at ``max_put_bytes``). One hop to a
        worker thread for the whole read."""
        return await self._run(self._read_sync, request, caller)

    def _read_sync(self, request: pb.BlocksRequest, caller: Caller
                   ) -> tuple[int, int, bool, bytearray | None]:
        namespace, hashes = self._read_blocks(request, caller)
        if namespace is None:
            return 0, 0, False, None
        layout = namespace.layout
        # Sized by the cached run, never by the hashes asked for (65,536 hashes of 32 MiB
        # blocks would be 2 TiB); a run longer than max_put_bytes is cut, and the client is
        # told to ask again for the rest.
        num_stored = self.store.lookup(namespace, hashes)
        num_cached = min(num_stored, max(1, self.config.max_put_bytes // layout.bytes_per_block))
        # A run that ends before the hashes do ends in a miss, which the store counts.
        missed_after = num_cached == num_stored < len(hashes)
        hashes = hashes[:num_cached]
        total_bytes = num_cached * layout.bytes_per_block
        buffer = self._buffers.take(total_bytes)
        try:
            flat = (torch.frombuffer(buffer, dtype=torch.uint8, count=total_bytes) if total_bytes
                    else torch.empty(0, dtype=torch.uint8))
            out = flat.view(layout.torch_dtype).reshape(len(hashes), *layout.block_shape)
            num_blocks = self.store.get_into(namespace, hashes, out, missed_after=missed_after)
            del out, flat  # the tensor views pin the buffer's export
        except (TierKVError, ValueError):
            # Only then: a cancelled call's copy may still be running in the worker thread, so
            # its buffer must never be handed to another call (it is left to the collector).
            self._buffers.give(buffer)
            raise
        more = num_blocks == num_cached < num_stored
        return num_blocks * layout.bytes_per_block, num_blocks, more, buffer

    # --- shared-memory data path ----------------------------------------------------------

    @unary
    async def Acquire(self, request: pb.AcquireRequest, context: Any, caller: Caller) -> Any:
        return await self._run(self._acquire, request, caller)

    def _release_carried(self, releases: Sequence[pb.LeaseRequest], caller: Caller) -> None:
        """The read-lease releases a call carries, before it leases anything (so their pages
        are free for it); one that names no live lease of the caller's (it expired, or a
        server restarted in between) is skipped: the client's copy was checked either way."""
        if len(releases) > MAX_CARRIED_RELEASES:
            raise InvalidArgumentError(f"a call carries at most {MAX_CARRIED_RELEASES} releases, "
                                       f"got {len(releases)}")
        for release in releases:
            with contextlib.suppress(LeaseNotFoundError, LeaseStateError):
                self.store.sidecar.release(release.lease_id, caller.owner, release.corrupt_indices,
                                   convert.num_copied_from(release))

    def _acquire(self, request: pb.AcquireRequest, caller: Caller) -> pb.LeaseResponse:
        self._release_carried(request.releases, caller)
        namespace, hashes = self._blocks(request, caller)
        return read_lease_to(self.store.sidecar.acquire(
            namespace, hashes, convert.ttl_from(request.lease_ttl_s), caller.owner,
            slab_id=request.slab_id, client_id=caller.client_id,
        ), self.store.sidecar.host_slab_id, request.packed_extents)

    @unary
    async def Release(self, request: pb.LeaseRequest, context: Any, caller: Caller) -> Any:
        # A few dict operations under the store lock: cheaper here than a thread hop.
        num_copied = convert.num_copied_from(request)
        if request.corrupt_indices:  # rare: the suspects' pages are hashed, off the loop
            await self._run(self.store.sidecar.release, request.lease_id, caller.owner,
                            request.corrupt_indices, num_copied)
        else:
            self.store.sidecar.release(request.lease_id, caller.owner, num_copied=num_copied)
        return pb.LeaseDoneResponse()

    @unary
    async def Allocate(self, request: pb.AllocateRequest, context: Any, caller: Caller) -> Any:
        return await self._run(self._allocate, request, caller)

    def _allocate(self, request: pb.AllocateRequest, caller: Caller) -> pb.LeaseResponse:
        self._release_carried(request.releases, caller)
        namespace, hashes = self._blocks(request, caller)
        return write_lease_to(self.store.sidecar.allocate(
            namespace, hashes, convert.ttl_from(request.lease_ttl_s), caller.owner,
            priority=priority_from(request.priority),
            write_policy=write_policy_from(request.write_policy),
            slab_id=request.slab_id, client_id=caller.client_id,
            detail=put_detail_from(request.detail, request.HasField("detail")),
        ), self.store.sidecar.host_slab_id, request.packed_extents)

    @unary
    async def Commit(self, request: pb.LeaseRequest, context: Any, caller: Caller) -> Any:
        return pb.CountResponse(count=await self._run(self.store.sidecar.commit, request.lease_id,
                                                      caller.owner, request.checksums))

    @unary
    async def Abort(self, request: pb.LeaseRequest, context: Any, caller: Caller) -> Any:
        self.store.sidecar.abort(request.lease_id, caller.owner)  # dict work under the lock, as Release
        return pb.LeaseDoneResponse()

    # --- sessions -------------------------------------------------------------------------

    @unary
    async def SaveSession(self, request: pb.SaveSessionRequest, context: Any, caller: Caller) -> Any:
        namespace = await self._run(self._namespace, request.namespace, caller)
        num_tokens = await self._run(self.store.save_session, namespace, request.session_id,
                                     list(request.token_ids), convert.ttl_from(request.ttl_s))
        return pb.SaveSessionResponse(num_tokens=num_tokens)

    @unary
    async def ResumeSession(self, request: pb.SessionRequest, context: Any, caller: Caller) -> Any:
        resumed = await self._run(self.store.resume_session, request.session_id,
                                  tenant=caller.tenant, seed=self.config.hash_seed,
                                  algorithm=self.config.hash_algo)
        return pb.ResumeSessionResponse(
            namespace=namespace_to(resumed.namespace), token_ids=resumed.token_ids,
            num_cached_tokens=resumed.num_cached_tokens,
        )

    @unary
    async def DeleteSession(self, request: pb.SessionRequest, context: Any, caller: Caller) -> Any:
        deleted = await self._run(self.store.delete_session, request.session_id,
                                  tenant=caller.tenant)
        return pb.DeleteSessionResponse(deleted=deleted)

    @unary
    async def ListSessions(self, request: pb.ListSessionsRequest, context: Any,
                           caller: Caller) -> Any:
        return sessions_to(await self._run(self.store.list_sessions, tenant=caller.tenant))

    # --- the operator's calls: a caller reaches its own tenant's namespaces, an admin tenant
    # (``ServiceConfig.admin_tenants``, or every caller of a server without tokens) every one

    @unary
    async def Stats(self, request: pb.StatsRequest, context: Any, caller: Caller) -> Any:
        limit = request.max_namespaces or DEFAULT_STATS_NAMESPACES
        # A caller that is not an admin sees its own tenant's figures only: the server-wide
        # ones would tell it what other tenants put, read and hold.
        scope = None if caller.is_admin else caller.tenant
        stats = await self._run(self.store.stats, scope)
        namespaces = await self._run(self.store.namespace_stats, scope)
        holding = [n for n in namespaces if n.num_blocks or n.num_sessions]
        tenants = await self._run(self.store.tenant_stats, scope)
        return stats_to(stats, holding[:limit], tenants)

    async def Clear(self, request: pb.ClearRequest, context: Any
                    ) -> AsyncIterator[pb.ClearProgress]:
        """Progress messages as the store's clear goes (on a worker thread), then the counts.
        A clear that began runs to its end even if the caller goes (its deletes are durable
        batch by batch; stopping halfway would leave a namespace half cleared for no gain)."""
        status: tuple[grpc.StatusCode, str] | None = None
        try:
            caller = await self._caller(context)
            check_parsed(request)
            filters = convert.clear_filters_from(request, caller.tenant, caller.is_admin)
        except REFUSALS as exc:
            status = status_of_refusal(exc)
        if status is not None:
            end_call(context, status)
            return
        progress = ClearProgress(asyncio.get_running_loop())
        clearing = asyncio.ensure_future(self._run(
            self.store.clear, tenant=filters.tenant, model_id=filters.model_id,
            namespace=filters.namespace, progress=progress.put,
        ))
        clearing.add_done_callback(progress.finish)
        async for done, total in progress:
            yield clear_progress_to(done, total)
        try:
            result = await clearing
        except REFUSALS as exc:
            status = status_of_refusal(exc)
        if status is not None:
            end_call(context, status)
            return
        yield clear_result_to(result, progress.total)
