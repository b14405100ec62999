"""Engines and applications on top of tierkv: each module here adapts one of them.

``tierkv.integrations.vllm``: a KV connector for vLLM v1 (``TierKVConnector``).
``tierkv.integrations.transformers``: a transformers model's KV cache as blocks
(``save_kv``/``restore_kv``) and chats that keep it across restarts (``ChatSession``).
"""
