"""What the connector tells vLLM's own metrics: the blocks each worker loaded, saved, failed
to load and dropped, and the requests whose load failed, where an operator of ``vllm serve``
looks (its periodic ``KV Transfer metrics:`` log line and its Prometheus ``/metrics``, as
``vllm:tierkv_*`` counters labelled like vLLM's own). The workers' figures are deltas since
their last report; vLLM sums them over TP ranks and steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# counter (a ``WorkerCounters`` field) -> what its Prometheus counter counts
COUNTERS: dict[str, str] = {
    "blocks_loaded": "blocks loaded from the tierkv sidecar into vLLM's KV cache",
    "bytes_loaded": "bytes loaded from the tierkv sidecar into vLLM's KV cache",
    "blocks_failed": "blocks whose load from the tierkv sidecar failed (recomputed by vLLM)",
    "loads_failed": "requests whose load from the tierkv sidecar failed (vLLM recomputes or "
                    "fails each, by kv_load_failure_policy)",
    "blocks_saved": "blocks saved into the tierkv sidecar",
    "bytes_saved": "bytes saved into the tierkv sidecar",
    "blocks_dropped": "blocks not saved (the save queue full, or the sidecar refused or failed)",
}


@dataclass
class TierKVStats(KVConnectorStats):  # type: ignore[misc]
    """Counts since the last report (``data``: counter name -> count)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + int(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(self.data.get(name, 0)) for name in COUNTERS if self.data.get(name)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class TierKVPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """``vllm:tierkv_<counter>_total`` per engine, for every counter of ``COUNTERS``."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        self.counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:tierkv_{name}", documentation=text,
                                  labelnames=labelnames), per_engine_labelvalues)
            for name, text in COUNTERS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self.counters.items():
            value = int(transfer_stats_data.get(name, 0))
            if value:
                per_engine[engine_idx].inc(value)
