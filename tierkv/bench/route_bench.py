"""``tierkv bench route``: what an exact KV-aware router buys. A synthetic chat trace is served by
two workers (two ``tierkv serve`` sidecars, instances 1 and 2 of one model, each holding a
fraction of the trace's distinct blocks) under three routing policies, each on fresh sidecars:

- ``round-robin``: request ``n`` goes to worker ``n % 2``;
- ``dynamo``: NVIDIA Dynamo's KV indexer (``python -m dynamo.indexer`` from ``ai-dynamo-runtime``,
  in a venv whose python is passed in), fed by the sidecars' router-mode KV events, is queried
  and the worker with the longest ``longest_matched`` wins;
- ``oracle``: each sidecar's own ``lookup`` is asked and the longest wins.

Ties go to the round-robin worker of the request (worker ``n % 2`` first), in both ranked
policies, so that an exact router chooses exactly as the oracle does. The hit is the chosen
sidecar's own ``lookup``; the request is then served as an engine does: the hit read with
``get_into`` (which promotes it) and the missing blocks put with their token ids and parent.
Under ``dynamo``, before the next request, Dynamo's match for the chosen worker is awaited
(at most ``settle_timeout_s``) until it equals the sidecar's lookup of the request's chain, so
that the figures do not depend on event timing; requests where it never did are counted.

Each trace block id stands for ``BLOCK_TOKENS`` token ids that depend on the id alone, so equal
ids are equal tokens and equal chained hashes (``tierkv.hashing.block_hashes``) in every request.
"""

from __future__ import annotations

import contextlib
import random
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tierkv.bench.dynamo_indexer import DynamoIndexer
from tierkv.bench.servers import free_port, tierkv_server
from tierkv.bench.traces import Request
from tierkv.client import Client
from tierkv.errors import ConfigError, ServiceUnavailableError
from tierkv.hashing import block_hashes
from tierkv.keys import Namespace
from tierkv.layout import KVLayout
from tierkv.tiers.records import block_record_bytes
from tierkv.types import PutDetail

Progress = Callable[[str], None]

BLOCK_TOKENS = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=BLOCK_TOKENS)  # 16 KiB
MODEL = "route-bench"
NAMESPACE = Namespace(MODEL, LAYOUT)
HASH_SEED = "route-bench"
VOCAB_SIZE = 50_000
INSTANCES = (1, 2)  # Dynamo instance ids of the two workers, in worker order
POLICIES = ("round-robin", "dynamo", "oracle")
PUT_BLOCKS = 16  # blocks per put, as a chunked prefill saves them
# The sentinel: a chain of its own put and deleted before the trace, so that the namespace's
# event sockets exist (they are bound with its first published block) when Dynamo registers.
_SENTINEL_TOKENS = [VOCAB_SIZE + n for n in range(BLOCK_TOKENS)]
_INDEXER_START_TIMEOUT_S = 60.0
_HTTP_TIMEOUT_S = 10.0  # the sidecars' /metrics


@dataclass(frozen=True, slots=True)
class RouteBenchConfig:
    """``host_share`` (and ``disk_share``, 0 for no DISK tier): each sidecar's HOST (DISK)
    capacity as a share of the trace's distinct blocks; ``dynamo_python``: the python of a venv
    holding ``ai-dynamo-runtime`` (its ``dynamo.indexer``); ``settle_timeout_s``: the longest
    wait, under ``dynamo``, for Dynamo's match of a served chain to equal the sidecar's;
    ``events_interval_s``: the sidecars' ``--events-interval-s``."""

    work_dir: Path
    dynamo_python: Path
    host_share: float = 0.35
    disk_share: float = 0.0
    settle_timeout_s: float = 2.0
    events_interval_s: float = 0.01
    policies: tuple[str, ...] = POLICIES


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """One policy over the trace, in tokens. ``oracle_agreements``: requests where the policy
    chose the worker the oracle would have (every request for the oracle itself);
    ``match_disagreements`` (``dynamo`` only, else 0): requests where Dynamo's match for the
    chosen worker differed from that sidecar's lookup when it was chosen;
    ``unsettled``: requests after which Dynamo's match never equalled the sidecar's within
    ``settle_timeout_s``."""

    policy: str
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    oracle_agreements: int
    match_disagreements: int
    unsettled: int
    hits_by_worker: tuple[int, int]

    @property
    def hit_share(self) -> float:
        """Tokens saved / prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _Trace:
    """Token ids and chained hashes of a trace's requests (a block's tokens depend on its id)."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.requests = requests
        self._tokens: dict[int, list[int]] = {}

    def block_tokens(self, block_id: int) -> list[int]:
        tokens = self._tokens.get(block_id)
        if tokens is None:
            rng = random.Random(block_id)
            tokens = self._tokens[block_id] = [rng.randrange(VOCAB_SIZE)
                                               for _ in range(BLOCK_TOKENS)]
        return tokens

    def tokens(self, request: Request) -> list[int]:
        return [token for block in request.block_ids for token in self.block_tokens(block)]

    @staticmethod
    def hashes(tokens: Sequence[int]) -> list[bytes]:
        return [bytes(h) for h in block_hashes(list(tokens), BLOCK_TOKENS, seed=HASH_SEED)]

    @property
    def num_distinct_blocks(self) -> int:
        return len({block for request in self.requests for block in request.block_ids})


