"""The worker half of the connector: moves blocks between vLLM's paged KV cache and the sidecar.

A tierkv block of this engine is every attention layer's page of one vLLM block, in layer
order: ``[L, H, N, C]`` as vLLM's standardized per-layer view ``[B, H, N, C]`` holds it (the
physical layout is read from the tensors' strides by the index operations; C packs K and V as
the backend does, which is why the namespace names the backend's layout and device).

How blocks are copied is one of two strategies (``copies.py``), chosen once when vLLM registers
its caches: on the CPU straight through the sidecar's leased slab pages, on the GPU through
pinned staging and a side stream. The rest is written once over them.

* Loads (``load_mode="sync"``): ``start_load`` fetches each request's blocks from the sidecar
  on a worker thread, into where its copies land them (``Copies.step_landings``). On the CPU
  that thread scatters them out of the sidecar's leased slab pages straight into vLLM's
  blocks, and ``wait_for_layer`` waits for that load: a layer is never used before every
  block's checksum held. On the GPU they are fetched into pinned staging and
  ``wait_for_layer`` issues its layer's copy on the side stream. A block the sidecar no longer
  has, one whose checksum fails, or a sidecar that fails, makes that block and every later one
  of the request a load error: reported to vLLM (which recomputes them over whatever the
  scatter left), never left looking loaded. Asynchronous loads fetch and scatter every layer
  on another thread while the request waits, and report the request received when done.
* Saves: ``save`` queues one put of the blocks vLLM computed in this step (all the step's
  requests) for a saver thread. On the CPU (``Copies.gathers_in_step`` False) the saver
  gathers them straight into the sidecar's leased slab pages (``Client.put_with``: one pass
  over the bytes, then a hash pass over the pages); vLLM may overwrite a block from its next
  step on, and it calls ``handle_preemptions`` (``before_step``) before anything of that step
  writes a block, so ``before_step`` waits for a gather under way and gathers any save not
  gathered yet into a staging buffer itself (what a slow sidecar costs the engine: the gather
  it would have done anyway, never a call). On the GPU ``save`` gathers into pinned staging
  before the step ends. The queue is bounded by ``save_queue_bytes``: the
  leading blocks of a request that fit are kept and the rest of it is dropped (a block after a
  missing one could never be found), counted; saves the sidecar refuses are dropped too. The
  engine never waits for the sidecar, and a sidecar that failed a load is not asked again for
  a moment.
* Handoffs (``handoff.py``): a step's tickets are queued after its saves, so the saver writes
  one once every save of its request before it was answered; it publishes the request's
  blocks first (``Client.publish``: with a REMOTE tier, until Redis holds them) and says
  FAILED when any of them was dropped, refused or not published. A finished request whose
  blocks vLLM held for a last save is released (``finished_sending``) once the next step's
  ``before_step`` has copied them out.
* Staging buffers are reused (a fresh one page-faults once a 4 KiB page, as long as the copy
  itself takes): GPU loads land in one buffer per loading thread (``GpuCopies``); a save's
  buffer is the saver's until its put has returned, then kept (at most ``IDLE_SAVE_BUFFERS``)
  for a later save.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from tierkv.client import Client
from tierkv.errors import ConfigError
from tierkv.integrations.vllm.copies import Copies, Landing, as_store_blocks, copies_for
from tierkv.integrations.vllm.geometry import BlockGeometry, EngineGeometry
from tierkv.integrations.vllm.handoff import TICKET_NAMESPACE, TicketStatus
from tierkv.integrations.vllm.scheduler import BlockOp, StepMetadata, TicketOp
from tierkv.integrations.vllm.settings import ConnectorSettings
from tierkv.keys import Namespace
from tierkv.types import PutDetail

log = logging.getLogger("tierkv.integrations.vllm")

IDLE_SAVE_BUFFERS = 2  # saves' staging buffers kept between saves (two: gather beside a put)


@dataclass(slots=True)
class WorkerCounters:
    """What the worker did, for logs and tests."""

    blocks_loaded: int = 0
    blocks_failed: int = 0
    loads_failed: int = 0  # requests whose load failed (any of their blocks)
    blocks_saved: int = 0
    blocks_dropped: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0


@dataclass(frozen=True, slots=True)
class _Load:
    op: BlockOp
    landing: Landing  # where the fetch lands it; ``wait_for_layer`` has each layer scattered
    fetched: Future[int]  # how many leading blocks arrived (counted and errors noted by then)


class _GatherWindowClosedError(Exception):
    """A save's blocks were asked for again after vLLM may have reused them (a put written a
    second time, into a restarted sidecar's slab): the save is dropped."""


