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
4. The namespace is the model's identity: its class, a digest of the config fields that
   change the KV math (layers, heads, head dim, vocabulary, rope settings...; not
   ``_name_or_path`` nor ``transformers_version``, so one checkpoint loaded by two paths or
   under two transformers releases still hits), the attention implementation (eager, sdpa and
   flash give different bf16 K/V), the dtype, a digest of the weights themselves (see
   ``weights_digest``), the active PEFT adapters, the KV layout and the tenant. ``model_id``
   is an explicit override: given, it replaces the weights digest (the caller vouches for the
   weights: a revision, a content hash it already has).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

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
    """The namespace of ``model``'s KV blocks (see note 4). ``model_id``, when given, stands
    for the weights instead of their digest: blocks of two models with one config, dtype and
    ``model_id`` meet, so it must change whenever the weights do."""
    config = model.config
    layout = KVLayout.from_hf_config(config, block_size=block_size, dtype=model.dtype)
    config_dict = {k: v for k, v in config.to_dict().items()
                   if not k.startswith("_") and k not in _NOT_KV_MATH}
    digest = hashlib.sha256(
        json.dumps(config_dict, sort_keys=True, default=str).encode()
    ).hexdigest()[:16]
    seed_digest = none_hash(HASH_SEED, HASH_ALGORITHM).hex()[:16]
    parts = [
        f"transformers:{type(model).__name__}",
        f"id={model_id}" if model_id else f"weights={weights_digest(model)}",
        f"config={digest}",
        f"attn={getattr(config, '_attn_implementation', None)}",
        f"dtype={model.dtype}",
        f"hash={HASH_ALGORITHM}:{seed_digest}",
    ]
    adapters = _active_adapters(model)
    if adapters:
        parts.append(f"adapters={','.join(adapters)}")
    return Namespace("|".join(parts), layout, tenant=tenant)


_NOT_KV_MATH = frozenset({"transformers_version", "dtype", "torch_dtype"})
"""Config keys that do not change the KV (the dtype is ``model.dtype``, in the namespace)."""

_WEIGHT_DIGESTS: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], str]] = (
    weakref.WeakKeyDictionary())


def weights_digest(model: Any) -> str:
    """An xxh3-128 digest of ``model``'s weights: every parameter then every buffer, in
    ``named_parameters()``/``named_buffers()`` order, each as its name, shape, dtype and bytes
    (one hash update per tensor, from a contiguous CPU view; a GPU tensor is copied to the host
    one at a time).

    Computed once per model object and cached. The cache is dropped when a cheap stamp changes:
    a tensor replaced, moved, reshaped or written in place by a torch op (its version counter:
    ``load_state_dict``, an optimizer step, ``copy_``). Writes that bypass the counter (through
    ``.data``, numpy, or the memory of a mapped file) are not noticed: pass ``model_id`` then.
    Measured on a 2-core CPU for the bench model (``BENCH_156M``: 187M tensors' elements with
    the embeddings, 374 MB in bf16): 40-80 ms the first time, then about 0.3 ms per call.
    """
    tensors = [*model.named_parameters(), *model.named_buffers()]
    stamp = tuple((name, t.data_ptr(), t._version, t.shape, t.dtype, t.device)
                  for name, t in tensors)
    cached = _WEIGHT_DIGESTS.get(model)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    hasher = xxhash.xxh3_128()
    for name, tensor in tensors:
        if tensor.device.type == "meta":
            raise InvalidArgumentError(
                f"model_namespace: {name} is on the meta device (offloaded weights): pass "
                "model_id= to name the weights")
        hasher.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}\n".encode())
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        hasher.update(data.view(torch.uint8).numpy())
    digest = hasher.hexdigest()
    _WEIGHT_DIGESTS[model] = (stamp, digest)
    return digest


def _active_adapters(model: Any) -> list[str]:
    """The names of the PEFT adapters active on ``model`` (a transformers model with adapters
    loaded, or a ``peft`` wrapper); empty without any."""
    if not (getattr(model, "_hf_peft_config_loaded", False) or hasattr(model, "peft_config")):
        return []
    active = getattr(model, "active_adapters", None)
    names = active() if callable(active) else active
    if names is None:
        return []
    return [str(names)] if isinstance(names, str) else [str(name) for name in names]


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
    ``[1, H, n*bs, D]`` tensors of its own, on ``blocks``' device (note 1: one strided copy per
    layer and K/V into new tensors, which the cache takes as they are; it does not alias
    ``blocks``)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    num_blocks, block_size = blocks.shape[0], layout.block_size
    heads, dim = layout.num_kv_heads, layout.head_dim
    cache = DynamicCache()
    for index in range(layout.num_layers):
        kv = []
        for kind in (0, 1):
            tensor = torch.empty((1, heads, num_blocks * block_size, dim), dtype=blocks.dtype,
                                 device=blocks.device)
            # [1, H, n*bs, D] -> [H, n, bs, D] (a view) <- [n, bs, H, D] permuted.
            tensor.view(heads, num_blocks, block_size, dim).copy_(
                blocks[:, index, kind].permute(2, 0, 1, 3))
            kv.append(tensor)
        # What DynamicLayer.update does on its first call, less its torch.cat onto an empty
        # tensor (a second copy); tests/test_transformers_kv.py checks it on each release.
        layer = DynamicLayer()  # type: ignore[no-untyped-call]
        layer.lazy_initialization(kv[0], kv[1])
        layer.keys, layer.values = kv[0], kv[1]
        cache.layers.append(layer)
    return cache
