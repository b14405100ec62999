"""A transformers model's KV cache as tierkv blocks, and back.

Notes:
1. Bulk copies only. A cache layer holds ``[1, H, S, D]`` keys and values; a run of ``n``
   blocks is ``[n, L, 2, bs, H, D]``. Each direction is one strided ``copy_`` per layer and per
   K/V for the whole run: no Python work per token or per block.
2. Only full blocks are saved, and only those not yet stored (one lookup first). A restore
   always leaves at least the last token of the sequence to prefill, so that the model gives
   the logits of the next token.
3. The hash scheme is fixed: vLLM's default algorithm and seed, given explicitly, so that the
   block hashes do not depend on this process's ``PYTHONHASHSEED``. It is named in the
   namespace too, as the vLLM connector does: blocks hashed another way never meet these.
4. The namespace separates models by a digest of their config (layers, heads, head dim,
   vocabulary, rope settings, name or path...), the dtype the model runs in, the KV layout and
   the tenant. Two checkpoints with one config and different weights share a namespace unless
   ``model_id`` tells them apart (a revision, a path).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from tierkv.config import Priority, WritePolicy
from tierkv.errors import InvalidArgumentError
from tierkv.hashing import VLLM_DEFAULT_SEED, HashAlgorithm, block_hashes, none_hash
from tierkv.integrations.transformers.store import BlockStore
from tierkv.keys import BlockHash, Namespace
from tierkv.layout import KVLayout

HASH_ALGORITHM: HashAlgorithm = "sha256"
HASH_SEED = VLLM_DEFAULT_SEED


def model_namespace(model: Any, *, block_size: int = 16, tenant: str = "default",
                    model_id: str | None = None) -> Namespace:
    """The namespace of ``model``'s KV blocks (see note 4); ``model_id`` adds an identity of
    the weights that the config does not show."""
    config = model.config
    layout = KVLayout.from_hf_config(config, block_size=block_size, dtype=model.dtype)
    config_dict = {k: v for k, v in config.to_dict().items()
                   if not k.startswith("_") or k == "_name_or_path"}
    digest = hashlib.sha256(
        json.dumps(config_dict, sort_keys=True, default=str).encode()
    ).hexdigest()[:16]
    seed_digest = none_hash(HASH_SEED, HASH_ALGORITHM).hex()[:16]
    parts = [
        f"transformers:{type(model).__name__}",
        f"config={digest}",
        f"weights={model.dtype}",
        f"hash={HASH_ALGORITHM}:{seed_digest}",
    ]
    if model_id:
        parts.insert(1, f"id={model_id}")
    return Namespace("|".join(parts), layout, tenant=tenant)


def hashes_of(namespace: Namespace, token_ids: Sequence[int]) -> list[BlockHash]:
    """The block hashes of every full block of ``token_ids`` in ``namespace`` (note 3)."""
    return block_hashes(token_ids, namespace.layout.block_size, HASH_SEED,
                        algorithm=HASH_ALGORITHM)


def save_kv(store: BlockStore, namespace: Namespace, token_ids: Sequence[int], cache: Any, *,
            priority: Priority = Priority.SESSION,
            write_policy: WritePolicy | None = WritePolicy.WRITE_THROUGH) -> int:
    """Store the full blocks of ``cache`` (the KV of ``token_ids``, or of a prefix of them: the
    last generated token is usually not in it yet) that are not stored yet; returns how many
    blocks were newly stored."""
    layers = _layers_of(cache, namespace.layout)
    block_size = namespace.layout.block_size
    num_tokens = min(len(token_ids), int(layers[0][0].shape[-2]))
    hashes = hashes_of(namespace, token_ids[: num_tokens // block_size * block_size])
    if not hashes:
        return 0
    num_stored = store.lookup(namespace, hashes)
    if num_stored >= len(hashes):
        return 0
    blocks = cache_to_blocks(layers, namespace.layout, num_stored, len(hashes))
    return store.put(namespace, hashes[num_stored:], blocks, priority=priority,
                     write_policy=write_policy)


def restore_kv(store: BlockStore, namespace: Namespace, token_ids: Sequence[int], *,
               device: torch.device | str | None = None,
               out: torch.Tensor | None = None) -> tuple[Any, int]:
    """The longest cached prefix of ``token_ids`` as a ``DynamicCache`` on ``device`` (default
    CPU), and its length in tokens; ``(None, 0)`` on a miss. At least the last token is left to
    prefill (note 2). ``out``, a ``[>= n, *block_shape]`` tensor of the layout's dtype, is used
    as the landing buffer when it is large enough (the cache does not keep it)."""
    layout = namespace.layout
    num_usable = (len(token_ids) - 1) // layout.block_size * layout.block_size
    hashes = hashes_of(namespace, token_ids[:num_usable]) if num_usable > 0 else []
    num_found = store.lookup(namespace, hashes) if hashes else 0
    if num_found == 0:
        return None, 0
    device = torch.device(device or "cpu")
    if (out is None or out.shape[0] < num_found or out.device != device
            or out.dtype != layout.torch_dtype or tuple(out.shape[1:]) != layout.block_shape):
        out = torch.empty((num_found, *layout.block_shape), dtype=layout.torch_dtype,
                          device=device)
    num_got = store.get_into(namespace, hashes[:num_found], out)
    if num_got == 0:  # evicted between the lookup and the read
        return None, 0
    return blocks_to_cache(out[:num_got], layout), num_got * layout.block_size


def _layers_of(cache: Any, layout: KVLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The cache's per-layer ``(keys, values)``, checked against ``layout``."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise InvalidArgumentError(
            f"save_kv: needs a transformers 5 Cache with .layers, got {type(cache).__name__}")
    if len(layers) != layout.num_layers:
        raise InvalidArgumentError(
            f"save_kv: the cache has {len(layers)} layers, the namespace's layout "
            f"{layout.num_layers}: wrong model or namespace")
    pairs = []
    expected = (1, layout.num_kv_heads, layout.head_dim, layout.torch_dtype)
    for layer in layers:
        if getattr(layer, "is_sliding", False):
            raise InvalidArgumentError("save_kv: sliding-window cache layers are not supported")
        keys, values = layer.keys, layer.values
        got = (keys.shape[0], keys.shape[1], keys.shape[3], keys.dtype)
        if got != expected or values.shape != keys.shape:
            raise InvalidArgumentError(
                f"save_kv: a cache layer is {tuple(keys.shape)} {keys.dtype}; the layout needs "
                f"[1, {layout.num_kv_heads}, S, {layout.head_dim}] {layout.torch_dtype} "
                "(batch 1, same model and dtype)")
        pairs.append((keys, values))
    return pairs


def cache_to_blocks(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout,
                    first_block: int, end_block: int) -> torch.Tensor:
    """Blocks ``[first_block, end_block)`` of per-layer ``[1, H, S, D]`` keys and values as a
    new contiguous CPU ``[n, L, 2, bs, H, D]`` tensor (note 1)."""
    num_blocks, block_size = end_block - first_block, layout.block_size
    blocks = torch.empty((num_blocks, *layout.block_shape), dtype=layout.torch_dtype)
    start, end = first_block * block_size, end_block * block_size
    heads, dim = layout.num_kv_heads, layout.head_dim
    for index, (keys, values) in enumerate(layers):
        for kind, tensor in ((0, keys), (1, values)):
            # [H, n*bs, D] -> [H, n, bs, D] -> [n, bs, H, D]: a view; copy_ does the move.
            run = tensor[0, :, start:end].reshape(heads, num_blocks, block_size, dim)
            blocks[:, index, kind].copy_(run.permute(1, 2, 0, 3))
    return blocks


def blocks_to_cache(blocks: torch.Tensor, layout: KVLayout) -> Any:
    """A ``DynamicCache`` holding ``blocks`` (``[n, L, 2, bs, H, D]``) as per-layer
    ``[1, H, n*bs, D]`` tensors of its own (note 1: the layer's concatenation is the one copy;
    the cache does not alias ``blocks``)."""
    from transformers import DynamicCache

    num_tokens = blocks.shape[0] * layout.block_size
    heads, dim = layout.num_kv_heads, layout.head_dim
    pairs = []
    for index in range(layout.num_layers):
        kv = [blocks[:, index, kind].reshape(num_tokens, heads, dim).permute(1, 0, 2)
              .unsqueeze(0) for kind in (0, 1)]
        pairs.append((kv[0], kv[1]))
    return DynamicCache(pairs)
