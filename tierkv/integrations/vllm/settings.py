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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from tierkv.config import Priority, WritePolicy
from tierkv.errors import ConfigError
from tierkv.integrations.vllm.geometry import BlockGeometry, EngineGeometry
from tierkv.keys import Namespace
from tierkv.wire.limits import DEFAULT_TARGET

_KEYS = frozenset({
    "address", "token", "token_file", "write_policy", "priority", "lookup_timeout_s",
    "load_timeout_s", "save_queue_bytes", "load_mode", "event_detail", "pd_wait_timeout_s",
})
LOAD_MODES = ("auto", "sync", "async")
ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's ``kv_connector_extra_config``, checked.

    ``lookup_timeout_s`` bounds a scheduler lookup when the sidecar is slow (it then answers 0
    and is not asked again for ``lookup_timeout_s * 4``, at least 1 s); ``load_timeout_s``
    bounds a load (a failed load is reported and vLLM recomputes the blocks);
    ``save_queue_bytes`` bounds the blocks waiting to be saved (more are dropped and counted).
    ``load_mode``: ``sync`` loads blocks in the step that schedules the request (on a GPU layer
    by layer as the model reaches each layer; on a CPU whole, before the first layer);
    ``async`` loads them between steps while the request waits (vLLM's
    ``WAITING_FOR_REMOTE_KVS``), so other requests run meanwhile; ``auto`` (the default) is
    ``sync`` for an engine of one KV cache group and ``async`` for several (``for_engine``).
    ``event_detail``: saves carry
    each block's token ids, parent hash, LoRA name and extra keys (``PutDetail``), so that a
    sidecar publishing KV events puts them in its ``BlockStored`` events as vLLM's own
    publisher does (it keeps none of them); off: hashes only.

    ``role`` is vLLM's ``kv_role``: ``kv_producer`` saves and never loads, ``kv_consumer``
    loads and never saves, ``kv_both`` does both. ``pd_wait_timeout_s`` bounds how long a
    consumer waits for a prefill engine's handoff (``handoff.py``) before it computes, and how
    long a producer waits for its blocks to reach REMOTE before it says they did not.
    """

    address: str = DEFAULT_TARGET
    token: str | None = None
    write_policy: WritePolicy | None = None  # None: the sidecar's (write_back unless set)
    priority: Priority = Priority.NORMAL
    lookup_timeout_s: float = 0.5
    load_timeout_s: float = 10.0
    save_queue_bytes: int = 512 * 1024 * 1024
    load_mode: str = "auto"
    event_detail: bool = True
    role: str = "kv_both"
    pd_wait_timeout_s: float = 5.0

    @property
    def loads(self) -> bool:
        """Whether the engine loads blocks (every role but ``kv_producer``)."""
        return self.role != "kv_producer"

    @property
    def saves(self) -> bool:
        """Whether the engine saves blocks (every role but ``kv_consumer``)."""
        return self.role != "kv_consumer"

    def for_engine(self, num_groups: int) -> ConnectorSettings:
        """These settings with ``load_mode`` resolved for an engine of ``num_groups`` KV cache
        groups: ``auto`` is ``sync`` for one group and ``async`` for several. vLLM 0.32 takes a
        failed load of several groups only per request, and only from an asynchronous load
        (``failed_recving``); a failed synchronous one it can only be told as block ids, which
        stop its engine with several groups (``Scheduler._handle_invalid_blocks``): ``sync``
        with several groups is a ``ConfigError``."""
        mode = self.load_mode
        if mode == "auto":
            mode = "sync" if num_groups <= 1 else "async"
        elif mode == "sync" and num_groups > 1:
            raise ConfigError(
                f"TierKVConnector: load_mode='sync' with {num_groups} KV cache groups: vLLM 0.32 "
                "cannot recover a failed synchronous load of a model with several groups (its "
                "scheduler stops the engine); drop load_mode (auto: async here) or set 'async'")
        return replace(self, load_mode=mode)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None, role: str | None = "kv_both"
                          ) -> ConnectorSettings:
        """Parse vLLM's ``kv_connector_extra_config`` for an engine of ``kv_role`` ``role``;
        an unknown key, a bad value, or a setting the role never uses is a ``ConfigError``
        that names it, in one line."""
        extra = dict(extra or {})
        if role not in ROLES:
            raise ConfigError(f"TierKVConnector: kv_role={role!r}; choose one of {list(ROLES)}")
        if role == "kv_producer" and extra.get("load_mode", "auto") not in ("auto", "sync"):
            raise ConfigError("TierKVConnector: a kv_producer never loads; drop load_mode")
        if role == "kv_consumer" and ("write_policy" in extra or "priority" in extra):
            raise ConfigError("TierKVConnector: a kv_consumer never saves; drop write_policy "
                              "and priority")
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
            load_mode=_one_of(extra, "load_mode", LOAD_MODES, "auto"),
            event_detail=_flag(extra, "event_detail", True),
            role=role,
            pd_wait_timeout_s=_positive(extra, "pd_wait_timeout_s", 5.0),
        )


def _flag(extra: dict[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"TierKVConnector: {key} must be true or false, got {value!r}")
    return value


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


def namespaces_of(vllm_config: Any, kv_cache_config: Any, geometry: EngineGeometry,
                  tp_rank: int) -> tuple[Namespace, ...]:
    """The namespace of each group's blocks (``geometry.groups`` order) for TP rank
    ``tp_rank``."""
    return tuple(namespace_of(vllm_config, kv_cache_config, group, tp_rank,
                              plain=geometry.is_plain) for group in geometry.groups)


def namespace_of(vllm_config: Any, kv_cache_config: Any,
                 geometry: BlockGeometry | EngineGeometry, tp_rank: int, *,
                 plain: bool | None = None) -> Namespace:
    """The namespace of one group's blocks (an engine's: its first group's) for TP rank
    ``tp_rank`` (see the module doc). Unless the engine is ``plain`` (one full-attention group,
    whose namespace is what it was before groups), it names the group: its index, kind and
    window. A replicated group (MLA) is rank 0's on every rank: stored once, loaded by all."""
    if isinstance(geometry, EngineGeometry):
        plain = geometry.is_plain if plain is None else plain
        geometry = geometry.groups[0]
    plain = True if plain is None else plain
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
        *(() if plain else (f"group={geometry.group_index}:{geometry.label}",)),
    ))
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    if geometry.replicated:
        tp_rank, tp_size = 0, 1
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
