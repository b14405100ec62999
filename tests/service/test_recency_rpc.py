"""Recency through a real server and the SDK, on both data paths (shared memory: Acquire and
Allocate/Commit; the stream: Get and Put): every read refreshes what it serves, and a chain put
in several calls naming its parents is evicted tail first (docs/design/eviction.md#chains)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.harness import ALICE_TOKEN, BackgroundServer
from tests.support.tiny_blocks import TINY_LAYOUT, blocks, keys, same_bytes
from tierkv import Client, Namespace
from tierkv.types import PutDetail

HOST_BLOCKS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    served = BackgroundServer(tmp_path_factory.mktemp("recency"), host_blocks=HOST_BLOCKS,
                              disk_blocks=0)
    try:
        yield served
    finally:
        served.close()


@pytest.fixture(params=["shm", "stream"])
def client(request: pytest.FixtureRequest, server: BackgroundServer) -> Iterator[Client]:
    with Client(server.unix_target, token=ALICE_TOKEN,
                use_shm=request.param == "shm") as opened:
        yield opened


def _namespace(request: pytest.FixtureRequest) -> Namespace:
    return Namespace(f"recency-{request.node.name}", TINY_LAYOUT)


@pytest.mark.parametrize("read", ["get", "get_into"])
def test_a_prefix_read_every_round_outlives_what_came_after_it(
        request: pytest.FixtureRequest, client: Client, server: BackgroundServer,
        read: str) -> None:
    namespace = _namespace(request)
    hot, data = keys(4, salt=f"hot-{request.node.name}"), blocks(4, seed=1)
    client.put(namespace, hot, data)
    out = torch.empty_like(data)
    for i in range(6):  # 24 more blocks through a 16-block HOST
        if read == "get":
            assert same_bytes(client.get(namespace, hot), data)
        else:
            assert client.get_into(namespace, hot, out) == 4 and same_bytes(out, data)
        client.put(namespace, keys(4, salt=f"cold-{request.node.name}-{i}"),
                   blocks(4, seed=10 + i))
    assert client.lookup(namespace, hot) == 4
    server.store.clear(model_id=namespace.model_id)


def test_a_chain_put_in_four_calls_keeps_its_head(
        request: pytest.FixtureRequest, client: Client, server: BackgroundServer) -> None:
    """The issue's case at this server's scale: a 12-block chain put in calls of 3, each
    naming its parent, then 8 blocks of others through a 16-block HOST: the head half stays
    a hit (without parents, the head went first and nothing was reachable)."""
    namespace = _namespace(request)
    chain = keys(12, salt=f"chain-{request.node.name}")
    for start in range(0, 12, 3):
        client.put(namespace, chain[start : start + 3], blocks(3, seed=start),
                   detail=PutDetail(parent_hash=chain[start - 1] if start else None))
    for i in range(4):
        client.put(namespace, keys(2, salt=f"other-{request.node.name}-{i}"),
                   blocks(2, seed=50 + i))
    assert client.lookup(namespace, chain) == 8
    assert [client.lookup(namespace, [h]) for h in chain[8:]] == [0] * 4  # nothing stranded
    server.store.clear(model_id=namespace.model_id)
