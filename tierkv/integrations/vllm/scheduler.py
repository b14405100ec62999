"""The scheduler half of the connector: which prompt blocks the sidecar holds, which to load
into which of vLLM's blocks, and which to save once vLLM has computed them.

Contracts (vLLM v1's connector API):

* ``num_matched_tokens`` looks up ``request.block_hashes`` (vLLM's own hashes, never
  recomputed) and offers whole blocks beyond what vLLM already computed, never the whole prompt
  (at least one token is left to compute). With several KV cache groups (vLLM's hybrid
  allocator) the hit is the longest prefix for which every group holds what it needs: all
  blocks for full attention, the window before the hit for a sliding window; loads and saves
  skip vLLM's null block (a position out of a window). It answers from the sidecar's
  shared-memory presence table when it can, else with one Lookup; a sidecar that is down or
  slow makes it answer 0 within ``lookup_timeout_s``, and it is not asked again for a while
  (a breaker).
* Loads are synchronous for an engine of one KV cache group (in the step that schedules the
  request; see docs/vllm.md for the measurement) and asynchronous for several (while the
  request waits: the only loads whose failure vLLM 0.32 takes for such a model, as the
  request's, ``failed_recving``); ``load_mode`` may ask for async with one group. Saves cover
  the full prompt blocks the sidecar does not hold, in the step vLLM computes them.
* Blocks computed in the step that loads a request are saved in its next step, once vLLM has
  told (``update_connector_output``) whether the load failed anywhere (on any TP rank): KV
  computed over blocks that failed to load is never stored. Failed blocks are saved again once
  vLLM has recomputed them, a request whose load failed is offered nothing at its next lookup,
  and a failed load stops offers for a while (the presence table in shared memory keeps
  answering for a sidecar that hangs).
* Saves are copied out of vLLM's blocks within their step. A request that finishes before its
  blocks are all saved (it finished in its load step) has them saved in the next step, and
  ``request_finished`` holds its blocks until the worker has copied them out.
* Roles: a ``kv_producer`` looks up only to skip saving what the sidecar holds, and offers no
  hit; a ``kv_consumer`` saves nothing. A producer asked for a handoff answers
  ``kv_transfer_params`` naming it, and its worker writes the ticket once the request's saves
  are answered; a consumer given one answers ``None`` ("ask again") until the ticket is there
  or ``pd_wait_timeout_s`` has passed (``handoff.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from tierkv.client import Client
from tierkv.errors import DeadlineExceededError
from tierkv.integrations.vllm.geometry import FULL, NULL_BLOCK_ID, BlockGeometry, EngineGeometry
from tierkv.integrations.vllm.handoff import (
    TICKET_NAMESPACE,
    Handoff,
    TicketStatus,
    namespaces_digest,
    wants_handoff,
)
from tierkv.integrations.vllm.settings import ConnectorSettings
from tierkv.keys import Namespace
from tierkv.types import PutDetail

log = logging.getLogger("tierkv.integrations.vllm")

# Saves of a request wait this many steps after its (synchronous) load: with vLLM's asynchronous
# scheduling the next step is planned before the load step's output arrives, the one after it is
# not. By then ``on_output`` has heard of any block that failed to load, on any TP rank.
SAVE_DELAY_STEPS = 2
_MAX_CUTS = 8  # rounds of cutting a hybrid hit to what every group holds (each: one lookup)
# A waiting handoff asks the sidecar for its ticket after 2 ms, then twice as long each time
# up to 50 ms: vLLM asks again every step (about 1 ms apart on an idle engine), and a call a
# step would cost the sidecar a call a millisecond per waiting request.
TICKET_POLL_S = 0.002
TICKET_POLL_MAX_S = 0.05
_NORMAL_FINISHES = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"})


@dataclass(frozen=True, slots=True)
class BlockOp:
    """Load or save ``hashes`` from/into vLLM's blocks ``block_ids`` (same length) of group
    ``group`` (an index into the engine geometry's groups) for request ``req_id``."""

    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    group: int = 0
    detail: PutDetail | None = None  # a save's: what KV events say of its blocks


@dataclass(frozen=True, slots=True)
class TicketOp:
    """Write ``handoff``'s ticket once every save of ``req_id`` queued before it is answered
    and each group's ``publish`` hashes (``(group, hashes)``) are published."""

    req_id: str
    handoff: Handoff
    publish: tuple[tuple[int, tuple[bytes, ...]], ...]


@dataclass(slots=True)
class StepMetadata:
    """What the scheduler tells the workers for one step (pickled to them by vLLM). Subclasses
    vLLM's ``KVConnectorMetadata`` in the connector module; kept plain here. ``namespaces``:
    one per group, sent with the first step and with every step that moves blocks."""

    namespaces: tuple[Namespace, ...] | None = None
    loads: list[BlockOp] = field(default_factory=list)  # in this step's forward pass
    async_loads: list[BlockOp] = field(default_factory=list)  # between steps (load_mode async)
    saves: list[BlockOp] = field(default_factory=list)
    tickets: list[TicketOp] = field(default_factory=list)  # after this step's saves
    # Finished requests whose blocks vLLM holds for this step's saves: released (vLLM's
    # ``finished_sending``) once the worker has copied them out.
    releases: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Wait:
    """A consumer's wait for a producer's ticket."""

    handoff: Handoff
    deadline_s: float
    next_poll_s: float = 0.0
    interval_s: float = TICKET_POLL_S


@dataclass(slots=True)
class _Request:
    """What the scheduler keeps of one live request (per group: vLLM's block ids, and the
    leading blocks the sidecar holds, or that are being saved, or that can never be)."""

    request: Any  # vLLM's Request: its block_hashes grow as tokens come
    num_prompt_tokens: int
    block_ids: list[list[int]]
    stored_blocks: list[int]
    pending_loads: list[BlockOp] = field(default_factory=list)
    load_step: int | None = None  # the step its last synchronous load was in
    handoff: Handoff | None = None  # a producer's, minted in the step its prompt completes


class SchedulerSide:
    """The connector's scheduler-side state; one per engine."""

    def __init__(self, settings: ConnectorSettings, geometry: EngineGeometry | BlockGeometry,
                 namespaces: Sequence[Namespace] | Namespace) -> None:
        self.geometry = EngineGeometry.of(geometry)
        self.settings = settings.for_engine(len(self.geometry.groups))
        self.namespaces = ((namespaces,) if isinstance(namespaces, Namespace)
                           else tuple(namespaces))
        if len(self.namespaces) != len(self.geometry.groups):
            raise ValueError("one namespace per KV cache group")
        self._client = Client(settings.address, token=settings.token,
                                   timeout_s=settings.lookup_timeout_s, retries=0)
        self._requests: dict[str, _Request] = {}
        # req_id -> (tokens vLLM had computed, each group's held blocks)
        self._matched: dict[str, tuple[int, list[int]]] = {}
        self._down_until = 0.0
        self._namespace_sent = False
        self._num_steps = 0
        self.num_lookup_errors = 0
        self._digest = namespaces_digest(self.namespaces)
        self._waits: dict[str, _Wait] = {}  # consumer: handoffs waited for
        self._settled: set[str] = set()  # consumer: requests no longer waited for
        self._refused: set[str] = set()  # requests whose load failed: no offer at the next lookup
        self._finishing: StepMetadata = StepMetadata()  # saves, tickets, releases for next step

        # Consumer: how handoffs ended (ticket DONE / FAILED, timed out, params refused).
        self.handoffs: dict[str, int] = {"done": 0, "failed": 0, "timed_out": 0, "refused": 0}
        if self.geometry.uncached:  # one line at start, naming every group it cannot serve
            log.warning("tierkv: no hits and no saves for this model: %s",
                        "; ".join(self.geometry.uncached))

    @property
    def namespace(self) -> Namespace:
        """The first group's namespace (the only one of a model with one group)."""
        return self.namespaces[0]

    # --- lookups ----------------------------------------------------------------------------

    def _hashes(self, request: Any, end: int, start: int = 0, group: int = 0
                ) -> tuple[bytes, ...]:
        """vLLM's hashes of blocks ``start`` to ``end`` of ``group`` (at its block size)."""
        ratio = self.geometry.groups[group].block_size // self.geometry.hash_block_size
        hashes = request.block_hashes
        return tuple(bytes(hashes[(k + 1) * ratio - 1]) for k in range(start, end))

    def _num_hashed_blocks(self, request: Any, num_tokens: int, group: int = 0) -> int:
        block_size = self.geometry.groups[group].block_size
        ratio = block_size // self.geometry.hash_block_size
        return min(num_tokens // block_size, len(request.block_hashes) // ratio)

    @property
    def loads_async(self) -> bool:
        """Whether loads happen between steps (``load_mode="async"``)."""
        return self.settings.load_mode == "async"

    def num_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that can be loaded: the longest prefix, a
        multiple of the engine's block size, for which every group holds what a hit needs
        (``geometry``'s module doc), never the last token of the request. None while a
        producer's handoff is awaited; 0 for a producer (which only learns what not to
        save)."""
        if not self.geometry.serves:
            return 0
        if self.settings.loads and self._awaits_handoff(request):
            return None
        if request.request_id in self._refused:  # its load failed: vLLM recomputes it
            self._refused.discard(request.request_id)
            self._matched[request.request_id] = (num_computed_tokens, [0] * len(self.geometry.groups))
            return 0
        unit = self.geometry.block_size
        groups = self.geometry.groups
        # At least one token is left to compute: vLLM needs one to produce the next token.
        hashed = min(self._num_hashed_blocks(request, request.num_tokens - 1, g) * b.block_size
                     for g, b in enumerate(groups))
        length = min(request.num_tokens - 1, hashed) // unit * unit
        # Full groups: every full block is looked up, the last one too, so that what the
        # sidecar holds is not saved again, even the block that cannot be loaded.
        held = [0] * len(groups)
        for g, group in enumerate(groups):
            if group.kind == FULL:
                wanted = self._num_hashed_blocks(request, request.num_tokens, g)
                held[g] = self._lookup(request, g, 0, wanted) if wanted > 0 else 0
                length = min(length, held[g] * group.block_size // unit * unit)
        # The other groups cut it to what they hold, until no group cuts it further (vLLM's
        # fixed point): each cut is to just before a block that is not held.
        for _ in range(_MAX_CUTS):
            cut = False
            for g, group in enumerate(groups):
                if group.kind == FULL or length <= num_computed_tokens:
                    continue
                first, end = group.first_needed_block(length), length // group.block_size
                if end <= first:
                    continue
                count = self._lookup(request, g, first, end - first)
                if count < end - first:
                    length = (first + count) * group.block_size // unit * unit
                    cut = True
            if not cut:
                break
        else:
            length = 0
        length = max(num_computed_tokens, length)
        for g, group in enumerate(groups):
            if group.kind != FULL:
                held[g] = length // group.block_size if self.settings.loads else 0
        self._matched[request.request_id] = (num_computed_tokens, held)
        if not self.settings.loads:
            return 0
        return max(0, int(length) - num_computed_tokens)

    # --- handoffs (consumer) ----------------------------------------------------------------

    def _awaits_handoff(self, request: Any) -> bool:
        """Whether ``request`` waits for its producer's ticket (``handoff.py``): True until
        every rank's ticket is there, the sidecar fails, or ``pd_wait_timeout_s`` passed."""
        req_id = request.request_id
        if req_id in self._settled:
            return False
        wait = self._waits.get(req_id)
        if wait is None:
            handoff = self._handoff_of(request)
            if handoff is None:
                self._settled.add(req_id)
                return False
            wait = self._waits[req_id] = _Wait(
                handoff, time.monotonic() + self.settings.pd_wait_timeout_s)
        now = time.monotonic()
        status: TicketStatus | None = None
        if now >= wait.next_poll_s:
            status = self._ticket_status(wait.handoff)
            wait.next_poll_s = time.monotonic() + wait.interval_s
            wait.interval_s = min(TICKET_POLL_MAX_S, 2 * wait.interval_s)
        if status is None and now < wait.deadline_s:
            return True
        outcome = ("timed_out" if status is None else
                   "done" if status is TicketStatus.DONE else "failed")
        self.handoffs[outcome] += 1
        if outcome == "timed_out":
            log.warning("tierkv: no ticket of the prefill engine's handoff for request %s "
                        "within %.1f s; it computes what the sidecar does not hold", req_id,
                        self.settings.pd_wait_timeout_s)
        del self._waits[req_id]
        self._settled.add(req_id)
        return False

    def _handoff_of(self, request: Any) -> Handoff | None:
        """The request's handoff if it names this engine's blocks of this very prompt; None
        (counted, said once a request) for params that do not: never waited for."""
        params = getattr(request, "kv_transfer_params", None)
        try:
            handoff = Handoff.from_params(params)
        except ValueError as exc:
            reason = str(exc)
        else:
            if handoff is None:
                return None
            unit = self.geometry.hash_block_size
            index = handoff.num_tokens // unit - 1
            hashes = request.block_hashes
            if handoff.namespaces != self._digest:
                reason = "it names another model, layout or cache"
            elif (handoff.num_tokens % unit or handoff.num_tokens > request.num_prompt_tokens
                  or index >= len(hashes)):
                reason = f"num_tokens={handoff.num_tokens} does not fit the prompt"
            elif bytes(hashes[index]) != handoff.last_block_hash:
                reason = "its last block hash is not this prompt's"
            else:
                return handoff
        self.handoffs["refused"] += 1
        log.warning("tierkv: request %s: handoff ignored (%s); looked up as any request",
                    request.request_id, reason)
        return None

    def _ticket_status(self, handoff: Handoff) -> TicketStatus | None:
        """FAILED if any rank's ticket says so, or the sidecar fails (nothing to wait for);
        DONE when every rank's says so; None while one is missing, or the sidecar is slow to
        say (the ticket may still come within the bound)."""
        ranks = range(self.namespaces[0].tp_size)
        keys = [handoff.key(r) for r in ranks]
        try:  # a lookup first: on the sidecar's host it is read from shared memory
            if self._client.lookup(TICKET_NAMESPACE, keys) < len(keys):
                return None
            found = self._client.get(TICKET_NAMESPACE, keys)
        except DeadlineExceededError:
            return None
        except Exception as exc:  # a sidecar that fails has no ticket to wait for
            log.warning("tierkv: reading a handoff's ticket failed (%s)", exc)
            return TicketStatus.FAILED
        statuses = [handoff.status_of(found[r], r) for r in range(found.shape[0])]
        if TicketStatus.FAILED in statuses:
            return TicketStatus.FAILED
        return TicketStatus.DONE if len(statuses) == len(ranks) else None

    def _lookup(self, request: Any, group: int, start: int, num_blocks: int) -> int:
        """How many of ``group``'s blocks ``start`` to ``start + num_blocks`` the sidecar holds,
        leading ones (0 when it fails)."""
        now = time.monotonic()
        if now < self._down_until:
            return 0
        try:
            hashes = self._hashes(request, start + num_blocks, start, group)
            return min(num_blocks, self._client.lookup(self.namespaces[group], hashes))
        except Exception as exc:  # any failure is a miss: the scheduler must go on
            self.num_lookup_errors += 1
            self._down_until = now + max(1.0, 4 * self.settings.lookup_timeout_s)
            log.warning("tierkv lookup failed (%s); answering misses for %.1f s",
                        exc, self._down_until - now)
            return 0

    # --- allocation and steps ---------------------------------------------------------------

    def _group_ids(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """vLLM's block ids of every group (``kv_cache_groups`` order) as ours."""
        return [list(block_ids[g.group_index]) if g.group_index < len(block_ids) else []
                for g in self.geometry.groups]

    def after_alloc(self, request: Any, block_ids: Sequence[Sequence[int]],
                    num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks, per group) and will load
        ``num_external_tokens`` from the connector after its locally computed ones."""
        req_id = request.request_id
        groups = self.geometry.groups
        ids = self._group_ids(block_ids)
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _Request(
                request, int(request.num_prompt_tokens), ids, [0] * len(groups))
        state.request = request
        state.block_ids = ids
        local, held = self._matched.get(req_id, (0, [0] * len(groups)))
        state.stored_blocks = [max(a, b) for a, b in zip(state.stored_blocks, held, strict=True)]
        state.pending_loads = []
        if num_external_tokens <= 0:
            return
        # vLLM loads external tokens right after its own computed ones (a multiple of the
        # engine's block size); request.num_computed_tokens is not updated yet.
        end_tokens = local + num_external_tokens
        for g, group in enumerate(groups):
            start = max(local // group.block_size, group.first_needed_block(end_tokens))
            end = end_tokens // group.block_size
            load = self._op(request, g, ids[g], start, min(end, len(ids[g])))
            if load is not None:
                state.pending_loads.append(load)

    def build(self, output: Any) -> StepMetadata:
        """The metadata of one scheduled step (vLLM's ``SchedulerOutput``); empty for an engine
        the connector does not serve (a hit must restore every group: nothing is saved)."""
        meta, self._finishing = self._finishing, StepMetadata()
        if not self.geometry.serves:
            return meta
        current = getattr(output, "kv_connector_block_state", None)
        for new in output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = self._group_ids(new.block_ids)
                self._refresh(state, current)
                self._step(meta, state, new.num_computed_tokens
                           + output.num_scheduled_tokens.get(new.req_id, 0))
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = (self._group_ids(new_ids) if new_ids is not None
                                   else [[] for _ in self.geometry.groups])
            elif new_ids is not None:
                for ids, more in zip(state.block_ids, self._group_ids(new_ids), strict=True):
                    ids.extend(more)
            self._refresh(state, current)
            self._step(meta, state, cached.num_computed_tokens[i]
                       + output.num_scheduled_tokens.get(req_id, 0))
        if self.loads_async:
            # Requests that wait for their blocks are not scheduled: their loads go out now.
            for state in self._requests.values():
                meta.async_loads += state.pending_loads
                state.pending_loads = []
        if (not self._namespace_sent or meta.loads or meta.async_loads or meta.saves
                or meta.tickets):
            meta.namespaces = self.namespaces
            self._namespace_sent = True
        self._num_steps += 1
        return meta

    def _refresh(self, state: _Request, current: Any) -> None:
        """vLLM's current table of the request, where it tells it: a window's blocks that
        left it are the null block there (freed: they may hold another request's KV now)."""
        ids = current.get_block_ids(state.request.request_id) if current is not None else None
        if ids is not None:
            state.block_ids = self._group_ids(ids)

    def _step(self, meta: StepMetadata, state: _Request, computed_after: int) -> None:
        if state.pending_loads and not self.loads_async:
            meta.loads += state.pending_loads
            state.pending_loads = []
            state.load_step = self._num_steps
        if state.load_step is not None and self._num_steps - state.load_step < SAVE_DELAY_STEPS:
            return  # KV computed over a load is saved once the load is known good everywhere
        self._save_up_to(meta, state, computed_after)
        if (computed_after >= state.num_prompt_tokens and state.handoff is None
                and self.settings.saves
                and wants_handoff(getattr(state.request, "kv_transfer_params", None))):
            # The step that completes the prompt: its ticket follows the step's saves, not a
            # step after the request finished (a busy prefill engine's steps are long).
            state.handoff = self._handoff(meta, state, state.num_prompt_tokens)

    def _save_up_to(self, meta: StepMetadata, state: _Request, computed_after: int) -> None:
        """Saves of the request's full prompt blocks computed by ``computed_after`` tokens that
        are not saved yet (none for a consumer)."""
        if not self.settings.saves:
            return
        computed_prompt = min(computed_after, state.num_prompt_tokens)
        for g in range(len(self.geometry.groups)):
            ids = state.block_ids[g]
            end = min(self._num_hashed_blocks(state.request, computed_prompt, g), len(ids))
            start = state.stored_blocks[g]
            if end <= start:
                continue
            state.stored_blocks[g] = end
            save = self._save_op(state.request, g, ids, start, end)
            if save is not None:
                meta.saves.append(save)

    def _op(self, request: Any, group: int, ids: list[int], start: int, end: int
            ) -> BlockOp | None:
        """Blocks ``start`` to ``end`` of ``group`` with vLLM's ``ids``, but for the null block
        (a position out of a window: nothing to load or save there); None when none is left."""
        positions = [k for k in range(start, end) if ids[k] != NULL_BLOCK_ID]
        if not positions:
            return None
        hashes = self._hashes(request, end, start, group)  # only these: not the whole prefix
        return BlockOp(request.request_id, tuple(hashes[k - start] for k in positions),
                       tuple(ids[k] for k in positions), group)

    def _save_op(self, request: Any, group: int, ids: list[int], start: int, end: int
                 ) -> BlockOp | None:
        """``_op``, with each block's parent (the sidecar evicts a chain saved in several
        steps tail first by them), and what vLLM's own ``BlockStored`` says of each block (its
        tokens, LoRA and extra keys) when ``event_detail`` is on."""
        op = self._op(request, group, ids, start, end)
        if op is None:
            return None
        positions = [k for k in range(start, end) if ids[k] != NULL_BLOCK_ID]
        hashes = self._hashes(request, end, max(0, start - 1), group)
        parents = tuple(hashes[k - max(0, start - 1) - 1] if k else None for k in positions)
        tokens = getattr(request, "all_token_ids", None)
        if not self.settings.event_detail or tokens is None:
            return dataclasses.replace(op, detail=PutDetail(parent_hashes=parents))
        size = self.geometry.groups[group].block_size
        lora = getattr(request, "lora_request", None)
        extra: tuple[tuple[Any, ...] | None, ...] = ()
        if lora is not None or getattr(request, "cache_salt", None) or getattr(
                request, "mm_features", None):
            extra = tuple(_event_extra_keys(request, k * size, (k + 1) * size) for k in positions)
        return dataclasses.replace(op, detail=PutDetail(
            tuple(int(t) for k in positions for t in tokens[k * size : (k + 1) * size]),
            lora_name=lora.name if lora is not None else None, extra_keys=extra,
            parent_hashes=parents))

    def on_output(self, invalid_block_ids: set[int], failed_receives: Set[str] = frozenset()
                  ) -> None:
        """vLLM's report of the loads that failed (on any TP rank): blocks (an engine of one
        group: vLLM recomputes from the first of a request), or whole requests (several
        groups: an asynchronous load whose request vLLM recomputes from its start, or fails
        alone). What failed (and all after it, in every group) is saved again once vLLM has
        recomputed it; a failed request's next lookup offers nothing (vLLM's own contract:
        the same hit again would fail the same way); offers stop for a while."""
        if not invalid_block_ids and not failed_receives:
            return
        groups = self.geometry.groups
        for state in self._requests.values():
            failed = [k * groups[g].block_size for g, ids in enumerate(state.block_ids)
                      for k, block_id in enumerate(ids) if block_id in invalid_block_ids]
            if state.request.request_id in failed_receives:
                failed.append(0)
            if failed:
                token = min(failed)
                state.stored_blocks = [min(stored, token // group.block_size)
                                       for stored, group in zip(state.stored_blocks, groups,
                                                                strict=True)]
        self._refused |= failed_receives
        now = time.monotonic()
        self._down_until = max(self._down_until, now + max(1.0, 4 * self.settings.lookup_timeout_s))
        log.warning("tierkv: %s failed to load; no hits offered for %.1f s",
                    f"{len(failed_receives)} requests" if failed_receives
                    else f"{len(invalid_block_ids)} blocks", self._down_until - now)

    def finished(self, request: Any, block_ids: Sequence[Sequence[int]] | None = None
                 ) -> tuple[bool, dict[str, Any] | None]:
        """A request ended (finished, aborted, or failed while it waited), with ``block_ids``
        of its computed tokens (per group) where vLLM gives them. Returns vLLM's
        ``(delay_free_blocks, kv_transfer_params)``: blocks are held when a save of them is
        still to come (next step); params name the handoff a producer was asked for."""
        req_id = request.request_id
        self._matched.pop(req_id, None)
        self._waits.pop(req_id, None)
        self._settled.discard(req_id)
        self._refused.discard(req_id)
        state = self._requests.pop(req_id, None)
        if state is None or not self.settings.saves or not self.geometry.serves:
            return False, None
        if block_ids is not None:
            state.block_ids = self._group_ids(block_ids)
        # Tokens whose KV is computed (async scheduling may have one more step in flight).
        done = (int(getattr(request, "num_computed_tokens", 0))
                - int(getattr(request, "num_in_flight_tokens", 0)))
        delay = False
        if getattr(getattr(request, "status", None), "name", "") in _NORMAL_FINISHES:
            # A finished request's loads were good (vLLM recomputes a failed one instead):
            # what it computed after them is saved now, not SAVE_DELAY_STEPS later.
            before = len(self._finishing.saves)
            self._save_up_to(self._finishing, state, done)
            delay = len(self._finishing.saves) > before
            if delay:
                self._finishing.releases.append(req_id)
        if not wants_handoff(getattr(request, "kv_transfer_params", None)):
            return delay, None
        handoff = state.handoff if not delay else None
        if handoff is None:
            handoff = self._handoff(self._finishing, state, min(done, state.num_prompt_tokens))
        return delay, None if handoff is None else handoff.to_params()

    def _handoff(self, meta: StepMetadata, state: _Request, num_tokens: int) -> Handoff | None:
        """The handoff of a producer's request: the full blocks of its first ``num_tokens``
        prompt tokens that every group saved or is saving; its ticket goes into ``meta``,
        after the saves there."""
        request = state.request
        unit = self.geometry.block_size
        groups = self.geometry.groups
        num_tokens = min([num_tokens // unit * unit]
                         + [self._num_hashed_blocks(request, num_tokens, g) * b.block_size
                            for g, b in enumerate(groups)]
                         + [state.stored_blocks[g] * b.block_size for g, b in enumerate(groups)])
        if num_tokens <= 0:
            return None
        publish = []
        for g, group in enumerate(groups):
            end = num_tokens // group.block_size
            start = 0 if group.kind == FULL else group.first_needed_block(num_tokens)
            ids = state.block_ids[g]
            keep = [k for k in range(start, end) if k < len(ids) and ids[k] != NULL_BLOCK_ID]
            hashes = self._hashes(request, end, 0, g)
            publish.append((g, tuple(hashes[k] for k in keep)))
        index = num_tokens // self.geometry.hash_block_size - 1
        handoff = Handoff.new(self._digest, num_tokens, bytes(request.block_hashes[index]))
        meta.tickets.append(TicketOp(request.request_id, handoff, tuple(publish)))
        return handoff

    def close(self) -> None:
        self._client.close()


def _event_extra_keys(request: Any, start: int, end: int) -> tuple[Any, ...] | None:
    """The extra keys vLLM's own ``BlockStored`` carries for tokens ``start`` to ``end`` of
    ``request`` (LoRA name, multimodal items, salt), by vLLM's own functions."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
    event = to_event_extra_keys([keys])
    return None if not event or event[0] is None else tuple(event[0])
