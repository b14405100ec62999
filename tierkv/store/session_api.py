"""``TieredStore``'s chat-session calls (the table itself is ``tierkv.store.sessions``)."""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.hashing import DEFAULT_ALGORITHM, HashAlgorithm, block_hashes
from tierkv.keys import Namespace
from tierkv.store.ledger import NamespaceState
from tierkv.store.sessions import ResumedSession, SessionInfo, SessionTable, TokenIds


class SessionMethods:
    """Mixed into ``TieredStore``, which provides the state below."""

    _sessions: SessionTable

    def _state(self, namespace: Namespace) -> NamespaceState:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    def register(self, namespace: Namespace) -> None:
        raise NotImplementedError

    def lookup(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        raise NotImplementedError

    def save_session(
        self,
        namespace: Namespace,
        session_id: str,
        token_ids: TokenIds,
        ttl_s: float | None = None,
    ) -> int:
        """Store (or replace) the chat session ``session_id`` of ``namespace.tenant``: its
        namespace and ``token_ids`` (ints, or a 1-D integer numpy array or tensor), last used
        now, kept until deleted or, with ``ttl_s``, until ``ttl_s`` seconds pass without a
        ``resume_session``. Returns the number of tokens.

        Store the session's blocks yourself (``write_through``, ``Priority.SESSION``). With a
        disk tier the record is durable when this returns; without one it is kept in memory
        only, and ends with the process. Raises ``InvalidArgumentError`` (a ``ValueError``) for
        an empty ``session_id``, one over 256 UTF-8 bytes or with NUL, token ids outside
        ``[0, 2**32)`` or more than ``2**20`` of them, or a ``ttl_s`` outside ``(0, 30 days]``;
        ``UnknownNamespaceError`` if ``namespace`` is not registered. Nothing is stored then.
        """
        self._state(namespace)
        return self._sessions.save(namespace, session_id, token_ids, ttl_s)

    def resume_session(
        self, tenant: str, session_id: str, seed: str | None = None,
        algorithm: HashAlgorithm = DEFAULT_ALGORITHM,
    ) -> ResumedSession:
        """The session's namespace and token ids, and how many leading tokens are cached (whole
        blocks whose hashes, computed as ``block_hashes(..., seed, algorithm=algorithm)`` does,
        are stored in some tier): prefill only ``token_ids[num_cached_tokens:]``. Sets its last
        use to now (written to disk in the background) and registers its namespace if needed.
        Raises ``SessionNotFoundError`` (a ``LookupError``) if the tenant has no such session or
        its TTL ran out."""
        self._check_open()
        record = self._sessions.resume(tenant, session_id)
        namespace = record.namespace
        self.register(namespace)
        tokens = record.token_array()
        block_size = namespace.layout.block_size
        num_blocks = self.lookup(namespace, block_hashes(tokens, block_size, seed, algorithm=algorithm))
        return ResumedSession(namespace, tuple(tokens.tolist()), num_blocks * block_size)

    def delete_session(self, tenant: str, session_id: str) -> bool:
        """Delete the session (durably, with a disk tier); True if it existed and had not
        expired. Its blocks stay until evicted or ``delete``d."""
        self._check_open()
        return self._sessions.delete(tenant, session_id)

    def list_sessions(self, tenant: str) -> list[SessionInfo]:
        """The tenant's sessions that have not expired, sorted by ``session_id``."""
        self._check_open()
        return self._sessions.list_for(tenant)
