"""A router's view of a tierkv sidecar's KV events, rebuilt the way a consumer would: vLLM's own
decoder (``vllm.distributed.kv_events.KVEventBatch``), an index of (topic, medium, locality) ->
hashes, and the recovery a router needs to trust it: a gap in a topic's sequence is replayed
from the ring (``[b"", start_seq, topic]`` on the replay socket), and a gap the ring no longer
covers, or a topic first met mid-stream, is resynced (``[b"", b"resync", topic]``); a jump on
the node's own topic (``kv@<node>``: the sidecar restarted) resyncs every topic."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
Where = tuple[str, str | None]  # (medium, locality)


@dataclass
class EventIndex:
    """Subscribes to ``endpoint`` (every topic starting with ``prefix``) and keeps the index.
    ``poll`` applies what arrived; ``close`` disconnects (a killed router: its index is gone)."""

    endpoint: str
    replay_endpoint: str
    prefix: bytes = b"kv@"
    index: dict[bytes, dict[Where, set[Any]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(set)))
    next_seq: dict[bytes, int] = field(default_factory=dict)
    stored: list[tuple[bytes, BlockStored]] = field(default_factory=list)
    num_replays: int = 0
    num_replayed: int = 0
    num_resyncs: int = 0
    payloads: list[bytes] = field(default_factory=list)  # every batch applied, as it came

    def __post_init__(self) -> None:
        self._ctx = zmq.Context()
        # Never wait for unsent messages at the end, even when a failed test leaves this to
        # the collector (a context's finalizer otherwise blocks on them: the test run hangs).
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.prefix)
        self._sub.connect(self.endpoint)
        self._replay = self._ctx.socket(zmq.DEALER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.connect(self.replay_endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._restating: set[bytes] = set()

    def close(self) -> None:
        self._ctx.destroy(linger=0)

    # --- the stream -------------------------------------------------------------------------

    def poll(self, duration_s: float = 1.0) -> None:
        """Apply what arrives for ``duration_s`` (longer than the publisher's heartbeat: every
        topic has said something by then)."""
        deadline = time.monotonic() + duration_s
        while (left_s := deadline - time.monotonic()) > 0:
            if self._sub.poll(max(1, int(left_s * 1000))):
                topic, seq, payload = self._sub.recv_multipart()
                self.payloads.append(payload)
                self.receive(topic, int.from_bytes(seq, "big"), payload)

    def receive(self, topic: bytes, seq: int, payload: bytes) -> None:
        """One batch off the stream, with the recovery of the module docstring."""
        expected = self.next_seq.get(topic)
        if topic.count(b"@") == 1:  # the node's own topic: heartbeats, one sequence a life
            self.next_seq[topic] = seq + 1
            if expected is not None and seq != expected:  # a restart, or missed heartbeats
                self.resync()
            return
        if expected is None:
            batch = self._decoder.decode(payload)
            if batch.events and isinstance(batch.events[0], AllBlocksCleared):
                self._apply(topic, seq, batch)  # a start or a resync: a whole state follows
            else:
                self.resync(topic)
            return
        if seq < expected:
            return  # seen already (a replay or a resync answered it)
        if seq > expected:
            self.replay(topic, expected)
            if self.next_seq.get(topic, 0) < seq:  # the ring no longer has the gap
                self.resync(topic)
            if seq < self.next_seq[topic]:
                return  # the replay (or the resync's restatement) covers this one
        self._apply(topic, seq, self._decoder.decode(payload))

    def _apply(self, topic: bytes, seq: int, batch: KVEventBatch) -> None:
        if topic in self._restating:  # the resync's answer named this batch: it restates
            assert batch.events and isinstance(batch.events[0], AllBlocksCleared), topic
            self._restating.discard(topic)
        held = self.index[topic]
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockStored):
                held[(event.medium or "", event.locality)].update(event.block_hashes)
                self.stored.append((topic, event))
            elif isinstance(event, BlockRemoved):
                held[(event.medium or "", event.locality)].difference_update(event.block_hashes)
        self.next_seq[topic] = seq + 1

    # --- recovery ---------------------------------------------------------------------------

    def _answers(self) -> Iterator[list[bytes]]:
        while True:
            assert self._replay.poll(20_000), "no answer from the replay socket"
            frames = self._replay.recv_multipart()
            if frames[2] == END_SEQ:
                return
            yield frames

    def replay(self, topic: bytes, start: int) -> None:
        """Apply ``topic``'s batches from ``start`` on that the ring still holds, while they
        follow on from what was applied."""
        self.num_replays += 1
        self._replay.send_multipart((b"", start.to_bytes(8, "big"), topic))
        for _, name, seq, payload in self._answers():
            number = int.from_bytes(seq, "big")
            if name == topic and number == self.next_seq.get(topic):
                self._apply(topic, number, self._decoder.decode(payload))
                self.num_replayed += 1

    def resync(self, topic: bytes = b"") -> None:
        """Ask for ``topic``'s whole holding (empty: every topic's): forget what is known of
        it and take the stream from the restatement's first batch on (what came before on the
        stream is skipped)."""
        self.num_resyncs += 1
        self._replay.send_multipart((b"", b"resync", topic))
        restated = set()
        for _, name, seq, _ in self._answers():
            self.index.pop(name, None)
            self.next_seq[name] = int.from_bytes(seq, "big")
            restated.add(name)
            self._restating.add(name)
        if not topic:  # every topic was restated: the others hold nothing now
            for name in [name for name in self.next_seq if name not in restated
                         and name.count(b"@") != 1]:
                self.index.pop(name, None)
                del self.next_seq[name]

    # --- what it says -----------------------------------------------------------------------

    def holding(self, topic: bytes) -> dict[Where, set[Any]]:
        """``topic``'s index: hashes by (medium, locality), empty places left out."""
        return {where: set(hashes) for where, hashes in self.index.get(topic, {}).items()
                if hashes}


def published_endpoints(metrics_port: int, timeout_s: float = 10.0) -> list[dict[str, str]]:
    """Each namespace's events endpoints as a sidecar's Prometheus endpoint states them
    (``tierkv_events_endpoint_info``: what an operator reads to register a router): one dict
    of its labels a namespace."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                timeout=timeout_s) as response:
        text = response.read().decode()
    return [dict(sample.labels) for family in text_string_to_metric_families(text)
            if family.name == "tierkv_events_endpoint_info" for sample in family.samples]