@dataclass(slots=True)
class _Save:
    """One step's saves of one group (of all its requests, in order): ``hashes`` and vLLM's
    ``block_ids`` holding them. On the CPU the saver gathers the blocks straight into the
    sidecar's leased pages while ``window_open`` (until the next step begins: vLLM may then
    reuse the blocks); a save not gathered by then is gathered into ``staging`` by the engine's
    thread first. On the GPU (``Copies.gathers_in_step``) every save is gathered into
    ``staging`` within its step. The mutable fields are the worker's lock's."""

    group: int
    namespace: Namespace
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    detail: PutDetail | None = None  # each block's parent, and what the KV events say of it
    req_ids: frozenset[str] = frozenset()  # whose blocks these are (a failure fails each)
    staging: torch.Tensor | None = None  # [n, L, H, N, C], gathered out of vLLM's blocks
    buffer: torch.Tensor | None = None  # what ``staging`` is the head of: given back after
    window_open: bool = False
    staging_pending: bool = False  # the engine's thread is gathering it into ``staging``
    gathering: bool = False  # the saver is gathering it out of vLLM's blocks
    gathered: bool = False  # the saver gathered it (into the sidecar's pages)


@dataclass(slots=True)
class _Group:
    """One KV cache group as registered: how its blocks are copied, and its saves' idle staging
    buffers (a group's block ids are its own: layers of two groups share memory, each block id
    belongs to one group)."""

    geometry: BlockGeometry
    copies: Copies
    save_buffers: list[torch.Tensor] = field(default_factory=list)


