"""``tierkv.AsyncClient``: the asyncio client SDK (same methods as ``Client``, awaitable).

The logic is ``tierkv.client.flows``'s, shared with ``Client``; each method here awaits its
flow. Bulk copies into and out of the shared-memory slab run on a worker thread, so a large get
or put never blocks the caller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import TypeVar, Unpack

import grpc
import torch

from tierkv.client import base
from tierkv.client.base import BlockFill, BlockUse, ClientOptions
from tierkv.client.effects import Flow, run_async
from tierkv.client.flows import ClientFlows
from tierkv.client.results import ServerStats
from tierkv.config import Priority, WritePolicy
from tierkv.errors import TierKVError
from tierkv.keys import DEFAULT_TENANT, Namespace
from tierkv.types import ClearResult, PutDetail, ResumedSession, SessionInfo
from tierkv.wire.convert import LookupDetail, ServerInfo
from tierkv.wire.limits import DEFAULT_TARGET

R = TypeVar("R")


class AsyncClient(ClientFlows):
    """An asyncio connection to a ``tierkv serve`` sidecar (``async with``, or ``await close()``)."""

    def __init__(self, target: str = DEFAULT_TARGET, **settings: Unpack[ClientOptions]) -> None:
        super().__init__(target, settings)
        self._channel, self._connection = base.open_channel(grpc.aio, target, self.settings)
        # When queued releases that no call carried are sent (on the loop of the call that
        # queued them), and the task sending them.
        self._release_timer: asyncio.TimerHandle | None = None
        self._release_loop: asyncio.AbstractEventLoop | None = None
        self._release_task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """``Client.close``, awaitable."""
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        if not self._closed:
            with contextlib.suppress(TierKVError):
                await run_async(self._connection, self._send_releases())
        self._unmap()
        task = self._release_task
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            with contextlib.suppress(TierKVError, asyncio.CancelledError):
                await task
        await self._channel.close()

    async def _run(self, flow: Flow[R]) -> R:
        try:
            return await run_async(self._connection, flow)
        finally:
            if self._releases:
                self._schedule_releases()

    def _schedule_releases(self) -> None:
        """Send the queued releases once they are due, unless a call carries them first."""
        due_in_s = self._releases_due_in_s()
        loop = asyncio.get_running_loop()
        if due_in_s is None or self._closed:
            return
        if self._release_timer is not None:
            if self._release_loop is loop:
                return
            self._release_timer.cancel()  # of a loop that may never run again
        self._release_loop = loop
        self._release_timer = loop.call_later(max(0.0, due_in_s), self._start_sending_releases)

    def _start_sending_releases(self) -> None:
        self._release_timer = None
        if self._release_task is None or self._release_task.done():
            self._release_task = asyncio.ensure_future(self._send_releases_now())

    async def _send_releases_now(self) -> None:
        if self._releases_due_in_s() is None:
            return
        with contextlib.suppress(TierKVError):
            await run_async(self._connection, self._send_releases())
        if self._releases:
            self._schedule_releases()

    async def describe(self) -> ServerInfo:
        """``Client.describe``, awaitable."""
        return await self._run(self._describe())

    async def uses_shared_memory(self) -> bool:
        """``Client.uses_shared_memory``, awaitable."""
        return await self._run(self._uses_shared_memory())

    async def put(
        self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
        priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
        timeout_s: float | None = None, detail: PutDetail | None = None,
    ) -> int:
        """``Client.put``, awaitable."""
        return await self._run(self._put(namespace, hashes, blocks, priority, write_policy,
                                         timeout_s, detail))

    async def put_with(
        self, namespace: Namespace, hashes: Sequence[bytes], fill: BlockFill, *,
        priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
        timeout_s: float | None = None, detail: PutDetail | None = None,
    ) -> int:
        """Store blocks that ``fill`` writes (``BlockFill``: on a worker thread, straight into
        the server's slab when it is on this host) under ``hashes``; returns the blocks newly
        stored."""
        return await self._run(self._put_with(namespace, hashes, fill, priority, write_policy,
                                              timeout_s, detail))

    async def lookup_detail(
        self, namespace: Namespace, hashes: Sequence[bytes], *, prefetch: bool = False,
        pin_ttl_s: float = 0.0, timeout_s: float | None = None,
    ) -> LookupDetail:
        """``Client.lookup_detail``, awaitable."""
        return await self._run(self._lookup_detail(namespace, hashes, prefetch, pin_ttl_s,
                                                   timeout_s))

    async def lookup(self, namespace: Namespace, hashes: Sequence[bytes], *,
                     timeout_s: float | None = None) -> int:
        """``Client.lookup``, awaitable."""
        local = self._lookup_now(namespace, hashes)
        if local is not None:
            return local
        return await self._run(self._lookup(namespace, hashes, timeout_s))

    async def prefetch(self, namespace: Namespace, hashes: Sequence[bytes], *,
                       timeout_s: float | None = None) -> int:
        """``Client.prefetch``, awaitable."""
        detail = await self.lookup_detail(namespace, hashes, prefetch=True, timeout_s=timeout_s)
        return detail.num_cached

    async def get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor, *,
                       timeout_s: float | None = None) -> int:
        """``Client.get_into``, awaitable."""
        return await self._run(self._get_into(namespace, hashes, out, timeout_s))

    async def get_with(self, namespace: Namespace, hashes: Sequence[bytes], use: BlockUse, *,
                       timeout_s: float | None = None) -> int:
        """Hand the leading cached blocks to ``use`` (``BlockUse``: on a worker thread, as the
        server's slab pages when it is on this host), checked; returns how many leading blocks
        were handed over good."""
        return await self._run(self._get_with(namespace, hashes, use, timeout_s))

    async def get(self, namespace: Namespace, hashes: Sequence[bytes],
                  device: str | torch.device = "cpu", *,
                  timeout_s: float | None = None) -> torch.Tensor:
        """``Client.get``, awaitable."""
        return await self._run(self._get(namespace, hashes, device, timeout_s))

    async def pin(self, namespace: Namespace, hashes: Sequence[bytes],
                  ttl_s: float | None = None, *, timeout_s: float | None = None) -> int:
        """``Client.pin``, awaitable."""
        return await self._run(self._pin(namespace, hashes, ttl_s, timeout_s))

    async def unpin(self, namespace: Namespace, hashes: Sequence[bytes], *,
                    timeout_s: float | None = None) -> int:
        """``Client.unpin``, awaitable."""
        return await self._run(self._count("Unpin", self._blocks_request(namespace, hashes),
                                           timeout_s))

    async def delete(self, namespace: Namespace, hashes: Sequence[bytes], *,
                     timeout_s: float | None = None) -> int:
        """``Client.delete``, awaitable."""
        return await self._run(self._count("Delete", self._blocks_request(namespace, hashes),
                                           timeout_s))

    async def publish(self, namespace: Namespace, hashes: Sequence[bytes], *,
                      wait_s: float = 5.0, timeout_s: float | None = None) -> int:
        """``Client.publish``."""
        return await self._run(self._publish(namespace, hashes, wait_s, timeout_s))

    async def stats(self, *, max_namespaces: int = 0, timeout_s: float | None = None
                    ) -> ServerStats:
        """``Client.stats``, awaitable."""
        return await self._run(self._stats(max_namespaces, timeout_s))

    async def clear(
        self, *, tenant: str | None = None, model_id: str | None = None,
        namespace: Namespace | None = None, all_namespaces: bool = False,
        progress: Callable[[int, int], None] | None = None, timeout_s: float | None = None,
    ) -> ClearResult:
        """``Client.clear``, awaitable (``progress`` is called on the event loop)."""
        return await self._run(self._clear(tenant, model_id, namespace, all_namespaces,
                                           progress, timeout_s))

    async def save_session(self, namespace: Namespace, session_id: str,
                           token_ids: Sequence[int], ttl_s: float | None = None, *,
                           timeout_s: float | None = None) -> int:
        """``Client.save_session``, awaitable."""
        return await self._run(self._save_session(namespace, session_id, token_ids, ttl_s,
                                                  timeout_s))

    async def resume_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT,
                             timeout_s: float | None = None) -> ResumedSession:
        """``Client.resume_session``, awaitable."""
        return await self._run(self._resume_session(session_id, timeout_s))

    async def delete_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT,
                             timeout_s: float | None = None) -> bool:
        """``Client.delete_session``, awaitable."""
        return await self._run(self._delete_session(session_id, timeout_s))

    async def list_sessions(self, *, tenant: str = DEFAULT_TENANT,
                            timeout_s: float | None = None) -> list[SessionInfo]:
        """``Client.list_sessions``, awaitable."""
        return await self._run(self._list_sessions(timeout_s))
