"""KV events (``tierkv.service.events``) against the store they describe: a subscriber decoding
with vLLM's own classes (``tests/support/kv_events.py``) rebuilds, topic by topic, what every
tier holds, and after a random workload (puts with and without token ids, reads that promote,
evictions HOST -> DISK -> REMOTE on a real ``redis-server``, deletes, clears, a restart) its
index equals the store's holding tier by tier; the same after the subscriber is killed and
comes back (replay), and after it missed more than the ring holds (resync)."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import store_config
from tests.support.kv_events import EventIndex
from tests.support.redis_cluster import RedisServer
from tests.support.tiny_blocks import TINY_LAYOUT, blocks, keys
from tierkv import Namespace, PutDetail, Tier, WritePolicy
from tierkv.config import RemoteTierConfig
from tierkv.service.config import EventsConfig
from tierkv.service.events import EventPublisher, topic_of
from tierkv.store import EventLog, TieredStore

NODE = "node-a"
WHERE = {Tier.GPU: ("GPU", "LOCAL"), Tier.HOST: ("CPU", "LOCAL"),
         Tier.DISK: ("STORAGE", "LOCAL")}
REMOTE_WHERE = ("STORAGE", "REMOTE")
NAMESPACES = [Namespace("model-a", TINY_LAYOUT, tenant="alice"),
              Namespace("model-a", TINY_LAYOUT, tenant="bob")]


def external(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")


class Sidecar:
    """A store with an event publisher on ``ipc`` sockets under ``root`` (restartable)."""

    def __init__(self, root: Path, remote_url: str, max_pending: int = 1_000_000,
                 **events: Any) -> None:
        self.config = dataclasses.replace(
            store_config(root, host_blocks=8, disk_blocks=12),
            remote=RemoteTierConfig.from_url(remote_url))
        # tierkv's own mode, every namespace on one endpoint: what this subscriber reads
        # (the router mode is tested against Dynamo's indexer, test_dynamo_events.py).
        events = {"interval_s": 0.01, "heartbeat_s": 0.2, "mode": "tierkv",
                  "ownership": f"tierkv@{NODE}", **events}
        self.events_config = EventsConfig(f"ipc://{root}/events", node=NODE,
                                          max_pending=max_pending, **events)
        self.store: TieredStore
        self.publisher: EventPublisher
        self.start()

    def start(self) -> None:
        log = EventLog(self.events_config.max_pending)
        self.store = TieredStore(self.config, events=log)
        for namespace in NAMESPACES:
            self.store.register(namespace)
        self.publisher = EventPublisher(self.events_config, self.store, log)
        self.publisher.start()

    def stop(self) -> None:
        self.store.close(flush=True)
        self.publisher.close()

    def settle(self) -> None:
        self.store.wait_for_background(10)
        assert self.store.flush_remote(10)

    def truth(self, namespace: Namespace) -> dict[tuple[str, str | None], set[int]]:
        held = {WHERE[tier]: {external(h) for h in hashes}
                for tier, hashes in self.store.sidecar.blocks_by_tier(namespace).items()}
        held[REMOTE_WHERE] = {external(h) for h in self.store.sidecar.remote_hashes(namespace.id)}
        return {where: hashes for where, hashes in held.items() if hashes}

    def subscriber(self) -> EventIndex:
        return EventIndex(self.publisher.endpoint, self.publisher.replay_endpoint)


def topic(namespace: Namespace) -> bytes:
    return topic_of(EventsConfig("ipc:///x").topic, NODE, namespace).encode()


def assert_index_is_truth(index: EventIndex, sidecar: Sidecar) -> None:
    sidecar.settle()
    index.poll()
    for namespace in NAMESPACES:
        assert index.holding(topic(namespace)) == sidecar.truth(namespace), namespace.tenant


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture
def sidecar(tmp_path: Path, redis_url: str) -> Iterator[Sidecar]:
    import redis

    redis.Redis.from_url(redis_url).flushall()
    sidecar = Sidecar(Path(tmp_path), redis_url)
    yield sidecar
    sidecar.stop()


def random_workload(sidecar: Sidecar, rng: random.Random, num_steps: int) -> None:
    """Puts (some written through, some with token ids), reads, deletes and clears over a pool
    of 40 hashes a namespace: HOST holds 8 blocks and DISK 12, so blocks go on to REMOTE."""
    store = sidecar.store
    pool = keys(40)
    for _ in range(num_steps):
        namespace = rng.choice(NAMESPACES)
        start = rng.randrange(len(pool) - 4)
        chain = pool[start : start + rng.randint(1, 4)]
        action = rng.random()
        if action < 0.55:
            detail = None
            if rng.random() < 0.5:
                tokens = tuple(rng.randrange(1000) for _ in range(len(chain) * 4))
                detail = PutDetail(tokens, pool[start - 1] if start else None)
            policy = WritePolicy.WRITE_THROUGH if rng.random() < 0.3 else None
            store.put(namespace, chain, blocks(len(chain), seed=start), write_policy=policy,
                      detail=detail)
        elif action < 0.8:
            store.get(namespace, chain)
        elif action < 0.95:
            store.delete(namespace, chain)
        else:
            store.clear(namespace=namespace)


def test_index_follows_a_random_workload_and_a_restart(sidecar: Sidecar) -> None:
    index = sidecar.subscriber()
    index.resync()  # a router that starts after the sidecar asks for everything once
    rng = random.Random(28)
    for _ in range(3):
        random_workload(sidecar, rng, 60)
        assert_index_is_truth(index, sidecar)
    assert any(index.holding(topic(ns)).get(REMOTE_WHERE) for ns in NAMESPACES)
    # A restart: HOST is flushed to DISK, the new publisher's sequence jumps ahead and starts
    # with every namespace restated; the subscriber that stayed sees the jump and recovers.
    sidecar.stop()
    sidecar.start()
    random_workload(sidecar, rng, 30)
    assert_index_is_truth(index, sidecar)
    assert index.num_resyncs >= 2 or index.num_replays >= 1
    index.close()


def test_a_killed_subscriber_replays_what_it_missed(sidecar: Sidecar) -> None:
    index = sidecar.subscriber()
    index.resync()
    random_workload(sidecar, random.Random(1), 40)
    assert_index_is_truth(index, sidecar)
    next_seq = dict(index.next_seq)
    index.close()  # killed: what is published now reaches nobody
    random_workload(sidecar, random.Random(2), 40)
    sidecar.settle()
    back = sidecar.subscriber()
    back.index, back.next_seq = index.index, next_seq  # its state as it was when it died
    for name, start in next_seq.items():
        back.replay(name, start)
    assert back.num_replayed > 0 and back.num_resyncs == 0
    assert_index_is_truth(back, sidecar)
    back.close()


def test_a_gap_past_the_ring_is_resynced(tmp_path: Path, redis_url: str) -> None:
    sidecar = Sidecar(tmp_path, redis_url, ring_batches=2)
    try:
        index = sidecar.subscriber()
        index.resync()
        random_workload(sidecar, random.Random(3), 20)
        assert_index_is_truth(index, sidecar)
        next_seq = dict(index.next_seq)
        index.close()
        for step in range(6):  # many batches, each flushed alone: the ring keeps 2
            random_workload(sidecar, random.Random(10 + step), 5)
            sidecar.settle()
            time.sleep(0.05)  # published in a batch of its own
        back = sidecar.subscriber()
        back.index, back.next_seq = index.index, next_seq
        random_workload(sidecar, random.Random(99), 10)  # the stream goes on: a gap is seen
        assert_index_is_truth(back, sidecar)
        assert back.num_resyncs >= 1
        assert sidecar.publisher.counters.resyncs >= 1
        back.close()
    finally:
        sidecar.stop()


def test_token_ids_and_parents_reach_the_event(sidecar: Sidecar) -> None:
    index = sidecar.subscriber()
    index.resync()
    namespace = NAMESPACES[0]
    chain = keys(3, start=100)
    tokens = tuple(range(500, 512))
    sidecar.store.put(namespace, chain, blocks(3), detail=PutDetail(tokens, keys(1, 99)[0],
                                                                    lora_name="adapter"))
    assert_index_is_truth(index, sidecar)
    # One event for the chain, parent first, as vLLM's publisher says a chain: every block's
    # hash in order, the head's parent, all the tokens.
    [event] = [event for name, event in index.stored
               if name == topic(namespace) and event.medium == "CPU"
               and external(chain[0]) in event.block_hashes]
    assert event.block_hashes == [external(block_hash) for block_hash in chain]
    assert event.token_ids == list(tokens)
    assert event.parent_block_hash == external(keys(1, 99)[0])
    assert event.block_size == 4 and event.lora_name == "adapter"
    assert event.ownership == f"tierkv@{NODE}"
    index.close()


def test_token_ids_off_publishes_none(tmp_path: Path, redis_url: str) -> None:
    sidecar = Sidecar(tmp_path, redis_url, token_ids=False)
    try:
        index = sidecar.subscriber()
        index.resync()
        sidecar.store.put(NAMESPACES[0], keys(2), blocks(2),
                          detail=PutDetail(tuple(range(8))))
        assert_index_is_truth(index, sidecar)
        assert index.stored and all(event.token_ids == [] for _, event in index.stored)
        index.close()
    finally:
        sidecar.stop()


def test_records_dropped_while_the_publisher_lags_are_restated(tmp_path: Path,
                                                               redis_url: str) -> None:
    # 6 records wait at most; a batch goes every 0.3 s: a burst of puts overflows it.
    sidecar = Sidecar(tmp_path, redis_url, max_pending=6, interval_s=0.3)
    try:
        index = sidecar.subscriber()
        index.resync()
        random_workload(sidecar, random.Random(5), 40)
        assert_index_is_truth(index, sidecar)
        assert sidecar.publisher.num_dropped > 0
    finally:
        sidecar.stop()


def test_two_tenants_same_hashes_two_topics(sidecar: Sidecar) -> None:
    index = sidecar.subscriber()
    index.resync()
    alice, bob = NAMESPACES
    chain = keys(3, start=200)
    sidecar.store.put(alice, chain, blocks(3))
    sidecar.store.put(bob, chain, blocks(3))
    sidecar.store.delete(bob, chain)
    assert_index_is_truth(index, sidecar)
    assert index.holding(topic(alice)) == {("CPU", "LOCAL"): {external(h) for h in chain}}
    assert index.holding(topic(bob)) == {}
    assert b":alice:" in topic(alice) and b":bob:" in topic(bob)
    index.close()


@pytest.mark.parametrize("frames", [
    [b""], [b"", b"x" * 9], [b"", b"\x00" * 8, b"no-such-topic"], [b"", b"resync", b"nope"],
    [b"junk", b"more", b"frames", b"here", b"!"],
])
def test_bad_replay_requests_are_answered_or_dropped(sidecar: Sidecar,
                                                     frames: list[bytes]) -> None:
    import zmq

    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(sidecar.publisher.replay_endpoint)
        dealer.send_multipart(frames)
        if dealer.poll(2000):  # an answer, if any, ends with the end marker
            assert dealer.recv_multipart()[-2:] == [(-1).to_bytes(8, "big", signed=True), b""]
    finally:
        context.destroy(linger=0)
    # The publisher goes on: a put still reaches a subscriber.
    index = sidecar.subscriber()
    index.resync()
    sidecar.store.put(NAMESPACES[0], keys(1, start=300), blocks(1))
    assert_index_is_truth(index, sidecar)
    index.close()


def test_a_corrupt_remote_record_is_removed(tmp_path: Path, redis_url: str) -> None:
    import redis

    from tierkv.tiers.remote_keys import remote_key

    redis.Redis.from_url(redis_url).flushall()
    writer = Sidecar(tmp_path / "a", redis_url)
    chain = keys(3, start=400)
    writer.store.put(NAMESPACES[0], chain, blocks(3), write_policy=WritePolicy.WRITE_THROUGH)
    writer.settle()
    writer.stop()
    reader = Sidecar(tmp_path / "b", redis_url)  # a node that never saw them: REMOTE only
    try:
        index = reader.subscriber()
        index.resync()
        assert_index_is_truth(index, reader)
        assert index.holding(topic(NAMESPACES[0])) == {
            REMOTE_WHERE: {external(h) for h in chain}}
        raw = NAMESPACES[0].id + chain[1]
        client = redis.Redis.from_url(redis_url)
        record = bytearray(client.get(remote_key(raw)) or b"")
        record[-1] ^= 0x01  # the payload's last byte
        client.set(remote_key(raw), bytes(record))
        assert len(reader.store.get(NAMESPACES[0], chain)) == 1  # the chain stops before it
        assert client.exists(remote_key(raw)) == 0
        assert_index_is_truth(index, reader)
        assert external(chain[1]) not in index.holding(topic(NAMESPACES[0]))[REMOTE_WHERE]
        index.close()
    finally:
        reader.stop()


def test_a_write_through_during_a_remote_delete_is_said_in_order(
        sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow delete in Redis and a write of the same key offered meanwhile, whose answer
    comes late: Redis ends with the key (written after the delete), and so does the index."""
    import threading

    from tierkv.tiers.remote import RemoteTier

    put, delete = RemoteTier.put, RemoteTier.delete

    def slow_answer(self: RemoteTier, *args: Any, **kwargs: Any) -> Any:
        stored = put(self, *args, **kwargs)
        time.sleep(0.3)
        return stored

    def slow_delete(self: RemoteTier, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)
        return delete(self, *args, **kwargs)

    namespace, chain = NAMESPACES[0], keys(2, start=500)
    sidecar.store.put(namespace, chain, blocks(2), write_policy=WritePolicy.WRITE_THROUGH)
    sidecar.settle()
    index = sidecar.subscriber()
    index.resync()
    monkeypatch.setattr(RemoteTier, "put", slow_answer)
    monkeypatch.setattr(RemoteTier, "delete", slow_delete)
    deleting = threading.Thread(target=sidecar.store.delete, args=(namespace, chain))
    deleting.start()
    time.sleep(0.1)  # its delete is on its way to Redis
    sidecar.store.put(namespace, chain, blocks(2), write_policy=WritePolicy.WRITE_THROUGH)
    deleting.join()
    assert_index_is_truth(index, sidecar)
    index.close()


