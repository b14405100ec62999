"""Fixtures of the client SDK tests and of the service tests that use the SDK: real servers
(port 0 and a Unix socket) and ``Client`` / ``AsyncClient`` of them, closed at the end of the
test. ``tests/client/conftest.py`` and ``tests/service/conftest.py`` import them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.client_harness import (
    KINDS,
    PATHS,
    AnyClient,
    AsyncFacade,
    LiveServer,
    ServerFactory,
    path_settings,
)
from tests.support.tiny_blocks import BLOCK_BYTES, PAGE_BYTES, RECORD_BYTES
from tierkv import Client


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """Start servers: ``host_bytes``, ``page_bytes``, ``disk_bytes`` (0: no disk tier),
    ``gpu_bytes`` (an emulated GPU tier), and any ``ServiceConfig`` field."""
    servers: list[LiveServer] = []

    def build(host_bytes: int = 64 * BLOCK_BYTES, page_bytes: int = PAGE_BYTES,
              disk_bytes: int = 4096 * RECORD_BYTES, gpu_bytes: int = 0,
              **service_fields: Any) -> LiveServer:
        server = LiveServer(tmp_path / f"server-{len(servers)}", host_bytes=host_bytes,
                            page_bytes=page_bytes, disk_bytes=disk_bytes, disk_blocks=0,
                            gpu_bytes=gpu_bytes, **service_fields)
        servers.append(server)
        return server

    yield build
    for server in servers:
        server.close()


@pytest.fixture
def connect() -> Iterator[Callable[..., AnyClient]]:
    """``connect(target, kind, **settings)``: a ``Client`` or an ``AsyncFacade``, closed at the
    end of the test."""
    opened: list[AnyClient] = []

    def make(target: str, kind: str = "sync", **settings: Any) -> AnyClient:
        client = Client(target, **settings) if kind == "sync" else AsyncFacade(target, **settings)
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


@pytest.fixture
def open_client(connect: Callable[..., AnyClient]) -> Callable[..., AnyClient]:
    """``open_client(server, path, kind, **overrides)``: a client of ``server`` on ``path``."""

    def make(server: LiveServer, path: str, kind: str = "sync", **overrides: Any) -> AnyClient:
        target, settings = path_settings(server, path)
        return connect(target, kind, **{**settings, **overrides})

    return make


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server(make_server: ServerFactory) -> LiveServer:
    """The default server: 64 tiny blocks of HOST, a disk tier of 4096."""
    return make_server()


@pytest.fixture
def client(server: LiveServer, open_client: Callable[..., AnyClient], kind: str, path: str) -> AnyClient:
    """A client of the default server, of each kind, on each path."""
    return open_client(server, path, kind)
