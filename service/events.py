"""KV events: what the sidecar holds, published for cache-aware routers in vLLM 0.32's wire
format (``vllm.distributed.kv_events``), so that an unmodified consumer decodes them with vLLM's
own classes. A ZMQ PUB socket sends three frames a message: the topic, an 8-byte big-endian
sequence number and a msgpack ``KVEventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``; a ROUTER socket replays batches still in a bounded ring and restates a
topic's whole holding on request (a resync). One thread owns every socket.

Contracts (docs/design/events.md):
1. One topic per namespace (the template must name ``{namespace}``), so one tenant's blocks are
   never on another's topic, and an ``AllBlocksCleared`` there clears exactly one namespace. In
   ``router`` mode each namespace has sockets of its own (``namespace_endpoints``), as a router
   expects of one worker of one model (Dynamo and llm-d take every topic of an endpoint), and a
   namespace's clear is said as the removal of each of its blocks.
6. Stores come parent first, one ``BlockStored`` per contiguous chain of a tier (its blocks'
   token ids, the head's parent), removals children first, in every tier and in restatements:
   each block's parent and tokens are kept with it (``tierkv.store.tokens``).
2. Each topic's sequence numbers are consecutive, from the instant this publisher started in
   microseconds since the epoch: a restart jumps ahead, which a subscriber sees as a gap.
3. Each start and each resync of a topic is one ``AllBlocksCleared`` and then ``BlockStored``
   for everything every tier holds at one instant, in order with the events before and after;
   a topic first met after the start begins with an ``AllBlocksCleared`` too. A subscriber may
   adopt a topic from any batch that begins with one, and must resync one it meets elsewhere.
4. Store records dropped because this publisher fell behind make their namespaces restated.
5. The node's own topic (``node_topic``) carries heartbeats only, one sequence a life: a jump
   there is a restart, even one no namespace survived (a subscriber then resyncs everything).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from tierkv.config import Tier
from tierkv.errors import StoreClosedError
from tierkv.keys import Namespace
from tierkv.logs import log_event
from tierkv.service.config import EventsConfig
from tierkv.store import (
    CLEARED,
    REMOTE_TIER,
    REMOVED,
    SNAPSHOT,
    STORED,
    BlockTokens,
    EventLog,
    EventRecord,
    StoredBlock,
    TieredStore,
    extra_key,
    lora_name,
    token_ids,
)
from tierkv.store import Snapshot as HoldingSnapshot

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The last frame of a replay or resync answer (vLLM's end-of-replay marker)."""
RESYNC = b"resync"
"""First frame of a resync request: ``[b"", b"resync", topic]`` (topic empty: every topic)."""

# (medium, locality) of each tier code: vLLM's GPU / CPU / STORAGE, REMOTE is remote storage.
_MEDIUM: dict[int, tuple[str, str]] = {
    Tier.GPU: ("GPU", "LOCAL"), Tier.HOST: ("CPU", "LOCAL"), Tier.DISK: ("STORAGE", "LOCAL"),
    REMOTE_TIER: ("STORAGE", "REMOTE"),
}
_RESERVED = str.maketrans({"%": "%25", "@": "%40", ":": "%3A"})
_RESERVED_IN_MODEL = str.maketrans({"%": "%25", "@": "%40"})  # "org/name" stays as routers know it


def model_name(model_id: str) -> str:
    """The model a namespace's ``model_id`` names, as routers know it: the vLLM connector's
    ``vllm:NAME@REVISION|...`` gives NAME; any other id its text before the first ``|``."""
    head = model_id.split("|", 1)[0]
    if head.startswith("vllm:"):
        head = head.removeprefix("vllm:").rsplit("@", 1)[0]
    return head


def namespace_endpoints(config: EventsConfig, namespace: Namespace) -> tuple[str, str]:
    """Where ``namespace``'s events and replays are bound in ``router`` mode: for
    ``ipc://PATH``, ``ipc://PATH-<its id's first 16 hex digits>`` and that plus ``-replay``
    (stable across restarts); for ``tcp://HOST:PORT``, free ports of HOST (the bound ones:
    ``EventPublisher.endpoints``, the log and ``tierkv_events_endpoint_info``)."""
    if config.endpoint.startswith("ipc://"):
        base = f"{config.endpoint}-{namespace.id.hex()[:16]}"
        return base, f"{base}-replay"
    host = config.endpoint.rpartition(":")[0]
    return f"{host}:0", f"{host}:0"


