"""Fixtures of the transformers integration's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import ALICE_TOKEN, BOB_TOKEN, BackgroundServer
from tierkv import TieredStore


@pytest.fixture(params=["store", "shm", "stream"])
def open_blocks(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[str], Any]]:
    """``open_blocks(tenant)``: a ``BlockStore``: an in-process TieredStore (every tenant's:
    the namespaces say whose), or a sidecar ``Client`` with ``tenant``'s token on its
    shared-memory path or its stream path (as from another host); the same tests run through
    all three."""
    # Imported here: the rest of the suite need not import the transformers integration.
    from tests.support.tiny_llama import kv_store_config
    from tierkv import Client

    if request.param == "store":
        store = TieredStore(kv_store_config(tmp_path))
        yield lambda tenant: store  # (whose blocks: the namespace's tenant)
        store.close(flush=False)
        return
    server = BackgroundServer(tmp_path, host_bytes=8 << 20, disk_bytes=32 << 20, page_bytes=4096)
    clients: list[Client] = []

    def open_client(tenant: str) -> Any:
        token = {"alice": ALICE_TOKEN, "bob": BOB_TOKEN}[tenant]
        clients.append(Client(server.unix_target, token=token, use_shm=request.param == "shm"))
        return clients[-1]

    yield open_client
    for client in clients:
        client.close()
    server.close()
