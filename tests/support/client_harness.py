"""Helpers of the client SDK tests: a server whose servicer records every call, an
``AsyncClient`` driven from synchronous code, and the checks of which data path a client took.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import torch

from tests.support.harness import ALICE_TOKEN, BackgroundServer
from tests.support.tiny_blocks import TINY_LAYOUT, blocks
from tierkv import (
    AsyncClient,
    KVLayout,
    Namespace,
)
from tierkv.service.auth import client_id_of
from tierkv.service.config import ServiceConfig
from tierkv.service.servicer import TierKVServicer
from tierkv.tiers.records import block_record_bytes
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

# 4 layers x 2 (K,V) x 16 tokens x 8 heads x 64 dims x fp16 = 128 KiB a block: 40 of them are
# 5 MiB, more than one stream chunk (1 MiB) and than one gRPC message (4 MiB).
BIG_LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16)
BIG_BLOCK_BYTES = BIG_LAYOUT.bytes_per_block
BIG_PAGE_BYTES = 64 * 1024
BIG_RECORD_BYTES = block_record_bytes(BIG_LAYOUT)  # one block's room on disk

PATHS = ("shm", "stream")
KINDS = ("sync", "async")
LEASE_METHODS = frozenset({"Allocate", "Commit", "Abort", "Acquire", "Release"})
STREAM_METHODS = frozenset({"Put", "Get"})


# --- a server whose servicer records every call ------------------------------------------------


class SpyServicer(TierKVServicer):
    """The real servicer, recording ``(client id, method)`` of every call before serving it."""

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__(config)
        self.calls: list[tuple[str, str]] = []
        self._calls_lock = threading.Lock()

    def note(self, context: Any, method: str) -> None:
        with self._calls_lock:
            self.calls.append((client_id_of(context.invocation_metadata()), method))

    def methods_of(self, client_id: str) -> collections.Counter[str]:
        """How often the client with ``client_id`` called each method."""
        with self._calls_lock:
            return collections.Counter(m for c, m in self.calls if c == client_id)

    async def Get(self, request: Any, context: Any) -> Any:
        self.note(context, "Get")
        async for chunk in super().Get(request, context):
            yield chunk


def _spied(name: str) -> Callable[..., Any]:
    served = getattr(TierKVServicer, name)

    async def method(self: SpyServicer, request: Any, context: Any) -> Any:
        self.note(context, name)
        return await served(self, request, context)

    method.__name__ = name
    return method


for _name in ("Describe", "Lookup", "Pin", "Unpin", "Delete", "Stats", "Put", "Acquire", "Release",
              "Allocate", "Commit", "Abort", "SaveSession", "ResumeSession", "DeleteSession",
              "ListSessions"):
    setattr(SpyServicer, _name, _spied(_name))


class LiveServer(BackgroundServer):
    """The in-process harness (``BackgroundServer``) with a ``SpyServicer``: ``spy`` tells which
    RPCs each client made."""

    def __init__(self, root: Path, **serve_args: Any) -> None:
        super().__init__(root, servicer=SpyServicer, **serve_args)
        assert isinstance(self.served.server.servicer, SpyServicer)
        self.spy: SpyServicer = self.served.server.servicer


ServerFactory = Callable[..., LiveServer]


# --- clients -----------------------------------------------------------------------------------


class AsyncFacade:
    """An ``AsyncClient`` driven from synchronous code: each call is awaited on a private loop.

    Lets one test body check both clients; ``client`` is the real ``AsyncClient``."""

    def __init__(self, target: str, **settings: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._closed = False

        async def open_client() -> AsyncClient:  # its channel belongs to the loop it runs on
            return AsyncClient(target, **settings)

        self.client = self._loop.run_until_complete(open_client())

    def run(self, coroutine: Any) -> Any:
        return self._loop.run_until_complete(coroutine)

    @property
    def settings(self) -> Any:
        return self.client.settings

    @property
    def uses_shared_memory(self) -> bool:
        return bool(self.run(self.client.uses_shared_memory()))

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.run(method(*args, **kwargs))

        return call

    def __enter__(self) -> AsyncFacade:
        assert self.run(self.client.__aenter__()) is self.client
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.run(self.client.__aexit__(*exc_info))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.run(self.client.close())
            self._loop.close()


AnyClient = Any  # Client or AsyncFacade: the same methods


def path_settings(server: LiveServer, path: str) -> tuple[str, dict[str, Any]]:
    """Target and settings of a client on ``path``."""
    if path == "shm":
        return server.unix_target, {"token": ALICE_TOKEN}  # use_shm left to the client
    return server.tcp_target, {"token": ALICE_TOKEN, "use_shm": False}


def check_path(server: LiveServer, client: AnyClient, path: str) -> None:
    """The client said it uses the path, and the server saw only that path's data calls."""
    assert client.uses_shared_memory is (path == "shm")
    methods = server.spy.methods_of(client.settings.client_id)
    data_calls = set(methods) & (LEASE_METHODS | STREAM_METHODS)
    assert data_calls, f"no data call reached the server: {methods}"
    if path == "shm":
        assert not data_calls & STREAM_METHODS, methods
    else:
        assert not data_calls & LEASE_METHODS, methods


def ns(model: str = "test-model", layout: KVLayout = TINY_LAYOUT) -> Namespace:
    return Namespace(model, layout)


def patterned_blocks(n: int, seed: int = 0, layout: KVLayout = TINY_LAYOUT) -> torch.Tensor:
    """``n`` blocks: all zeros, all ones (0xFF: NaN fp16s), every byte value in order and
    reversed, then random bits."""
    raw = blocks(n, seed, layout).view(torch.uint8).reshape(n, -1).clone()
    size = raw.shape[1]
    every_byte = torch.arange(256, dtype=torch.uint8).repeat(size // 256 + 1)[:size]
    fixed = [torch.zeros(size, dtype=torch.uint8), torch.full((size,), 255, dtype=torch.uint8),
             every_byte, every_byte.flip(0)]
    for row, pattern in enumerate(fixed[:n]):
        raw[row] = pattern
    return raw.view(layout.torch_dtype).reshape(n, *layout.block_shape)


def shm_mappings(shm_name: str) -> int:
    """How many mappings of the slab ``shm_name`` this process holds."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return sum(line.endswith(f"/dev/shm/{shm_name}") for line in lines)


def raw_stub(server: LiveServer) -> tuple[grpc.Channel, pb_grpc.TierKVStub]:
    channel = grpc.insecure_channel(server.unix_target)
    return channel, pb_grpc.TierKVStub(channel)


def wire_ns(layout: KVLayout = TINY_LAYOUT, model: str = "test-model") -> pb.Namespace:
    return pb.Namespace(model_id=model, num_layers=layout.num_layers,
                        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                        block_size=layout.block_size, dtype=layout.dtype.value, tp_size=1)
