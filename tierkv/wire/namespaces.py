"""Namespaces <-> wire ``Namespace`` messages (both sides; the tenant never travels).

A request names its model and layout; the server adds the tenant of the caller's credentials
(``namespace_from``). Bounds keep one block's size sane: a hostile layout must not size a slab.
"""

from __future__ import annotations

from tierkv.errors import InvalidArgumentError
from tierkv.keys import Namespace
from tierkv.layout import DType, KVLayout
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire.limits import MAX_MODEL_ID_CHARS

# Generous bounds on each dimension of a layout that comes over the wire.
_MAX_LAYERS, _MAX_HEADS, _MAX_HEAD_DIM, _MAX_BLOCK_SIZE = 1024, 1024, 4096, 4096
# What an unset field means (proto3 sends 0 / ""): the defaults of KVLayout and Namespace.
_DEFAULT_BLOCK_SIZE, _DEFAULT_DTYPE, _DEFAULT_TP_SIZE = 16, "fp16", 1


def namespace_from(spec: pb.Namespace, tenant: str) -> Namespace:
    """The caller's namespace: the request's model and layout, the credentials' tenant.
    ``InvalidArgumentError`` names the field that is out of bounds."""
    if not spec.model_id or len(spec.model_id) > MAX_MODEL_ID_CHARS:
        raise InvalidArgumentError(
            f"namespace.model_id must be 1..{MAX_MODEL_ID_CHARS} characters"
        )
    block_size = spec.block_size or _DEFAULT_BLOCK_SIZE
    limits = (
        ("num_layers", spec.num_layers, _MAX_LAYERS),
        ("num_kv_heads", spec.num_kv_heads, _MAX_HEADS),
        ("head_dim", spec.head_dim, _MAX_HEAD_DIM),
        ("block_size", block_size, _MAX_BLOCK_SIZE),
    )
    for name, value, limit in limits:
        if not 1 <= value <= limit:
            raise InvalidArgumentError(f"namespace.{name} must be in [1, {limit}], got {value}")
    head_dim_v = spec.head_dim_v if spec.HasField("head_dim_v") else None
    if head_dim_v is not None and head_dim_v > _MAX_HEAD_DIM:
        raise InvalidArgumentError(
            f"namespace.head_dim_v must be in [0, {_MAX_HEAD_DIM}], got {head_dim_v}")
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size,
                      DType.parse(spec.dtype or _DEFAULT_DTYPE), head_dim_v)
    return Namespace(spec.model_id, layout, spec.tp_rank, spec.tp_size or _DEFAULT_TP_SIZE,
                     tenant)


def namespace_to(namespace: Namespace) -> pb.Namespace:
    """The wire form of a namespace (without its tenant: the server decides it)."""
    layout = namespace.layout
    return pb.Namespace(
        model_id=namespace.model_id, num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
        block_size=layout.block_size, dtype=layout.dtype.value,
        tp_rank=namespace.tp_rank, tp_size=namespace.tp_size, head_dim_v=layout.head_dim_v,
    )
