"""The small block interface the transformers helpers use, and its two adapters.

``BlockStore`` is what ``save_kv``, ``restore_kv`` and ``ChatSession`` need from a store: one
code path above it serves a sidecar (``tierkv.Client``) and an in-process ``TieredStore``.

Notes:
1. The tenant is decided by the store side, as on a server: a ``Client``'s tenant comes from
   its token (the server rewrites every namespace), and ``StoreBlocks`` rewrites every namespace
   to the tenant it was made for. So the same code sees the same isolation on both back-ends.
2. ``StoreBlocks`` registers a namespace on first use (the server does the same for a client).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from tierkv.client import Client
from tierkv.config import Priority, WritePolicy
from tierkv.keys import Namespace, NamespaceId
from tierkv.store import TieredStore
from tierkv.types import PutDetail


@runtime_checkable
class BlockStore(Protocol):
    """Blocks and session records of one tenant (see the module notes)."""

    def lookup(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are stored."""
        ...

    def get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor) -> int:
        """Copy the leading stored blocks of ``hashes`` into ``out[:k]``; returns ``k``."""
        ...

    def put(self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
            priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
            parent: bytes | None = None) -> int:
        """Store ``blocks`` under ``hashes``; returns how many were newly stored. ``parent``:
        the stored block before the first (a later turn's blocks are then evicted before the
        history they continue)."""
        ...

    def save_session(self, namespace: Namespace, session_id: str,
                     token_ids: Sequence[int]) -> int:
        """Store (or replace) the session record; returns its number of tokens."""
        ...

    def resume_session(self, session_id: str) -> tuple[Namespace, list[int]]:
        """The recorded namespace and token ids of ``session_id`` (``NotFoundError``
        when there is none: ``SessionNotFoundError`` from a ``TieredStore``)."""
        ...


class ClientBlocks:
    """``BlockStore`` over a sidecar ``Client``; ``timeout_s`` bounds every call (None: the
    client's own deadline)."""

    def __init__(self, client: Client, timeout_s: float | None = None) -> None:
        self.client = client
        self.timeout_s = timeout_s

    def lookup(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        return self.client.lookup(namespace, hashes, timeout_s=self.timeout_s)

    def get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor) -> int:
        return self.client.get_into(namespace, hashes, out, timeout_s=self.timeout_s)

    def put(self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
            priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
            parent: bytes | None = None) -> int:
        return self.client.put(namespace, hashes, blocks, priority=priority,
                               write_policy=write_policy, timeout_s=self.timeout_s,
                               detail=_detail(parent))

    def save_session(self, namespace: Namespace, session_id: str,
                     token_ids: Sequence[int]) -> int:
        return self.client.save_session(namespace, session_id, token_ids,
                                        timeout_s=self.timeout_s)

    def resume_session(self, session_id: str) -> tuple[Namespace, list[int]]:
        namespace, token_ids, _ = self.client.resume_session(session_id, timeout_s=self.timeout_s)
        return namespace, token_ids


class StoreBlocks:
    """``BlockStore`` over an in-process ``TieredStore``, as ``tenant`` (note 1)."""

    def __init__(self, store: TieredStore, tenant: str = "default") -> None:
        self.store = store
        self.tenant = tenant
        self._registered: set[NamespaceId] = set()

    def _own(self, namespace: Namespace) -> Namespace:
        if namespace.tenant != self.tenant:
            namespace = namespace.with_tenant(self.tenant)
        if namespace.id not in self._registered:
            self.store.register(namespace)
            self._registered.add(namespace.id)
        return namespace

    def lookup(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        return self.store.lookup(self._own(namespace), hashes)

    def get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor) -> int:
        return self.store.get_into(self._own(namespace), hashes, out)

    def put(self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
            priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
            parent: bytes | None = None) -> int:
        return self.store.put(self._own(namespace), hashes, blocks, priority=priority,
                              write_policy=write_policy, detail=_detail(parent))

    def save_session(self, namespace: Namespace, session_id: str,
                     token_ids: Sequence[int]) -> int:
        return self.store.save_session(self._own(namespace), session_id, token_ids)

    def resume_session(self, session_id: str) -> tuple[Namespace, list[int]]:
        resumed = self.store.resume_session(self.tenant, session_id)
        return resumed.namespace, list(resumed.token_ids)


def blocks_of(target: Client | TieredStore | BlockStore, tenant: str = "default", *,
              timeout_s: float | None = None) -> BlockStore:
    """The ``BlockStore`` of a sidecar client (its tenant comes from its token: ``tenant`` is
    not used), of an in-process store (as ``tenant``), or ``target`` itself if it is one."""
    if isinstance(target, Client):
        return ClientBlocks(target, timeout_s)
    if isinstance(target, TieredStore):
        return StoreBlocks(target, tenant)
    return target


def _detail(parent: bytes | None) -> PutDetail | None:
    """What a put says of its blocks: the chain's block before them, if any."""
    return None if parent is None else PutDetail(parent_hash=parent)
