"""The router mode's events read by vLLM's own ``MockSubscriber`` (vLLM 0.32.0's
``tests/distributed/conftest.py``, from its sdist at test time): a namespace's sockets carry its
topic alone, in one consecutive sequence; a replay after a gap returns what the subscriber
missed, numbered as it expects; a replay from before the ring restates first. Applying the
batches in order as vLLM's consumers do rebuilds exactly what the store holds."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from tests.support.harness import store_config
from tests.support.tiny_blocks import TINY_LAYOUT, blocks, keys
from tests.support.vllm_sdist import vllm_mock_subscriber
from tierkv import Namespace, PutDetail, Tier
from tierkv.service.config import EventsConfig
from tierkv.service.events import EventPublisher, namespace_endpoints, topic_of
from tierkv.store import EventLog, TieredStore

NODE = "node-r"
WHERE = {Tier.HOST: "CPU", Tier.DISK: "STORAGE"}
NAMESPACES = [Namespace("model-a", TINY_LAYOUT, tenant="alice"),
              Namespace("model-b", TINY_LAYOUT, tenant="alice")]


class Sidecar:
    """A store (8 HOST blocks, 24 DISK) with a router-mode publisher on ``ipc`` under ``root``."""

    def __init__(self, root: Path, **events: Any) -> None:
        self.config = store_config(root, host_blocks=8, disk_blocks=24)
        self.events_config = EventsConfig(f"ipc://{root}/ev", node=NODE, interval_s=0.01,
                                          heartbeat_s=1.0, **events)
        log = EventLog()
        self.store = TieredStore(self.config, events=log)
        for namespace in NAMESPACES:
            self.store.register(namespace)
        self.publisher = EventPublisher(self.events_config, self.store, log)
        self.publisher.start()

    def subscriber(self, namespace: Namespace) -> Any:
        endpoint, replay = namespace_endpoints(self.events_config, namespace)
        topic = topic_of(self.events_config.topic, NODE, namespace)
        subscriber = vllm_mock_subscriber()(endpoint, replay, topic, decode_type=KVEventBatch)
        # Past ZMQ's slow join: a heartbeat (every 1 s on a quiet topic) arrives.
        assert subscriber.receive_one(timeout=5000) is not None
        return subscriber

    def truth(self, namespace: Namespace) -> dict[str, set[int]]:
        self.store.wait_for_background(10)
        time.sleep(0.1)  # published (every 10 ms)
        held = self.store.sidecar.blocks_by_tier(namespace)
        return {WHERE[tier]: {external(h) for h in hashes}
                for tier, hashes in held.items() if hashes and tier in WHERE}

    def close(self) -> None:
        self.store.close(flush=False)
        self.publisher.close()


def external(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")


def apply(batches: list[tuple[int, Any]]) -> dict[str, set[int]]:
    """What a vLLM consumer holds after applying ``batches`` in sequence order (duplicates of a
    sequence number once)."""
    held: dict[str, set[int]] = {}
    for _, batch in sorted(dict(batches).items()):
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockStored):
                held.setdefault(event.medium, set()).update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.setdefault(event.medium, set()).difference_update(event.block_hashes)
    return {medium: hashes for medium, hashes in held.items() if hashes}


def drain(subscriber: Any) -> None:
    while subscriber.receive_one(timeout=300) is not None:
        pass


def workload(store: TieredStore, start: int) -> None:
    """Chains in both namespaces (more than HOST holds: some go to DISK), a delete."""
    for number, namespace in enumerate(NAMESPACES * 3):
        chain = keys(4, start=start + 10 * number)
        store.put(namespace, chain, blocks(4, seed=number),
                  detail=PutDetail(tuple(range(4 * 4)), None))
    store.delete(NAMESPACES[0], keys(1, start=start))


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    sidecar = Sidecar(tmp_path)
    yield sidecar
    sidecar.close()


def test_a_namespace_socket_carries_its_topic_alone_in_one_consecutive_sequence(
        sidecar: Sidecar) -> None:
    subscriber = sidecar.subscriber(NAMESPACES[0])
    workload(sidecar.store, 0)
    truth = sidecar.truth(NAMESPACES[0])
    drain(subscriber)  # MockSubscriber asserts each message's topic is its own
    seqs = [seq for seq, _ in subscriber.received_msgs]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    # The live stream alone holds what was put after it joined; the replay from 0 (what a
    # router that joins late asks first) holds it all, the start's restatement included.
    subscriber.request_replay(0)
    replayed = subscriber.receive_replay()
    assert replayed and [seq for seq, _ in replayed] == list(
        range(replayed[0][0], replayed[0][0] + len(replayed)))
    assert apply(replayed + subscriber.received_msgs) == truth
    assert truth["CPU"] and truth["STORAGE"]  # both tiers took part
    subscriber.close()


def test_a_subscriber_that_missed_batches_replays_them_and_rebuilds_the_index(
        sidecar: Sidecar) -> None:
    subscriber = sidecar.subscriber(NAMESPACES[0])
    subscriber.request_replay(0)
    got = subscriber.receive_replay()
    drain(subscriber)
    got += subscriber.received_msgs
    last = max(seq for seq, _ in got)
    subscriber.close()  # gone while the store changes
    workload(sidecar.store, 100)
    back = sidecar.subscriber(NAMESPACES[0])  # its first batch shows the gap
    first = back.received_msgs[0][0]
    assert first > last + 1
    back.request_replay(last + 1)
    missed = back.receive_replay()
    assert [seq for seq, _ in missed][:first - last - 1] == list(range(last + 1, first))
    drain(back)
    assert apply(got + missed + back.received_msgs) == sidecar.truth(NAMESPACES[0])
    back.close()


def test_a_replay_from_before_the_ring_restates_the_namespace_first(tmp_path: Path) -> None:
    sidecar = Sidecar(tmp_path, ring_batches=2)
    try:
        subscriber = sidecar.subscriber(NAMESPACES[1])
        for step in range(4):  # batches of their own: the ring keeps 2
            workload(sidecar.store, 200 + 100 * step)
            time.sleep(0.05)
        truth = sidecar.truth(NAMESPACES[1])
        subscriber.request_replay(0)
        replayed = subscriber.receive_replay()
        assert isinstance(replayed[0][1].events[0], AllBlocksCleared)
        assert apply(replayed) == truth
        assert sidecar.publisher.counters.resyncs >= 1
        subscriber.close()
    finally:
        sidecar.close()
