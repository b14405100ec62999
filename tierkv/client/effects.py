"""What the client's logic asks of I/O, and the two drivers that do it: blocking and asyncio.

The logic (``tierkv.client.flows``) is written once, as generators that yield an *effect* (a
call to make, a copy to run, a pause) and receive its result, or have its exception thrown in
at the ``yield``. ``run_blocking`` performs each effect in the calling thread; ``run_async``
awaits it, with copies on a worker thread so that the event loop never waits on one. Each
effect's two ways of being done sit side by side below: that is all that differs between
``Client`` and ``AsyncClient``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

import numpy as np

from tierkv.client.base import Connection
from tierkv.errors import ServiceUnavailableError
from tierkv.wire import tierkv_pb2 as pb

R = TypeVar("R")


class Effect:
    """One step of I/O a flow asks for: done by ``blocking`` in ``Client`` and by ``awaited``
    in ``AsyncClient``, with the same result (or exception)."""

    __slots__ = ()

    def blocking(self, connection: Connection) -> Any:
        """Do it in the calling thread."""
        raise NotImplementedError

    async def awaited(self, connection: Connection) -> Any:
        """Do it without blocking the event loop."""
        raise NotImplementedError


Flow = Generator[Effect, Any, R]
"""The client's logic for one call: yields effects, receives their results, returns ``R``."""


class Unary(Effect):
    """A unary call: its response message."""

    __slots__ = ("method", "request", "timeout_s")

    def __init__(self, method: str, request: Any, timeout_s: float) -> None:
        self.method, self.request, self.timeout_s = method, request, timeout_s

    def blocking(self, connection: Connection) -> Any:
        return getattr(connection.stub, self.method)(
            self.request, timeout=self.timeout_s, metadata=connection.metadata)

    async def awaited(self, connection: Connection) -> Any:
        return await getattr(connection.stub, self.method)(
            self.request, timeout=self.timeout_s, metadata=connection.metadata)


class PutStream(Effect):
    """A Put of the serialized chunks ``chunks()`` gives (called again on each attempt): its
    ``CountResponse``."""

    __slots__ = ("chunks", "timeout_s")

    def __init__(self, chunks: Callable[[], Iterator[bytes]], timeout_s: float) -> None:
        self.chunks, self.timeout_s = chunks, timeout_s

    def blocking(self, connection: Connection) -> Any:
        return connection.put_stream(self.chunks(), timeout=self.timeout_s,
                                     metadata=connection.metadata)

    async def awaited(self, connection: Connection) -> Any:
        return await connection.put_stream(self.chunks(), timeout=self.timeout_s,
                                           metadata=connection.metadata)


class GetReceiver:
    """Lands a Get stream's chunks in ``target`` as they come (one slice copy per ~1 MiB
    chunk); ``finish`` gives the number of blocks, or raises if the stream ended early.
    ``more``: the server cut its answer short of the stored run (ask again for the rest)."""

    __slots__ = ("block_bytes", "more", "num_blocks", "received_bytes", "started", "target")

    def __init__(self, target: np.ndarray, block_bytes: int) -> None:
        self.target, self.block_bytes = target, block_bytes
        self.num_blocks, self.received_bytes, self.started, self.more = 0, 0, False, False

    def take(self, chunk: pb.GetChunk) -> None:
        """One more chunk (the first says how many blocks follow)."""
        if not self.started:
            self.num_blocks, self.started, self.more = chunk.num_blocks, True, chunk.more
        size = len(chunk.data)
        self.target[self.received_bytes : self.received_bytes + size] = memoryview(chunk.data)
        self.received_bytes += size

    def finish(self) -> tuple[int, bool]:
        """The blocks received, once every byte they announced has arrived, and ``more``."""
        if self.received_bytes != self.num_blocks * self.block_bytes:
            raise ServiceUnavailableError("the Get stream ended early")
        return self.num_blocks, self.more


class GetStream(Effect):
    """A Get received into a fresh ``receiver()`` (each attempt starts over): its blocks, and
    whether the stored run goes on past them (``GetReceiver.more``)."""

    __slots__ = ("receiver", "request", "timeout_s")

    def __init__(self, request: pb.BlocksRequest, timeout_s: float,
                 receiver: Callable[[], GetReceiver]) -> None:
        self.request, self.timeout_s, self.receiver = request, timeout_s, receiver

    def blocking(self, connection: Connection) -> tuple[int, bool]:
        receiver = self.receiver()
        for chunk in connection.stub.Get(self.request, timeout=self.timeout_s,
                                         metadata=connection.metadata):
            receiver.take(chunk)
        return receiver.finish()

    async def awaited(self, connection: Connection) -> tuple[int, bool]:
        receiver = self.receiver()
        async for chunk in connection.stub.Get(self.request, timeout=self.timeout_s,
                                               metadata=connection.metadata):
            receiver.take(chunk)
        return receiver.finish()


class ServerStream(Effect):
    """A call answered with a stream of messages, each handed to ``on_message`` as it comes
    (in the calling thread, or on the event loop): the last message (None if there was
    none)."""

    __slots__ = ("method", "on_message", "request", "timeout_s")

    def __init__(self, method: str, request: Any, timeout_s: float,
                 on_message: Callable[[Any], None]) -> None:
        self.method, self.request, self.timeout_s = method, request, timeout_s
        self.on_message = on_message

    def blocking(self, connection: Connection) -> Any:
        last = None
        for last in getattr(connection.stub, self.method)(
                self.request, timeout=self.timeout_s, metadata=connection.metadata):
            self.on_message(last)
        return last

    async def awaited(self, connection: Connection) -> Any:
        last = None
        async for last in getattr(connection.stub, self.method)(
                self.request, timeout=self.timeout_s, metadata=connection.metadata):
            self.on_message(last)
        return last


class Copy(Effect):
    """Blocking work (a bulk copy through the slab): ``fn(*args)``, on a worker thread when
    awaited."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def blocking(self, connection: Connection) -> Any:
        return self.fn(*self.args)

    async def awaited(self, connection: Connection) -> Any:
        return await asyncio.to_thread(self.fn, *self.args)


class Sleep(Effect):
    """A pause (the backoff between attempts)."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def blocking(self, connection: Connection) -> None:
        time.sleep(self.seconds)

    async def awaited(self, connection: Connection) -> None:
        await asyncio.sleep(self.seconds)


def run_blocking(connection: Connection, flow: Flow[R]) -> R:
    """Drive ``flow`` to its result in this thread. An exception an effect raises is thrown
    into the flow at its ``yield`` (its ``except`` and ``finally`` blocks may yield more)."""
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            if error is None:
                effect = flow.send(result)
            else:
                effect, error = flow.throw(error), None
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            result = effect.blocking(connection)
        except BaseException as exc:  # the flow decides (it re-raises what it does not handle)
            result, error = None, exc


async def run_async(connection: Connection, flow: Flow[R]) -> R:
    """``run_blocking``, awaiting each effect (cancellation is thrown into the flow too)."""
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            if error is None:
                effect = flow.send(result)
            else:
                effect, error = flow.throw(error), None
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            result = await effect.awaited(connection)
        except BaseException as exc:
            result, error = None, exc