# --- Dynamo's indexer --------------------------------------------------------------------------


def _matched(indexer: DynamoIndexer, token_ids: Sequence[int]) -> dict[int, int]:
    """Tokens of ``token_ids``' prefix each instance holds, by instance id (0 if absent)."""
    matched = dict.fromkeys(INSTANCES, 0)
    for instance, match in indexer.query(token_ids, MODEL).items():
        matched[instance] = match.longest_matched
    return matched


def _settle(indexer: DynamoIndexer, instance_id: int, token_ids: Sequence[int], tokens: int,
            timeout_s: float) -> bool:
    """Wait until the instance's match of ``token_ids`` is ``tokens``; whether it was."""
    deadline = time.monotonic() + timeout_s
    while True:
        match = indexer.match(instance_id, token_ids, MODEL)
        if (match.longest_matched if match else 0) == tokens:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _endpoints(metrics_port: int) -> list[dict[str, str]]:
    """The sidecar's ``tierkv_events_endpoint_info`` labels, one dict a namespace."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                timeout=_HTTP_TIMEOUT_S) as response:
        text = response.read().decode()
    return [dict(sample.labels) for family in text_string_to_metric_families(text)
            if family.name == "tierkv_events_endpoint_info" for sample in family.samples]


# --- the workers -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Worker:
    client: Client
    metrics_port: int


@contextlib.contextmanager
def _workers(cfg: RouteBenchConfig, trace: _Trace, work: Path) -> Iterator[list[_Worker]]:
    """Two fresh sidecars in router mode, with their clients."""
    distinct = trace.num_distinct_blocks
    host_bytes = max(PUT_BLOCKS, int(cfg.host_share * distinct)) * LAYOUT.bytes_per_block
    disk_bytes = int(cfg.disk_share * distinct) * block_record_bytes(LAYOUT)
    with contextlib.ExitStack() as stack:
        sockets = stack.enter_context(tempfile.TemporaryDirectory(prefix="tkv-ev-", dir="/tmp"))
        workers = []
        for number in range(len(INSTANCES)):
            metrics_port = free_port()
            flags = ["--metrics-port", str(metrics_port),
                     "--events-endpoint", f"ipc://{sockets}/ev{number}",
                     "--events-interval-s", str(cfg.events_interval_s)]
            if not disk_bytes:
                flags.append("--no-disk")
            unix, _ = stack.enter_context(tierkv_server(
                work / f"worker{number}", host_bytes, disk_bytes=max(disk_bytes, 1),
                extra_flags=flags))
            workers.append(_Worker(stack.enter_context(Client(unix)), metrics_port))
        yield workers


def _register(indexer: DynamoIndexer, workers: Sequence[_Worker], timeout_s: float) -> None:
    """Each worker's namespace endpoints registered with Dynamo, as an operator would from its
    metrics: a sentinel block is put (the namespace's sockets are bound with its first
    published block), awaited in Dynamo, then deleted and awaited gone."""
    hashes = _Trace.hashes(_SENTINEL_TOKENS)
    data = torch.zeros((1, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)
    for instance, worker in zip(INSTANCES, workers, strict=True):
        worker.client.put(NAMESPACE, hashes, data, detail=PutDetail(tuple(_SENTINEL_TOKENS)))
        deadline = time.monotonic() + 10.0
        while not (found := _endpoints(worker.metrics_port)):
            if time.monotonic() > deadline:
                raise ServiceUnavailableError("a sidecar published no events endpoint")
            time.sleep(0.05)
        indexer.register(instance, found[0]["endpoint"], MODEL, BLOCK_TOKENS,
                         replay_endpoint=found[0]["replay_endpoint"])
        if not _settle(indexer, instance, _SENTINEL_TOKENS, BLOCK_TOKENS, 10.0):
            raise ServiceUnavailableError(f"Dynamo never saw instance {instance}'s events "
                                          f"(log: {indexer.log_path})")
        worker.client.delete(NAMESPACE, hashes)
        if not _settle(indexer, instance, _SENTINEL_TOKENS, 0, 10.0):
            raise ServiceUnavailableError(f"Dynamo never saw instance {instance}'s delete")


def _ranked(matched: Sequence[int], first: int) -> int:
    """The worker with the most matched, ties to ``first`` (then the next)."""
    order = [(first + step) % len(matched) for step in range(len(matched))]
    return max(order, key=lambda worker: matched[worker])  # max keeps the first of equals


def _serve(client: Client, hashes: Sequence[bytes], tokens: Sequence[int], found: int,
           data: torch.Tensor, out: torch.Tensor) -> None:
    """As an engine: the hit read (and so promoted), then the rest put with tokens and parent."""
    if found:
        found = client.get_into(NAMESPACE, hashes[:found], out[:found])
    for start in range(found, len(hashes), PUT_BLOCKS):
        chunk = hashes[start:start + PUT_BLOCKS]
        client.put(NAMESPACE, chunk, data[:len(chunk)], detail=PutDetail(
            tuple(tokens[start * BLOCK_TOKENS:(start + len(chunk)) * BLOCK_TOKENS]),
            hashes[start - 1] if start else None))


def replay(policy: str, trace: _Trace, cfg: RouteBenchConfig,
           progress: Progress | None = None) -> PolicyResult:
    """The trace served by two fresh workers routed by ``policy`` (one of ``POLICIES``)."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown routing policy {policy!r}: one of {', '.join(POLICIES)}")
    longest = max(len(request.block_ids) for request in trace.requests)
    data = torch.zeros((PUT_BLOCKS, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)
    out = torch.empty((longest, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)
    prompt = hit = agreements = disagreements = unsettled = 0
    hits_by_worker = [0, 0]
    with tempfile.TemporaryDirectory(prefix=f"route-{policy}-", dir=cfg.work_dir) as work, \
            _workers(cfg, trace, Path(work)) as workers, contextlib.ExitStack() as stack:
        indexer = None
        if policy == "dynamo":
            indexer = stack.enter_context(DynamoIndexer(
                cfg.dynamo_python, Path(work), start_timeout_s=_INDEXER_START_TIMEOUT_S,
                log_level="warn"))
            _register(indexer, workers, cfg.settle_timeout_s * 5)
        for number, request in enumerate(trace.requests):
            tokens = trace.tokens(request)
            hashes = _Trace.hashes(tokens)
            first = number % len(workers)
            found = [worker.client.lookup(NAMESPACE, hashes) for worker in workers]
            oracle = _ranked(found, first)
            if indexer is not None:
                matched = _matched(indexer, tokens)
                chosen = _ranked([matched[instance] for instance in INSTANCES], first)
                disagreements += matched[INSTANCES[chosen]] != found[chosen] * BLOCK_TOKENS
            elif policy == "oracle":
                chosen = oracle
            else:
                chosen = first
            agreements += chosen == oracle
            client = workers[chosen].client
            _serve(client, hashes, tokens, found[chosen], data, out)
            prompt += len(tokens)
            hit += found[chosen] * BLOCK_TOKENS
            hits_by_worker[chosen] += found[chosen] * BLOCK_TOKENS
            if indexer is not None:
                held = client.lookup(NAMESPACE, hashes) * BLOCK_TOKENS
                if not _settle(indexer, INSTANCES[chosen], tokens, held, cfg.settle_timeout_s):
                    unsettled += 1
            if progress is not None and number % 100 == 99:
                progress(f"{policy}: {number + 1} requests")
    return PolicyResult(policy, len(trace.requests), prompt, hit, agreements, disagreements,
                        unsettled, (hits_by_worker[0], hits_by_worker[1]))


def run_route_bench(requests: Sequence[Request], cfg: RouteBenchConfig,
                    progress: Progress | None = None) -> list[PolicyResult]:
    """Each of ``cfg.policies`` over ``requests``, in that order, on fresh workers."""
    trace = _Trace(requests)
    return [replay(policy, trace, cfg, progress) for policy in cfg.policies]


def format_results(results: Sequence[PolicyResult]) -> str:
    """A Markdown table, one row per policy."""
    lines = ["| policy | requests | prompt tokens | hit tokens | hit % | same worker as oracle "
             "| Dynamo match != sidecar lookup | unsettled |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        dynamo = r.policy == "dynamo"
        lines.append(f"| {r.policy} | {r.num_requests} | {r.prompt_tokens:,} | {r.hit_tokens:,} "
                     f"| {100 * r.hit_share:.1f} | {100 * r.oracle_agreements / r.num_requests:.1f}% "
                     f"| {r.match_disagreements if dynamo else '-'} "
                     f"| {r.unsettled if dynamo else '-'} |")
    return "\n".join(lines)
