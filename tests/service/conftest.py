"""Fixtures of the service tests: real servers on port 0 and a Unix socket, and clients of them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from tests.support.client_fixtures import client, connect, kind, make_server, open_client, path, server
from tests.support.dynamo_indexer import dynamo_indexer
from tests.support.harness import Served, serving
from tests.support.rpc_calls import Bench, put
from tests.support.service_fixtures import payload
from tests.support.tiny_blocks import keys


@pytest_asyncio.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    """A server with 64 tiny blocks of HOST and 1024 of disk; tokens for alice and bob."""
    async with serving(tmp_path / "store")as handle:
        yield handle


@pytest_asyncio.fixture
async def small(tmp_path: Path) -> AsyncIterator[Served]:
    """A server with only 8 tiny blocks of HOST (eviction to disk is easy to cause)."""
    async with serving(tmp_path / "store", host_blocks=8)as handle:
        yield handle


@pytest_asyncio.fixture
async def bench(served: Served) -> Bench:
    stub = served.stub()
    stored, fresh = keys(4, salt="stored"), keys(4, salt="fresh")
    await put(stub, stored, payload(4, seed=71))
    return Bench(served, stub, stored, fresh)


# The SDK's fixtures (servers, clients of each kind on each path) are shared with tests/client/;
# Dynamo's indexer (a subprocess, module scope) is for tests/service/test_dynamo_rules.py and the
# sidecar's tests against a real router.
__all__ = [
    "bench", "client", "connect", "dynamo_indexer", "kind", "make_server", "open_client", "path", "served",
    "server", "small",
]
