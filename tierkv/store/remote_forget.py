"""What ``delete()`` and ``clear()`` took out of the REMOTE tier lately: so that nothing brings
it back.

Two things could: a fill that fetched a block from REMOTE before the delete reached Redis and
publishes it after the local copy was doomed, and an eviction whose record reaches REMOTE's
queue after the delete (a DISK record the disk writer reads later; a HOST block encoded while
the delete runs). One rule covers both, for a key and for its namespace: something that saw the
block at time ``t`` (a fill's fetch, an eviction) must drop it when a forget of it is running
now or ended at or after ``t``. A forget that ended before ``t`` already deleted REMOTE's copy,
so what ``t`` saw is a block put again since, and welcome.

Owned by ``RemoteLink``; thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierkv.keys import NAMESPACE_ID_BYTES

# How long a finished forget is remembered (a disk writer's job, a fill, take far less).
KEEP_S = 60.0
# Finished forgets' keys remembered at most (the oldest go first): 64K x ~100 B. Running
# forgets are always consulted in full.
MAX_KEYS = 1 << 16


@dataclass(eq=False)
class Forgetting:
    """One forget in progress (``Forgotten.begin``)."""

    raw_keys: frozenset[bytes]
    namespace_ids: frozenset[bytes]
    started_s: float = field(default_factory=time.monotonic)


class Forgotten:
    """Forgets running now and those ended lately (see the module docstring)."""

    def __init__(self, keep_s: float = KEEP_S, max_keys: int = MAX_KEYS) -> None:
        self.keep_s = keep_s
        self.max_keys = max_keys
        self.lock = threading.Lock()
        """Held by a fill across its check and its publish, and by ``begin``: a forget that
        begins after a fill's check waits for the fill to publish, then dooms what it did."""
        self._active: set[Forgetting] = set()
        self._keys: OrderedDict[bytes, float] = OrderedDict()  # key -> when its forget ended
        self._namespaces: dict[bytes, float] = {}

    def begin(self, raw_keys: Sequence[bytes] = (), namespace_ids: Sequence[bytes] = ()
              ) -> Forgetting:
        """Start forgetting ``raw_keys`` and every key of ``namespace_ids``: call before the
        local copies are doomed, and ``end`` once REMOTE's are deleted."""
        forgetting = Forgetting(frozenset(raw_keys), frozenset(namespace_ids))
        with self.lock:
            self._active.add(forgetting)
        return forgetting

    def end(self, forgetting: Forgetting) -> None:
        """The forget is done (REMOTE's copies deleted, or given up on)."""
        now = time.monotonic()
        with self.lock:
            self._active.discard(forgetting)
            for raw_key in forgetting.raw_keys:
                self._keys[raw_key] = now
                self._keys.move_to_end(raw_key)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
            for namespace_id in forgetting.namespace_ids:
                self._namespaces[namespace_id] = now
            expired = [n for n, when in self._namespaces.items() if now - when > self.keep_s]
            for namespace_id in expired:
                del self._namespaces[namespace_id]

    def forbids_locked(self, raw_key: bytes, seen_s: float) -> bool:
        """Whether what saw ``raw_key`` at ``seen_s`` must drop it (``lock`` held)."""
        namespace_id = raw_key[:NAMESPACE_ID_BYTES]
        for forgetting in self._active:
            if raw_key in forgetting.raw_keys or namespace_id in forgetting.namespace_ids:
                return True
        ended = self._keys.get(raw_key)
        if ended is not None and ended >= seen_s:
            return True
        ended = self._namespaces.get(namespace_id)
        return ended is not None and ended >= seen_s

    def forbids(self, raw_key: bytes, seen_s: float) -> bool:
        """``forbids_locked``, taking the lock."""
        with self.lock:
            return self.forbids_locked(raw_key, seen_s)
