"""A transformers model's KV cache groups and the namespaces that name their blocks.

A group is the layers of one kind: full attention, or sliding-window attention of one window.
Each group has a namespace of its own, so blocks of two groups, windows or models never meet.

Notes:
1. The namespace is the model's identity: its class, a digest of the config fields that
   change the KV math (layers, heads, head dim, vocabulary, rope settings, layer types and
   windows...; not ``_name_or_path`` nor ``transformers_version``, so one checkpoint loaded by
   two paths or under two transformers releases still hits), the attention implementation
   (eager, sdpa and flash give different bf16 K/V), the dtype, a digest of the weights
   themselves (see ``weights_digest``), the active PEFT adapters, the KV layout and the
   tenant. ``model_id`` is an explicit override: given, it replaces the weights digest (the
   caller vouches for the weights: a revision, a content hash it already has).
2. A model whose layers are all plain full attention has one group, named by the model's
   namespace itself, as before groups existed: its stored blocks keep hitting. Any other model
   names each group in its namespace's ``model_id`` (``|group=full``,
   ``|group=sliding:<window>``) and in its layout (the group's own number of layers).
3. The layers are what ``DynamicCache(config=...)`` builds for the config, which is what the
   model builds itself: ``DynamicLayer`` (full) and ``DynamicSlidingWindowLayer`` (sliding
   window; transformers uses it for chunked attention too, whose cache behaves the same).
   Other layers (linear attention, state-space, indexed, hybrid) are refused.
4. DeepSeek V2/V3 (MLA): transformers caches per layer one "head" of keys holding the
   compressed latent (``kv_lora_rank``) and one of values holding the shared rope key
   (``qk_rope_head_dim``), not per-head K and V. Their layout says just that:
   ``KVLayout(L, 1, kv_lora_rank, head_dim_v=qk_rope_head_dim)`` (the bytes of vLLM's
   latent, ``[L, bs, 1, kv_lora_rank + qk_rope_head_dim]``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from tierkv.errors import InvalidArgumentError
from tierkv.hashing import VLLM_DEFAULT_SEED, HashAlgorithm, none_hash
from tierkv.keys import Namespace
from tierkv.layout import KVLayout

HASH_ALGORITHM: HashAlgorithm = "sha256"
HASH_SEED = VLLM_DEFAULT_SEED


@dataclass(frozen=True, slots=True)
class KVGroup:
    """The cache layers of one kind and the namespace of their blocks.

    ``layer_indices``: the model's layers in this group, in order (block layer ``i`` is model
    layer ``layer_indices[i]``; the layout has that many layers). ``sliding_window_tokens``:
    None for full attention, else the window: a token attends to itself and the
    ``window - 1`` tokens before it, which is what its cache layer keeps.
    """

    namespace: Namespace
    layer_indices: tuple[int, ...]
    sliding_window_tokens: int | None = None

    @property
    def name(self) -> str:
        """``full`` or ``sliding:<window>``."""
        return _group_name(self.sliding_window_tokens)


@dataclass(frozen=True, slots=True)
class KVGroups:
    """A model's KV cache groups (see the module notes).

    ``namespace`` is the model's (session records are kept under it); a model of one
    full-attention group stores its blocks under it too. Every group has the block size of
    ``namespace``.
    """

    namespace: Namespace
    groups: tuple[KVGroup, ...]

    @property
    def num_layers(self) -> int:
        """How many cache layers the model has."""
        return sum(len(group.layer_indices) for group in self.groups)

    @property
    def block_size(self) -> int:
        """Tokens per block, in every group."""
        return self.namespace.layout.block_size

    @classmethod
    def of_namespace(cls, namespace: Namespace) -> KVGroups:
        """One full-attention group over every layer of ``namespace``'s layout."""
        layers = tuple(range(namespace.layout.num_layers))
        return cls(namespace, (KVGroup(namespace, layers),))


def model_namespace(model: Any, *, block_size: int = 16, tenant: str = "default",
                    model_id: str | None = None) -> Namespace:
    """The namespace of ``model`` (note 1): of its blocks when all its layers are full
    attention, else of its session records (``model_groups`` names each group's blocks).
    ``model_id``, when given, stands for the weights instead of their digest: blocks of two
    models with one config, dtype and ``model_id`` meet, so it must change whenever the
    weights do."""
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


def model_groups(model: Any, *, block_size: int = 16, tenant: str = "default",
                 model_id: str | None = None) -> KVGroups:
    """``model``'s cache groups, each with its namespace (notes 2-3); the arguments are
    ``model_namespace``'s. Raises ``InvalidArgumentError`` naming the layers when the model's
    cache has layers tierkv does not store."""
    namespace = model_namespace(model, block_size=block_size, tenant=tenant, model_id=model_id)
    windows = _layer_windows(model, namespace.layout.num_layers)
    kinds = sorted(set(windows), key=lambda window: -1 if window is None else window)
    if kinds == [None]:
        return KVGroups.of_namespace(namespace)
    groups = []
    for window in kinds:
        indices = tuple(i for i, w in enumerate(windows) if w == window)
        layout = dataclasses.replace(namespace.layout, num_layers=len(indices))
        group_namespace = Namespace(f"{namespace.model_id}|group={_group_name(window)}",
                                    layout, tenant=tenant)
        groups.append(KVGroup(group_namespace, indices, window))
    return KVGroups(namespace, tuple(groups))


def _group_name(window: int | None) -> str:
    return "full" if window is None else f"sliding:{window}"


def _layer_windows(model: Any, num_layers: int) -> list[int | None]:
    """Each cache layer's sliding window (None: full attention), as the model's own
    ``DynamicCache`` would build it (note 3)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    config = model.config.get_text_config(decoder=True)
    layers = DynamicCache(config=model.config).layers
    if not layers and not getattr(config, "num_kv_shared_layers", None):
        return [None] * num_layers  # a config without layer types: the cache grows DynamicLayers
    odd = sorted({type(layer).__name__ for layer in layers
                  if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)})
    if odd:
        raise InvalidArgumentError(
            f"{type(model).__name__}'s cache has {', '.join(odd)} layers, which tierkv does "
            "not store")
    if len(layers) != num_layers or getattr(config, "num_kv_shared_layers", None):
        raise InvalidArgumentError(
            f"{type(model).__name__}'s cache has {len(layers)} layers for {num_layers} "
            "hidden layers (shared KV layers), which tierkv does not store")
    windows: list[int | None] = []
    for layer in layers:
        window = (getattr(layer, "sliding_window", None)
                  if type(layer) is DynamicSlidingWindowLayer else None)
        if window is not None and (not isinstance(window, int) or window < 2):
            raise InvalidArgumentError(
                f"{type(model).__name__}: a sliding window of {window!r} tokens is not stored")
        windows.append(window)
    return windows


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
