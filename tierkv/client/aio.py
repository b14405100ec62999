"""``tierkv.AsyncClient``: the asyncio client SDK (same methods as ``Client``, awaitable).

Bulk copies into and out of the shared-memory slab run on a worker thread, so a large get or put
never blocks the caller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import torch

from tierkv.client import base
from tierkv.codec import namespace_from_wire
from tierkv.config import Priority, WritePolicy
from tierkv.errors import InvalidArgumentError, ServiceUnavailableError, TierKVError
from tierkv.keys import Namespace
from tierkv.store.validation import check_out
from tierkv.wire import tierkv_pb2 as pb

R = TypeVar("R")


class AsyncClient(base.ClientBase):
    """An asyncio connection to a ``tierkv serve`` sidecar (``async with``, or ``await close()``)."""

    def __init__(self, target: str = base.DEFAULT_TARGET, **settings: Any) -> None:
        super().__init__(target, settings)
        self._channel, self._stub, self._put_stream = base.open_channel(grpc.aio, target,
                                                                         self.settings)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel and unmap the slab. Calls afterwards raise
        ``ServiceUnavailableError``."""
        self._unmap()
        await self._channel.close()

    async def _retrying(self, attempt: Callable[[], Awaitable[R]], retry: bool = True) -> R:
        settings = self.settings
        if self._closed:
            raise ServiceUnavailableError("this client is closed")
        for number in range(settings.retries + 1):
            try:
                return await attempt()
            except grpc.RpcError as exc:
                if retry and base.is_retryable(exc) and number < settings.retries:
                    await asyncio.sleep(settings.backoff_s * 2**number)
                    continue
                raise base.error_from(exc) from None
            except ValueError as exc:  # grpc's "closed channel": closed by another thread
                if self._closed and not isinstance(exc, TierKVError):
                    raise ServiceUnavailableError("this client was closed during the call") from None
                raise
        raise AssertionError("unreachable")

    async def _call(self, method: str, request: Any, timeout_s: float | None = None,
                    retry: bool = True) -> Any:
        return await self._retrying(
            lambda: getattr(self._stub, method)(
                request, timeout=timeout_s or self.settings.timeout_s,
                metadata=self._metadata,
            ),
            retry,
        )

    async def describe(self) -> pb.DescribeResponse:
        """The server's facts (slab, host, limits); fetched once, and again when the server's
        slab went away (it restarted)."""
        self._check_mapping()
        if self._info is None:
            self._info = await self._call("Describe", pb.DescribeRequest())
            self._adopt(self._info)
        return self._info

    async def uses_shared_memory(self) -> bool:
        """Whether bulk bytes go through the server's shared-memory slab."""
        await self.describe()
        return self._slab is not None

    async def put(
        self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
        priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
        timeout_s: float | None = None,
    ) -> int:
        """Store ``blocks`` under ``hashes``; returns the blocks newly stored."""
        flat = base.block_bytes_of(blocks, namespace)
        if len(hashes) != blocks.shape[0]:
            raise InvalidArgumentError(f"got {len(hashes)} hashes but {blocks.shape[0]} blocks")
        for attempt in range(2):
            await self.describe()
            if self._slab is None:
                break
            try:
                with self._leasing():
                    return await self._put_shared(namespace, hashes, flat, priority,
                                                  write_policy, timeout_s)
            except base.REMAP_ERRORS:
                if attempt:
                    raise
                self._forget_server()  # a restarted server: map its new slab and write again
        response = await self._retrying(lambda: self._put_stream(
            base.put_chunks(namespace, hashes, flat, write_policy, priority),
            timeout=timeout_s or self.settings.timeout_s, metadata=self._metadata,
        ))
        return int(response.count)

    async def _put_shared(
        self, namespace: Namespace, hashes: Sequence[bytes], flat: torch.Tensor,
        priority: Priority, write_policy: WritePolicy | None, timeout_s: float | None,
    ) -> int:
        slab = self._slab
        assert slab is not None
        lease = await self._call(
            "Allocate", self._allocate_request(namespace, hashes, priority, write_policy), timeout_s
        )
        granted_s = time.monotonic()
        try:
            commit = await asyncio.to_thread(self._fill_lease, slab, lease, namespace, flat,
                                             granted_s)
        except BaseException:
            with contextlib.suppress(TierKVError):  # the lease may be gone with its server
                await self._call("Abort", pb.LeaseRequest(lease_id=lease.lease_id), retry=False)
            raise
        response = await self._call("Commit", commit, timeout_s, retry=False)
        return int(response.count)

    async def lookup_detail(
        self, namespace: Namespace, hashes: Sequence[bytes], *, prefetch: bool = False,
        pin_ttl_s: float = 0.0, timeout_s: float | None = None,
    ) -> pb.LookupResponse:
        """The cached prefix with per-tier counts; optionally prefetch it into HOST and pin it."""
        response: pb.LookupResponse = await self._call(
            "Lookup", self._lookup_request(namespace, hashes, prefetch, pin_ttl_s), timeout_s
        )
        return response

    async def lookup(self, namespace: Namespace, hashes: Sequence[bytes], *,
                     timeout_s: float | None = None) -> int:
        """How many leading ``hashes`` are cached (short chains, on the same host, from the
        shared presence table without a call)."""
        await self.describe()
        local = self._lookup_locally(namespace, hashes)
        if local is not None:
            return local
        return int((await self.lookup_detail(namespace, hashes, timeout_s=timeout_s)).num_cached)

    async def prefetch(self, namespace: Namespace, hashes: Sequence[bytes], *,
                       timeout_s: float | None = None) -> int:
        """Bring the cached prefix into HOST; returns its length."""
        detail = await self.lookup_detail(namespace, hashes, prefetch=True, timeout_s=timeout_s)
        return int(detail.num_cached)

    async def get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor, *,
                       timeout_s: float | None = None) -> int:
        """Copy the leading cached blocks into ``out[:k]``; returns ``k``."""
        flat = check_out(namespace.layout, out, len(hashes))
        target = flat if flat.device.type == "cpu" else torch.empty(flat.numel(), dtype=torch.uint8)
        block_bytes = namespace.layout.bytes_per_block
        num_blocks: int | None = None
        for attempt in range(2):
            await self.describe()
            if self._slab is None:
                break
            try:
                with self._leasing():
                    num_blocks = await self._get_shared(namespace, hashes, target, timeout_s)
                break
            except base.REMAP_ERRORS:
                if attempt:
                    raise
                self._forget_server()
        if num_blocks is None:
            num_blocks = await self._get_streamed(namespace, hashes, target, timeout_s)
        if target is not flat:
            flat[: num_blocks * block_bytes].copy_(target[: num_blocks * block_bytes])
        return num_blocks

    async def _get_shared(self, namespace: Namespace, hashes: Sequence[bytes],
                          flat: torch.Tensor, timeout_s: float | None) -> int:
        slab = self._slab
        assert slab is not None
        done = 0
        while done < len(hashes):
            lease = await self._call("Acquire", self._acquire_request(namespace, hashes[done:]),
                                     timeout_s)
            bad: int | None = None
            release = pb.LeaseRequest(lease_id=lease.lease_id)
            try:
                bad = await asyncio.to_thread(self._read_lease, slab, lease, namespace, flat, done)
            finally:
                if bad is not None:
                    release.corrupt_indices.append(bad)
                with contextlib.suppress(TierKVError):  # an expired lease: the copy is checked
                    await self._call("Release", release, retry=False)
            if bad is not None:
                return done + bad  # a damaged block ends the run: a miss, never its bytes
            count = len(lease.blocks)
            done += count
            if count == 0 or count >= lease.num_cached:
                break
        return done

    async def _get_streamed(self, namespace: Namespace, hashes: Sequence[bytes],
                            flat: torch.Tensor, timeout_s: float | None) -> int:
        request = self._blocks_request(namespace, hashes)
        target = flat.numpy()

        async def attempt() -> int:
            num_blocks, received, first = 0, 0, True
            call = self._stub.Get(request, timeout=timeout_s or self.settings.timeout_s,
                                  metadata=self._metadata)
            async for chunk in call:
                if first:
                    num_blocks, first = chunk.num_blocks, False
                size = len(chunk.data)
                target[received : received + size] = memoryview(chunk.data)
                received += size
            if received != num_blocks * namespace.layout.bytes_per_block:
                raise ServiceUnavailableError("the Get stream ended early")
            return num_blocks

        return await self._retrying(attempt)

    async def get(self, namespace: Namespace, hashes: Sequence[bytes],
                  device: str | torch.device = "cpu", *,
                  timeout_s: float | None = None) -> torch.Tensor:
        """The leading cached blocks as a new ``[k, *block_shape]`` tensor."""
        layout = namespace.layout
        out = torch.empty((len(hashes), *layout.block_shape), dtype=layout.torch_dtype,
                          device=device)
        return out[: await self.get_into(namespace, hashes, out, timeout_s=timeout_s)]

    async def pin(self, namespace: Namespace, hashes: Sequence[bytes],
                  ttl_s: float | None = None, *, timeout_s: float | None = None) -> int:
        """Pin the cached prefix (until ``unpin``, or for ``ttl_s``); returns how many."""
        response = await self._call("Pin", pb.PinRequest(
            namespace=self._wire(namespace), hashes=list(hashes), ttl_s=ttl_s or 0.0,
        ), timeout_s)
        return int(response.count)

    async def unpin(self, namespace: Namespace, hashes: Sequence[bytes], *,
                    timeout_s: float | None = None) -> int:
        """Drop one pin of each; returns how many were pinned."""
        return int((await self._call("Unpin", self._blocks_request(namespace, hashes),
                                     timeout_s)).count)

    async def delete(self, namespace: Namespace, hashes: Sequence[bytes], *,
                     timeout_s: float | None = None) -> int:
        """Delete the blocks; returns how many were stored."""
        return int((await self._call("Delete", self._blocks_request(namespace, hashes),
                                     timeout_s)).count)

    async def stats(self, *, timeout_s: float | None = None) -> pb.StatsResponse:
        """The server's tier and counter snapshot."""
        response: pb.StatsResponse = await self._call("Stats", pb.StatsRequest(), timeout_s)
        return response

    async def save_session(self, namespace: Namespace, session_id: str,
                           token_ids: Sequence[int], ttl_s: float | None = None, *,
                           timeout_s: float | None = None) -> int:
        """Store a session's token ids durably; returns their number."""
        response = await self._call("SaveSession", pb.SaveSessionRequest(
            namespace=self._wire(namespace), session_id=session_id,
            token_ids=list(token_ids), ttl_s=ttl_s or 0.0,
        ), timeout_s)
        return int(response.num_tokens)

    async def resume_session(self, session_id: str, *, timeout_s: float | None = None,
                             ) -> tuple[Namespace, list[int], int]:
        """``(namespace, token ids, number of leading tokens cached)`` of a saved session."""
        response = await self._call("ResumeSession", pb.SessionRequest(session_id=session_id),
                                    timeout_s)
        namespace = namespace_from_wire(response.namespace, "")
        return namespace, list(response.token_ids), int(response.num_cached_tokens)

    async def delete_session(self, session_id: str, *, timeout_s: float | None = None) -> bool:
        """Delete a session; True if it existed."""
        response = await self._call("DeleteSession", pb.SessionRequest(session_id=session_id),
                                    timeout_s)
        return bool(response.deleted)

    async def list_sessions(self, *, timeout_s: float | None = None) -> list[pb.SessionInfo]:
        """The caller's sessions."""
        return list((await self._call("ListSessions", pb.ListSessionsRequest(), timeout_s)).sessions)
