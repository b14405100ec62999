"""The worker half of the connector: moves blocks between vLLM's paged KV cache and the sidecar.

A tierkv block of this engine is every attention layer's page of one vLLM block, in layer
order: ``[L, H, N, C]`` as vLLM's standardized per-layer view ``[B, H, N, C]`` holds it (the
physical layout is read from the tensors' strides by the index operations; C packs K and V as
the backend does, which is why the namespace names the backend's layout and device).

* Loads (``load_mode="sync"``): ``start_load`` fetches each request's blocks from the sidecar
  into a staging tensor on a worker thread; ``wait_for_layer`` scatters one layer into vLLM's
  blocks when the model reaches it (one ``index_copy_`` per layer per request). A block the
  sidecar no longer has, or a sidecar that fails, makes that block and every later one of the
  request a load error: reported to vLLM, never left looking loaded. Asynchronous loads fetch
  and scatter every layer on another thread while the request waits, and report the request
  received when done.
* Saves: ``save`` gathers the blocks vLLM computed in this step (one ``index_select`` per layer
  per request, before the step ends, so vLLM may reuse its blocks at once) and queues the put
  on a saver thread. The queue is bounded by ``save_queue_bytes``: the leading blocks that fit
  are kept and the rest of the request is dropped (a block after a missing one could never be
  found), counted; saves the sidecar refuses are dropped too. The engine never waits for the
  sidecar, and a sidecar that failed a load is not asked again for a moment.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tierkv.client import Client
from tierkv.errors import ConfigError
from tierkv.integrations.vllm.scheduler import BlockOp, StepMetadata
from tierkv.integrations.vllm.settings import BlockGeometry, ConnectorSettings
from tierkv.keys import Namespace

log = logging.getLogger("tierkv.integrations.vllm")


@dataclass(slots=True)
class WorkerCounters:
    """What the worker did, for logs and tests."""

    blocks_loaded: int = 0
    blocks_failed: int = 0
    blocks_saved: int = 0
    blocks_dropped: int = 0


@dataclass(frozen=True, slots=True)
class _Load:
    op: BlockOp
    staging: torch.Tensor  # [n, L, H, N, C]
    fetched: Future[int]  # how many leading blocks arrived (counted and errors noted by then)


@dataclass(frozen=True, slots=True)
class _Save:
    namespace: Namespace
    op: BlockOp
    staging: torch.Tensor  # [n, L, H, N, C], gathered out of vLLM's blocks


class WorkerSide:
    """The connector's worker-side state; one per worker (TP rank)."""

    def __init__(self, settings: ConnectorSettings, geometry: BlockGeometry, tp_rank: int) -> None:
        self.settings = settings
        self.geometry = geometry
        self.tp_rank = tp_rank
        self.counters = WorkerCounters()
        # One client per thread that uses one: a client that finds the sidecar's slab replaced
        # drops its mapping, which must not happen under another thread's copy.
        self._load_client = self._new_client()
        self._async_client = self._new_client()
        self._save_client = self._new_client()
        self._down_until = 0.0  # after a failed fetch, fetches fail at once until then
        self._layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._namespace: Namespace | None = None
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="tierkv-load")
        self._async_loader = ThreadPoolExecutor(1, thread_name_prefix="tierkv-async-load")
        self._received: set[str] = set()  # async loads done (or failed), not yet reported
        self._loads: list[_Load] = []
        self._loaded_layers: set[int] = set()
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()
        self._truncated: set[str] = set()  # requests a save was dropped for: no later ones
        self._queued_bytes = 0
        self._saves: queue.Queue[_Save | None] = queue.Queue()  # None: stop
        self._saver = threading.Thread(target=self._save_loop, name="tierkv-save", daemon=True)
        self._saver.start()
        self._stream: torch.cuda.Stream | None = None
        # Synchronous loads of a step land in this buffer, kept for the next steps: a fresh
        # one each step costs a page fault per 4 KiB (as much as the copy itself).
        self._load_buffer: torch.Tensor | None = None

    def _new_client(self) -> Client:
        return Client(self.settings.address, token=self.settings.token,
                      timeout_s=self.settings.load_timeout_s, retries=1)

    # --- registration -----------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer caches; each must be the ``[B, H, N, C]`` view of this
        geometry (C = 2 x head size), else the connector refuses to start."""
        layout = self.geometry.layout
        want = (layout.num_kv_heads, layout.block_size, 2 * layout.head_dim)
        missing = [name for name in self.geometry.layer_names if name not in kv_caches]
        if missing:
            raise ConfigError(f"TierKVConnector: vLLM registered no cache for layers {missing}")
        layers = [kv_caches[name] for name in self.geometry.layer_names]
        for name, tensor in zip(self.geometry.layer_names, layers, strict=True):
            if tensor.dim() != 4 or tuple(tensor.shape[1:]) != want or tensor.dtype != layout.torch_dtype:
                raise ConfigError(
                    f"TierKVConnector: layer {name} has a cache of {tuple(tensor.shape)} "
                    f"{tensor.dtype}; expected [blocks, *{want}] {layout.torch_dtype}"
                )
        if len({t.data_ptr() for t in layers}) != len(layers):
            raise ConfigError("TierKVConnector: layers that share one cache are not supported")
        self._layers = layers
        self._layer_index = {name: i for i, name in enumerate(self.geometry.layer_names)}
        if layers and layers[0].device.type == "cuda":
            self._stream = torch.cuda.Stream(device=layers[0].device)  # type: ignore[no-untyped-call]

    def _load_staging(self, num_blocks: int) -> torch.Tensor:
        """``[num_blocks, L, H, N, C]`` of the reused load buffer (grown when too small)."""
        if self._load_buffer is None or self._load_buffer.shape[0] < num_blocks:
            self._load_buffer = self._staging(max(num_blocks, 2 * self._capacity()))
        return self._load_buffer[:num_blocks]

    def _capacity(self) -> int:
        return 0 if self._load_buffer is None else int(self._load_buffer.shape[0])

    def _staging(self, num_blocks: int) -> torch.Tensor:
        layout = self.geometry.layout
        shape = (num_blocks, layout.num_layers, layout.num_kv_heads, layout.block_size,
                 2 * layout.head_dim)
        pinned = self._stream is not None  # so that copies to and from the GPU are async
        return torch.empty(shape, dtype=layout.torch_dtype, pin_memory=pinned)

    def _adopt(self, meta: StepMetadata) -> Namespace | None:
        if meta.namespace is not None:
            ns = meta.namespace
            if ns.layout != self.geometry.layout:
                raise ConfigError(f"TierKVConnector: scheduler layout {ns.layout} differs from "
                                  f"the worker's {self.geometry.layout}")
            self._namespace = Namespace(ns.model_id, ns.layout, tp_rank=self.tp_rank,
                                        tp_size=ns.tp_size)
        return self._namespace

    # --- loads ------------------------------------------------------------------------------

    def start_load(self, meta: StepMetadata) -> None:
        """Start fetching the step's loads; layers are scattered by ``wait_for_layer``."""
        namespace = self._adopt(meta)
        self._loads, self._loaded_layers = [], set()
        if namespace is None or not self._layers:
            return
        # One deadline for the whole step: a hung sidecar stalls a step once, not once a load.
        deadline = time.monotonic() + self.settings.load_timeout_s
        buffer = self._load_staging(sum(len(op.hashes) for op in meta.loads))
        first = 0
        for op in meta.loads:
            staging = buffer[first : first + len(op.hashes)]
            first += len(op.hashes)
            fetched = self._fetcher.submit(self._fetch, self._load_client, namespace, op, staging,
                                           deadline)
            self._loads.append(_Load(op, staging, fetched))
        for op in meta.async_loads:
            self._async_loader.submit(self._load_between_steps, namespace, op)

    def _load_between_steps(self, namespace: Namespace, op: BlockOp) -> None:
        """An asynchronous load: every layer, on a worker thread, into blocks vLLM keeps for the
        waiting request; its errors are recorded before the request is reported received."""
        try:
            staging = self._staging(len(op.hashes))
            count = self._fetch(self._async_client, namespace, op, staging,
                                time.monotonic() + self.settings.load_timeout_s)
            for index in range(len(self._layers)):
                self._scatter(op, staging, count, index, wait=True)
        except Exception as exc:  # a bug must not leave the request waiting forever
            log.exception("tierkv: asynchronous load failed: %s", exc)
            with self._lock:
                self._load_errors.update(op.block_ids)
        finally:
            with self._lock:
                self._received.add(op.req_id)

    def _fetch(self, client: Client, namespace: Namespace, op: BlockOp, staging: torch.Tensor,
               deadline: float) -> int:
        """How many leading blocks of ``op`` arrived in ``staging`` by ``deadline`` (0 when the
        sidecar failed, or failed a moment ago: the rest of the step does not wait for it). The
        blocks that did not arrive are load errors from here on."""
        count = 0
        now = time.monotonic()
        if self._down_until <= now < deadline:
            try:
                count = client.get_into(namespace, list(op.hashes),
                                        staging.view((len(op.hashes), *namespace.layout.block_shape)),
                                        timeout_s=deadline - now)
            except Exception as exc:  # whatever it is, the blocks are reported, never raised
                self._down_until = time.monotonic() + max(1.0, self.settings.lookup_timeout_s * 4)
                log.warning("tierkv load of %d blocks failed (%s); vLLM recomputes them",
                            len(op.hashes), exc)
        with self._lock:
            self.counters.blocks_loaded += count
            self.counters.blocks_failed += len(op.block_ids) - count
            self._load_errors.update(op.block_ids[count:])
        return count

    def wait_for_layer(self, layer_name: str) -> None:
        """Scatter layer ``layer_name`` of every load of this step into vLLM's blocks."""
        index = self._layer_index.get(layer_name)
        if index is None or not self._loads or index in self._loaded_layers:
            return
        self._loaded_layers.add(index)
        for load in self._loads:
            self._scatter(load.op, load.staging, load.fetched.result(), index, wait=False)
            if self._stream is not None:  # the forward pass reads the layer next
                torch.cuda.current_stream(self._layers[index].device).wait_stream(self._stream)
        if len(self._loaded_layers) == len(self._layers):
            self._loads = []

    def _scatter(self, op: BlockOp, staging: torch.Tensor, count: int, index: int, *,
                 wait: bool) -> None:
        """Layer ``index`` of the ``count`` fetched leading blocks into vLLM's blocks; ``wait``
        for the GPU copy to finish (an asynchronous load is done only when its bytes are)."""
        if count == 0:
            return
        layer = self._layers[index]
        source = staging[:count, index]
        if self._stream is None:
            layer.index_copy_(0, torch.tensor(op.block_ids[:count], dtype=torch.long), source)
            return
        with torch.cuda.stream(self._stream):  # the index tensor is made (and freed) on it too
            ids = torch.tensor(op.block_ids[:count], dtype=torch.long, device=layer.device)
            layer.index_copy_(0, ids, source.to(layer.device, non_blocking=True))
        if wait:
            self._stream.synchronize()

    def finish_loads(self) -> None:
        """Scatter whatever a step's forward did not ask for (a model that skipped
        ``wait_for_layer_load``): never leave a block half loaded."""
        for name in self.geometry.layer_names:
            self.wait_for_layer(name)

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # --- saves ------------------------------------------------------------------------------

    def save(self, meta: StepMetadata) -> None:
        """Gather the step's saves out of vLLM's blocks and queue them for the sidecar."""
        namespace = self._adopt(meta)
        if namespace is None or not self._layers:
            return
        block_bytes = self.geometry.layout.bytes_per_block
        for op in meta.saves:
            with self._lock:
                # Blocks after a dropped one could never be found (lookups walk a prefix):
                # save the leading blocks that fit, and nothing of the request after them.
                room = (self.settings.save_queue_bytes - self._queued_bytes) // block_bytes
                keep = 0 if op.req_id in self._truncated else min(len(op.hashes), room)
                if keep < len(op.hashes):
                    self._truncated.add(op.req_id)
                    self.counters.blocks_dropped += len(op.hashes) - keep
                self._queued_bytes += keep * block_bytes
            if keep:
                part = BlockOp(op.req_id, op.hashes[:keep], op.block_ids[:keep])
                self._saves.put(_Save(namespace, part, self._gather(part)))

    def _gather(self, op: BlockOp) -> torch.Tensor:
        staging = self._staging(len(op.hashes))
        device = self._layers[0].device
        if self._stream is None:
            ids = torch.tensor(op.block_ids, dtype=torch.long)
            for index, layer in enumerate(self._layers):
                torch.index_select(layer, 0, ids, out=staging[:, index])
            return staging
        self._stream.wait_stream(torch.cuda.current_stream(device))  # after the step's writes
        with torch.cuda.stream(self._stream):
            ids = torch.tensor(op.block_ids, dtype=torch.long, device=device)
            for index, layer in enumerate(self._layers):
                staging[:, index].copy_(layer.index_select(0, ids), non_blocking=True)
        self._stream.synchronize()
        return staging

    def _save_loop(self) -> None:
        while True:
            item = self._saves.get()
            if item is None:
                return
            namespace, op, staging = item.namespace, item.op, item.staging
            size = len(op.hashes) * namespace.layout.bytes_per_block
            saved = False
            try:
                self._save_client.put(
                    namespace, list(op.hashes),
                    staging.view((len(op.hashes), *namespace.layout.block_shape)),
                    priority=self.settings.priority, write_policy=self.settings.write_policy,
                )
                saved = True
            except Exception as exc:  # the saver thread outlives any failure of one save
                log.warning("tierkv save of %d blocks dropped (%s)", len(op.hashes), exc)
            finally:
                with self._lock:
                    self._queued_bytes -= size
                    if saved:
                        self.counters.blocks_saved += len(op.hashes)
                    else:
                        self.counters.blocks_dropped += len(op.hashes)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """The requests whose asynchronous loads are done since the last call (their failed
        blocks are in ``take_load_errors`` by then). Saves hold no request: they are copied out
        of vLLM's blocks within their step."""
        with self._lock:
            self._truncated -= finished_req_ids
            received, self._received = self._received, set()
        return received

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for queued saves; True when none is left."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._queued_bytes == 0:
                    return True
            time.sleep(0.01)
        return False

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
