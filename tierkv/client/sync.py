"""``tierkv.Client``: the blocking client SDK of the sidecar.

``tierkv.BlockStore``'s calls, as the embedded ``TieredStore`` has them (put, lookup, get,
get_into, prefetch, pin, unpin, delete, publish, stats, sessions), each with a ``timeout_s``.
Bulk bytes go through the server's shared-memory slab when the server is on this host (leases:
allocate -> copy -> commit, acquire -> copy -> release), else through chunked
streams. Every call has a deadline; UNAVAILABLE is retried with backoff; failures raise the
tierkv exception of their status code. The logic is ``tierkv.client.flows``'s, shared with
``AsyncClient``; each method here runs its flow in the calling thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar, Unpack

import grpc
import torch

from tierkv.client import base
from tierkv.client.base import BlockFill, BlockUse, ClientOptions
from tierkv.client.effects import Flow, run_blocking
from tierkv.client.flows import ClientFlows
from tierkv.client.results import ServerStats
from tierkv.config import Priority, WritePolicy
from tierkv.errors import TierKVError
from tierkv.keys import DEFAULT_TENANT, Namespace
from tierkv.types import ClearResult, PutDetail, ResumedSession, SessionInfo
from tierkv.wire.convert import LookupDetail, ServerInfo
from tierkv.wire.limits import DEFAULT_TARGET

R = TypeVar("R")
log = logging.getLogger(__name__)


class Client(ClientFlows):
    """A connection to a ``tierkv serve`` sidecar. Use as a context manager, or ``close()``."""

    def __init__(self, target: str = DEFAULT_TARGET, **settings: Unpack[ClientOptions]) -> None:
        super().__init__(target, settings)
        self._channel, self._connection = base.open_channel(grpc, target, self.settings)
        # Sends queued releases that no call carried within release_delay_s (started with the
        # first one queued).
        self._release_sender: threading.Thread | None = None
        self._release_wakeup = threading.Condition()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Send the queued releases, close the channel and unmap the slab. Calls afterwards
        raise ``ServiceUnavailableError``."""
        if not self._closed:
            with contextlib.suppress(TierKVError):
                run_blocking(self._connection, self._send_releases())
        self._unmap()
        with self._release_wakeup:
            self._release_wakeup.notify_all()
        if self._release_sender is not None and self._release_sender is not threading.current_thread():
            self._release_sender.join(timeout=1.0)
        self._channel.close()

    def _run(self, flow: Flow[R]) -> R:
        try:
            return run_blocking(self._connection, flow)
        finally:
            if self._releases:
                self._wake_release_sender()

    def _wake_release_sender(self) -> None:
        with self._release_wakeup:
            sender = self._release_sender
            if (sender is None or not sender.is_alive()) and not self._closed:
                self._release_sender = threading.Thread(
                    target=Client._send_releases_when_due,
                    args=(weakref.ref(self), self._release_wakeup),
                    name="tierkv-client-releases", daemon=True)
                self._release_sender.start()
            self._release_wakeup.notify_all()

    @staticmethod
    def _send_releases_when_due(client_ref: weakref.ref[Client],
                                wakeup: threading.Condition) -> None:
        """The sender thread: each queued release no call carried goes once it is due. It
        holds the client weakly, so a client dropped without ``close`` is still collected
        (its thread then ends within a second)."""
        while True:
            with wakeup:
                client = client_ref()
                if client is None or client._closed:
                    return
                due_in_s = client._releases_due_in_s()
                del client
                if due_in_s is None or due_in_s > 0:
                    wakeup.wait(1.0 if due_in_s is None else min(due_in_s, 1.0))
                    continue
            client = client_ref()
            if client is None:
                return
            try:
                run_blocking(client._connection, client._send_releases())
            except (TierKVError, ValueError):  # closed under it: nothing to do
                pass
            except Exception:  # the next call or close sends what is left
                log.exception("tierkv: sending queued releases failed")
            del client

    def describe(self) -> ServerInfo:
        """The server's facts (slab, host, limits); fetched once, and again when the server's
        slab went away (it restarted)."""
        return self._run(self._describe())

    @property
    def uses_shared_memory(self) -> bool:
        """Whether bulk bytes go through the server's shared-memory slab."""
        return self._run(self._uses_shared_memory())

    # --- the block API ------------------------------------------------------------------------

    def put(
        self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
        priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
        timeout_s: float | None = None, detail: PutDetail | None = None,
    ) -> int:
        """Store ``blocks`` under ``hashes``; returns the blocks newly stored. ``detail``: what
        the writer says of them: token ids for the sidecar's KV events, parents so that a
        chain saved in several puts is evicted tail first."""
        return self._run(self._put(namespace, hashes, blocks, priority, write_policy, timeout_s,
                                         detail))

    def put_with(
        self, namespace: Namespace, hashes: Sequence[bytes], fill: BlockFill, *,
        priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
        timeout_s: float | None = None, detail: PutDetail | None = None,
    ) -> int:
        """Store blocks that ``fill`` writes (``BlockFill``: on this thread, straight into the
        server's slab when it is on this host, so the bytes are copied once) under ``hashes``;
        returns the blocks newly stored."""
        return self._run(self._put_with(namespace, hashes, fill, priority, write_policy,
                                        timeout_s, detail))

    def lookup(self, namespace: Namespace, hashes: Sequence[bytes], *,
               timeout_s: float | None = None) -> int:
        """How many leading ``hashes`` are cached (short chains, on the same host, from the
        shared presence table without a call)."""
        local = self._lookup_now(namespace, hashes)
        return local if local is not None else self._run(self._lookup(namespace, hashes, timeout_s))

    def lookup_detail(
        self, namespace: Namespace, hashes: Sequence[bytes], *, prefetch: bool = False,
        pin_ttl_s: float = 0.0, timeout_s: float | None = None,
    ) -> LookupDetail:
        """The cached prefix with per-tier counts; optionally prefetch it into HOST and pin it."""
        return self._run(self._lookup_detail(namespace, hashes, prefetch, pin_ttl_s, timeout_s))

    def prefetch(self, namespace: Namespace, hashes: Sequence[bytes], *,
                 timeout_s: float | None = None) -> int:
        """Bring the cached prefix into HOST; returns its length."""
        return self.lookup_detail(namespace, hashes, prefetch=True, timeout_s=timeout_s).num_cached

    def get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor, *,
                 timeout_s: float | None = None) -> int:
        """Copy the leading cached blocks into ``out[:k]``; returns ``k``."""
        return self._run(self._get_into(namespace, hashes, out, timeout_s))

    def get_with(self, namespace: Namespace, hashes: Sequence[bytes], use: BlockUse, *,
                 timeout_s: float | None = None) -> int:
        """Hand the leading cached blocks to ``use`` (``BlockUse``: on this thread, as the
        server's slab pages when it is on this host, so the bytes are copied once, by ``use``),
        checked; returns how many leading blocks were handed over good."""
        return self._run(self._get_with(namespace, hashes, use, timeout_s))

    def get(self, namespace: Namespace, hashes: Sequence[bytes],
            device: str | torch.device = "cpu", *, timeout_s: float | None = None) -> torch.Tensor:
        """The leading cached blocks as a new ``[k, *block_shape]`` tensor."""
        return self._run(self._get(namespace, hashes, device, timeout_s))

    def pin(self, namespace: Namespace, hashes: Sequence[bytes], ttl_s: float | None = None, *,
            timeout_s: float | None = None) -> int:
        """Pin the cached prefix (until ``unpin``, or for ``ttl_s``); returns how many."""
        return self._run(self._pin(namespace, hashes, ttl_s, timeout_s))

    def unpin(self, namespace: Namespace, hashes: Sequence[bytes], *,
              timeout_s: float | None = None) -> int:
        """Drop one pin of each; returns how many were pinned."""
        return self._run(self._count("Unpin", self._blocks_request(namespace, hashes), timeout_s))

    def delete(self, namespace: Namespace, hashes: Sequence[bytes], *,
               timeout_s: float | None = None) -> int:
        """Delete the blocks; returns how many were stored."""
        return self._run(self._count("Delete", self._blocks_request(namespace, hashes), timeout_s))

    def publish(self, namespace: Namespace, hashes: Sequence[bytes], *, wait_s: float = 5.0,
                timeout_s: float | None = None) -> int:
        """Make the leading cached blocks readable where every sidecar sharing this one's
        REMOTE tier looks, waiting up to ``wait_s`` for REMOTE: how many leading ``hashes`` it
        then holds (without REMOTE: how many this sidecar holds)."""
        return self._run(self._publish(namespace, hashes, wait_s, timeout_s))

    def stats(self, *, max_namespaces: int = 0, timeout_s: float | None = None
              ) -> ServerStats:
        """The server's tier and counter snapshot (``StoreStats``) and its largest namespaces
        (at most ``max_namespaces``; 0: the server's default, 20; only the caller's tenant's
        unless the server names it an admin tenant)."""
        return self._run(self._stats(max_namespaces, timeout_s))

    def clear(
        self, *, tenant: str | None = None, model_id: str | None = None,
        namespace: Namespace | None = None, all_namespaces: bool = False,
        progress: Callable[[int, int], None] | None = None, timeout_s: float | None = None,
    ) -> ClearResult:
        """Delete every block and session of the namespaces matching the filters (an operator
        call; see ``TieredStore.clear``): of ``tenant`` (None: every tenant this caller may
        clear), of ``model_id``, or exactly ``namespace`` (of ``tenant``, or of the caller's own
        tenant: the namespace's own ``tenant`` field is not sent); ``all_namespaces`` instead of
        any filter clears everything the caller may. ``progress(num_blocks_done,
        num_blocks_total)`` is called as the server reports it. The caller reaches its
        own tenant only, unless the server names it an admin tenant:
        ``PermissionDeniedError`` for another tenant. ``InvalidArgumentError`` for no filter
        and not ``all_namespaces``, or both. The deadline is ``timeout_s`` or an hour."""
        return self._run(self._clear(tenant, model_id, namespace, all_namespaces, progress,
                                      timeout_s))

    # --- sessions -----------------------------------------------------------------------------

    def save_session(self, namespace: Namespace, session_id: str, token_ids: Sequence[int],
                     ttl_s: float | None = None, *, timeout_s: float | None = None) -> int:
        """Store a session's token ids durably; returns their number."""
        return self._run(self._save_session(namespace, session_id, token_ids, ttl_s, timeout_s))

    def resume_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT,
                       timeout_s: float | None = None) -> ResumedSession:
        """A saved session's namespace, token ids and number of leading tokens cached
        (``NotFoundError``: none). ``tenant`` is not sent: the token's tenant is the caller's."""
        return self._run(self._resume_session(session_id, timeout_s))

    def delete_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT,
                       timeout_s: float | None = None) -> bool:
        """Delete a session; True if it existed (``tenant``: as for ``resume_session``)."""
        return self._run(self._delete_session(session_id, timeout_s))

    def list_sessions(self, *, tenant: str = DEFAULT_TENANT,
                      timeout_s: float | None = None) -> list[SessionInfo]:
        """The caller's sessions (``tenant``: as for ``resume_session``)."""
        return self._run(self._list_sessions(timeout_s))
