"""A transformers model's KV cache as tierkv blocks, and back.

Notes:
1. Bulk copies only. A cache layer holds ``[1, H, S, D]`` keys and values; a run of ``n``
   blocks of a group is ``[n, *layout.block_shape]`` (``[n, L, 2, bs, H, D]``, or
   ``[n, L, bs, H, Dk + Dv]`` when K and V have two head sizes: K then V). Each direction is
   one strided ``copy_`` per layer and per K/V for the whole run: no Python work per token or
   per block.
2. Only full blocks are saved, and only those not yet stored (one lookup per group first). A
   restore always leaves at least the last token of the sequence to prefill, so that the model
   gives the logits of the next token.
3. The hash scheme is fixed: vLLM's default algorithm and seed, given explicitly, so that the
   block hashes do not depend on this process's ``PYTHONHASHSEED``. It is named in the
   namespace too, as the vLLM connector does: blocks hashed another way never meet these.
4. Groups (``groups.py``): a full-attention group stores and loads every block of the prefix.
   A sliding-window layer of window ``w`` keeps only its last ``w - 1`` tokens: ``save_kv``
   stores every full block the layer still holds (``ChatSession`` records a turn's whole past,
   so that is every block), and a restore of ``P`` tokens loads only the blocks that cover
   tokens ``[P - w + 1, P)`` and rebuilds the layer as a prefill of ``P`` tokens leaves it:
   those tokens, ``cumulative_length = P``.
5. The restored length is the longest block-aligned prefix for which every group has the
   blocks it needs (full: ``[0, P)``; sliding: its window's), found with ``lookup`` on those
   ranges: block hashes are chained, so a block's hash names its whole prefix. First the
   prefix every group holds from block 0 (one lookup each), then at most
   ``MAX_WINDOW_PROBES`` window lookups for a longer one. A block evicted between the lookup
   and the read cuts the restore to what was read, or makes it a miss when that leaves a
   window short.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierkv.block_store import BlockStore
from tierkv.config import Priority, WritePolicy
from tierkv.errors import InvalidArgumentError
from tierkv.hashing import block_hashes
from tierkv.integrations.transformers.groups import (
    HASH_ALGORITHM,
    HASH_SEED,
    KVGroup,
    KVGroups,
)
from tierkv.keys import BlockHash, Namespace
from tierkv.layout import KVLayout
from tierkv.types import PutDetail

MAX_WINDOW_PROBES = 8
"""Window lookups a restore makes beyond one per group (note 5)."""

Pairs = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class KVRestore:
    """What ``restore_kv_detail`` restored: the cache (None on a miss), how many tokens it
    holds, and what was read for it: blocks per group (in ``KVGroups.groups`` order) and
    their bytes."""

    cache: Any
    num_cached_tokens: int
    num_loaded_blocks: tuple[int, ...]
    num_loaded_bytes: int


def hashes_of(namespace: Namespace, token_ids: Sequence[int]) -> list[BlockHash]:
    """The block hashes of every full block of ``token_ids`` in ``namespace`` (note 3)."""
    return block_hashes(token_ids, namespace.layout.block_size, HASH_SEED,
                        algorithm=HASH_ALGORITHM)


def save_kv(store: BlockStore, namespace: Namespace | KVGroups, token_ids: Sequence[int],
            cache: Any, *, priority: Priority = Priority.SESSION,
            write_policy: WritePolicy | None = WritePolicy.WRITE_THROUGH) -> int:
    """Store the full blocks of ``cache`` (the KV of ``token_ids``, or of a prefix of them: the
    last generated token is usually not in it yet) that are not stored yet, in each group's
    namespace (``namespace``: a model's ``KVGroups``, or one namespace of full-attention
    layers); returns how many blocks were newly stored. A sliding-window layer holds only its
    last ``window - 1`` tokens, whose blocks rarely cover a later restore's window, unless the
    cache records its past (``cache.activate_past_recording()`` before the prefill, as
    ``ChatSession`` does): then every full block is stored."""
    groups = _groups_of(namespace)
    block_size = groups.block_size
    held = [_held_by(cache, groups, group) for group in groups.groups]  # all checked first
    _register(store, groups)
    end_token = min(len(token_ids), max(end for _, _, end in held))
    hashes = hashes_of(groups.namespace, token_ids[: end_token // block_size * block_size])
    num_new = 0
    for group, (pairs, first_token, end) in zip(groups.groups, held, strict=True):
        first_block = -(-first_token // block_size)
        end_block = min(end, end_token) // block_size
        if end_block <= first_block:
            continue
        start = first_block + store.lookup(group.namespace, hashes[first_block:end_block])
        if start >= end_block:
            continue
        blocks = _to_blocks(pairs, group.namespace.layout, start, end_block, first_token)
        num_new += store.put(group.namespace, hashes[start:end_block], blocks,
                             priority=priority, write_policy=write_policy,
                             detail=PutDetail(parent_hash=hashes[start - 1]) if start else None)
    return num_new


def restore_kv(store: BlockStore, namespace: Namespace | KVGroups, token_ids: Sequence[int], *,
               device: torch.device | str | None = None,
               out: torch.Tensor | None = None) -> tuple[Any, int]:
    """The longest cached prefix of ``token_ids`` as a ``DynamicCache`` on ``device`` (default
    CPU), and its length in tokens; ``(None, 0)`` on a miss. See ``restore_kv_detail``."""
    restored = restore_kv_detail(store, namespace, token_ids, device=device, out=out)
    return restored.cache, restored.num_cached_tokens


def restore_kv_detail(store: BlockStore, namespace: Namespace | KVGroups,
                      token_ids: Sequence[int], *, device: torch.device | str | None = None,
                      out: torch.Tensor | None = None) -> KVRestore:
    """The longest prefix of ``token_ids`` every group can serve (notes 4-5) as a
    ``DynamicCache`` on ``device`` (default CPU), with what was read for it. At least the last
    token is left to prefill (note 2). ``out``, a ``[>= n, *block_shape]`` tensor of the
    layout's dtype, is the landing buffer of a one-group model when it is large enough (the
    cache does not keep it)."""
    groups = _groups_of(namespace)
    block_size = groups.block_size
    miss = KVRestore(None, 0, (0,) * len(groups.groups), 0)
    num_usable = (len(token_ids) - 1) // block_size
    hashes = hashes_of(groups.namespace, token_ids[: num_usable * block_size])
    if hashes:
        _register(store, groups)
    num_blocks = _longest_hit(store, groups, hashes) if hashes else 0
    if num_blocks == 0:
        return miss
    device = torch.device(device or "cpu")
    runs = []
    for group in groups.groups:
        first = _window_start(group, num_blocks, block_size)
        landing = _landing(out if len(groups.groups) == 1 else None, group.namespace.layout,
                           num_blocks - first, device)
        num_got = store.get_into(group.namespace, hashes[first:num_blocks], landing)
        runs.append((first, landing[:num_got]))
    num_read = min(first + run.shape[0] for first, run in runs)  # evicted since the lookup?
    if num_read == 0 or any(_window_start(group, num_read, block_size) != first
                            for group, (first, _) in zip(groups.groups, runs, strict=True)):
        return miss
    cache = _cache_of(groups, runs, num_read)
    num_loaded = tuple(run.shape[0] for _, run in runs)
    num_bytes = sum(num * group.namespace.layout.bytes_per_block
                    for num, group in zip(num_loaded, groups.groups, strict=True))
    return KVRestore(cache, num_read * block_size, num_loaded, num_bytes)


def cache_to_blocks(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout,
                    first_block: int, end_block: int) -> torch.Tensor:
    """Blocks ``[first_block, end_block)`` of per-layer ``[1, H, S, D]`` keys and values
    (holding tokens from 0) as a new contiguous CPU ``[n, *block_shape]`` tensor (note 1)."""
    return _to_blocks(list(layers), layout, first_block, end_block, 0)


def blocks_to_cache(blocks: torch.Tensor, layout: KVLayout) -> Any:
    """A ``DynamicCache`` of full-attention layers holding ``blocks`` (``[n, *block_shape]``)
    as per-layer ``[1, H, n*bs, D]`` tensors of its own, on ``blocks``' device (note 1: one
    strided copy per layer and K/V into new tensors, which the cache takes as they are; it does
    not alias ``blocks``)."""
    groups = KVGroups.of_namespace(Namespace("blocks_to_cache", layout))
    return _cache_of(groups, [(0, blocks)], blocks.shape[0])


def _groups_of(namespace: Namespace | KVGroups) -> KVGroups:
    groups = namespace if isinstance(namespace, KVGroups) else KVGroups.of_namespace(namespace)
    for group in groups.groups:
        if group.namespace.layout.value_head_dim == 0:
            raise InvalidArgumentError(
                f"{group.namespace.model_id}: a layout without V (head_dim_v=0) does not say "
                "how a transformers cache splits it into keys and values: use model_groups()")
    return groups


def _held_by(cache: Any, groups: KVGroups, group: KVGroup) -> tuple[Pairs, int, int]:
    """The ``(keys, values)`` of ``group``'s layers in ``cache``, checked against its layout
    and kind, and the tokens ``[first, end)`` they hold."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise InvalidArgumentError(
            f"save_kv: needs a transformers 5 Cache with .layers, got {type(cache).__name__}")
    if len(layers) != groups.num_layers:
        raise InvalidArgumentError(
            f"save_kv: the cache has {len(layers)} layers, the namespace's layout "
            f"{groups.num_layers}: wrong model or namespace")
    layout, window = group.namespace.layout, group.sliding_window_tokens
    heads = layout.num_kv_heads
    pairs, spans = [], set()
    for index in group.layer_indices:
        layer = layers[index]
        is_sliding = bool(getattr(layer, "is_sliding", False))
        if is_sliding != (window is not None) or (
                is_sliding and getattr(layer, "sliding_window", None) != window):
            raise InvalidArgumentError(
                f"save_kv: cache layer {index} is a {type(layer).__name__}, the namespace "
                f"expects a {group.name} layer: pass model_groups(model)")
        keys, values = layer.keys, layer.values
        expected = ((1, heads, layout.head_dim), (1, heads, layout.value_head_dim))
        if (keys is None or values is None or keys.dim() != 4 or values.dim() != 4
                or ((keys.shape[0], keys.shape[1], keys.shape[3]),
                    (values.shape[0], values.shape[1], values.shape[3])) != expected
                or keys.shape[2] != values.shape[2]
                or {keys.dtype, values.dtype} != {layout.torch_dtype}):
            shape = None if keys is None else (tuple(keys.shape), keys.dtype)
            raise InvalidArgumentError(
                f"save_kv: cache layer {index} holds {shape}; the layout needs keys "
                f"[1, {heads}, S, {layout.head_dim}] and values [1, {heads}, S, "
                f"{layout.value_head_dim}] of {layout.torch_dtype} (batch 1, same model and "
                "dtype)")
        num_held = int(keys.shape[2])
        end = int(layer.cumulative_length) if is_sliding else num_held
        spans.add((end - num_held, end))
        pairs.append((keys, values))
    if len(spans) != 1:
        raise InvalidArgumentError(f"save_kv: the {group.name} layers hold different tokens "
                                   f"({sorted(spans)})")
    first, end = spans.pop()
    return pairs, first, end


