"""``tierkv.BlockStore``: one script of calls, the same answers from an in-process
``TieredStore``, a sidecar ``Client`` (shared memory and stream) and an ``AsyncClient``.

mypy proves the signatures (``tierkv/__init__.py``); this proves the behaviour behind them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.harness import BackgroundServer
from tests.support.tiny_blocks import TINY_LAYOUT, blocks, keys, same_bytes
from tierkv import (
    AsyncBlockStore,
    AsyncClient,
    BlockStore,
    Client,
    NotFoundError,
    PutDetail,
    ResumedSession,
    StoreStats,
    TieredStore,
    block_hashes,
)
from tierkv.keys import Namespace

NAMESPACE = Namespace("protocol-model", TINY_LAYOUT)
TOKENS = list(range(100, 122))  # 5 full blocks of 4 tokens and 2 tokens more


def script(store: BlockStore, seed: str | None) -> list[Any]:
    """Every protocol call once, on a fresh store; what each answered."""
    data, hashes = blocks(6, seed=3), keys(6, salt="protocol")
    out = torch.empty((6, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype)
    store.register(NAMESPACE)
    answers: list[Any] = [
        store.put(NAMESPACE, hashes[:4], data[:4]),
        store.put(NAMESPACE, hashes[4:], data[4:], detail=PutDetail(parent_hash=hashes[3])),
        store.put(NAMESPACE, hashes[:2], data[:2]),  # already stored: idempotent
        store.lookup(NAMESPACE, hashes),
        store.lookup(NAMESPACE, [*hashes[:2], keys(1, salt="absent")[0], hashes[3]]),
        store.get_into(NAMESPACE, hashes, out),
        same_bytes(out, data),
        same_bytes(store.get(NAMESPACE, hashes[:3]), data[:3]),
        store.prefetch(NAMESPACE, hashes),
        store.pin(NAMESPACE, hashes[:3]),
        store.unpin(NAMESPACE, hashes),
        store.publish(NAMESPACE, hashes, wait_s=0.0),  # no REMOTE: what is held here
        store.delete(NAMESPACE, hashes[4:]),
        store.lookup(NAMESPACE, hashes),
    ]
    stats = store.stats()
    answers += [isinstance(stats, StoreStats), stats.puts > 0 and stats.gets > 0]
    session_hashes = block_hashes(TOKENS, TINY_LAYOUT.block_size, seed)
    store.put(NAMESPACE, [bytes(h) for h in session_hashes[:3]], blocks(3, seed=4))
    answers.append(store.save_session(NAMESPACE, "chat", TOKENS))
    resumed = store.resume_session("chat")
    answers += [isinstance(resumed, ResumedSession), resumed.namespace.model_id,
                resumed.namespace.layout, list(resumed.token_ids), resumed.num_cached_tokens]
    answers.append([(s.session_id, s.model_id, s.num_tokens) for s in store.list_sessions()])
    answers += [store.delete_session("chat"), store.delete_session("chat")]
    with pytest.raises(NotFoundError):
        store.resume_session("chat")
    return answers


EXPECTED = [4, 2, 0, 6, 2, 6, True, True, 6, 3, 3, 6, 2, 4, True, True, 22, True,
            "protocol-model", TINY_LAYOUT, TOKENS, 12, [("chat", "protocol-model", 22)],
            True, False]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    server = BackgroundServer(tmp_path_factory.mktemp("protocol"), tokens={})
    yield server
    server.close()


def test_an_in_process_store_answers_the_script(tmp_path: Path) -> None:
    from tests.support.harness import store_config

    with TieredStore(store_config(tmp_path, 64, 1024)) as store:
        assert script(store, None) == EXPECTED


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "stream"])
def test_a_client_answers_the_script_as_the_store_does(server: BackgroundServer,
                                                       use_shm: bool) -> None:
    with Client(server.unix_target, use_shm=use_shm) as client:
        client.delete(NAMESPACE, keys(6, salt="protocol"))  # (the other parameter's run)
        seed = client.describe().hash_seed
        client.delete(NAMESPACE, [bytes(h) for h in block_hashes(TOKENS, 4, seed)])
        assert script(client, seed) == EXPECTED


def test_an_async_client_answers_the_script_awaited(server: BackgroundServer) -> None:
    class Blocking:
        """An ``AsyncBlockStore`` driven call by call from this thread."""

        def __init__(self, inner: AsyncBlockStore, loop: asyncio.AbstractEventLoop) -> None:
            self.inner, self.loop = inner, loop

        def __getattr__(self, name: str) -> Any:
            call = getattr(self.inner, name)
            if not asyncio.iscoroutinefunction(call):
                return call
            return lambda *a, **k: self.loop.run_until_complete(call(*a, **k))

    loop = asyncio.new_event_loop()
    try:
        async def connect() -> AsyncClient:  # (its channel belongs to this loop)
            return AsyncClient(server.unix_target)

        client = loop.run_until_complete(connect())
        seed = loop.run_until_complete(client.describe()).hash_seed
        blocking: Any = Blocking(client, loop)
        blocking.delete(NAMESPACE, keys(6, salt="protocol"))
        blocking.delete(NAMESPACE, [bytes(h) for h in block_hashes(TOKENS, 4, seed)])
        assert script(blocking, seed) == EXPECTED
        loop.run_until_complete(client.close())
    finally:
        loop.close()


def test_the_three_are_block_stores_at_run_time(server: BackgroundServer,
                                                tmp_path: Path) -> None:
    from tests.support.harness import store_config

    with TieredStore(store_config(tmp_path, 64, 1024)) as store, \
            Client(server.unix_target) as client:
        assert isinstance(store, BlockStore) and isinstance(client, BlockStore)
