"""What the connector is told (``kv_connector_extra_config``) and what it derives from vLLM's
config: the namespace its blocks live in.

The namespace separates everything that makes two engines' blocks differ in meaning: the model
(name or path, revision, and a digest of its config), the KV layout (layers, KV heads, head
size, dtype, block size), vLLM's physical cache layout and device type (the CPU backend and the
GPU backends pack K and V differently inside a block), the TP rank and size, and the hash scheme
(algorithm and ``NONE_HASH``, which stands for the seed): blocks hashed under two schemes never
meet. ``cache_salt`` and LoRA are already inside vLLM's block hashes; the tenant comes from the
token, on the server.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from tierkv.config import Priority, WritePolicy
from tierkv.errors import ConfigError
from tierkv.keys import Namespace
from tierkv.layout import DType, KVLayout
from tierkv.wire.limits import DEFAULT_TARGET

_KEYS = frozenset({
    "address", "token", "token_file", "write_policy", "priority", "lookup_timeout_s",
    "load_timeout_s", "save_queue_bytes", "load_mode",
})
LOAD_MODES = ("sync", "async")


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's ``kv_connector_extra_config``, checked.

    ``lookup_timeout_s`` bounds a scheduler lookup when the sidecar is slow (it then answers 0
    and is not asked again for ``lookup_timeout_s * 4``, at least 1 s); ``load_timeout_s``
    bounds a load (a failed load is reported and vLLM recomputes the blocks);
    ``save_queue_bytes`` bounds the blocks waiting to be saved (more are dropped and counted).
    ``load_mode``: ``sync`` loads blocks in the step that schedules the request, layer by layer
    as the model reaches each layer; ``async`` loads them between steps while the request waits
    (vLLM's ``WAITING_FOR_REMOTE_KVS``), so other requests run meanwhile.
    """

    address: str = DEFAULT_TARGET
    token: str | None = None
    write_policy: WritePolicy | None = None  # None: the sidecar's (write_back unless set)
    priority: Priority = Priority.NORMAL
    lookup_timeout_s: float = 0.5
    load_timeout_s: float = 10.0
    save_queue_bytes: int = 512 * 1024 * 1024
    load_mode: str = "sync"

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Parse vLLM's ``kv_connector_extra_config``; an unknown key or a bad value is a
        ``ConfigError`` that names it."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ConfigError(
                f"TierKVConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"known: {sorted(_KEYS)}"
            )
        if "token" in extra and "token_file" in extra:
            raise ConfigError("TierKVConnector: give token or token_file, not both")
        token = extra.get("token")
        if "token_file" in extra:
            try:
                token = Path(str(extra["token_file"])).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"TierKVConnector: token_file: {exc}") from None
        return cls(
            address=_text(extra, "address", DEFAULT_TARGET),
            token=str(token) if token else None,
            write_policy=_choice(extra, "write_policy", WritePolicy, None),
            priority=_choice(extra, "priority", Priority, Priority.NORMAL) or Priority.NORMAL,
            lookup_timeout_s=_positive(extra, "lookup_timeout_s", 0.5),
            load_timeout_s=_positive(extra, "load_timeout_s", 10.0),
            save_queue_bytes=int(_positive(extra, "save_queue_bytes", 512 * 1024 * 1024)),
            load_mode=_one_of(extra, "load_mode", LOAD_MODES, "sync"),
        )


def _text(extra: dict[str, Any], key: str, default: str) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"TierKVConnector: {key} must be a non-empty string, got {value!r}")
    return value


E = TypeVar("E", WritePolicy, Priority)


def _choice(extra: dict[str, Any], key: str, kind: type[E], default: E | None) -> E | None:
    value = extra.get(key)
    if value is None:
        return default
    by_name = {m.name.lower(): m for m in kind} | {str(m.value).lower(): m for m in kind}
    found = by_name.get(str(value).lower())
    if found is None:
        raise ConfigError(
            f"TierKVConnector: {key}={value!r}; choose one of {sorted(m.name.lower() for m in kind)}"
        )
    return found


def _one_of(extra: dict[str, Any], key: str, choices: tuple[str, ...], default: str) -> str:
    value = extra.get(key, default)
    if value not in choices:
        raise ConfigError(f"TierKVConnector: {key}={value!r}; choose one of {list(choices)}")
    return str(value)


