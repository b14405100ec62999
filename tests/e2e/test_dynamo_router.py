"""NVIDIA Dynamo's own KV indexer (``ai-dynamo-runtime`` 1.6.1, in a venv built at test time)
reads a ``tierkv serve`` sidecar's events in the default router mode, registered as an operator
would from the sidecar's ``tierkv_events_endpoint_info``: chains put with their token ids
through the SDK, overflowing HOST into DISK, a branch, a promotion, a delete and a namespace
clear. Every chain the sidecar holds matches in Dynamo to its full length, tier by tier as the
sidecar's own lookup counts it, and nothing deleted or cleared matches; the same after the
sidecar restarts on its disk."""
from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.support.dynamo_indexer import DynamoIndexer, Match, free_port, wait_for
from tests.support.harness import Sidecar, SidecarPool, short_socket_dir
from tests.support.kv_events import published_endpoints
from tests.support.tiny_blocks import blocks
from tierkv import Client, KVLayout, Namespace, PutDetail
from tierkv.hashing import block_hashes

BS = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=BS)  # 16 KiB a block
MODELS = {"model-a": 1, "model-b": 2, "model-c": 3}  # model -> Dynamo instance id
NAMESPACES = {model: Namespace(model, LAYOUT) for model in MODELS}


@dataclass
class Chain:
    model: str
    tokens: list[int]
    put_from: int = 0  # blocks before it are another chain's (a branch)

    @property
    def hashes(self) -> list[bytes]:
        return [bytes(h) for h in block_hashes(self.tokens, BS, seed="dynamo-e2e")]


def chains() -> tuple[dict[str, Chain], dict[str, Chain]]:
    """(the chains that stay, the chains deleted or cleared)."""
    rng = random.Random(45)

    def tokens(num_blocks: int) -> list[int]:
        return [rng.randrange(50_000) for _ in range(num_blocks * BS)]

    kept = {f"a{n}": Chain("model-a", tokens(96)) for n in range(7)}
    kept["a0-branch"] = Chain("model-a", kept["a0"].tokens[:40 * BS] + tokens(20), put_from=40)
    kept |= {f"b{n}": Chain("model-b", tokens(96)) for n in range(2)}
    gone = {"a7": Chain("model-a", tokens(96)),
            **{f"c{n}": Chain("model-c", tokens(48)) for n in range(2)}}
    return kept, gone


def put(client: Client, chain: Chain, seed: int) -> None:
    """``chain``'s blocks; a branch reads its shared prefix first, as an engine loads its hit
    before it saves the rest (a prefix left on DISK under a continuation in HOST would match
    in Dynamo only up to the prefix: docs/events.md)."""
    if chain.put_from:
        shared = chain.hashes[:chain.put_from]
        out = torch.empty((len(shared), *LAYOUT.block_shape), dtype=LAYOUT.dtype.torch_dtype)
        assert client.get_into(NAMESPACES[chain.model], shared, out) == len(shared)
    hashes = chain.hashes[chain.put_from:]
    parent = chain.hashes[chain.put_from - 1] if chain.put_from else None
    client.put(NAMESPACES[chain.model], hashes, blocks(len(hashes), seed, LAYOUT),
               detail=PutDetail(tuple(chain.tokens[chain.put_from * BS:]), parent))


def register(indexer: DynamoIndexer, sidecar: Sidecar) -> None:
    """Each namespace's endpoints, as the sidecar's metrics state them, as one Dynamo worker."""
    port = int(sidecar.ready["metrics_port"])

    def every_namespace() -> list[dict[str, str]] | None:
        # A namespace's sockets are bound when its first blocks are published (within 50 ms).
        found = published_endpoints(port)
        return found if len(found) == len(MODELS) else None

    for labels in wait_for(every_namespace):
        indexer.register(MODELS[labels["model"]], labels["endpoint"], labels["model"],
                         int(labels["block_size"]), replay_endpoint=labels["replay_endpoint"])


def assert_dynamo_matches(indexer: DynamoIndexer, client: Client, kept: dict[str, Chain],
                          gone: dict[str, Chain]) -> None:
    for name, chain in kept.items():
        detail = client.lookup_detail(NAMESPACES[chain.model], chain.hashes)
        assert detail.num_cached == len(chain.hashes), name  # the sidecar holds it all
        expected = Match(len(chain.tokens), detail.num_gpu * BS, detail.num_host * BS,
                         detail.num_disk * BS)
        seen = wait_for(functools.partial(_matching, indexer, chain, expected), what=name)
        assert seen == expected
    for name, chain in gone.items():
        assert client.lookup(NAMESPACES[chain.model], chain.hashes) == 0, name
        assert indexer.wait_matched(MODELS[chain.model], chain.tokens, chain.model, 0) is None, \
            name


def _matching(indexer: DynamoIndexer, chain: Chain, expected: Match) -> Match | None:
    """Dynamo's match of ``chain`` if it is ``expected`` yet (events arrive asynchronously)."""
    match = indexer.match(MODELS[chain.model], chain.tokens, chain.model)
    return match if match == expected else None


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[SidecarPool]:
    pool = SidecarPool(tmp_path)
    yield pool
    pool.close()


def test_dynamo_matches_every_chain_the_sidecar_holds_before_and_after_a_restart(
        tmp_path: Path, pool: SidecarPool, dynamo_indexer: DynamoIndexer) -> None:
    socket_dir = short_socket_dir()
    flags = ("--host-bytes", "8MiB", "--disk-bytes", "64MiB", "--metrics-port",
             str(free_port()), "--events-endpoint", f"ipc://{socket_dir}/ev",
             "--events-heartbeat-s", "0.5")
    disk = tmp_path / "disk"
    sidecar = pool.start(*flags, disk_path=disk)
    kept, gone = chains()
    with Client(sidecar.unix_target) as client:
        # One chain of each model first: its namespace (and its sockets) exist from then on,
        # and Dynamo is registered as an operator would, the rest arriving live.
        firsts = [kept["a0"], kept["b0"], gone["c0"]]
        for seed, chain in enumerate(firsts):
            put(client, chain, seed)
        register(dynamo_indexer, sidecar)
        rest = [chain for chain in [*kept.values(), *gone.values()] if chain not in firsts]
        for seed, chain in enumerate(rest, start=len(firsts)):
            put(client, chain, seed)  # 12 MiB for model-a alone: HOST's oldest go to DISK
        out = torch.empty((96, *LAYOUT.block_shape), dtype=LAYOUT.dtype.torch_dtype)
        assert client.get_into(NAMESPACES["model-a"], kept["a1"].hashes, out) == 96  # promoted
        client.delete(NAMESPACES["model-a"], gone["a7"].hashes)
        client.clear(namespace=NAMESPACES["model-c"])
        held = client.lookup_detail(NAMESPACES["model-a"], kept["a0"].hashes)
        assert held.num_disk > 0  # the overflow did reach DISK
        assert_dynamo_matches(dynamo_indexer, client, kept, gone)
    sidecar.stop()  # HOST is flushed to DISK; the same endpoints come back with the restart
    sidecar = pool.start(*flags, disk_path=disk)
    with Client(sidecar.unix_target) as client:
        assert_dynamo_matches(dynamo_indexer, client, kept, gone)
    log = dynamo_indexer.log_text()
    for complaint in ("token_ids too short", "Failed to decode", "UnsupportedOwnership"):
        assert complaint not in log
