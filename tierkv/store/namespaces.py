"""A namespace in the store: its state, the descriptor stored for it on disk (so that a reopened
store knows its layout), and removing namespaces that hold nothing (no block in any tier, no
session of their model). A write lease's namespace state is kept weakly and taken back on
re-registration. Guarded by the store's lock. Design: docs/design/namespaces.md#pruning-store
"""
from __future__ import annotations

import weakref
from collections.abc import Collection

import msgpack

from tierkv.keys import Namespace
from tierkv.layout import KVLayout
from tierkv.store.core import StoreCore
from tierkv.store.index import NamespaceState
from tierkv.tiers.disk import DiskWrite
from tierkv.tiers.records import block_record_bytes


def namespace_descriptor(namespace: Namespace) -> bytes:
    """What is stored about a namespace so that a reopened store knows its layout."""
    layout = namespace.layout
    packed: bytes = msgpack.packb(
        {
            "model_id": namespace.model_id,
            "layout": [layout.num_layers, layout.num_kv_heads, layout.head_dim,
                       layout.block_size, layout.dtype.value],
            "tp": [namespace.tp_rank, namespace.tp_size],
            "tenant": namespace.tenant,
            # Only where K and V differ: descriptors of other layouts are as they were.
            **({} if layout.head_dim_v is None else {"head_dim_v": layout.head_dim_v}),
        }
    )
    return packed


def namespace_from_descriptor(data: bytes) -> Namespace:
    """Inverse of ``namespace_descriptor``."""
    fields = msgpack.unpackb(data)
    num_layers, num_kv_heads, head_dim, block_size, dtype = fields["layout"]
    layout = KVLayout(num_layers, num_kv_heads, head_dim, block_size, dtype,
                      fields.get("head_dim_v"))
    tp_rank, tp_size = fields["tp"]
    return Namespace(fields["model_id"], layout, tp_rank, tp_size, fields["tenant"])


def parse_descriptor(namespace_id: bytes, data: bytes) -> Namespace:
    """The namespace a stored descriptor (unsealed) describes under ``namespace_id``; raises
    ``ValueError``, ``KeyError`` or ``TypeError`` for one that does not parse or describes
    another namespace (docs/design/disk-records.md, recovery 1)."""
    namespace = namespace_from_descriptor(data)
    if namespace.id != namespace_id:
        raise ValueError(f"it describes namespace {bytes(namespace.id).hex()}")
    return namespace


def namespace_state(namespace: Namespace) -> NamespaceState:
    """A fresh state with the namespace's record size."""
    return NamespaceState(namespace, block_record_bytes(namespace.layout))


class RetiredNamespaces:
    """States of removed namespaces that something (a write lease) still holds."""

    def __init__(self) -> None:
        self._states: weakref.WeakValueDictionary[bytes, NamespaceState] = (
            weakref.WeakValueDictionary()
        )

    def revive(self, namespace_id: bytes) -> NamespaceState | None:
        """The state of a removed namespace, if it is still alive (it is registered again)."""
        return self._states.pop(namespace_id, None)

    def retire(self, state: NamespaceState) -> None:
        """Remember a removed namespace's state for as long as something else holds it."""
        self._states[bytes(state.id)] = state


def empty_namespaces_locked(core: StoreCore, tenant: str | None) -> list[Namespace]:
    """The namespaces (of ``tenant``, or of everyone) that hold no block."""
    return [
        state.namespace for state in core.namespaces.values()
        if not state.blocks and (tenant is None or state.namespace.tenant == tenant)
    ]


def remove_locked(
    core: StoreCore, retired: RetiredNamespaces, candidates: Collection[Namespace]
) -> tuple[list[Namespace], DiskWrite | None]:
    """Remove the ``candidates`` that are still registered and still hold no block; returns
    them and the disk job deleting their descriptors (None without a disk tier or removals)."""
    removed: list[Namespace] = []
    for namespace in candidates:
        state = core.namespaces.get(namespace.id)
        if state is None or state.blocks:
            continue
        del core.namespaces[namespace.id]
        retired.retire(state)
        removed.append(namespace)
    if core.disk is None or not removed:
        return removed, None
    job = DiskWrite(namespace_deletes=[bytes(namespace.id) for namespace in removed])
    core.disk.submit(job)  # under the lock: ordered after the puts of earlier registrations
    return removed, job