def topic_of(template: str, node: str, namespace: Namespace) -> str:
    """``template`` filled for ``namespace`` (``%``, ``@`` and ``:`` in a field are
    percent-encoded, ``:`` not in the model, so a field never reads as a separator)."""
    return template.format(
        node=node.translate(_RESERVED), tenant=namespace.tenant.translate(_RESERVED),
        model=model_name(namespace.model_id).translate(_RESERVED_IN_MODEL),
        namespace=namespace.id.hex())


@dataclass(eq=False)
class EventCounters:
    """Since start: events and batches published, batches replayed, resync requests answered,
    and replay or resync requests that were malformed (the store records dropped because the
    publisher fell behind are the ``EventLog``'s)."""

    events_published: int = 0
    batches_published: int = 0
    batches_replayed: int = 0
    resyncs: int = 0
    bad_requests: int = 0


@dataclass(frozen=True, slots=True)
class TopicEndpoints:
    """Where one namespace's events go (``EventPublisher.endpoints``)."""

    namespace: Namespace
    topic: str
    endpoint: str
    replay_endpoint: str


class _Topic:
    """One namespace's topic: its name, next sequence number and block size, and in ``router``
    mode its own sockets."""

    __slots__ = ("block_size", "endpoints", "first_seq", "name", "namespace", "next_seq", "pub",
                 "ring", "ring_bytes", "router", "sent_s")

    def __init__(self, name: bytes, namespace: Namespace | None, first_seq: int,
                 ring_batches: int, pub: zmq.Socket[bytes], router: zmq.Socket[bytes]) -> None:
        self.name = name
        self.namespace = namespace  # None: the node's topic
        self.block_size = namespace.layout.block_size if namespace is not None else 0
        self.pub = pub
        self.router = router
        # Where they are bound, read once here: a socket is its thread's alone, and the
        # metrics read these from theirs.
        self.endpoints = (pub.getsockopt_string(zmq.LAST_ENDPOINT),
                          router.getsockopt_string(zmq.LAST_ENDPOINT))
        self.first_seq = first_seq
        self.next_seq = first_seq
        self.sent_s = 0.0  # when its last batch went (monotonic)
        # Its last batches, for replay: a ring a topic, so one tenant's traffic never pushes
        # another's history out.
        self.ring: deque[tuple[bytes, bytes, bytes]] = deque(maxlen=ring_batches)
        self.ring_bytes = 0  # of the payloads in ``ring``

    def keep(self, frames: tuple[bytes, bytes, bytes], max_bytes: int) -> None:
        """Add a batch to the ring, dropping its oldest past ``max_bytes`` (one stays)."""
        if len(self.ring) == self.ring.maxlen:
            self.ring_bytes -= len(self.ring[0][2])
        self.ring.append(frames)
        self.ring_bytes += len(frames[2])
        while self.ring_bytes > max_bytes and len(self.ring) > 1:
            self.ring_bytes -= len(self.ring.popleft()[2])


