"""The asynchronous variants of ``TieredStore``'s calls: futures and awaitables.

They run the blocking call on the store's worker threads (``_submit``), so an ``await`` never
blocks the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


class AsyncMethods:
    """Mixed into ``TieredStore``, which provides the blocking calls and ``_submit``."""

    def _submit(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        raise NotImplementedError

    put: Callable[..., int]
    get: Callable[..., torch.Tensor]
    get_into: Callable[..., int]
    lookup: Callable[..., int]
    prefetch: Callable[..., Future[int]]

    def put_async(self, *args: Any, **kwargs: Any) -> Future[int]:
        """``put`` on a worker thread."""
        return self._submit(self.put, *args, **kwargs)

    def get_async(self, *args: Any, **kwargs: Any) -> Future[torch.Tensor]:
        """``get`` on a worker thread."""
        return self._submit(self.get, *args, **kwargs)

    def get_into_async(self, *args: Any, **kwargs: Any) -> Future[int]:
        """``get_into`` on a worker thread."""
        return self._submit(self.get_into, *args, **kwargs)

    async def aput(self, *args: Any, **kwargs: Any) -> int:
        """``put`` without blocking the event loop."""
        return await asyncio.wrap_future(self.put_async(*args, **kwargs))

    async def aget(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``get`` without blocking the event loop."""
        return await asyncio.wrap_future(self.get_async(*args, **kwargs))

    async def aget_into(self, *args: Any, **kwargs: Any) -> int:
        """``get_into`` without blocking the event loop."""
        return await asyncio.wrap_future(self.get_into_async(*args, **kwargs))

    async def aprefetch(self, *args: Any, **kwargs: Any) -> int:
        """``prefetch``, awaited."""
        return await asyncio.wrap_future(self.prefetch(*args, **kwargs))

    async def alookup(self, *args: Any, **kwargs: Any) -> int:
        """``lookup`` on a worker thread (it takes the store lock)."""
        return await asyncio.wrap_future(self._submit(self.lookup, *args, **kwargs))
