"""Engines and applications on top of tierkv: each module here adapts one of them.

``tierkv.integrations.vllm``: a KV connector for vLLM v1 (``TierKVConnector``).
"""
