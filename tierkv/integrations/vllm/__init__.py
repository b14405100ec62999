"""A KV connector for vLLM v1: ``TierKVConnector`` (see ``connector.py`` and docs/vllm.md).

vLLM loads it by name from this package; the class (and vLLM with it) is imported on first
use, so that the scheduler and worker halves import without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierkv.integrations.vllm.connector import TierKVConnector

__all__ = ["TierKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "TierKVConnector":
        from tierkv.integrations.vllm.connector import TierKVConnector

        return TierKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
