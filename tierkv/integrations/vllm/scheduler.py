"""The scheduler half of the connector: which prompt blocks the sidecar holds, which to load
into which of vLLM's blocks, and which to save once vLLM has computed them.

Contracts (vLLM v1's connector API):

* ``num_matched_tokens`` looks up ``request.block_hashes`` (vLLM's own hashes, never
  recomputed) and offers whole blocks beyond what vLLM already computed, never the whole prompt
  (at least one token is left to compute). It answers from the sidecar's shared-memory presence
  table when it can, else with one Lookup; a sidecar that is down or slow makes it answer 0
  within ``lookup_timeout_s``, and it is not asked again for a while (a breaker).
* Loads are synchronous by default (in the step that schedules the request; see the README for
  the measurement), or asynchronous (``load_mode="async"``: while the request waits); saves
  cover the full prompt blocks the sidecar does not hold, in the step vLLM computes them.
* Blocks computed in the step that loads a request are saved in its next step, once vLLM has
  told (``update_connector_output``) whether the load failed anywhere (on any TP rank): KV
  computed over blocks that failed to load is never stored. Failed blocks are saved again once
  vLLM has recomputed them, and a failed load stops offers for a while (the presence table in
  shared memory keeps answering for a sidecar that hangs).
* Saves are copied out of vLLM's blocks within their step, so ``request_finished`` never holds
  a request's blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tierkv.client import Client
from tierkv.integrations.vllm.settings import BlockGeometry, ConnectorSettings
from tierkv.keys import Namespace

log = logging.getLogger("tierkv.integrations.vllm")

# Saves of a request wait this many steps after its (synchronous) load: with vLLM's asynchronous
# scheduling the next step is planned before the load step's output arrives, the one after it is
# not. By then ``on_output`` has heard of any block that failed to load, on any TP rank.
SAVE_DELAY_STEPS = 2


@dataclass(frozen=True, slots=True)
class BlockOp:
    """Load or save ``hashes`` from/into vLLM's blocks ``block_ids`` (same length) for request
    ``req_id``."""

    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass(slots=True)
class StepMetadata:
    """What the scheduler tells the workers for one step (pickled to them by vLLM). Subclasses
    vLLM's ``KVConnectorMetadata`` in the connector module; kept plain here."""

    namespace: Namespace | None = None
    loads: list[BlockOp] = field(default_factory=list)  # in this step's forward pass
    async_loads: list[BlockOp] = field(default_factory=list)  # between steps (load_mode async)
    saves: list[BlockOp] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    """What the scheduler keeps of one live request."""

    request: Any  # vLLM's Request: its block_hashes grow as tokens come
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    stored_blocks: int = 0  # leading prompt blocks the sidecar holds or that are being saved
    pending_load: BlockOp | None = None
    load_step: int | None = None  # the step its last synchronous load was in