def _positive(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"TierKVConnector: {key} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class BlockGeometry:
    """vLLM's KV cache as the connector sees it: the attention layers in block order, tokens
    per block, and the tierkv layout of one block (every layer's ``[H, N, C]`` page, in layer
    order; C packs K and V as vLLM's backend does). ``page_dtype``: the element type vLLM's
    cache tensors hold (``torch.uint8`` for an fp8 cache, whose bytes move as they are);
    None: the layout's."""

    layer_names: tuple[str, ...]
    block_size: int
    hash_block_size: int
    layout: KVLayout
    page_dtype: torch.dtype | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        """The element type of vLLM's cache tensors (and of the connector's staging)."""
        return self.page_dtype or self.layout.torch_dtype


def geometry_of(vllm_config: Any, kv_cache_config: Any) -> BlockGeometry:
    """The block geometry of a vLLM engine with one full-attention KV cache group (hybrid
    models, MLA and quantized caches with scales are refused: their pages are not K/V of
    ``[H, N, 2 x head_size]``)."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ConfigError(f"TierKVConnector: needs one KV cache group, the model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    # Exactly full attention: MLA pages hold a latent, not K/V per head; sliding-window and
    # chunked specs free blocks that a prefix would need.
    if type(spec).__name__ != "FullAttentionSpec" or spec.head_size_v != spec.head_size:
        raise ConfigError(f"TierKVConnector: unsupported KV cache spec {type(spec).__name__} "
                          "(full attention with K and V of one head size only)")
    dtype, page_dtype = cache_dtype_of(
        spec.dtype, str(getattr(vllm_config.cache_config, "cache_dtype", "auto")))
    names = tuple(sorted(groups[0].layer_names, key=_layer_order))
    layout = KVLayout(num_layers=len(names), num_kv_heads=int(spec.num_kv_heads),
                      head_dim=int(spec.head_size), block_size=int(spec.block_size), dtype=dtype)
    hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None)
                          or vllm_config.cache_config.block_size)
    if layout.block_size % hash_block_size:
        raise ConfigError(
            f"TierKVConnector: block size {layout.block_size} is not a multiple of the hash "
            f"block size {hash_block_size}"
        )
    return BlockGeometry(names, layout.block_size, hash_block_size, layout,
                         page_dtype if page_dtype != layout.torch_dtype else None)


def cache_dtype_of(page_dtype: torch.dtype, cache_dtype: str) -> tuple[DType, torch.dtype]:
    """The KV dtype of a cache whose tensors hold ``page_dtype`` under vLLM's ``cache_dtype``
    setting, and the tensors' dtype. vLLM keeps an fp8 cache (``fp8``, ``fp8_e4m3``,
    ``fp8_e5m2``) in ``uint8`` tensors: its bytes are stored as they are, one byte an element;
    the setting itself is in the namespace, so e4m3 and e5m2 pages never meet. Its scales are
    the checkpoint's (vLLM 0.32 computes none at run time), named with the model like every
    weight."""
    if cache_dtype.startswith("fp8") and page_dtype in (torch.uint8, torch.float8_e4m3fn,
                                                         torch.float8_e5m2):
        return DType.FP8, page_dtype
    try:
        return DType.parse(page_dtype), page_dtype
    except ConfigError as exc:
        raise ConfigError(f"TierKVConnector: KV cache dtype {page_dtype} (cache_dtype "
                          f"{cache_dtype!r}): {exc}") from None


def _layer_order(name: str) -> tuple[int, str]:
    """Layers in model order (``model.layers.10`` after ``model.layers.9``), by name after."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    return (numbers[0] if numbers else -1, name)


def namespace_of(vllm_config: Any, kv_cache_config: Any, geometry: BlockGeometry,
                 tp_rank: int) -> Namespace:
    """The namespace of this engine's blocks for TP rank ``tp_rank`` (see the module doc)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    config_digest = hashlib.sha256(
        json.dumps(_config_dict(model.hf_config), sort_keys=True, default=str).encode()
    ).hexdigest()[:16]
    kv_layout = (getattr(kv_cache_config, "kv_cache_layout", None)
                 or getattr(cache, "kv_cache_layout", None) or "default")
    device = str(getattr(vllm_config.device_config, "device_type", "") or "auto")
    algorithm = str(cache.prefix_caching_hash_algo)
    # Weights quantized on the fly change every KV without changing the checkpoint's config.
    weights = f"{getattr(model, 'dtype', '')}/{getattr(model, 'quantization', None) or 'none'}"
    model_id = "|".join((
        f"vllm:{model.model}@{model.revision or 'main'}",
        f"config={config_digest}",
        f"weights={weights}",
        f"cache={kv_layout}/{device}/{cache.cache_dtype}",
        f"hash={algorithm}:{none_hash_of(algorithm).hex()[:16]}",
    ))
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    return Namespace(model_id, geometry.layout, tp_rank=tp_rank, tp_size=tp_size)


def _config_dict(hf_config: Any) -> dict[str, Any]:
    to_dict = getattr(hf_config, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else {"repr": repr(hf_config)}


def none_hash_of(algorithm: str) -> bytes:
    """vLLM's ``NONE_HASH`` for ``algorithm`` in this process: the parent of every first block,
    which stands for the seed. Taken from vLLM once it has set it; computed by vLLM's own rule
    (``PYTHONHASHSEED``, else its fixed default) when not yet."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name(algorithm)
    current = getattr(kv_cache_utils, "NONE_HASH", None)
    if current is not None and getattr(kv_cache_utils, "_NONE_HASH_SEED", None) is not None:
        seed = kv_cache_utils.get_none_hash_seed()
        if bytes(hash_fn(seed)) == bytes(current):
            return bytes(current)
    return bytes(hash_fn(kv_cache_utils.resolve_none_hash_seed(hash_fn)))