class WorkerSide:
    """The connector's worker-side state; one per worker (TP rank)."""

    def __init__(self, settings: ConnectorSettings, geometry: EngineGeometry | BlockGeometry,
                 tp_rank: int) -> None:
        self.engine = EngineGeometry.of(geometry)
        self.settings = settings.for_engine(len(self.engine.groups))
        self.tp_rank = tp_rank
        self.counters = WorkerCounters()
        # One client per thread that uses one: a client that finds the sidecar's slab replaced
        # drops its mapping, which must not happen under another thread's copy.
        self._load_client = self._new_client()
        self._async_client = self._new_client()
        self._save_client = self._new_client()
        self._down_until = 0.0  # after a failed fetch, fetches fail at once until then
        self._groups: list[_Group] = []  # as registered (``register``)
        self._registered = False
        self._layer_index: dict[str, tuple[int, int]] = {}  # name -> (group, layer in group)
        self._namespaces: tuple[Namespace, ...] | None = None
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="tierkv-load")
        self._async_loader = ThreadPoolExecutor(1, thread_name_prefix="tierkv-async-load")
        self._received: set[str] = set()  # async loads done (or failed), not yet reported
        # Of those, the ones that failed (several groups: vLLM takes failures per request).
        self._failed_receives: set[str] = set()
        self._reported = WorkerCounters()  # what ``take_stats`` reported so far
        self._loads: list[_Load] = []
        self._loaded_layers: set[tuple[int, int]] = set()
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)  # notified when no save is queued
        self._gathered = threading.Condition(self._lock)  # notified as a save's gather ends
        self._open_saves: list[_Save] = []  # saves vLLM's blocks are still kept for
        self._truncated: set[str] = set()  # requests a save was dropped for: no later ones
        self._queued_bytes = 0
        self._num_tickets = 0  # tickets queued, not yet written
        self._failed: set[str] = set()  # requests a save of failed since their ticket or end
        self._releasing: list[str] = []  # held for a save of this step: released after it
        self._released: set[str] = set()  # copied out: vLLM may free their blocks
        # Saves, then tickets, then requests vLLM finished (their failures are forgotten).
        self._saves: queue.Queue[_Save | TicketOp | frozenset[str] | None] = queue.Queue()
        self._saver = threading.Thread(target=self._save_loop, name="tierkv-save", daemon=True)
        self._saver.start()

    @property
    def geometry(self) -> BlockGeometry:
        """The first group's geometry (the only one of a model with one group)."""
        return self.engine.groups[0]

    def _new_client(self) -> Client:
        return Client(self.settings.address, token=self.settings.token,
                      timeout_s=self.settings.load_timeout_s, retries=1)

    # --- registration -----------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer caches; each layer of a group must be the ``[B, H, N, C]``
        view of its geometry (C = K + V head sizes, or the latent's), else the connector
        refuses to start. An engine the connector does not serve registers nothing."""
        if not self.engine.serves:
            return
        layers = [self._layers_of(g, geometry, kv_caches)
                  for g, geometry in enumerate(self.engine.groups)]
        # The CPU's copies or the GPU's, chosen here once (by where vLLM's caches are).
        copies = copies_for(list(zip(self.engine.groups, layers, strict=True)))
        self._groups = [_Group(geometry, group_copies)
                        for geometry, group_copies in zip(self.engine.groups, copies, strict=True)]
        self._registered = True

    def _layers_of(self, g: int, geometry: BlockGeometry, kv_caches: dict[str, torch.Tensor]
                   ) -> list[torch.Tensor]:
        """Group ``g``'s caches, each layer's checked against its geometry, in layer order."""
        want = geometry.page_shape
        missing = [name for name in geometry.layer_names if name not in kv_caches]
        if missing:
            raise ConfigError(f"TierKVConnector: vLLM registered no cache for layers {missing}")
        layers = [kv_caches[name] for name in geometry.layer_names]
        for name, tensor in zip(geometry.layer_names, layers, strict=True):
            dtype = geometry.cache_dtype
            if tensor.dim() != 4 or tuple(tensor.shape[1:]) != want or tensor.dtype != dtype:
                raise ConfigError(
                    f"TierKVConnector: layer {name} has a cache of {tuple(tensor.shape)} "
                    f"{tensor.dtype}; expected [blocks, *{want}] {dtype}"
                )
        if len({t.data_ptr() for t in layers}) != len(layers):
            raise ConfigError("TierKVConnector: layers of one group that share one cache are "
                              "not supported")
        for i, name in enumerate(geometry.layer_names):
            self._layer_index[name] = (g, i)
        return layers

    def _adopt(self, meta: StepMetadata) -> tuple[Namespace, ...] | None:
        """The step's namespaces (one per group) as this rank's: a replicated group's are
        rank 0's on every rank."""
        if meta.namespaces is not None:
            groups = self.engine.groups
            if len(meta.namespaces) != len(groups):
                raise ConfigError(f"TierKVConnector: the scheduler has {len(meta.namespaces)} "
                                  f"KV cache groups, the worker {len(groups)}")
            adopted = []
            for ns, geometry in zip(meta.namespaces, groups, strict=True):
                if ns.layout != geometry.layout:
                    raise ConfigError(f"TierKVConnector: scheduler layout {ns.layout} differs "
                                      f"from the worker's {geometry.layout}")
                rank = 0 if geometry.replicated else self.tp_rank
                adopted.append(Namespace(ns.model_id, ns.layout, tp_rank=rank,
                                         tp_size=ns.tp_size))
            self._namespaces = tuple(adopted)
        return self._namespaces

    # --- loads ------------------------------------------------------------------------------

    def start_load(self, meta: StepMetadata) -> None:
        """Start fetching the step's loads; layers are scattered by ``wait_for_layer``."""
        namespaces = self._adopt(meta)
        self._loads, self._loaded_layers = [], set()
        if namespaces is None or not self._registered:
            return
        # One deadline for the whole step: a hung sidecar stalls a step once, not once a load.
        deadline = time.monotonic() + self.settings.load_timeout_s
        for g, group in enumerate(self._groups):
            ops = [op for op in meta.loads if op.group == g]
            if not ops:
                continue
            for op, landing in zip(ops, group.copies.step_landings(ops), strict=True):
                fetched = self._fetcher.submit(self._load_in_step, namespaces[g], op, deadline,
                                               landing)
                self._loads.append(_Load(op, landing, fetched))
        by_request: dict[str, list[BlockOp]] = {}
        for op in meta.async_loads:
            by_request.setdefault(op.req_id, []).append(op)
        for ops in by_request.values():  # every group of a request, then it is received
            self._async_loader.submit(self._load_between_steps, namespaces, ops)

    def _load_in_step(self, namespace: Namespace, op: BlockOp, deadline: float,
                      landing: Landing) -> int:
        """A synchronous load (an engine of one group) on the fetching thread: into ``landing``
        (pinned staging on the GPU; on the CPU scattered out of the slab into vLLM's blocks,
        every layer, checked). The
        blocks that did not arrive, and every block of it when anything else fails (a bug must
        not leave the forward half loaded), are load errors: vLLM recomputes from the first."""
        count = 0
        try:
            count = self._fetch(self._load_client, namespace, op, deadline, landing)
        except Exception as exc:
            log.exception("tierkv: a load failed (%s); vLLM recomputes it", exc)
        self._note_failure(op, count, per_request=False)
        return count

    def _load_between_steps(self, namespaces: tuple[Namespace, ...], ops: list[BlockOp]) -> None:
        """An asynchronous load of one request (``ops``: each of its groups'): every layer, on
        a worker thread, into blocks vLLM keeps for the waiting request. Blocks that do not
        arrive fail the request: with several groups as a whole (vLLM's ``failed_recving``:
        it recomputes the request, or fails it alone), with one as block ids (vLLM recomputes
        from the first). Recorded before the request is reported received."""
        deadline = time.monotonic() + self.settings.load_timeout_s
        per_request = len(self.engine.groups) > 1
        failed = False  # (several groups: the rest of a failed request is not fetched)
        try:
            for op in ops:
                count = 0
                try:
                    if not failed:
                        count = self._load_op(namespaces[op.group], op, deadline)
                except Exception as exc:  # a bug must not leave the request waiting forever
                    log.exception("tierkv: asynchronous load failed: %s", exc)
                self._note_failure(op, count, per_request=per_request)
                failed = failed or (per_request and count < len(op.block_ids))
        finally:
            with self._lock:
                self._received.add(ops[0].req_id)

    def _load_op(self, namespace: Namespace, op: BlockOp, deadline: float) -> int:
        """One group's blocks of an asynchronous load, every layer; the leading count there."""
        landing = self._groups[op.group].copies.async_landing(op)
        count = self._fetch(self._async_client, namespace, op, deadline, landing)
        landing.scatter_all(count)
        return count

    def _note_failure(self, op: BlockOp, count: int, *, per_request: bool) -> None:
        """``op``'s blocks after its ``count`` leading ones did not load: block ids for vLLM
        to recompute from, or (``per_request``) its request failed as a whole."""
        if count >= len(op.block_ids):
            return
        with self._lock:
            self.counters.blocks_failed += len(op.block_ids) - count
            if per_request:
                if op.req_id not in self._failed_receives:
                    self.counters.loads_failed += 1
                self._failed_receives.add(op.req_id)
            else:
                self.counters.loads_failed += 1
                self._load_errors.update(op.block_ids[count:])

    def _fetch(self, client: Client, namespace: Namespace, op: BlockOp, deadline: float,
               landing: Landing) -> int:
        """How many leading blocks of ``op`` arrived by ``deadline`` in ``landing`` (0 when the
        sidecar failed, or failed a moment ago: the rest of the step does not wait for it); the
        caller notes the rest as failed."""
        count = 0
        now = time.monotonic()
        if self._down_until <= now < deadline:
            try:
                count = landing.receive(client, namespace, deadline - now)
            except Exception as exc:  # whatever it is, the blocks are reported, never raised
                self._down_until = time.monotonic() + max(1.0, self.settings.lookup_timeout_s * 4)
                log.warning("tierkv load of %d blocks failed (%s); vLLM recomputes them",
                            len(op.hashes), exc)
        with self._lock:
            self.counters.blocks_loaded += count
            self.counters.bytes_loaded += count * namespace.layout.bytes_per_block
        return count

    def wait_for_layer(self, layer_name: str) -> None:
        """Scatter layer ``layer_name`` of every load of this step (of its group) into vLLM's
        blocks."""
        position = self._layer_index.get(layer_name)
        if position is None or not self._loads or position in self._loaded_layers:
            return
        self._loaded_layers.add(position)
        g, index = position
        for load in self._loads:
            if load.op.group == g:
                load.landing.scatter_layer(index, load.fetched)
        if len(self._loaded_layers) == len(self._layer_index):
            self._loads = []

    def finish_loads(self) -> None:
        """Scatter whatever a step's forward did not ask for (a model that skipped
        ``wait_for_layer_load``): never leave a block half loaded."""
        for name in self._layer_index:
            self.wait_for_layer(name)

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (an engine of one group)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> dict[str, int]:
        """What the counters grew by since the last call (vLLM's connector stats)."""
        with self._lock:
            now = replace(self.counters)
            before, self._reported = self._reported, now
        return {n: getattr(now, n) - getattr(before, n) for n in WorkerCounters.__slots__
                if getattr(now, n) != getattr(before, n)}

    # --- saves ------------------------------------------------------------------------------

    def save(self, meta: StepMetadata) -> None:
        """Gather the step's saves out of vLLM's blocks and queue them for the sidecar (one put
        per group). A replicated group (MLA) is saved by rank 0 only: every rank holds the
        same pages."""
        namespaces = self._adopt(meta)
        if namespaces is None or not self._registered:
            return
        for g, group in enumerate(self._groups):
            if group.geometry.replicated and self.tp_rank != 0:
                continue
            ops = [op for op in meta.saves if op.group == g]
            if ops:
                self._save_group(g, group, namespaces[g], ops)
        with self._lock:
            self._releasing += meta.releases
            self._num_tickets += len(meta.tickets)
        for ticket in meta.tickets:
            self._saves.put(ticket)

    def _save_group(self, g: int, group: _Group, namespace: Namespace, ops: list[BlockOp]
                    ) -> None:
        block_bytes = group.geometry.layout.bytes_per_block
        hashes: list[bytes] = []
        block_ids: list[int] = []
        details: list[tuple[PutDetail | None, int]] = []
        with self._lock:
            for op in ops:
                # Blocks after a dropped one could never be found (lookups walk a prefix):
                # save the leading blocks that fit, and nothing of the request after them.
                room = (self.settings.save_queue_bytes - self._queued_bytes) // block_bytes
                keep = 0 if op.req_id in self._truncated else min(len(op.hashes), room)
                if keep < len(op.hashes):
                    self._truncated.add(op.req_id)
                    self._failed.add(op.req_id)
                    self.counters.blocks_dropped += len(op.hashes) - keep
                self._queued_bytes += keep * block_bytes
                hashes += op.hashes[:keep]
                block_ids += op.block_ids[:keep]
                details.append((op.detail, keep))
        if not hashes:
            return
        item = _Save(g, namespace, tuple(hashes), tuple(block_ids),
                     _joined(details, group.geometry.layout.block_size),
                     frozenset(op.req_id for op in ops))
        if not group.copies.gathers_in_step:  # the saver gathers it, into the sidecar's pages
            item.window_open = True
            with self._lock:
                self._open_saves.append(item)
            self._saves.put(item)
            return
        try:  # the step's requests in one put: each put costs ~2.5 ms beside its bytes
            self._stage(group, item)
        except BaseException:
            self._settle(item, saved=False)  # (a flush must not wait for it)
            raise
        self._saves.put(item)

    def _stage(self, group: _Group, item: _Save) -> None:
        """Gather ``item``'s blocks out of vLLM's into a staging buffer (taken for it)."""
        buffer = self._take_save_buffer(group, len(item.hashes))
        staging = buffer[: len(item.hashes)]
        try:
            group.copies.gather(item.block_ids, staging)
        except BaseException:
            self._give_back(group, buffer)
            raise
        item.staging, item.buffer = staging, buffer

    def before_step(self) -> None:
        """vLLM is about to start a step, which may overwrite any block it does not hold for a
        request (``handle_preemptions`` is called before anything writes one): wait for the
        saver's gathers under way, and gather the saves it has not reached into staging here.
        A save that cannot be staged is dropped; its blocks are never read again."""
        with self._lock:
            self._gathered.wait_for(lambda: not any(s.gathering for s in self._open_saves))
            closing, self._open_saves = self._open_saves, []
            for item in closing:
                item.window_open = False
                item.staging_pending = not item.gathered
        for item in closing:
            if not item.staging_pending:
                continue
            try:
                self._stage(self._groups[item.group], item)
            except Exception as exc:  # the saver finds no staging: it drops the save
                log.warning("tierkv: staging a save of %d blocks failed (%s)",
                            len(item.hashes), exc)
            finally:
                with self._lock:
                    item.staging_pending = False
                    self._gathered.notify_all()
        with self._lock:  # nothing reads their blocks any more
            self._released.update(self._releasing)
            self._releasing = []

    def _fill(self, item: _Save, indices: Sequence[int], out: torch.Tensor) -> None:
        """``put_with``'s fill of ``item``: its blocks ``indices`` into ``out`` (uint8, a row a
        block), out of vLLM's blocks while they are kept for it, else out of its staging."""
        with self._lock:
            self._gathered.wait_for(lambda: not item.staging_pending)
            direct = item.window_open
            item.gathering = direct
        if direct:
            try:
                self._groups[item.group].copies.gather([item.block_ids[i] for i in indices], out)
            finally:
                with self._lock:
                    item.gathering, item.gathered = False, True
                    self._gathered.notify_all()
            return
        if item.staging is None:
            raise _GatherWindowClosedError("vLLM may have reused the blocks of this save")
        rows = item.staging.view(torch.uint8).reshape(item.staging.shape[0], -1)
        torch.index_select(rows, 0, torch.tensor(list(indices), dtype=torch.long), out=out)

    def _take_save_buffer(self, group: _Group, num_blocks: int) -> torch.Tensor:
        """An idle save buffer of at least ``num_blocks`` blocks (the smallest), else a new one:
        no queued save holds it (each is given back only once its put has returned)."""
        with self._lock:
            fits = [b for b in group.save_buffers if b.shape[0] >= num_blocks]
            if fits:
                buffer = min(fits, key=lambda b: int(b.shape[0]))
                # By identity: ``list.remove`` would compare tensors elementwise.
                group.save_buffers = [b for b in group.save_buffers if b is not buffer]
                return buffer
        return group.copies.staging(num_blocks)

    def _give_back(self, group: _Group, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` for a later save; the smallest idle one goes beyond the limit."""
        with self._lock:
            group.save_buffers.append(buffer)
            if len(group.save_buffers) > IDLE_SAVE_BUFFERS:
                smallest = min(group.save_buffers, key=lambda b: int(b.shape[0]))
                group.save_buffers = [b for b in group.save_buffers if b is not smallest]

    def _save_loop(self) -> None:
        while True:
            item = self._saves.get()
            if item is None:
                return
            if isinstance(item, TicketOp):
                self._write_ticket(item)
                continue
            if isinstance(item, frozenset):
                with self._lock:
                    self._failed -= item
                continue
            namespace, hashes = item.namespace, item.hashes
            saved = False
            try:
                with self._lock:  # staged by now (or being staged): a plain put copies it
                    self._gathered.wait_for(lambda: not item.staging_pending)  # noqa: B023
                    staging = item.staging
                if staging is not None:
                    self._save_client.put(
                        namespace, list(hashes), as_store_blocks(staging, namespace, len(hashes)),
                        priority=self.settings.priority, write_policy=self.settings.write_policy,
                        detail=item.detail,
                    )
                else:
                    self._save_client.put_with(
                        namespace, list(hashes),
                        lambda indices, out: self._fill(item, indices, out),  # noqa: B023
                        priority=self.settings.priority, write_policy=self.settings.write_policy,
                        detail=item.detail,
                    )
                saved = True
            except Exception as exc:  # the saver thread outlives any failure of one save
                log.warning("tierkv save of %d blocks dropped (%s)", len(hashes), exc)
            finally:
                with self._lock:
                    self._gathered.wait_for(lambda: not item.staging_pending)  # noqa: B023
                    item.window_open = False  # a failed put's blocks are not read again
                    self._open_saves = [s for s in self._open_saves if s is not item]
                if item.buffer is not None:  # the put has returned: no copy reads it any more
                    self._give_back(self._groups[item.group], item.buffer)
                self._settle(item, saved=saved)

    def _settle(self, item: _Save, *, saved: bool) -> None:
        """``item``'s queued blocks are saved, or dropped: off the queue, counted (a drop
        fails its requests' tickets)."""
        num_blocks = len(item.hashes)
        block_bytes = self.engine.groups[item.group].layout.bytes_per_block
        with self._lock:
            self._queued_bytes -= num_blocks * block_bytes
            if self._drained_locked():
                self._drained.notify_all()
            if saved:
                self.counters.blocks_saved += num_blocks
                self.counters.bytes_saved += num_blocks * block_bytes
            else:
                self.counters.blocks_dropped += num_blocks
                self._failed |= item.req_ids

    def _write_ticket(self, op: TicketOp) -> None:
        """Publish ``op``'s blocks, then write this rank's ticket: DONE when every save of its
        request was answered and every block published, else FAILED. A ticket that cannot
        be written is waited for by the consumer until its bound, then computed."""
        handoff, rank = op.handoff, self.tp_rank
        try:
            with self._lock:
                failed = op.req_id in self._failed
                self._failed.discard(op.req_id)
            namespaces = self._namespaces
            failed = failed or namespaces is None
            wait_s = self.settings.pd_wait_timeout_s
            for g, hashes in op.publish:
                if failed:
                    break
                if self.engine.groups[g].replicated and rank != 0:
                    continue  # rank 0 saves (and publishes) a replicated group
                assert namespaces is not None
                failed = bool(hashes) and self._save_client.publish(
                    namespaces[g], hashes, wait_s=wait_s) < len(hashes)
            status = TicketStatus.FAILED if failed else TicketStatus.DONE
            self._save_client.put(TICKET_NAMESPACE, [handoff.key(rank)],
                                  handoff.record(rank, status))
            self._save_client.publish(TICKET_NAMESPACE, [handoff.key(rank)], wait_s=wait_s)
            if failed:
                log.warning("tierkv: request %s's handoff failed: not every block it names "
                            "was saved and published", op.req_id)
        except Exception as exc:  # the consumer waits its bound, then computes
            log.warning("tierkv: writing request %s's handoff ticket failed (%s)", op.req_id, exc)
        finally:
            with self._lock:
                self._num_tickets -= 1
                if self._drained_locked():
                    self._drained.notify_all()

    def _drained_locked(self) -> bool:
        """Whether no save or ticket is queued (under the lock)."""
        return self._queued_bytes == 0 and self._num_tickets == 0

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """vLLM's ``(finished_sending, finished_recving, failed_recving)``: the finished
        requests whose held blocks were copied out for their last saves (``before_step``), the
        requests whose asynchronous loads are done since the last call, and those of them whose
        load failed (several groups; with one, their failed blocks are in ``take_load_errors``
        by then)."""
        with self._lock:
            self._truncated -= finished_req_ids
            received, self._received = self._received, set()
            failed = self._failed_receives & received
            self._failed_receives -= failed
            released, self._released = self._released, set()
        if finished_req_ids:  # after any ticket of theirs queued by now (see ``save``)
            self._saves.put(frozenset(finished_req_ids))
        return released, received, failed

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for queued saves and tickets; True when none is left."""
        with self._drained:
            return self._drained.wait_for(self._drained_locked, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued saves (for at most ``timeout_s``), then stop."""
        if not self.flush(timeout_s):
            log.warning("tierkv: saves still queued at shutdown were dropped")
        self._saves.put(None)
        self._saver.join(timeout=1.0)
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        self._async_loader.shutdown(wait=False, cancel_futures=True)
        for client in (self._load_client, self._async_client, self._save_client):
            client.close()


def _joined(details: list[tuple[PutDetail | None, int]], block_size: int) -> PutDetail | None:
    """One put's detail out of its ops' (each with the blocks of it kept): None unless every
    op has one; the LoRA name only when they share it (each block's extra keys name it too)."""
    if not details or any(detail is None for detail, _ in details):
        return None
    kept = [(detail, keep) for detail, keep in details if keep and detail is not None]
    loras = {detail.lora_name for detail, _ in kept}
    with_extra = any(detail.extra_keys for detail, _ in kept)
    return PutDetail(
        tuple(t for detail, keep in kept for t in detail.token_ids[: keep * block_size]),
        lora_name=loras.pop() if len(loras) == 1 else None,
        extra_keys=tuple(key for detail, keep in kept
                         for key in (detail.extra_keys or (None,) * keep)[:keep])
        if with_extra else (),
        parent_hashes=tuple(p for detail, keep in kept for p in detail.parent_hashes[:keep]))
