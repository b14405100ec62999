"""The wire rules of NVIDIA Dynamo 1.6.1's KV indexer that tierkv's vLLM-format events rely on,
one test a rule, against the real indexer (``tests/support/dynamo_indexer.py``; the module fails,
with pip's reason, where its venv cannot be built).

No sidecar: each test registers an instance of its own model on a fresh PUB socket (an XPUB, so
the test knows when Dynamo's SUB has subscribed), sends hand-built batches (frames: topic, 8-byte
big-endian seq, msgpack ``[ts, events, dp_rank]``) and queries. A rule that drops something is
shown by a later event on the same socket that is kept: the listener applies in order, so once
that one matches, the dropped one was seen. A Dynamo upgrade that changes a rule fails here, at
that rule's name.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq

from tests.support.dynamo_indexer import DynamoIndexer, Match

BS = 4  # tokens a block
START = 1_700_000_000_000_000  # a first sequence number like tierkv's (µs since the epoch)
TOPIC = b"kv@rules"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_numbers = itertools.count(1)


@dataclass(frozen=True)
class Chain:
    """``blocks`` blocks of distinct tokens, with int hashes of its own."""

    blocks: int
    first_token: int
    first_hash: int

    def tokens(self, blocks: Sequence[int] | None = None) -> list[int]:
        wanted = range(self.blocks) if blocks is None else blocks
        return [self.first_token + b * BS + t for b in wanted for t in range(BS)]

    def hash(self, block: int) -> int:
        return self.first_hash + block


def chain(blocks: int = 4, high_hashes: bool = False) -> Chain:
    n = next(_numbers)
    return Chain(blocks, n * 10_000, (1 << 63 if high_hashes else 0) + (n << 32) + 1)


def stored(c: Chain, blocks: Sequence[int], medium: str = "GPU", locality: str | None = None,
           **fields: Any) -> dict[str, Any]:
    """A vLLM ``BlockStored`` of ``c``'s ``blocks`` (consecutive), its parent the block before."""
    first = blocks[0]
    event: dict[str, Any] = {
        "type": "BlockStored", "block_hashes": [c.hash(b) for b in blocks],
        "parent_block_hash": c.hash(first - 1) if first else None,
        "token_ids": c.tokens(blocks), "block_size": BS, "lora_id": None, "medium": medium,
        "lora_name": None}
    if locality is not None:
        event["locality"] = locality
    event.update(fields)
    return event


def removed(c: Chain, blocks: Sequence[int], medium: str = "GPU",
            locality: str | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": [c.hash(b) for b in blocks],
                             "medium": medium}
    if locality is not None:
        event["locality"] = locality
    return event


CLEARED = {"type": "AllBlocksCleared"}


def batch(*events: dict[str, Any]) -> bytes:
    return msgpack.packb([time.time(), list(events), 0], use_bin_type=True)  # type: ignore[no-any-return]


class Worker:
    """One registered instance: a PUB socket (and, with ``replay``, a ROUTER for Dynamo's replay
    requests) and its own model."""

    def __init__(self, indexer: DynamoIndexer, ctx: zmq.Context[zmq.Socket[bytes]],
                 replay: bool = False) -> None:
        self.indexer = indexer
        self.instance_id = indexer.next_instance_id()
        self.model = f"rules-{self.instance_id}"
        self.pub = ctx.socket(zmq.XPUB)
        endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.router: zmq.Socket[bytes] | None = None
        replay_endpoint = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            replay_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        indexer.register(self.instance_id, endpoint, self.model, BS, replay_endpoint=replay_endpoint)
        # Dynamo's SUB takes every topic: its subscription is b"\x01" (and nothing after it).
        assert self.pub.poll(10_000), f"no subscription within 10 s\n{indexer.log_tail()}"
        assert self.pub.recv() == b"\x01"
        self.seq = 0

    def send(self, *events: dict[str, Any], seq: int | None = None, topic: bytes = TOPIC) -> None:
        """One batch; ``seq`` defaults to the one after the last sent."""
        self.seq = self.seq if seq is None else seq
        self.pub.send_multipart([topic, self.seq.to_bytes(8, "big"), batch(*events)])
        self.seq += 1

    def wait_matched(self, c: Chain, tokens: int, blocks: int | None = None) -> Match | None:
        """Poll until the query of ``c``'s first ``blocks`` blocks (all) matches ``tokens``."""
        query = c.tokens(range(c.blocks if blocks is None else blocks))
        return self.indexer.wait_matched(self.instance_id, query, self.model, tokens)

    def match(self, c: Chain) -> Match | None:
        return self.indexer.match(self.instance_id, c.tokens(), self.model)