class EventPublisher:
    """Publishes one store's ``EventLog`` (see the module docstring). ``start`` binds (a
    ``ConfigError``-free ``zmq.ZMQError`` propagates for an endpoint that cannot be bound) and
    restates every namespace; ``close`` sends what is left and unbinds."""

    def __init__(self, config: EventsConfig, store: TieredStore, events: EventLog) -> None:
        self.config = config
        self.counters = EventCounters()
        self._store = store
        self._events = events
        self._first_seq = time.time_ns() // 1000
        self._router_mode = config.mode == "router"
        self._topics: dict[bytes, _Topic] = {}  # by namespace id
        self._by_name: dict[bytes, _Topic] = {}
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # a socket left to the collector never blocks it
        self._pub, self._router = self._sockets()
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._node = _Topic(config.node_topic.format(node=config.node.translate(_RESERVED))
                            .encode(), None, self._first_seq, config.ring_batches,
                            self._pub, self._router)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierkv-events", daemon=True)
        self.endpoint = ""
        self.replay_endpoint = ""

    def _sockets(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        pub.setsockopt(zmq.LINGER, 1000)
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.SNDHWM, 0)  # a replay sends a whole ring: never cut it
        return pub, router

    def start(self) -> None:
        """Bind the sockets (``endpoint`` and ``replay_endpoint`` are then the bound ones;
        in ``router`` mode each namespace's too, ``endpoints``), record every namespace's
        holding for the first batches, and start publishing."""
        try:
            self._pub.bind(self.config.endpoint)
            self._router.bind(self.config.replay_endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            for namespace in self._store.sidecar.restate_events():
                self._topic(namespace)  # known from the start: heartbeats go there too
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._send(self._node, [])  # the node's life starts (its sequence jumped)
        self._thread.start()

    def close(self) -> None:
        """Publish what the store recorded so far and an ``AllBlocksCleared`` on every topic
        (a sidecar that stopped serves nothing: routers stop sending here until it restates
        its holding at its next start), then stop (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._ctx.destroy(linger=1000)

    @property
    def num_dropped(self) -> int:
        """Store records dropped because the publisher fell behind (since start)."""
        return self._events.num_dropped

    def endpoints(self) -> list[TopicEndpoints]:
        """Each namespace's topic and the endpoints it is published on (its own in ``router``
        mode: what an operator registers with a router as one worker of one model)."""
        return [TopicEndpoints(topic.namespace, topic.name.decode(), *topic.endpoints)
                for topic in list(self._topics.values()) if topic.namespace is not None]

    # --- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        interval_s = self.config.interval_s
        poll_ms = max(1, min(10, int(interval_s * 1000)))
        next_flush_s = time.monotonic() + interval_s
        while not self._stop.is_set():
            try:
                while ready := self._poller.poll(poll_ms):
                    for socket, _ in ready:
                        self._answer(socket, socket.recv_multipart())
                if self._events.wake.is_set() or time.monotonic() >= next_flush_s:
                    self._flush()  # (what it restated unasked needs no answer)
                    self._heartbeat()
                    next_flush_s = time.monotonic() + interval_s
            except Exception:  # a bug must not stop the events; the next flush tries again
                log.exception("publishing KV events failed")
                time.sleep(interval_s)
        try:
            self._flush()
        except Exception:
            log.exception("publishing the last KV events failed")
        for topic in self._topics.values():  # nothing is served from here on
            self._send(topic, [{"type": "AllBlocksCleared"}])

    def _flush(self, restate: Sequence[bytes] | None = ()) -> dict[bytes, int]:
        """Publish everything recorded so far, then restate the namespaces of ``restate``
        (None: every one) and those whose records were dropped; the sequence number of the
        batch each restated topic's ``AllBlocksCleared`` starts (by topic name)."""
        records, lost = self._events.take()
        try:
            if lost:
                log_event(log, logging.WARNING, "events_dropped",
                          f"KV events fell behind: {len(lost)} namespaces restated",
                          num_namespaces=len(lost), num_dropped=self._events.num_dropped)
            if lost or restate != ():
                ids = None if restate is None else [*restate, *(state.id for state in lost)]
                records += self._restate(ids)
            grouped = list(self._group(records))
        except BaseException:
            # What was taken is not lost: its namespaces are restated at the next flush.
            self._events.lose([record[2] for record in records] + lost)
            raise
        restated: dict[bytes, int] = {}
        for topic, events, snapshot_at in grouped:
            seq = self._send(topic, events, snapshot_at)
            if seq is not None:
                restated[topic.name] = seq
        return restated

    def _restate(self, namespace_ids: list[bytes] | None) -> list[EventRecord]:
        """The store's restatement of ``namespace_ids`` (None: every namespace), and what was
        recorded before it, taken from the log; a known topic whose namespace is gone (pruned)
        is cleared instead: it holds nothing."""
        restated = {namespace.id for namespace in self._store.sidecar.restate_events(namespace_ids)}
        records, lost = self._events.take()
        self._events.lose(lost)  # dropped meanwhile: restated at the next flush
        wanted = self._topics if namespace_ids is None else namespace_ids
        for namespace_id in wanted:
            topic = self._topics.get(namespace_id)
            if namespace_id not in restated and topic is not None:
                self._send(topic, [{"type": "AllBlocksCleared"}], 0)
        return records

    def _group(self, records: list[EventRecord]) -> Iterator[tuple[_Topic, list[Any], int | None]]:
        """Each topic's events, in record order but for runs of ``STORED`` (parent first,
        chains merged) and of ``REMOVED`` (children first) of one tier, and where its last
        snapshot begins."""
        by_topic: dict[bytes, _Events] = {}
        for kind, tier, state, value, entry in records:
            batch = by_topic.get(state.id)
            if batch is None:
                new = state.id not in self._topics
                batch = by_topic[state.id] = _Events(self._topic(state.namespace))
                if new:  # a topic's first batch starts from nothing: a subscriber may adopt it
                    batch.events.append({"type": "AllBlocksCleared"})
            if kind in (STORED, REMOVED):
                assert isinstance(value, bytes)
                if batch.run_kind != kind or batch.run_tier != tier:
                    self._end_run(batch)
                    batch.run_kind, batch.run_tier = kind, tier
                batch.run.append((value, entry))
                continue
            self._end_run(batch)
            if kind == CLEARED:
                if not self._router_mode:  # routers: the removals that follow say it
                    batch.events.append({"type": "AllBlocksCleared"})
            elif kind == SNAPSHOT:
                assert isinstance(value, HoldingSnapshot)
                batch.snapshots.append(len(batch.events))
                batch.events.append({"type": "AllBlocksCleared"})
                batch.events.extend(self._holding(batch.topic, state.id, value))
        for batch in by_topic.values():
            self._end_run(batch)
            yield batch.topic, batch.events, batch.snapshots[-1] if batch.snapshots else None

    def _end_run(self, batch: _Events) -> None:
        """Turn ``batch``'s run of ``STORED`` or ``REMOVED`` records into events."""
        if not batch.run:
            return
        if batch.run_kind == STORED:
            batch.events.extend(self._stored(batch.topic, batch.run_tier, batch.run))
        else:
            medium, locality = _MEDIUM[batch.run_tier]
            order = [item for chain in _chains(batch.run) for item in chain]
            event: dict[str, Any] = {
                "type": "BlockRemoved",
                "block_hashes": [self._external(block_hash) for block_hash, _ in reversed(order)],
                "medium": medium, "locality": locality}
            if self.config.ownership is not None:
                event["ownership"] = self.config.ownership
            batch.events.append(event)
        batch.run = []

    def _holding(self, topic: _Topic, namespace_id: bytes, snapshot: HoldingSnapshot
                 ) -> Iterator[dict[str, Any]]:
        for tier, entries in snapshot.by_tier.items():
            if entries:
                yield from self._stored(topic, tier, [(e.block_hash, e) for e in entries])
        if snapshot.with_remote:  # read now: every REMOTE change from here on comes after
            try:
                held = set(self._store.sidecar.remote_hashes(namespace_id))
            except StoreClosedError:  # the last flush, after the store closed: none
                held = set()
            if held:
                yield from self._stored(topic, REMOTE_TIER, [(h, None) for h in held])

    def _stored(self, topic: _Topic, tier: int, items: list[tuple[bytes, StoredBlock | None]]
                ) -> Iterator[dict[str, Any]]:
        """One ``BlockStored`` per contiguous chain of ``items`` (copies new in ``tier``),
        parent first; a chain is cut where its blocks' LoRA differs or tokens are missing
        (one event says one LoRA, and token ids for all its blocks or none)."""
        medium, locality = _MEDIUM[tier]
        with_tokens = self.config.token_ids
        for chain in _chains(items):
            start = 0
            while start < len(chain):
                head = chain[start][1]
                tokens = head.tokens if head is not None and with_tokens else None
                lora = None if tokens is None else lora_name(tokens)
                end = start + 1
                while end < len(chain):
                    entry = chain[end][1]
                    said = entry.tokens if entry is not None and with_tokens else None
                    if (said is None) != (tokens is None) or (
                            said is not None and lora_name(said) != lora):
                        break
                    end += 1
                part = chain[start:end]
                parent = head.parent if head is not None else None
                said_all = [] if tokens is None else [_said(entry) for _, entry in part]
                event: dict[str, Any] = {
                    "type": "BlockStored",
                    "block_hashes": [self._external(block_hash) for block_hash, _ in part],
                    "parent_block_hash": None if parent is None else self._external(parent),
                    "token_ids": [token for said in said_all for token in token_ids(said)],
                    "block_size": topic.block_size, "lora_id": None, "medium": medium,
                    "lora_name": lora,
                }
                if said_all:
                    extra = [extra_key(said) for said in said_all]
                    if any(key is not None for key in extra):
                        event["extra_keys"] = [None if key is None else list(key)
                                               for key in extra]
                event["locality"] = locality
                if self.config.ownership is not None:
                    event["ownership"] = self.config.ownership
                yield event
                start = end

    def _external(self, block_hash: bytes) -> bytes | int:
        """vLLM's external form of a hash: its last 8 bytes as an int (vLLM's default,
        ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the bytes."""
        if self.config.hash_form == "int":
            return int.from_bytes(block_hash[-8:], "big")
        return block_hash

    def _topic(self, namespace: Namespace) -> _Topic:
        topic = self._topics.get(namespace.id)
        if topic is None:
            name = topic_of(self.config.topic, self.config.node, namespace).encode()
            pub, router = self._pub, self._router
            if self._router_mode:
                pub, router = self._sockets()
                endpoint, replay_endpoint = namespace_endpoints(self.config, namespace)
                try:
                    pub.bind(endpoint)
                    router.bind(replay_endpoint)
                except zmq.ZMQError:
                    pub.close(linger=0)
                    router.close(linger=0)
                    raise
                self._poller.register(router, zmq.POLLIN)
            topic = _Topic(name, namespace, self._first_seq, self.config.ring_batches, pub,
                           router)
            if self._router_mode:
                endpoint, replay_endpoint = topic.endpoints
                model = model_name(namespace.model_id)
                log_event(log, logging.INFO, "events_namespace",
                          f"KV events of namespace {namespace.id.hex()[:16]} ({namespace.tenant}, "
                          f"{model}) on {endpoint}", namespace=namespace.id.hex(),
                          tenant=namespace.tenant, model=model,
                          block_size=namespace.layout.block_size, endpoint=endpoint,
                          replay_endpoint=replay_endpoint)
            self._topics[namespace.id] = topic
            self._by_name[name] = topic
        return topic

    def _send(self, topic: _Topic, events: list[Any], snapshot_at: int | None = None
              ) -> int | None:
        """Publish ``events`` on ``topic`` in batches (an empty one: a heartbeat), a new
        batch starting at ``snapshot_at`` (a restatement starts a batch of its own); the
        sequence number of that batch."""
        size = self.config.batch_events
        topic.sent_s = time.monotonic()
        cuts = [0] if snapshot_at in (None, 0) else [0, snapshot_at]
        starts = [start for cut, end in zip(cuts, [*cuts[1:], len(events)], strict=True)
                  for start in range(cut, max(cut + 1, end), size)]
        snapshot_seq = None
        for number, start in enumerate(starts):
            end = starts[number + 1] if number + 1 < len(starts) else len(events)
            chunk = events[start:end]
            # vLLM's KVEventBatch: [ts, events, data_parallel_rank] (msgspec, array-like)
            payload: bytes = msgpack.packb([time.time(), chunk, 0], use_bin_type=True,
                                           default=repr)
            seq = topic.next_seq
            topic.next_seq += 1
            if start == snapshot_at:
                snapshot_seq = seq
            frames = (topic.name, seq.to_bytes(8, "big"), payload)
            topic.pub.send_multipart(frames, copy=False)
            # Each topic's share of the ring's bytes (at least 1 MiB): bounded in all.
            topic.keep(frames, max(1 << 20, self.config.ring_bytes // (len(self._topics) + 1)))
            self.counters.events_published += len(chunk)
            self.counters.batches_published += 1
        return snapshot_seq

    def _heartbeat(self) -> None:
        """An empty batch on the node's topic and on each topic quiet for ``heartbeat_s``: a
        subscriber learns of a gap (or of this publisher's restart, whose sequences jump)
        within that time, even on a topic with nothing to say."""
        now_s = time.monotonic()
        for topic in [self._node, *self._topics.values()]:
            if now_s - topic.sent_s >= self.config.heartbeat_s:
                self._send(topic, [])

    # --- replay and resync --------------------------------------------------------------------

    def _answer(self, socket: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """One request on a ROUTER socket: ``[id, b"", start_seq]`` replays the batches of
        every topic published on that socket from ``start_seq`` on (vLLM's form);
        ``[id, b"", start_seq, topic]`` that topic's; ``[id, b"", b"resync", topic]`` restates
        ``topic`` (empty: every topic of the socket). In ``router`` mode a replay from before
        what a namespace's ring still holds restates the namespace first and replays from
        there: the answer then ends exact."""
        if len(frames) not in (3, 4) or frames[1] != b"":
            self.counters.bad_requests += 1
            return
        client, head = frames[0], frames[2]
        own = [t for t in self._topics.values() if t.router is socket]
        if head == RESYNC and len(frames) == 4:
            self._begin_resync(socket, client, frames[3], own)
            return
        if len(head) != 8:
            self.counters.bad_requests += 1
            socket.send_multipart((client, b"", b"", END_SEQ, b""))
            return
        start = int.from_bytes(head, "big")
        topics = [*([self._node] if self._node.router is socket else []), *own]
        if len(frames) == 4:
            topics = [topic for topic in topics if topic.name == frames[3]]
        if self._router_mode:
            for topic in topics:
                start = self._restate_if_lost(topic, start)
        for topic in topics:
            for name, seq_bytes, payload in topic.ring:
                if int.from_bytes(seq_bytes, "big") >= start:
                    socket.send_multipart((client, b"", name, seq_bytes, payload))
                    self.counters.batches_replayed += 1
        socket.send_multipart((client, b"", b"", END_SEQ, b""))

    def _restate_if_lost(self, topic: _Topic, start: int) -> int:
        """Where a replay of ``topic`` from ``start`` begins: there, unless batches from it on
        have left the ring, in which case the namespace is restated now and the replay begins
        with the restatement."""
        oldest = int.from_bytes(topic.ring[0][1], "big") if topic.ring else topic.next_seq
        if topic.namespace is None or max(start, topic.first_seq) >= oldest:
            return start
        self.counters.resyncs += 1
        return self._flush([topic.namespace.id]).get(topic.name, start)

    def _begin_resync(self, socket: zmq.Socket[bytes], client: bytes, name: bytes,
                      own: list[_Topic]) -> None:
        """Restate ``name``'s namespace (empty: every namespace of the socket) in-stream now,
        then answer ``[topic, seq, b"resync"]`` for each topic restated (``seq``: the batch its
        ``AllBlocksCleared`` starts) and the end marker; an unknown topic gets the marker
        only."""
        self.counters.resyncs += 1
        restate: list[bytes] | None
        if name:
            topic = self._by_name.get(name)
            restate = ([topic.namespace.id] if topic is not None and topic.namespace
                       and topic in own else [])
        else:
            restate = None if socket is self._router and not self._router_mode else [
                topic.namespace.id for topic in own if topic.namespace is not None]
        starts: dict[bytes, int] = {}
        try:
            starts = self._flush(restate)
        finally:  # answered, even when the flush failed (its namespaces are restated later)
            for topic_name, seq in starts.items():
                if not name or topic_name == name:
                    socket.send_multipart((client, b"", topic_name, seq.to_bytes(8, "big"),
                                           RESYNC))
            socket.send_multipart((client, b"", b"", END_SEQ, b""))


class _Events:
    """One topic's events in one flush, with the run of records being gathered."""

    __slots__ = ("events", "run", "run_kind", "run_tier", "snapshots", "topic")

    def __init__(self, topic: _Topic) -> None:
        self.topic = topic
        self.events: list[Any] = []
        self.snapshots: list[int] = []
        self.run: list[tuple[bytes, StoredBlock | None]] = []
        self.run_kind = -1
        self.run_tier = -1


def _said(entry: StoredBlock | None) -> BlockTokens:
    """The tokens of a block known to have them."""
    assert entry is not None and entry.tokens is not None
    return entry.tokens


def _chains(items: list[tuple[bytes, StoredBlock | None]]) -> list[list[tuple[bytes, StoredBlock | None]]]:
    """``items`` (block hashes with their entries) as chains, parent first: each block of a
    chain is the child of the one before; a chain starts at a block whose parent is not among
    ``items``, or at a second child of a block (after the chain through its first). Every item
    is in exactly one chain, in an order where each block comes after its parent."""
    index = {block_hash: number for number, (block_hash, _) in enumerate(items)}
    children: dict[int, list[int]] = {}
    roots: list[int] = []
    for number, (block_hash, entry) in enumerate(items):
        parent = entry.parent if entry is not None else None
        at = index.get(parent) if parent is not None and parent != block_hash else None
        if at is None:
            roots.append(number)
        else:
            children.setdefault(at, []).append(number)
    chains: list[list[tuple[bytes, StoredBlock | None]]] = []
    seen = [False] * len(items)
    pending = roots[::-1]
    while True:
        if not pending:  # what no root reaches (a cycle, which chained hashes never make)
            pending = [number for number, done in enumerate(seen) if not done][:1]
            if not pending:
                return chains
        number = pending.pop()
        if seen[number]:
            continue
        chain = []
        while True:
            seen[number] = True
            chain.append(items[number])
            kids = [kid for kid in children.get(number, ()) if not seen[kid]]
            if not kids:
                break
            pending.extend(kids[:0:-1])
            number = kids[0]
        chains.append(chain)
