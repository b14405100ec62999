"""Hugging Face transformers on tierkv: a model's KV cache as blocks, and chats that keep it.

``save_kv`` stores the full blocks of a ``Cache``; ``restore_kv`` gives back the longest cached
prefix of a token sequence as a ``DynamicCache`` the model accepts, so only the rest is
prefilled (``restore_kv_detail`` also says what was read); ``model_groups`` names a model's
blocks, one namespace per group of layers of one kind (full attention, sliding window of one
size), and ``model_namespace`` the model itself; ``ChatSession`` runs a multi-turn chat whose
KV survives turns, processes and restarts. Each takes any ``tierkv.BlockStore``: a sidecar
``Client`` or an in-process ``TieredStore``. Supports
transformers 5.x (its ``Cache.layers`` API). Nothing here is imported by ``tierkv`` itself,
and transformers is imported only when a cache is built.
"""

from tierkv.integrations.transformers.chat import ChatSession, TurnResult
from tierkv.integrations.transformers.groups import (
    HASH_ALGORITHM,
    HASH_SEED,
    KVGroup,
    KVGroups,
    model_groups,
    model_namespace,
)
from tierkv.integrations.transformers.kv import (
    KVRestore,
    blocks_to_cache,
    cache_to_blocks,
    hashes_of,
    restore_kv,
    restore_kv_detail,
    save_kv,
)

__all__ = [
    "HASH_ALGORITHM",
    "HASH_SEED",
    "ChatSession",
    "KVGroup",
    "KVGroups",
    "KVRestore",
    "TurnResult",
    "blocks_to_cache",
    "cache_to_blocks",
    "hashes_of",
    "model_groups",
    "model_namespace",
    "restore_kv",
    "restore_kv_detail",
    "save_kv",
]
