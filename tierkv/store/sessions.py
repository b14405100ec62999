"""Chat sessions: ``(tenant, session_id) -> namespace, token ids, last use, TTL``, so that a
restarted process finds a conversation's blocks. Memory mirrors disk per session under a
striped lock held across the disk wait; the store lock is never taken.
Design: docs/design/sessions.md
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import torch

from tierkv.checks import check_ttl
from tierkv.errors import InvalidArgumentError, SessionNotFoundError, TierKVError
from tierkv.keys import Namespace
from tierkv.store.namespaces import namespace_descriptor, namespace_from_descriptor
from tierkv.tiers.disk import DiskTier, DiskWrite
from tierkv.types import SessionInfo

log = logging.getLogger(__name__)

MAX_SESSION_ID_BYTES = 256
"""Longest session id, in UTF-8 bytes."""
MAX_SESSION_TOKENS = 2**20
"""Most token ids one session holds."""
TOKEN_ID_LIMIT = 2**32
"""Token ids are uint32 (as on the wire): each must be in ``[0, TOKEN_ID_LIMIT)``."""
_MAX_KEY_BYTES = 511  # LMDB's key size limit (tenant + NUL + session id)
_NUM_KEY_LOCKS = 64
_RECORD_VERSION = 1
_TOKEN_DTYPE = np.dtype("<u4")

TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor
"""Token ids as ``save_session`` takes them: a sequence of ints, a 1-D numpy array or tensor."""






@dataclass(frozen=True, slots=True)
class SessionRecord:
    """A stored session (its tenant is ``namespace.tenant``)."""

    namespace: Namespace
    tokens: bytes  # little-endian uint32 token ids
    last_use: float  # unix seconds
    ttl: float | None  # seconds after last use; None: kept until deleted

    @property
    def num_tokens(self) -> int:
        """How many token ids the session holds."""
        return len(self.tokens) // _TOKEN_DTYPE.itemsize

    def token_array(self) -> npt.NDArray[np.uint32]:
        """The token ids as a read-only uint32 array (no copy)."""
        return np.frombuffer(self.tokens, dtype=_TOKEN_DTYPE)

    def expired(self, now: float) -> bool:
        """Whether the TTL ran out at ``now``."""
        return self.ttl is not None and now - self.last_use > self.ttl

    def encode(self) -> bytes:
        """The value stored in the sessions DB."""
        packed: bytes = msgpack.packb(
            {
                "v": _RECORD_VERSION,
                "namespace": namespace_descriptor(self.namespace),
                "tokens": self.tokens,
                "last_use": self.last_use,
                "ttl": self.ttl,
            }
        )
        return packed

    @classmethod
    def decode(cls, data: bytes) -> SessionRecord:
        """Inverse of ``encode``; raises ``ValueError`` (or ``KeyError``/``TypeError``) if
        ``data`` is not a record this version can read."""
        fields = msgpack.unpackb(data)
        if fields["v"] != _RECORD_VERSION:
            raise ValueError(f"session record version {fields['v']!r}")
        tokens, last_use, ttl = fields["tokens"], fields["last_use"], fields["ttl"]
        if not isinstance(tokens, bytes) or len(tokens) % _TOKEN_DTYPE.itemsize:
            raise ValueError("token ids are not packed uint32")
        if not isinstance(last_use, float) or not (ttl is None or isinstance(ttl, float)):
            raise TypeError("last use and TTL must be floats")
        return cls(namespace_from_descriptor(fields["namespace"]), tokens, last_use, ttl)


UNPARSABLE = (ValueError, KeyError, TypeError, msgpack.UnpackException)
"""What ``parse_session`` raises for a record it cannot read."""


def parse_session(key: bytes, data: bytes) -> tuple[str, str, SessionRecord]:
    """``(tenant, session_id, record)`` of a stored session (its unsealed value); raises one of
    ``UNPARSABLE`` for a record this version cannot read, or whose namespace names another
    tenant than its key."""
    tenant, _, session_id = key.decode().rpartition("\x00")
    record = SessionRecord.decode(data)
    if record.namespace.tenant != tenant:
        raise ValueError(f"tenant {record.namespace.tenant!r} in the key of {tenant!r}")
    return tenant, session_id, record


# --- input checks ---------------------------------------------------------------------------


def check_tenant(tenant: str) -> bytes:
    """The tenant as UTF-8 bytes."""
    if not isinstance(tenant, str):
        raise InvalidArgumentError(f"tenant must be a str, got {type(tenant).__name__}")
    try:
        return tenant.encode()
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"tenant is not valid Unicode: {exc}") from exc


def check_session_id(session_id: str) -> bytes:
    """The session id as UTF-8 bytes: non-empty, at most 256 bytes, no NUL."""
    if not isinstance(session_id, str):
        raise InvalidArgumentError(f"session_id must be a str, got {type(session_id).__name__}")
    try:
        encoded = session_id.encode()
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"session_id is not valid Unicode: {exc}") from exc
    if not encoded:
        raise InvalidArgumentError("session_id must not be empty")
    if len(encoded) > MAX_SESSION_ID_BYTES:
        raise InvalidArgumentError(
            f"session_id is {len(encoded)} UTF-8 bytes; at most {MAX_SESSION_ID_BYTES} are allowed"
        )
    if b"\x00" in encoded:
        raise InvalidArgumentError("session_id must not contain NUL characters")
    return encoded


def session_key(tenant: str, session_id: str) -> bytes:
    """The sessions-DB key of ``(tenant, session_id)``, after checking both."""
    key = check_tenant(tenant) + b"\x00" + check_session_id(session_id)
    if len(key) > _MAX_KEY_BYTES:
        raise InvalidArgumentError(
            f"tenant and session_id together are {len(key) - 1} UTF-8 bytes; at most "
            f"{_MAX_KEY_BYTES - 1} are allowed"
        )
    return key


def check_token_ids(token_ids: TokenIds) -> bytes:
    """The token ids packed as little-endian uint32: a 1-D sequence (list, numpy array, torch
    tensor) of at most ``MAX_SESSION_TOKENS`` integers in ``[0, 2**32)``."""
    ids: Any = token_ids
    if isinstance(ids, str | bytes | bytearray | memoryview):
        raise InvalidArgumentError("token_ids must be a sequence of ints, not one value")
    if hasattr(ids, "detach"):  # a torch tensor, possibly on a GPU
        if ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise InvalidArgumentError(f"token ids must be integers, got {ids.dtype}")
        ids = ids.detach().cpu().numpy()
    if hasattr(ids, "__len__") and len(ids) > MAX_SESSION_TOKENS:
        raise InvalidArgumentError(
            f"a session holds at most {MAX_SESSION_TOKENS} tokens, got {len(ids)}"
        )
    if isinstance(ids, np.ndarray):
        arr = ids
    else:
        try:  # refuses floats and negative ids instead of truncating them
            arr = np.frombuffer(array("Q", ids), dtype=np.uint64)
        except (TypeError, OverflowError) as exc:
            raise InvalidArgumentError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"token ids must be 1-D integers, got {arr.dtype} {arr.shape}")
    if len(arr) > MAX_SESSION_TOKENS:
        raise InvalidArgumentError(
            f"a session holds at most {MAX_SESSION_TOKENS} tokens, got {len(arr)}"
        )
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= TOKEN_ID_LIMIT:
            raise InvalidArgumentError(
                f"token id {lo if lo < 0 else hi} is outside [0, 2**32) (token ids are uint32)"
            )
    return arr.astype(_TOKEN_DTYPE).tobytes()


# --- the table ------------------------------------------------------------------------------


class SessionTable:
    """Every session of a store, in memory, mirrored in the disk tier's sessions DB when there
    is one. Thread-safe."""

    def __init__(self, disk: DiskTier | None, clock: Callable[[], float] = time.time) -> None:
        self._disk = disk
        self._clock = clock
        self._mutex = threading.Lock()  # guards _by_tenant; held only briefly, never over a wait
        self._by_tenant: dict[str, dict[str, SessionRecord]] = {}
        # Records held, by namespace id (kept with _by_tenant, under _mutex), so that counting
        # sessions per namespace never walks them.
        self._count_of: dict[bytes, tuple[Namespace, int]] = {}
        self._key_locks = [threading.Lock() for _ in range(_NUM_KEY_LOCKS)]
        if disk is not None:
            self._load(disk)

    def _load(self, disk: DiskTier) -> None:
        now = self._clock()
        expired: list[bytes] = []
        for key, data in disk.load_sessions().items():
            try:
                tenant, session_id, record = parse_session(key, data)
            except UNPARSABLE as exc:
                log.warning("unreadable session record %r (kept): %s", key, exc)
                continue
            if record.expired(now):
                expired.append(key)
            else:
                self._set(tenant, session_id, record)
        if expired:
            try:
                disk.submit(DiskWrite(session_deletes=expired)).result()
            except TierKVError as exc:
                log.warning("deleting %d expired sessions failed (retried at the next open): %s",
                            len(expired), exc)

    def _key_lock(self, key: bytes) -> threading.Lock:
        return self._key_locks[hash(key) % _NUM_KEY_LOCKS]  # delete_where takes them so too

    def _get(self, tenant: str, session_id: str) -> SessionRecord | None:
        with self._mutex:
            return self._by_tenant.get(tenant, {}).get(session_id)

    def _set(self, tenant: str, session_id: str, record: SessionRecord | None) -> None:
        with self._mutex:
            sessions = self._by_tenant.setdefault(tenant, {})
            old = sessions.get(session_id)
            if old is not None:
                self._count_locked(old.namespace, -1)
            if record is not None:
                sessions[session_id] = record
                self._count_locked(record.namespace, 1)
                return
            sessions.pop(session_id, None)
            if not sessions:
                del self._by_tenant[tenant]

    def _count_locked(self, namespace: Namespace, delta: int) -> None:
        _, count = self._count_of.get(namespace.id, (namespace, 0))
        if count + delta:
            self._count_of[namespace.id] = (namespace, count + delta)
        else:
            del self._count_of[namespace.id]

    @property
    def num_sessions(self) -> int:
        """Session records held, every tenant's (an expired one counts until it is dropped:
        lazily, docs/design/sessions.md 3)."""
        with self._mutex:
            return sum(count for _, count in self._count_of.values())

    def counts_by_namespace(self) -> dict[bytes, tuple[Namespace, int]]:
        """``namespace id -> (namespace, session records held)`` (as ``num_sessions`` counts
        them); O(namespaces with sessions)."""
        with self._mutex:
            return dict(self._count_of)

    # --- disk -----------------------------------------------------------------------------

    def _write(self, job: DiskWrite) -> None:
        """Commit ``job`` and wait until it is durable; raises its error (nothing changed)."""
        if self._disk is not None:
            self._disk.submit(job).result()

    def _write_in_background(self, job: DiskWrite, what: str) -> None:
        """Queue ``job`` without waiting; a failure is only logged (docs/design/sessions.md 3 and 5)."""
        if self._disk is None:
            return

        def report(future: Future[None]) -> None:
            exc = future.exception()
            if exc is not None:
                log.warning("%s failed: %s", what, exc)

        self._disk.submit(job).add_done_callback(report)

    def _expire_locked(self, key: bytes, tenant: str, session_id: str, record: SessionRecord) -> None:
        """Drop an expired session (the key lock is held): at once in memory, in the background
        on disk."""
        if self._get(tenant, session_id) is not record:
            return  # replaced or deleted meanwhile
        self._set(tenant, session_id, None)
        self._write_in_background(
            DiskWrite(session_deletes=[key]), f"deleting expired session {session_id!r}"
        )

    # --- operations -----------------------------------------------------------------------

    def save(
        self, namespace: Namespace, session_id: str, token_ids: TokenIds, ttl_s: float | None
    ) -> int:
        """Store or replace the session; durable on return when there is a disk tier."""
        key = session_key(namespace.tenant, session_id)
        tokens = check_token_ids(token_ids)
        ttl = check_ttl(ttl_s)
        with self._key_lock(key):
            record = SessionRecord(namespace, tokens, self._clock(), ttl)
            self._write(DiskWrite(session_puts=[(key, record.encode())]))
            self._set(namespace.tenant, session_id, record)
        return record.num_tokens

    def resume(self, tenant: str, session_id: str) -> SessionRecord:
        """The session's record, with its last use set to now."""
        key = session_key(tenant, session_id)
        with self._key_lock(key):
            record = self._get(tenant, session_id)
            now = self._clock()
            if record is not None and record.expired(now):
                self._expire_locked(key, tenant, session_id, record)
                record = None
            if record is None:
                raise SessionNotFoundError(f"no session {session_id!r} for tenant {tenant!r}")
            touched = replace(record, last_use=max(now, record.last_use))
            self._set(tenant, session_id, touched)
            self._write_in_background(
                DiskWrite(session_puts=[(key, touched.encode())]),
                f"recording the last use of session {session_id!r}",
            )
        return touched

    def delete(self, tenant: str, session_id: str) -> bool:
        """Delete the session durably; whether it existed (an expired one did not)."""
        key = session_key(tenant, session_id)
        with self._key_lock(key):
            record = self._get(tenant, session_id)
            if record is None:
                return False
            existed = not record.expired(self._clock())
            self._write(DiskWrite(session_deletes=[key]))
            self._set(tenant, session_id, None)
        return existed

    def delete_where(self, matches: Callable[[Namespace], bool]) -> int:
        """Delete every session whose namespace ``matches`` accepts, in one durable disk write;
        returns how many (expired ones included). The key locks of those sessions are taken in
        one order (every other operation holds one at a time), so nothing deadlocks, and a
        session saved again meanwhile is replaced, not deleted."""
        with self._mutex:
            found = [(tenant, session_id, record)
                     for tenant, sessions in self._by_tenant.items()
                     for session_id, record in sessions.items() if matches(record.namespace)]
        if not found:
            return 0
        keys = [session_key(tenant, session_id) for tenant, session_id, _ in found]
        indices = sorted({hash(key) % _NUM_KEY_LOCKS for key in keys})
        with contextlib.ExitStack() as held:
            for index in indices:
                held.enter_context(self._key_locks[index])
            gone = [(key, tenant, session_id)
                    for key, (tenant, session_id, record) in zip(keys, found, strict=True)
                    if self._get(tenant, session_id) is record]
            if gone:
                self._write(DiskWrite(session_deletes=[key for key, _, _ in gone]))
            for _, tenant, session_id in gone:
                self._set(tenant, session_id, None)
        return len(gone)

    def list_for(self, tenant: str) -> list[SessionInfo]:
        """The tenant's unexpired sessions, sorted by id."""
        check_tenant(tenant)
        now = self._clock()
        with self._mutex:
            records = sorted(self._by_tenant.get(tenant, {}).items())
        live: list[SessionInfo] = []
        for session_id, record in records:
            if record.expired(now):
                key = session_key(tenant, session_id)
                with self._key_lock(key):
                    self._expire_locked(key, tenant, session_id, record)
            else:
                live.append(SessionInfo(session_id, record.namespace.model_id, record.num_tokens,
                                        record.last_use))
        return live