class SchedulerSide:
    """The connector's scheduler-side state; one per engine."""

    def __init__(self, settings: ConnectorSettings, geometry: BlockGeometry,
                 namespace: Namespace) -> None:
        self.settings = settings
        self.geometry = geometry
        self.namespace = namespace
        self._client = Client(settings.address, token=settings.token,
                                   timeout_s=settings.lookup_timeout_s, retries=0)
        self._requests: dict[str, _Request] = {}
        # req_id -> (blocks vLLM had computed, leading prompt blocks the sidecar holds)
        self._matched: dict[str, tuple[int, int]] = {}
        self._down_until = 0.0
        self._namespace_sent = False
        self._num_steps = 0
        self.num_lookup_errors = 0

    # --- lookups ----------------------------------------------------------------------------

    def _hashes(self, request: Any, end: int, start: int = 0) -> tuple[bytes, ...]:
        """vLLM's hashes of blocks ``start`` to ``end`` (at the connector's block size)."""
        ratio = self.geometry.block_size // self.geometry.hash_block_size
        hashes = request.block_hashes
        return tuple(bytes(hashes[(k + 1) * ratio - 1]) for k in range(start, end))

    def _num_hashed_blocks(self, request: Any, num_tokens: int) -> int:
        ratio = self.geometry.block_size // self.geometry.hash_block_size
        return min(num_tokens // self.geometry.block_size, len(request.block_hashes) // ratio)

    @property
    def loads_async(self) -> bool:
        """Whether loads happen between steps (``load_mode="async"``)."""
        return self.settings.load_mode == "async"

    def num_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that can be loaded (whole blocks, never the
        last token of the request)."""
        block_size = self.geometry.block_size
        # At least one token is left to compute: vLLM needs one to produce the next token.
        limit = self._num_hashed_blocks(request, request.num_tokens - 1)
        start = num_computed_tokens // block_size
        # Every full block is looked up, the last one too: what the sidecar holds is not saved
        # again, even the block that cannot be loaded.
        held = self._num_hashed_blocks(request, request.num_tokens)
        held = self._lookup(request, held) if held > 0 else 0
        self._matched[request.request_id] = (start, held)
        return max(0, min(held, limit) - start) * block_size

    def _lookup(self, request: Any, num_blocks: int) -> int:
        now = time.monotonic()
        if now < self._down_until:
            return 0
        try:
            return min(num_blocks, self._client.lookup(self.namespace,
                                                       self._hashes(request, num_blocks)))
        except Exception as exc:  # any failure is a miss: the scheduler must go on
            self.num_lookup_errors += 1
            self._down_until = now + max(1.0, 4 * self.settings.lookup_timeout_s)
            log.warning("tierkv lookup failed (%s); answering misses for %.1f s",
                        exc, self._down_until - now)
            return 0

    # --- allocation and steps ---------------------------------------------------------------

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks) and will load
        ``num_external_tokens`` from the connector after its locally computed ones."""
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _Request(request, int(request.num_prompt_tokens))
        state.request = request
        state.block_ids = list(block_ids)
        local, hit = self._matched.get(req_id, (0, 0))
        state.stored_blocks = max(state.stored_blocks, hit)
        state.pending_load = None
        if num_external_tokens > 0:
            # vLLM loads external tokens right after its own (block-aligned) computed ones;
            # request.num_computed_tokens is not updated yet when it calls this.
            start = local
            end = start + num_external_tokens // self.geometry.block_size
            state.pending_load = BlockOp(req_id, self._hashes(request, end, start),
                                         tuple(block_ids[start:end]))

    def build(self, output: Any) -> StepMetadata:
        """The metadata of one scheduled step (vLLM's ``SchedulerOutput``)."""
        meta = StepMetadata()
        for new in output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._step(meta, state, new.num_computed_tokens
                           + output.num_scheduled_tokens.get(new.req_id, 0))
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._step(meta, state, cached.num_computed_tokens[i]
                       + output.num_scheduled_tokens.get(req_id, 0))
        if self.loads_async:
            # Requests that wait for their blocks are not scheduled: their loads go out now.
            for state in self._requests.values():
                if state.pending_load is not None:
                    meta.async_loads.append(state.pending_load)
                    state.pending_load = None
        if not self._namespace_sent or meta.loads or meta.async_loads or meta.saves:
            meta.namespace = self.namespace
            self._namespace_sent = True
        self._num_steps += 1
        return meta

    def _step(self, meta: StepMetadata, state: _Request, computed_after: int) -> None:
        if state.pending_load is not None and not self.loads_async:
            meta.loads.append(state.pending_load)
            state.pending_load = None
            state.load_step = self._num_steps
        if state.load_step is not None and self._num_steps - state.load_step < SAVE_DELAY_STEPS:
            return  # KV computed over a load is saved once the load is known good everywhere
        computed_prompt = min(computed_after, state.num_prompt_tokens)
        end = min(self._num_hashed_blocks(state.request, computed_prompt), len(state.block_ids))
        start = state.stored_blocks
        if end > start:
            meta.saves.append(BlockOp(state.request.request_id,
                                      self._hashes(state.request, end, start),
                                      tuple(state.block_ids[start:end])))
            state.stored_blocks = end

    def on_output(self, invalid_block_ids: set[int]) -> None:
        """vLLM's report of the blocks whose load failed (on any TP rank): vLLM recomputes them,
        and they (and all after them) are saved again once it has; offers stop for a while."""
        if not invalid_block_ids:
            return
        for state in self._requests.values():
            for index, block_id in enumerate(state.block_ids):
                if block_id in invalid_block_ids:
                    state.stored_blocks = min(state.stored_blocks, index)
                    break
        now = time.monotonic()
        self._down_until = max(self._down_until, now + max(1.0, 4 * self.settings.lookup_timeout_s))
        log.warning("tierkv: %d blocks failed to load; no hits offered for %.1f s",
                    len(invalid_block_ids), self._down_until - now)

    def finished(self, request: Any) -> None:
        """A request ended (finished, aborted, or failed while it waited)."""
        self._matched.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)

    def close(self) -> None:
        self._client.close()
