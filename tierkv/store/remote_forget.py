"""What ``delete()`` and ``clear()`` took out of the REMOTE tier lately: so that nothing brings
it back.

Two things could: a fill that fetched a block from REMOTE before the delete reached Redis and
publishes it after the local copy was doomed, and a DISK eviction whose record the disk writer
reads (and hands to REMOTE) after the delete. A fill that started before a forget of its key
(or of its namespace) began, or while one runs, publishes nothing of that key; a demoted record
of a key forgotten within ``keep_s`` is dropped. A new put of the key revives it.

Owned by ``RemoteLink``; thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierkv.keys import NAMESPACE_ID_BYTES

# How long a forgotten key still drops demoted records (a disk writer's job takes far less).
KEEP_S = 60.0
# Forgotten keys remembered at most (the oldest go first): 64K x ~100 B.
MAX_KEYS = 1 << 16


@dataclass(eq=False)
class Forgetting:
    """One forget in progress (``Forgotten.begin``)."""

    raw_keys: frozenset[bytes]
    namespace_ids: frozenset[bytes]
    started_s: float = field(default_factory=time.monotonic)


class Forgotten:
    """Forgets in progress and those done lately (see the module docstring)."""

    def __init__(self, keep_s: float = KEEP_S, max_keys: int = MAX_KEYS) -> None:
        self.keep_s = keep_s
        self.max_keys = max_keys
        self.lock = threading.Lock()
        """Held by a fill across its check and its publish, and by ``begin``: a forget that
        begins after a fill's check waits for the fill to publish, then dooms what it did."""
        self._active: set[Forgetting] = set()
        self._keys: OrderedDict[bytes, float] = OrderedDict()
        self._namespaces: dict[bytes, float] = {}

    def begin(self, raw_keys: Sequence[bytes] = (), namespace_ids: Sequence[bytes] = ()
              ) -> Forgetting:
        """Start forgetting ``raw_keys`` and every key of ``namespace_ids``: call before the
        local copies are doomed, and ``end`` once REMOTE's are deleted."""
        forgetting = Forgetting(frozenset(raw_keys), frozenset(namespace_ids))
        with self.lock:
            self._active.add(forgetting)
            now = forgetting.started_s
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
        return forgetting

    def end(self, forgetting: Forgetting) -> None:
        """The forget is done (REMOTE's copies deleted, or given up on)."""
        with self.lock:
            self._active.discard(forgetting)

    def blocks_fill_locked(self, raw_key: bytes, fill_started_s: float) -> bool:
        """Whether a fill that started at ``fill_started_s`` must not publish ``raw_key``
        (``lock`` held)."""
        namespace_id = raw_key[:NAMESPACE_ID_BYTES]
        for forgetting in self._active:
            if raw_key in forgetting.raw_keys or namespace_id in forgetting.namespace_ids:
                return True
        when = self._keys.get(raw_key)
        if when is not None and when >= fill_started_s:
            return True
        when = self._namespaces.get(namespace_id)
        return when is not None and when >= fill_started_s

    def blocks_demotion(self, raw_key: bytes) -> bool:
        """Whether a demoted record of ``raw_key`` is of a block forgotten lately."""
        now = time.monotonic()
        with self.lock:
            when = self._keys.get(raw_key)
            if when is not None and now - when <= self.keep_s:
                return True
            when = self._namespaces.get(raw_key[:NAMESPACE_ID_BYTES])
            return when is not None and now - when <= self.keep_s

    def revive(self, raw_keys: Sequence[bytes]) -> None:
        """New puts of ``raw_keys``: their records are welcome again."""
        if not self._keys:
            return
        with self.lock:
            for raw_key in raw_keys:
                self._keys.pop(raw_key, None)
