"""The operator's calls of the TierKV service: Stats (with the largest namespaces) and Clear.

Mixed into ``TierKVServicer`` (which provides what is named below). A caller reaches its own
tenant's namespaces; one the server names an admin tenant (``ServiceConfig.admin_tenants``, or
every caller of a server without tokens) reaches every tenant's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from tierkv.service import convert
from tierkv.service.calls import (
    REFUSALS,
    Caller,
    check_parsed,
    end_call,
    status_of_refusal,
    unary,
)
from tierkv.store import TieredStore
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire.convert import clear_progress_to, clear_result_to, stats_to

R = TypeVar("R")
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


class OperatorCalls:
    """``Stats`` and ``Clear`` of ``TierKVServicer`` (see the module docstring)."""

    @property
    def store(self) -> TieredStore:
        raise NotImplementedError

    async def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        raise NotImplementedError

    async def _run(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        raise NotImplementedError

    @unary
    async def Stats(self, request: pb.StatsRequest, context: Any, caller: Caller) -> Any:  # noqa: N802
        limit = request.max_namespaces or DEFAULT_STATS_NAMESPACES
        stats = await self._run(self.store.stats)
        namespaces = await self._run(self.store.namespace_stats,
                                     None if caller.is_admin else caller.tenant)
        holding = [n for n in namespaces if n.num_blocks or n.num_sessions]
        return stats_to(stats, holding[:limit])

    async def Clear(self, request: pb.ClearRequest, context: Any  # noqa: N802
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

