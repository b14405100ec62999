"""The calls every tierkv store offers: ``BlockStore`` (blocking) and ``AsyncBlockStore``.

``TieredStore`` (in process), ``Client`` (a sidecar) and, awaitable, ``AsyncClient`` have these
methods with these signatures and result types; code written against the protocol runs on any of
them (mypy checks that they conform: ``tierkv/__init__.py``). Each side adds keywords of its own:
``timeout_s`` on the clients, ``tier`` and ``missed_after`` on the store.

Notes:
1. Tenants. A client's tenant is its token's: the server rewrites every namespace to it and
   ignores the ``tenant`` the session calls name. A ``TieredStore`` serves every tenant: a
   namespace's ``tenant`` field and the session calls' ``tenant`` say whose blocks and sessions.
2. ``register`` makes a namespace usable before its first call. A ``TieredStore`` refuses calls
   on a namespace it does not know (``UnknownNamespaceError``); a sidecar registers one on its
   first write, so a client's ``register`` only checks the namespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from tierkv.config import Priority, WritePolicy
from tierkv.keys import DEFAULT_TENANT, Namespace
from tierkv.types import PutDetail, ResumedSession, SessionInfo, StoreStats

DEFAULT_PUBLISH_WAIT_S = 5.0
"""How long ``publish`` waits for REMOTE by default."""


@runtime_checkable
class BlockStore(Protocol):
    """Blocks and chat sessions, blocking (see the module notes)."""

    def register(self, namespace: Namespace) -> None:
        """Make ``namespace`` usable (idempotent; note 2)."""
        ...

    def put(self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
            priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
            detail: PutDetail | None = None) -> int:
        """Store ``blocks`` (``[n, *block_shape]``) under ``hashes``; returns how many were newly
        stored. ``detail``: token ids for KV events, the parent so that a chain saved in
        several puts is evicted tail first."""
        ...

    def lookup(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are stored."""
        ...

    def get(self, namespace: Namespace, hashes: Sequence[bytes],
            device: str | torch.device = "cpu") -> torch.Tensor:
        """The leading stored blocks as a new ``[k, *block_shape]`` tensor."""
        ...

    def get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor) -> int:
        """Copy the leading stored blocks into ``out[:k]``; returns ``k``."""
        ...

    def prefetch(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """Bring the leading stored blocks up into HOST (or a faster tier) and wait; returns
        how many leading blocks are then there."""
        ...

    def pin(self, namespace: Namespace, hashes: Sequence[bytes],
            ttl_s: float | None = None) -> int:
        """Keep the leading stored blocks from eviction until ``unpin`` (or ``ttl_s``); returns
        how many were pinned."""
        ...

    def unpin(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """Drop one pin of each stored block; returns how many were pinned."""
        ...

    def delete(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """Delete the blocks from every tier; returns how many were stored."""
        ...

    def publish(self, namespace: Namespace, hashes: Sequence[bytes], *,
                wait_s: float = DEFAULT_PUBLISH_WAIT_S) -> int:
        """Make the leading stored blocks readable from REMOTE, waiting up to ``wait_s``;
        returns how many leading ``hashes`` REMOTE then holds (without REMOTE: ``lookup``)."""
        ...

    def stats(self) -> StoreStats:
        """A snapshot of the tiers and counters."""
        ...

    def save_session(self, namespace: Namespace, session_id: str, token_ids: Sequence[int],
                     ttl_s: float | None = None) -> int:
        """Store (or replace) a chat session's record; returns its number of tokens."""
        ...

    def resume_session(self, session_id: str, *,
                       tenant: str = DEFAULT_TENANT) -> ResumedSession:
        """The session's namespace, token ids and cached leading tokens (``NotFoundError``:
        none; note 1 for ``tenant``)."""
        ...

    def delete_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT) -> bool:
        """Delete a session's record; True if it existed."""
        ...

    def list_sessions(self, *, tenant: str = DEFAULT_TENANT) -> list[SessionInfo]:
        """The tenant's sessions, by ``session_id``."""
        ...


class AsyncBlockStore(Protocol):
    """``BlockStore``'s calls, awaitable."""

    def register(self, namespace: Namespace) -> None:
        """As ``BlockStore.register`` (it makes no call)."""
        ...

    async def put(self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
                  priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
                  detail: PutDetail | None = None) -> int:
        """As ``BlockStore.put``."""
        ...

    async def lookup(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """As ``BlockStore.lookup``."""
        ...

    async def get(self, namespace: Namespace, hashes: Sequence[bytes],
                  device: str | torch.device = "cpu") -> torch.Tensor:
        """As ``BlockStore.get``."""
        ...

    async def get_into(self, namespace: Namespace, hashes: Sequence[bytes],
                       out: torch.Tensor) -> int:
        """As ``BlockStore.get_into``."""
        ...

    async def prefetch(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """As ``BlockStore.prefetch``."""
        ...

    async def pin(self, namespace: Namespace, hashes: Sequence[bytes],
                  ttl_s: float | None = None) -> int:
        """As ``BlockStore.pin``."""
        ...

    async def unpin(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """As ``BlockStore.unpin``."""
        ...

    async def delete(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """As ``BlockStore.delete``."""
        ...

    async def publish(self, namespace: Namespace, hashes: Sequence[bytes], *,
                      wait_s: float = DEFAULT_PUBLISH_WAIT_S) -> int:
        """As ``BlockStore.publish``."""
        ...

    async def stats(self) -> StoreStats:
        """As ``BlockStore.stats``."""
        ...

    async def save_session(self, namespace: Namespace, session_id: str,
                           token_ids: Sequence[int], ttl_s: float | None = None) -> int:
        """As ``BlockStore.save_session``."""
        ...

    async def resume_session(self, session_id: str, *,
                             tenant: str = DEFAULT_TENANT) -> ResumedSession:
        """As ``BlockStore.resume_session``."""
        ...

    async def delete_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT) -> bool:
        """As ``BlockStore.delete_session``."""
        ...

    async def list_sessions(self, *, tenant: str = DEFAULT_TENANT) -> list[SessionInfo]:
        """As ``BlockStore.list_sessions``."""
        ...
