"""The P/D handoff through the connector's halves against a real server, without an engine
(vLLM's calls played by hand, as in ``test_vllm_sides.py``): roles, the producer's params and
ticket, the consumer's wait, what it refuses, and the last saves of a request that finished in
its load step."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.integrations.vllm.test_vllm_sides import (
    BLOCK,
    GEOMETRY,
    NAMESPACE,
    caches,
    put_prefix,
    request,
    step,
    tokens,
)
from tests.support.harness import BackgroundServer
from tierkv import Client, ConfigError, block_hashes
from tierkv.integrations.vllm.handoff import (
    TICKET_NAMESPACE,
    Handoff,
    TicketStatus,
    namespaces_digest,
)
from tierkv.integrations.vllm.scheduler import SchedulerSide
from tierkv.integrations.vllm.settings import ConnectorSettings
from tierkv.integrations.vllm.worker import WorkerSide

FINISHED = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
ABORTED = SimpleNamespace(name="FINISHED_ABORTED")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BackgroundServer]:
    background = BackgroundServer(tmp_path, tokens={}, host_bytes=64 * 1024 * 1024)
    yield background
    background.close()


def settings(target: str, role: str, **fields: Any) -> ConnectorSettings:
    return ConnectorSettings(address=target, role=role, **fields)


def finishing(req: SimpleNamespace, computed: int, *, remote_decode: bool = True,
              status: SimpleNamespace = FINISHED) -> SimpleNamespace:
    """``req`` as vLLM hands it to ``request_finished``."""
    req.num_computed_tokens = computed
    req.status = status
    req.kv_transfer_params = {"do_remote_decode": True} if remote_decode else None
    return req


def asking(req: SimpleNamespace, params: dict[str, Any] | None) -> SimpleNamespace:
    req.kv_transfer_params = params
    return req


class Producer:
    """A producer's two halves on one server."""

    def __init__(self, target: str, **fields: Any) -> None:
        self.side = SchedulerSide(settings(target, "kv_producer", **fields), GEOMETRY, NAMESPACE)
        self.worker = WorkerSide(settings(target, "kv_producer", **fields), GEOMETRY, tp_rank=0)
        self.worker.register(caches())

    def prefill(self, req_id: str, prompt: list[int], *, asked_at_start: bool = True
                ) -> tuple[dict[str, Any] | None, Any]:
        """One step computing the whole prompt, then the request finishing (max_tokens=1);
        returns its params and the metadata that carries its ticket, not yet run by the
        worker: the prompt's step when vLLM's request carried ``do_remote_decode`` from its
        start (as the OpenAI server's do), else the step after it finished."""
        req = request(req_id, prompt)
        if asked_at_start:
            req.kv_transfer_params = {"do_remote_decode": True}
        assert self.side.num_matched_tokens(req, 0) == 0  # a producer offers nothing
        ids = list(range(1, len(prompt) // BLOCK + 2))
        self.side.after_alloc(req, (ids,), 0)
        meta = self.side.build(step(new=[(req_id, ids, 0, len(prompt))]))
        if not asked_at_start:
            assert not meta.tickets
            self.run(meta)
        delay, params = self.side.finished(finishing(req, len(prompt)), (ids,))
        assert not delay  # every block was saved in its step
        after = self.side.build(step())
        if asked_at_start:
            assert not after.tickets  # one ticket, in the prompt's step
            return params, meta
        return params, after

    def run(self, meta: Any) -> None:
        self.worker.before_step()
        self.worker.save(meta)
        assert self.worker.flush(30.0)

    def close(self) -> None:
        self.side.close()
        self.worker.close()


def test_roles_are_checked_at_start_in_one_line() -> None:
    for extra, role, message in (
        ({}, "kv_sender", "kv_role='kv_sender'; choose one of"),
        ({}, None, "kv_role=None"),
        ({"load_mode": "async"}, "kv_producer", "a kv_producer never loads"),
        ({"write_policy": "write_through"}, "kv_consumer", "a kv_consumer never saves"),
        ({"pd_wait_timeout_s": 0}, "kv_consumer", "pd_wait_timeout_s must be a positive"),
    ):
        with pytest.raises(ConfigError, match=message) as caught:
            ConnectorSettings.from_extra_config(extra, role=role)
        assert "\n" not in str(caught.value)
    consumer = ConnectorSettings.from_extra_config({"pd_wait_timeout_s": 2.5}, role="kv_consumer")
    assert (consumer.loads, consumer.saves, consumer.pd_wait_timeout_s) == (True, False, 2.5)
    producer = ConnectorSettings.from_extra_config({}, role="kv_producer")
    assert (producer.loads, producer.saves) == (False, True)


def test_params_round_trip_and_malformed_ones_are_named() -> None:
    handoff = Handoff.new("ab" * 16, 3 * BLOCK, bytes(range(32)))
    assert Handoff.from_params(handoff.to_params()) == handoff
    assert Handoff.from_params(None) is None
    assert Handoff.from_params({"do_remote_decode": True}) is None
    good = handoff.to_params()["tierkv"]
    for bad in ({**good, "v": 2}, {**good, "ticket": "xyz"}, {**good, "num_tokens": 0},
                {**good, "num_tokens": True}, {**good, "last_block_hash": "00"}, "text"):
        with pytest.raises(ValueError, match="handoff"):
            Handoff.from_params({"tierkv": bad})
    # A record of another handoff, rank, layout or version never reads as DONE.
    record = handoff.record(0, TicketStatus.DONE)
    assert handoff.status_of(record[0], 0) is TicketStatus.DONE
    assert handoff.status_of(record[0], 1) is TicketStatus.FAILED
    other = Handoff(handoff.ticket, handoff.namespaces, 2 * BLOCK, handoff.last_block_hash)
    assert other.status_of(record[0], 0) is TicketStatus.FAILED
    raw = record.view(-1).view(torch.uint8)
    for index in range(raw.numel()):  # a bit flipped anywhere, the status byte too
        damaged = raw.clone()
        damaged[index] ^= 0x40
        status = handoff.status_of(damaged.view(record.dtype).view(record.shape)[0], 0)
        assert status is TicketStatus.FAILED, index


@pytest.mark.parametrize("asked_at_start", [True, False], ids=["prompt-step", "after-finish"])
def test_producer_answers_params_and_writes_its_ticket_after_its_saves(
    server: BackgroundServer, asked_at_start: bool,
) -> None:
    target = server.served.unix_target
    prompt = tokens(5 * BLOCK + 7, seed=3)
    hashes = [bytes(h) for h in block_hashes(prompt, BLOCK)]
    put_prefix(target, prompt, 2)  # held already: looked up, not offered, not saved again
    producer = Producer(target)
    consumer = SchedulerSide(settings(target, "kv_consumer", pd_wait_timeout_s=30.0),
                             GEOMETRY, NAMESPACE)
    try:
        params, ticket_step = producer.prefill("p", prompt, asked_at_start=asked_at_start)
        assert params is not None
        handoff = Handoff.from_params(params)
        assert handoff is not None
        assert handoff.num_tokens == 5 * BLOCK and handoff.last_block_hash == hashes[4]
        assert handoff.namespaces == namespaces_digest((NAMESPACE,))
        assert [t.req_id for t in ticket_step.tickets] == ["p"]
        # The consumer asks before the ticket is written: "ask again later".
        decode = asking(request("d", prompt), params)
        assert consumer.num_matched_tokens(decode, 0) is None
        producer.run(ticket_step)
        with Client(target) as client:
            assert client.lookup(NAMESPACE, hashes) == 5
            found = client.get(TICKET_NAMESPACE, [handoff.key(0)])
            assert handoff.status_of(found[0], 0) is TicketStatus.DONE
        time.sleep(0.01)  # past the poll interval
        assert consumer.num_matched_tokens(decode, 0) == 5 * BLOCK
        assert consumer.handoffs == {"done": 1, "failed": 0, "timed_out": 0, "refused": 0}
        # Without do_remote_decode: no params, no ticket.
        plain = request("q", prompt)
        assert producer.side.finished(finishing(plain, len(prompt), remote_decode=False)) == (
            False, None)
    finally:
        producer.close()
        consumer.close()


def test_a_dropped_save_fails_the_ticket_and_the_consumer_stops_waiting(
    server: BackgroundServer,
) -> None:
    target = server.served.unix_target
    prompt = tokens(6 * BLOCK + 1, seed=4)
    producer = Producer(target, save_queue_bytes=2 * GEOMETRY.layout.bytes_per_block)
    consumer = SchedulerSide(settings(target, "kv_consumer", pd_wait_timeout_s=30.0),
                             GEOMETRY, NAMESPACE)
    try:
        params, ticket_step = producer.prefill("p", prompt)
        producer.run(ticket_step)
        assert producer.worker.counters.blocks_dropped == 4
        decode = asking(request("d", prompt), params)
        started = time.monotonic()
        assert consumer.num_matched_tokens(decode, 0) == 2 * BLOCK  # what did land
        assert time.monotonic() - started < 10.0  # never the 30 s bound
        assert consumer.handoffs["failed"] == 1
    finally:
        producer.close()
        consumer.close()


def test_without_a_ticket_the_consumer_waits_its_bound_then_looks_up(
    server: BackgroundServer,
) -> None:
    target = server.served.unix_target
    prompt = tokens(4 * BLOCK + 3, seed=5)
    hashes = [bytes(h) for h in block_hashes(prompt, BLOCK)]
    put_prefix(target, prompt, 4)
    consumer = SchedulerSide(settings(target, "kv_consumer", pd_wait_timeout_s=0.3),
                             GEOMETRY, NAMESPACE)
    try:
        handoff = Handoff.new(namespaces_digest((NAMESPACE,)), 4 * BLOCK, hashes[3])
        decode = asking(request("d", prompt), handoff.to_params())
        started = time.monotonic()
        answers = []
        while (answer := consumer.num_matched_tokens(decode, 0)) is None:
            answers.append(answer)
            time.sleep(0.02)
        assert time.monotonic() - started >= 0.3 and answers
        assert answer == 4 * BLOCK and consumer.handoffs["timed_out"] == 1
        assert consumer.num_matched_tokens(decode, 0) == 4 * BLOCK  # settled: never again
    finally:
        consumer.close()


def test_params_of_another_engine_or_prompt_are_never_waited_for(
    server: BackgroundServer,
) -> None:
    target = server.served.unix_target
    prompt, other = tokens(4 * BLOCK + 3, seed=6), tokens(4 * BLOCK + 3, seed=7)
    hashes = [bytes(h) for h in block_hashes(prompt, BLOCK)]
    consumer = SchedulerSide(settings(target, "kv_consumer", pd_wait_timeout_s=60.0),
                             GEOMETRY, NAMESPACE)
    digest = namespaces_digest((NAMESPACE,))
    try:
        cases = [
            Handoff.new("cd" * 16, 4 * BLOCK, hashes[3]).to_params(),  # another model
            Handoff.new(digest, 4 * BLOCK, hashes[2]).to_params(),  # not this prompt's hash
            Handoff.new(digest, 3 * BLOCK + 1, hashes[3]).to_params(),  # not a block's end
            Handoff.new(digest, 9 * BLOCK, hashes[3]).to_params(),  # past the prompt
            {"tierkv": {"v": 1, "ticket": None}},  # malformed
        ]
        for i, params in enumerate(cases):
            assert consumer.num_matched_tokens(asking(request(f"r{i}", other if i == 1 else
                                                              prompt), params), 0) == 0
        assert consumer.handoffs["refused"] == len(cases)
    finally:
        consumer.close()


def test_a_consumer_saves_nothing_and_a_producer_loads_nothing(server: BackgroundServer) -> None:
    target = server.served.unix_target
    prompt = tokens(5 * BLOCK, seed=8)
    put_prefix(target, prompt, 2)
    consumer = SchedulerSide(settings(target, "kv_consumer"), GEOMETRY, NAMESPACE)
    producer = SchedulerSide(settings(target, "kv_producer"), GEOMETRY, NAMESPACE)
    try:
        req = request("c", prompt)
        assert consumer.num_matched_tokens(req, 0) == 2 * BLOCK
        consumer.after_alloc(req, ([1, 2, 3, 4, 5],), 2 * BLOCK)
        built = consumer.build(step(new=[("c", [1, 2, 3, 4, 5], 2 * BLOCK, 3 * BLOCK)]))
        assert built.loads and not built.saves
        assert consumer.finished(finishing(req, 5 * BLOCK)) == (False, None)
        assert producer.num_matched_tokens(request("p", prompt), 0) == 0
    finally:
        consumer.close()
        producer.close()


def test_a_request_finished_in_its_load_step_saves_the_rest_and_holds_its_blocks(
    server: BackgroundServer,
) -> None:
    """A ``kv_both`` prefill that loads a prefix and finishes in that step (max_tokens=1):
    the blocks it computed after the load are saved in the next step, from blocks vLLM holds
    until the worker released them; an aborted one saves nothing more."""
    target = server.served.unix_target
    prompt = tokens(6 * BLOCK + 2, seed=9)
    hashes = [bytes(h) for h in block_hashes(prompt, BLOCK)]
    put_prefix(target, prompt, 2)
    both = settings(target, "kv_both")
    side = SchedulerSide(both, GEOMETRY, NAMESPACE)
    worker = WorkerSide(both, GEOMETRY, tp_rank=0)
    try:
        worker.register(caches())
        req = request("r", prompt)
        assert side.num_matched_tokens(req, 0) == 2 * BLOCK
        ids = [1, 2, 3, 4, 5, 6, 7]
        side.after_alloc(req, (ids,), 2 * BLOCK)
        load_step = side.build(step(new=[("r", ids, 0, len(prompt) - 2 * BLOCK)]))
        assert load_step.loads and not load_step.saves  # (saved once the load is known good)
        worker.before_step()
        worker.start_load(load_step)
        worker.finish_loads()
        worker.save(load_step)
        delay, params = side.finished(finishing(req, len(prompt), remote_decode=False), (ids,))
        assert delay and params is None
        last = side.build(step())
        assert [op.hashes for op in last.saves] == [tuple(hashes[2:6])]
        assert last.releases == ["r"]
        worker.before_step()
        worker.save(last)
        assert worker.finished(set()) == (set(), set(), set())  # copied out by the next step only
        worker.before_step()
        assert worker.finished(set()) == ({"r"}, set(), set())
        assert worker.flush(30.0)
        with Client(target) as client:
            assert client.lookup(NAMESPACE, hashes) == 6
        aborted = request("a", tokens(4 * BLOCK, seed=10))
        side.num_matched_tokens(aborted, 0)
        side.after_alloc(aborted, ([8, 9, 10, 11],), 0)
        side.build(step(new=[("a", [8, 9, 10, 11], 0, 2 * BLOCK)]))
        assert side.finished(finishing(aborted, 2 * BLOCK, remote_decode=False,
                                       status=ABORTED)) == (False, None)
    finally:
        side.close()
        worker.close()


def test_a_consumer_whose_sidecar_is_gone_stops_waiting_at_once(tmp_path: Path) -> None:
    """A sidecar that refuses calls has no ticket to wait for: the request computes now, not
    ``pd_wait_timeout_s`` later (a slow one, by contrast, is waited for within the bound)."""
    server = BackgroundServer(tmp_path, tokens={}, host_bytes=16 * 1024 * 1024)
    target = server.served.unix_target
    consumer = SchedulerSide(settings(target, "kv_consumer", pd_wait_timeout_s=60.0),
                             GEOMETRY, NAMESPACE)
    try:
        prompt = tokens(4 * BLOCK + 3, seed=11)
        hashes = [bytes(h) for h in block_hashes(prompt, BLOCK)]
        handoff = Handoff.new(namespaces_digest((NAMESPACE,)), 4 * BLOCK, hashes[3])
        server.close()
        started = time.monotonic()
        assert consumer.num_matched_tokens(asking(request("d", prompt),
                                                  handoff.to_params()), 0) == 0
        assert time.monotonic() - started < 30.0 and consumer.handoffs["failed"] == 1
    finally:
        consumer.close()