def test_a_replay_longer_than_zmqs_high_water_mark_arrives_whole(tmp_path: Path,
                                                                  redis_url: str) -> None:
    # Heartbeats every millisecond fill each topic's ring (the node's and two namespaces')
    # with 2,500 batches: past ZMQ's default high-water mark of 1,000 messages.
    sidecar = Sidecar(tmp_path, redis_url, interval_s=0.001, heartbeat_s=0.001,
                      ring_batches=2500)
    try:
        sidecar.store.put(NAMESPACES[0], keys(1), blocks(1))
        name = topic(NAMESPACES[0])
        deadline = time.monotonic() + 60
        while sidecar.publisher.counters.batches_published < 3 * 2600:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        index = sidecar.subscriber()
        index.next_seq[name] = 0
        index.replay(name, 0)  # everything the ring has: 2,500 batches and the end marker
        assert index.num_replayed == 0  # none follows on from 0: the ring starts later
        assert sidecar.publisher.counters.batches_replayed == 2500
        index.close()
    finally:
        sidecar.stop()


def test_batches_are_byte_for_byte_what_vllms_msgspec_encodes(sidecar: Sidecar) -> None:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    index = sidecar.subscriber()
    index.resync()
    sidecar.store.put(NAMESPACES[0], keys(3, start=600), blocks(3),
                      detail=PutDetail(tuple(range(12)), keys(1, 599)[0], "lora-x",
                                       (("lora-x", "salt"), None, ("lora-x",))))
    sidecar.store.delete(NAMESPACES[0], keys(2, start=600))
    assert_index_is_truth(index, sidecar)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    assert any(decoder.decode(payload).events for payload in index.payloads)
    for payload in index.payloads:
        assert encoder.encode(decoder.decode(payload)) == payload
    index.close()


def test_topics_name_the_model_as_routers_know_it() -> None:
    from tierkv.service.events import model_name

    connector_id = "vllm:meta-llama/Llama-3.1-8B@main|config=ab|weights=bf16/none"
    assert model_name(connector_id) == "meta-llama/Llama-3.1-8B"
    assert model_name("chat-model|group=1") == "chat-model"
    namespace = Namespace(connector_id, TINY_LAYOUT, tenant="team:a@b")
    name = topic_of("kv@{node}:{tenant}:{namespace}@{model}", "node:1", namespace)
    assert name == f"kv@node%3A1:team%3Aa%40b:{namespace.id.hex()}@meta-llama/Llama-3.1-8B"
    assert name.count("@") == 2