def _kv_views(blocks: torch.Tensor, layout: KVLayout,
              index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``index`` of ``[n, *block_shape]`` blocks as K and V views ``[n, bs, H, D]``."""
    if layout.is_split:
        return blocks[:, index, 0], blocks[:, index, 1]
    layer = blocks[:, index]
    return layer[..., : layout.head_dim], layer[..., layout.head_dim:]


def _to_blocks(pairs: Pairs, layout: KVLayout, first_block: int, end_block: int,
               first_token: int) -> torch.Tensor:
    """Blocks ``[first_block, end_block)`` of layers whose tensors hold tokens from
    ``first_token`` on, as a new contiguous CPU ``[n, *block_shape]`` tensor (note 1)."""
    num_blocks, block_size = end_block - first_block, layout.block_size
    blocks = torch.empty((num_blocks, *layout.block_shape), dtype=layout.torch_dtype)
    start = first_block * block_size - first_token
    end = start + num_blocks * block_size
    for index, kv in enumerate(pairs):
        for view, tensor in zip(_kv_views(blocks, layout, index), kv, strict=True):
            # [H, n*bs, D] -> [H, n, bs, D] -> [n, bs, H, D]: a view; copy_ does the move.
            heads, dim = tensor.shape[1], tensor.shape[3]
            run = tensor[0, :, start:end].reshape(heads, num_blocks, block_size, dim)
            view.copy_(run.permute(1, 2, 0, 3))
    return blocks


def _tokens_of(view: torch.Tensor) -> torch.Tensor:
    """``[n, bs, H, D]`` blocks of one layer's K or V as a new ``[1, H, n*bs, D]`` tensor."""
    num_blocks, block_size, heads, dim = view.shape
    tensor = torch.empty((1, heads, num_blocks * block_size, dim), dtype=view.dtype,
                         device=view.device)
    # [1, H, n*bs, D] -> [H, n, bs, D] (a view) <- [n, bs, H, D] permuted.
    tensor.view(heads, num_blocks, block_size, dim).copy_(view.permute(2, 0, 1, 3))
    return tensor


def _cache_of(groups: KVGroups, runs: list[tuple[int, torch.Tensor]], num_blocks: int) -> Any:
    """A ``DynamicCache`` of ``num_blocks`` blocks' tokens, from each group's run of blocks
    (``(first block, [n, *block_shape])``), its layers as a prefill of those tokens leaves
    them (note 4). What ``DynamicLayer.update`` does on its first call, less its ``torch.cat``
    onto an empty tensor (a second copy);
    tests/integrations/transformers/test_transformers_kv.py checks it on each release."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    num_tokens = num_blocks * groups.block_size
    layers: list[Any] = [None] * groups.num_layers
    for group, (first, blocks) in zip(groups.groups, runs, strict=True):
        run = blocks[: num_blocks - first]
        window = group.sliding_window_tokens
        for index, layer_index in enumerate(group.layer_indices):
            keys, values = (_tokens_of(view)
                            for view in _kv_views(run, group.namespace.layout, index))
            if window is None:
                layer = DynamicLayer()  # type: ignore[no-untyped-call]
            else:
                # A prefill keeps the last window - 1 tokens (a view of its concatenation).
                skip = num_tokens - min(num_tokens, window - 1) - first * groups.block_size
                keys, values = keys[:, :, skip:], values[:, :, skip:]
                layer = DynamicSlidingWindowLayer(sliding_window=window)
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            if window is not None:
                layer.cumulative_length = num_tokens
            layers[layer_index] = layer
    cache = DynamicCache()
    cache.layers.extend(layers)
    return cache


def _window_start(group: KVGroup, num_blocks: int, block_size: int) -> int:
    """The first block a restore of ``num_blocks`` blocks needs from ``group`` (note 4)."""
    window = group.sliding_window_tokens
    if window is None:
        return 0
    return max(0, num_blocks * block_size - window + 1) // block_size


def _register(store: BlockStore, groups: KVGroups) -> None:
    """Register every group's namespace (an in-process store refuses unknown ones)."""
    for group in groups.groups:
        store.register(group.namespace)


def _longest_hit(store: BlockStore, groups: KVGroups, hashes: Sequence[BlockHash]) -> int:
    """How many leading blocks of ``hashes`` every group can serve (note 5)."""
    num_blocks = len(hashes)
    sliding = [group for group in groups.groups if group.sliding_window_tokens is not None]
    for group in groups.groups:
        if group.sliding_window_tokens is None and num_blocks:
            num_blocks = store.lookup(group.namespace, hashes[:num_blocks])
    floor = num_blocks  # held from block 0 by every group: any window inside it is there
    for group in sliding:
        if floor:
            floor = store.lookup(group.namespace, hashes[:floor])
    num_probes = 0
    while num_blocks > floor and num_probes < MAX_WINDOW_PROBES:
        for group in sliding:
            first = _window_start(group, num_blocks, groups.block_size)
            num_found = store.lookup(group.namespace, hashes[first:num_blocks])
            num_probes += 1
            if first + num_found < num_blocks:
                num_blocks = first + num_found
                break
        else:
            return num_blocks
    return floor


def _landing(out: torch.Tensor | None, layout: KVLayout, num_blocks: int,
             device: torch.device) -> torch.Tensor:
    if (out is None or out.shape[0] < num_blocks or out.device != device
            or out.dtype != layout.torch_dtype or tuple(out.shape[1:]) != layout.block_shape):
        return torch.empty((num_blocks, *layout.block_shape), dtype=layout.torch_dtype,
                           device=device)
    return out
