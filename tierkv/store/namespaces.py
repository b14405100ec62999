"""Removing namespaces that hold nothing (no block in any tier, no session of their model), with
their disk descriptor. A write lease's namespace state is kept weakly and taken back on
re-registration. Guarded by the store's lock. Design: docs/design/namespaces.md#pruning-store
"""
from __future__ import annotations

import weakref
from collections.abc import Collection

from tierkv.keys import Namespace
from tierkv.store.core import StoreCore
from tierkv.store.index import NamespaceState
from tierkv.tiers.disk import DiskWrite


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
