"""Conversions between tierkv objects and wire messages that client and server share."""

from __future__ import annotations

from tierkv.errors import InvalidArgumentError
from tierkv.keys import Namespace
from tierkv.layout import DType, KVLayout
from tierkv.wire import tierkv_pb2 as pb

MAX_MODEL_ID_CHARS = 256
# Generous bounds that keep one block's size sane (a hostile layout must not size a slab).
_MAX_LAYERS, _MAX_HEADS, _MAX_HEAD_DIM, _MAX_BLOCK_SIZE = 1024, 1024, 4096, 4096


def namespace_from_wire(spec: pb.Namespace, tenant: str) -> Namespace:
    """The caller's namespace: the request's model and layout, the credentials' tenant."""
    if not spec.model_id or len(spec.model_id) > MAX_MODEL_ID_CHARS:
        raise InvalidArgumentError(
            f"namespace.model_id must be 1..{MAX_MODEL_ID_CHARS} characters"
        )
    limits = (
        ("num_layers", spec.num_layers, _MAX_LAYERS),
        ("num_kv_heads", spec.num_kv_heads, _MAX_HEADS),
        ("head_dim", spec.head_dim, _MAX_HEAD_DIM),
        ("block_size", spec.block_size or 16, _MAX_BLOCK_SIZE),
    )
    for name, value, limit in limits:
        if not 1 <= value <= limit:
            raise InvalidArgumentError(f"namespace.{name} must be in [1, {limit}], got {value}")
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size or 16,
                      DType.parse(spec.dtype or "fp16"))
    return Namespace(spec.model_id, layout, spec.tp_rank, spec.tp_size or 1, tenant)


def namespace_to_wire(namespace: Namespace) -> pb.Namespace:
    """The wire form of a namespace (without its tenant)."""
    layout = namespace.layout
    return pb.Namespace(
        model_id=namespace.model_id, num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
        block_size=layout.block_size, dtype=layout.dtype.value,
        tp_rank=namespace.tp_rank, tp_size=namespace.tp_size,
    )
