"""``TierKVConnector``: vLLM v1's ``KVConnectorBase_V1`` backed by a tierkv sidecar.

Load it with::

    --kv-transfer-config '{"kv_connector": "TierKVConnector",
                           "kv_connector_module_path": "tierkv.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"address": "unix:///tmp/tierkv.sock"}}'

The scheduler half lives in ``scheduler.py``, the worker half in ``worker.py``; this class only
maps vLLM's calls onto them. A sidecar that is down or slow never stops the engine: lookups
answer 0, saves are dropped and counted, failed loads are reported so that vLLM recomputes them
(with ``kv_load_failure_policy="recompute"``; vLLM's default, ``"fail"``, ends such a request
with an error instead): as block ids for a model of one KV cache group, as the request's
(``failed_recving``) for several, the only way vLLM 0.32 takes them there. The connector
reconnects when the sidecar is back. Its counters reach vLLM's metrics (``stats.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from tierkv.integrations.vllm.geometry import geometry_of
from tierkv.integrations.vllm.scheduler import SchedulerSide, StepMetadata
from tierkv.integrations.vllm.settings import ConnectorSettings, namespaces_of
from tierkv.integrations.vllm.stats import TierKVPromMetrics, TierKVStats
from tierkv.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("tierkv.integrations.vllm")


class TierKVMetadata(KVConnectorMetadata, StepMetadata):  # type: ignore[misc]
    """One step's loads and saves, as vLLM carries them to the workers."""


class TierKVConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Keeps vLLM's prefix KV in a tierkv sidecar, so that a fresh engine skips the prefill of
    every prefix the sidecar holds. Serves vLLM's hybrid allocator (``SupportsHMA``): every
    KV cache group is a namespace of its own, with its own block ids."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        settings = ConnectorSettings.from_extra_config(
            transfer.kv_connector_extra_config, role=getattr(transfer, "kv_role", "kv_both"))
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("tierkv: kv_load_failure_policy=%r: a block the sidecar cannot deliver "
                        "fails its request; 'recompute' recomputes it instead",
                        transfer.kv_load_failure_policy)
        self.geometry = geometry_of(vllm_config, kv_cache_config)
        self.settings = settings.for_engine(len(self.geometry.groups))
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            namespaces = namespaces_of(vllm_config, kv_cache_config, self.geometry, tp_rank=0)
            self._scheduler = SchedulerSide(self.settings, self.geometry, namespaces)
        else:
            self._worker = WorkerSide(self.settings, self.geometry, _tp_rank())

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is a future miss, never a wrong answer."""
        return False

    # --- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        num_tokens = self._scheduler.num_matched_tokens(request, num_computed_tokens)
        return num_tokens, bool(num_tokens) and self._scheduler.loads_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        step = self._scheduler.build(scheduler_output)
        meta = TierKVMetadata()
        meta.namespaces, meta.loads, meta.saves = step.namespaces, step.loads, step.saves
        meta.async_loads = step.async_loads
        meta.tickets, meta.releases = step.tickets, step.releases
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.on_output(set(connector_output.invalid_block_ids or ()),
                                  set(getattr(connector_output, "failed_recving", None) or ()))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Holds the blocks only while a save of them is still to come (a request that
        finished in its load step); a producer asked for a handoff answers its params."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """The hybrid allocator's ``request_finished``."""
        assert self._scheduler is not None
        return self._scheduler.finished(request, block_ids)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-by-layer loads run in ``wait_for_layer_load``, which a full CUDA graph replay
        would skip: vLLM must capture piecewise graphs."""
        return True

    # --- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierKVMetadata)
        self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing per layer: ``wait_for_save`` gathers every layer of the step's saves at once
        (a gather per layer here would not overlap with compute on a CPU, and on a GPU it
        runs on the connector's stream anyway)."""

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierKVMetadata)
        self._worker.finish_loads()
        self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``get_transfer_results`` without its failures (vLLM calls that one)."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Blocks released, asynchronous loads done, and those of them that failed (an engine
        of several groups: vLLM takes such failures per request, never as block ids)."""
        assert self._worker is not None
        released, received, failed = self._worker.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=released, finished_recving=received,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed (an engine of one group; vLLM recomputes from them)."""
        assert self._worker is not None
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> TierKVStats | None:
        """What this worker loaded, saved, failed and dropped since the last call."""
        if self._worker is None:
            return None
        counts = self._worker.take_stats()
        return TierKVStats(data=counts) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierKVStats:
        return TierKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> TierKVPromMetrics:
        """``vllm:tierkv_*`` counters on vLLM's ``/metrics`` (``stats.py``)."""
        return TierKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Called before anything of a step writes vLLM's blocks (preempted requests' blocks
        included): the saves of earlier steps are copied out of them by the time it returns."""
        if self._worker is not None:
            self._worker.before_step()

    def flush_saves(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until this worker's queued saves are in the sidecar (or
        dropped); True when none is left. For tests and orderly handovers between engines."""
        assert self._worker is not None
        return self._worker.flush(timeout_s)

    def worker_counters(self) -> dict[str, int]:
        """What this worker moved (blocks and bytes loaded, saved, failed, dropped)."""
        assert self._worker is not None
        counters = self._worker.counters
        return {name: int(getattr(counters, name)) for name in counters.__slots__}

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError, ImportError):  # no TP group: a single worker
        return 0
