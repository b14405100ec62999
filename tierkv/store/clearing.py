"""``TieredStore.clear``: the operator's delete of every block and session of whole namespaces,
pinned or busy, never waiting for a reader. Done in batches under the store lock on the common
delete path; namespaces stay registered. Design: docs/design/namespaces.md#clearing-store
"""
from __future__ import annotations

from collections.abc import Callable

from tierkv.errors import InvalidArgumentError
from tierkv.keys import Namespace
from tierkv.store.core import StoreCore
from tierkv.store.index import DOOMED, Entry, NamespaceState
from tierkv.store.sessions import SessionTable
from tierkv.types import ClearResult

_BATCH_BLOCKS = 4096
"""Blocks deleted per hold of the store lock."""

Progress = Callable[[int, int], None]
"""``progress(num_blocks_done, num_blocks_total)``, called as a clear goes."""




def namespace_filter(
    tenant: str | None, model_id: str | None, namespace: Namespace | None
) -> Callable[[Namespace], bool]:
    """Whether a namespace matches every filter given (None: any); ``InvalidArgumentError``
    for a filter of the wrong type."""
    if namespace is not None and not isinstance(namespace, Namespace):
        raise InvalidArgumentError(f"namespace must be a Namespace, got {type(namespace).__name__}")
    for name, value in (("tenant", tenant), ("model_id", model_id)):
        if value is not None and not isinstance(value, str):
            raise InvalidArgumentError(f"{name} must be a str, got {type(value).__name__}")

    def matches(candidate: Namespace) -> bool:
        return ((tenant is None or candidate.tenant == tenant)
                and (model_id is None or candidate.model_id == model_id)
                and (namespace is None or candidate == namespace))

    return matches


class Clearer:
    """Clears the matching namespaces of one store (see the module docstring)."""

    def __init__(self, core: StoreCore, sessions: SessionTable) -> None:
        self._core = core
        self._sessions = sessions

    def clear(self, matches: Callable[[Namespace], bool], progress: Progress | None) -> ClearResult:
        """Delete every block and session of the namespaces ``matches`` accepts."""
        core = self._core
        with core.lock:
            states = [s for s in core.namespaces.values() if matches(s.namespace)]
            work = [(state, list(state.blocks.values())) for state in states]
            if core.events is not None:  # subscribers drop them at once; later puts follow
                for state in states:
                    core.events.cleared(state)
        total = sum(len(entries) for _, entries in work)
        done = num_blocks = cleared_bytes = num_busy = 0
        if progress is not None:
            progress(0, total)
        for state, entries in work:
            for start in range(0, len(entries), _BATCH_BLOCKS):
                batch = entries[start : start + _BATCH_BLOCKS]
                deleted, busy = self._delete_batch(state, batch)
                num_blocks += deleted
                cleared_bytes += deleted * state.block_bytes
                num_busy += busy
                done += len(batch)
                if progress is not None:
                    progress(done, total)
        num_sessions = self._sessions.delete_where(matches)
        return ClearResult(len(states), num_blocks, cleared_bytes, num_sessions, num_busy)

    def _delete_batch(self, state: NamespaceState, batch: list[Entry]) -> tuple[int, int]:
        """Delete the entries of ``batch`` still indexed; ``(deleted, of those busy)``."""
        core = self._core
        deleted = busy = 0
        with core.lock:
            for entry in batch:
                if entry.priority == DOOMED or state.blocks.get(entry.block_hash) is not entry:
                    continue  # deleted or evicted meanwhile
                if entry.readers:
                    busy += 1  # freed when its reads end, as delete() does it
                core.doom_locked(entry)
                deleted += 1
            job = core.submit_deletes_locked()
        if job is not None:
            core.wait_disk(job)
        return deleted, busy
