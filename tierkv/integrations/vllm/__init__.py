"""A KV connector for vLLM v1: ``TierKVConnector`` (see ``connector.py`` and the README).

Importing this package imports vLLM.
"""

from tierkv.integrations.vllm.connector import TierKVConnector

__all__ = ["TierKVConnector"]
