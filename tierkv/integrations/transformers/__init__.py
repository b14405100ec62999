"""Hugging Face transformers on tierkv: a model's KV cache as blocks, and chats that keep it.

``save_kv`` stores the full blocks of a ``Cache``; ``restore_kv`` gives back the longest cached
prefix of a token sequence as a ``DynamicCache`` the model accepts, so only the rest is
prefilled; ``model_namespace`` names a model's blocks; ``ChatSession`` runs a
multi-turn chat whose KV survives turns, processes and restarts; ``blocks_of`` adapts a sidecar
``Client`` or an in-process ``TieredStore`` to the one ``BlockStore`` interface they use.
Supports transformers 5.x (its ``Cache.layers`` API). Nothing here is imported by ``tierkv``
itself, and transformers is imported only when a cache is built.
"""

from tierkv.integrations.transformers.chat import ChatSession, TurnResult
from tierkv.integrations.transformers.kv import (
    HASH_ALGORITHM,
    HASH_SEED,
    blocks_to_cache,
    cache_to_blocks,
    hashes_of,
    model_namespace,
    restore_kv,
    save_kv,
)
from tierkv.integrations.transformers.store import BlockStore, ClientBlocks, StoreBlocks, blocks_of

__all__ = [
    "HASH_ALGORITHM",
    "HASH_SEED",
    "BlockStore",
    "ChatSession",
    "ClientBlocks",
    "StoreBlocks",
    "TurnResult",
    "blocks_of",
    "blocks_to_cache",
    "cache_to_blocks",
    "hashes_of",
    "model_namespace",
    "restore_kv",
    "save_kv",
]