@pytest.fixture
def worker(dynamo_indexer: DynamoIndexer) -> Iterator[Any]:
    """``worker(replay=False)``: a registered ``Worker``; all are unregistered at the end."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    workers: list[Worker] = []

    def make(replay: bool = False) -> Worker:
        workers.append(Worker(dynamo_indexer, ctx, replay))
        return workers[-1]

    yield make
    for w in workers:
        dynamo_indexer.unregister(w.instance_id, w.model)
    ctx.destroy(linger=0)


FULL = 4 * BS  # a 4-block chain matched in full


def test_an_event_with_any_ownership_is_dropped_and_one_without_is_kept(worker: Any) -> None:
    w = worker()
    tierkv, kvcr, plain = chain(), chain(), chain()
    w.send(stored(tierkv, range(4), ownership="tierkv@node"), stored(kvcr, range(4), ownership="kvcr"))
    w.send(stored(plain, range(4)))
    assert w.wait_matched(plain, FULL) == Match(FULL, FULL, 0, 0)
    assert w.match(tierkv) is None
    assert w.match(kvcr) is None


def test_int_hashes_at_and_above_2_63_are_accepted(worker: Any) -> None:
    w = worker()
    high = chain(high_hashes=True)
    assert high.hash(0) >= 1 << 63
    w.send(*(stored(high, [b]) for b in range(4)))
    assert w.wait_matched(high, FULL) == Match(FULL, FULL, 0, 0)


def test_32_byte_hashes_make_the_whole_batch_undecodable(worker: Any, dynamo_indexer: DynamoIndexer) -> None:
    w = worker()
    as_bytes, beside, after = chain(), chain(), chain()
    event = stored(as_bytes, range(4))
    event["block_hashes"] = [h.to_bytes(32, "big") for h in event["block_hashes"]]
    w.send(event, stored(beside, range(4)))
    w.send(stored(after, range(4)))
    w.wait_matched(after, FULL)
    assert w.match(as_bytes) is None
    assert w.match(beside) is None  # an int-hash event of the same batch goes too
    assert "Failed to decode KvEventBatch" in dynamo_indexer.log_text()


def test_blocks_without_their_token_ids_are_dropped(worker: Any) -> None:
    w = worker()
    short, empty, after = chain(), chain(), chain()
    event = stored(short, range(4))
    event["token_ids"] = event["token_ids"][: 2 * BS + 1]  # tokens for 2 blocks and a bit
    w.send(event, stored(empty, range(4), token_ids=[]))
    w.send(stored(after, range(4)))
    w.wait_matched(after, FULL)
    assert w.match(short) == Match(2 * BS, 2 * BS, 0, 0)  # the blocks before the first short one
    assert w.match(empty) is None


def test_gpu_tier_skips_a_child_stored_before_its_parent(worker: Any) -> None:
    w = worker()
    child_first = chain()
    w.send(*(stored(child_first, [b]) for b in (3, 2, 1, 0)))
    # The head is the last event: once it matches, the children were seen (and skipped).
    assert w.wait_matched(child_first, BS) == Match(BS, BS, 0, 0)


def test_gpu_tier_matches_a_chain_stored_parent_first_one_event_a_block(worker: Any) -> None:
    w = worker()
    parent_first = chain()
    w.send(*(stored(parent_first, [b]) for b in range(4)))
    assert w.wait_matched(parent_first, FULL) == Match(FULL, FULL, 0, 0)


def test_gpu_tier_removing_a_parent_drops_its_descendants(worker: Any) -> None:
    w = worker()
    c = chain()
    w.send(stored(c, range(4)))
    w.wait_matched(c, FULL)
    w.send(removed(c, [1]))
    w.wait_matched(c, BS)
    w.send(stored(c, [1]))  # the parent back: its former children stay gone
    assert w.wait_matched(c, 2 * BS) == Match(2 * BS, 2 * BS, 0, 0)


@pytest.mark.parametrize(("medium", "locality"), [("CPU", "LOCAL"), ("STORAGE", "LOCAL")])
def test_cpu_and_disk_tiers_take_blocks_in_any_order(worker: Any, medium: str, locality: str) -> None:
    w = worker()
    child_first = chain()
    w.send(*(stored(child_first, [b], medium, locality) for b in (3, 2, 1, 0)))
    expected = Match(FULL, 0, FULL, 0) if medium == "CPU" else Match(FULL, 0, 0, FULL)
    assert w.wait_matched(child_first, FULL) == expected


def test_remote_locality_is_dropped(worker: Any) -> None:
    w = worker()
    remote, local = chain(), chain()
    w.send(stored(remote, range(4), "STORAGE", "REMOTE"))
    w.send(stored(local, range(4), "STORAGE", "LOCAL"))
    assert w.wait_matched(local, FULL) == Match(FULL, 0, 0, FULL)
    assert w.match(remote) is None


def test_all_blocks_cleared_clears_the_instance_in_every_tier(worker: Any) -> None:
    w = worker()
    gpu, cpu, disk, after = chain(), chain(), chain(), chain()
    w.send(stored(gpu, range(4)), stored(cpu, range(4), "CPU", "LOCAL"),
           stored(disk, range(4), "STORAGE", "LOCAL"))
    w.wait_matched(disk, FULL)
    assert w.match(gpu) == Match(FULL, FULL, 0, 0)
    assert w.match(cpu) == Match(FULL, 0, FULL, 0)
    w.send(CLEARED, stored(after, range(4), "CPU", "LOCAL"))
    w.wait_matched(after, FULL)
    assert (w.match(gpu), w.match(cpu), w.match(disk)) == (None, None, None)


def test_a_query_walks_gpu_then_cpu_then_disk(worker: Any) -> None:
    w = worker()
    disk_head, cpu_head, gpu_head = chain(), chain(), chain()
    w.send(stored(disk_head, range(2), "STORAGE", "LOCAL"), stored(disk_head, range(2, 4), "CPU", "LOCAL"),
           stored(cpu_head, range(2), "CPU", "LOCAL"), stored(cpu_head, range(2, 4), "STORAGE", "LOCAL"),
           stored(gpu_head, range(2)), stored(gpu_head, range(2, 4), "STORAGE", "LOCAL"))
    assert w.wait_matched(gpu_head, FULL) == Match(FULL, 2 * BS, 0, 2 * BS)
    assert w.match(cpu_head) == Match(FULL, 0, 2 * BS, 2 * BS)
    # A tail in a faster tier than its head is not reached: the disk head only.
    assert w.match(disk_head) == Match(2 * BS, 0, 0, 2 * BS)


def test_one_sequence_per_socket_drops_a_second_topics_batches_as_stale(worker: Any) -> None:
    w = worker()
    a, b, after = chain(), chain(), chain()
    w.send(stored(a, range(2), "CPU", "LOCAL"), topic=b"kv@a", seq=0)
    w.send(stored(b, range(2), "CPU", "LOCAL"), topic=b"kv@b", seq=0)  # seq 0 < the cursor, 1
    w.send(stored(a, range(2, 4), "CPU", "LOCAL"), topic=b"kv@a", seq=1)
    w.send(stored(b, range(2, 4), "CPU", "LOCAL"), topic=b"kv@b", seq=1)
    w.send(stored(after, range(4), "CPU", "LOCAL"), topic=b"kv@a", seq=2)
    w.wait_matched(after, FULL)
    assert w.match(a) == Match(FULL, 0, FULL, 0)
    assert w.match(b) is None


def test_a_first_batch_past_zero_without_a_replay_endpoint_is_applied(worker: Any,
                                                                     dynamo_indexer: DynamoIndexer) -> None:
    w = worker()
    c = chain()
    w.send(stored(c, range(2), "CPU", "LOCAL"), seq=START)
    w.wait_matched(c, 2 * BS, blocks=2)
    w.send(stored(c, range(2, 4), "CPU", "LOCAL"), seq=START + 5)  # a gap: logged, then applied
    assert w.wait_matched(c, FULL) == Match(FULL, 0, FULL, 0)
    assert "No replay endpoint configured" in dynamo_indexer.log_text()


def test_a_first_batch_past_zero_is_preceded_by_the_replay_it_asks_for(worker: Any) -> None:
    w = worker(replay=True)
    assert w.router is not None
    c = chain(5)
    ring = [(START, batch(CLEARED, stored(c, range(2), "GPU"))),
            (START + 1, batch(stored(c, range(2, 4), "GPU")))]
    w.send(stored(c, [4], "GPU"), seq=START + 2)
    assert w.router.poll(10_000), "no replay request"
    identity, empty, start = w.router.recv_multipart()
    assert (empty, int.from_bytes(start, "big")) == (b"", 0)  # from the start of the socket's sequence
    for seq, payload in ring:
        w.router.send_multipart([identity, b"", TOPIC, seq.to_bytes(8, "big"), payload])
    w.router.send_multipart([identity, b"", b"", END_SEQ, b""])
    # Blocks 0-3 came only by the replay, and in the GPU tier block 4 is kept only if its parents
    # are there first: the whole chain matches once the replay is applied, before the live batch.
    five = 5 * BS
    assert w.wait_matched(c, five, blocks=5) == Match(five, five, 0, 0)
