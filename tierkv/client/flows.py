"""The client's logic, written once for ``Client`` and ``AsyncClient``: each call is a generator
(a ``Flow``) that yields the I/O it needs (``tierkv.client.effects``) and decides the rest itself
(retries, shared-memory or stream path, remaps, lease margins, chunking, damaged blocks).
The drivers hold no logic of their own.
Design: docs/design/client.md
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import torch

from tierkv.checks import check_out
from tierkv.client import base
from tierkv.client.effects import (
    Copy,
    Effect,
    Flow,
    GetReceiver,
    GetStream,
    PutStream,
    ServerStream,
    Sleep,
    Unary,
)
from tierkv.client.results import ServerStats
from tierkv.config import Priority, WritePolicy
from tierkv.errors import InvalidArgumentError, ServiceUnavailableError, TierKVError
from tierkv.keys import Namespace
from tierkv.types import (
    ClearResult,
    NamespaceStats,
    PutDetail,
    RemoteStats,
    ResumedSession,
    SessionInfo,
    TenantTierStats,
    TierStats,
)
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire.convert import (
    LookupDetail,
    ServerInfo,
    clear_request_to,
    clear_result_from,
    lookup_from,
    server_info_from,
    sessions_from,
    stats_from,
)
from tierkv.wire.namespaces import namespace_from

_MAX_UINT32 = 2**32 - 1

_CARRIES_RELEASES = frozenset({"Acquire", "Allocate", "Release"})
"""Calls that carry queued releases in their request (Release: is one), or need none sent."""

_RELEASES_POLL_S = 0.001
"""How often a call waiting for releases being sent on their own looks again."""

CLEAR_TIMEOUT_S = 3600.0
"""A Clear's deadline when the call names none: clearing millions of blocks takes minutes, far
beyond the deadline of other calls (``ClientSettings.timeout_s``)."""


class ClientFlows(base.ClientBase):
    """Every call of the client as a ``Flow`` (see the module's docstring)."""

    # --- plumbing -----------------------------------------------------------------------------

    def _retrying(self, effect: Effect, retry: bool = True) -> Flow[Any]:
        """``effect``'s result; a retryable failure is tried again after a backoff, any other
        raises the tierkv exception of its status code."""
        settings = self.settings
        if self._closed:
            raise ServiceUnavailableError("this client is closed")
        for number in range(settings.retries + 1):
            try:
                return (yield effect)
            except grpc.RpcError as exc:
                if not (retry and base.is_retryable(exc) and number < settings.retries):
                    raise base.error_from(exc) from None
            except ValueError as exc:  # grpc's "closed channel": closed by another thread
                if self._closed and not isinstance(exc, TierKVError):
                    raise ServiceUnavailableError("this client was closed during the call") from None
                raise
            yield Sleep(settings.backoff_s * 2**number)
        raise AssertionError("unreachable")

    def _call(self, method: str, request: Any, timeout_s: float | None = None,
              retry: bool = True) -> Flow[Any]:
        """A unary call under the client's retry policy. A call that carries no releases
        sends the queued ones first, and waits for those another thread or task is sending:
        whatever it reads (stats, a lookup) counts them."""
        if method not in _CARRIES_RELEASES or not self._carries_releases():
            yield from self._send_releases()
            waited_until_s = time.monotonic() + self.settings.timeout_s
            while self._releases_sending() and time.monotonic() < waited_until_s:
                yield Sleep(_RELEASES_POLL_S)
        return (yield from self._retrying(
            Unary(method, request, timeout_s or self.settings.timeout_s), retry))

    def _send_releases(self) -> Flow[None]:
        """Send every queued release on its own (a lease that expired meanwhile, or of a
        server that restarted, is not an error: the client's copy was checked)."""
        while releases := self._take_releases():
            self._sending_releases(len(releases))
            try:
                for release in releases:
                    with contextlib.suppress(TierKVError):
                        yield from self._retrying(
                            Unary("Release", release, self.settings.timeout_s), retry=False)
            finally:
                self._sending_releases(-len(releases))

    def _describe(self) -> Flow[ServerInfo]:
        """The server's facts; fetched once, and again when the server's slab went away."""
        self._check_mapping()
        if self._info is None:
            response = yield from self._call("Describe", pb.DescribeRequest())
            self._info = server_info_from(response)
            self._adopt(self._info)
        return self._info

    def _uses_shared_memory(self) -> Flow[bool]:
        yield from self._describe()
        return self._slab is not None

    # --- puts ---------------------------------------------------------------------------------

    def _put(
        self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor,
        priority: Priority, write_policy: WritePolicy | None, timeout_s: float | None,
        detail: PutDetail | None = None,
    ) -> Flow[int]:
        flat = base.block_bytes_of(blocks, namespace)
        if len(hashes) != blocks.shape[0]:
            raise InvalidArgumentError(f"got {len(hashes)} hashes but {blocks.shape[0]} blocks")
        count = yield from self._put_leased(
            namespace, hashes, priority, write_policy, timeout_s,
            lambda slab, lease, granted_s: self._fill_lease(slab, lease, namespace, flat,
                                                            granted_s), detail)
        if count is not None:
            return count
        return (yield from self._put_streamed(namespace, hashes, flat, priority, write_policy,
                                              timeout_s, detail))

    def _put_with(
        self, namespace: Namespace, hashes: Sequence[bytes], fill: base.BlockFill,
        priority: Priority, write_policy: WritePolicy | None, timeout_s: float | None,
        detail: PutDetail | None = None,
    ) -> Flow[int]:
        if not hashes:
            return 0
        count = yield from self._put_leased(
            namespace, hashes, priority, write_policy, timeout_s,
            lambda slab, lease, granted_s: self._fill_lease_with(
                slab, lease, namespace, fill, len(hashes), granted_s), detail)
        if count is not None:
            return count
        block_bytes = namespace.layout.bytes_per_block
        buffer = torch.empty((len(hashes), block_bytes), dtype=torch.uint8)
        yield Copy(fill, list(range(len(hashes))), buffer)
        return (yield from self._put_streamed(namespace, hashes, buffer.view(-1), priority,
                                              write_policy, timeout_s, detail))

    def _put_leased(
        self, namespace: Namespace, hashes: Sequence[bytes], priority: Priority,
        write_policy: WritePolicy | None, timeout_s: float | None,
        write: Callable[[base.SlabMapping, pb.LeaseResponse, float], pb.LeaseRequest],
        detail: PutDetail | None = None,
    ) -> Flow[int | None]:
        """A put through the slab, written again once into a restarted server's; None when
        the server is not on this host (the caller streams)."""
        for attempt in range(2):
            yield from self._describe()
            if self._slab is None:
                return None
            try:
                with self._leasing():
                    return (yield from self._put_shared(namespace, hashes, priority,
                                                        write_policy, timeout_s, write, detail))
            except base.REMAP_ERRORS:
                if attempt:
                    raise
                self._forget_server()  # a restarted server: map its new slab and write again
        return None

    def _put_streamed(
        self, namespace: Namespace, hashes: Sequence[bytes], flat: torch.Tensor,
        priority: Priority, write_policy: WritePolicy | None, timeout_s: float | None,
        detail: PutDetail | None = None,
    ) -> Flow[int]:
        response = yield from self._retrying(PutStream(
            lambda: base.put_chunks(namespace, hashes, flat, write_policy, priority, detail),
            timeout_s or self.settings.timeout_s,
        ))
        return int(response.count)

    def _put_shared(
        self, namespace: Namespace, hashes: Sequence[bytes], priority: Priority,
        write_policy: WritePolicy | None, timeout_s: float | None,
        write: Callable[[base.SlabMapping, pb.LeaseResponse, float], pb.LeaseRequest],
        detail: PutDetail | None = None,
    ) -> Flow[int]:
        """Allocate, ``write`` the lease's blocks into the slab (it returns the Commit
        request), Commit; a failed write aborts the lease."""
        slab = self._slab
        assert slab is not None
        request = self._allocate_request(namespace, hashes, priority, write_policy, detail)
        try:
            lease = yield from self._call("Allocate", request, timeout_s)
        except BaseException:
            self._requeue_releases(request.releases)
            raise
        granted_s = time.monotonic()
        try:
            commit = yield Copy(write, slab, lease, granted_s)
        except BaseException:
            with contextlib.suppress(TierKVError):  # the lease may be gone with its server
                yield from self._call("Abort", pb.LeaseRequest(lease_id=lease.lease_id),
                                      retry=False)
            raise
        response = yield from self._call("Commit", commit, timeout_s, retry=False)
        return int(response.count)

    # --- gets ---------------------------------------------------------------------------------

    def _get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor,
                  timeout_s: float | None) -> Flow[int]:
        flat = check_out(namespace.layout, out, len(hashes))
        target = flat if flat.device.type == "cpu" else torch.empty(flat.numel(), dtype=torch.uint8)
        block_bytes = namespace.layout.bytes_per_block

        def read(slab: base.SlabMapping, lease: pb.LeaseResponse, done: int) -> int | None:
            return self._read_lease(slab, lease, namespace, target, done)

        def rest(done: int) -> Flow[int]:
            return self._get_streamed(namespace, hashes[done:], target[done * block_bytes :],
                                      timeout_s)

        num_blocks = yield from self._get_leased(namespace, hashes, read, rest, timeout_s)
        if target is not flat:
            size = num_blocks * block_bytes
            flat[:size].copy_(target[:size])
        return num_blocks

    def _get_with(self, namespace: Namespace, hashes: Sequence[bytes], use: base.BlockUse,
                  timeout_s: float | None) -> Flow[int]:
        if not hashes:
            return 0

        def read(slab: base.SlabMapping, lease: pb.LeaseResponse, done: int) -> int | None:
            return self._read_lease_with(slab, lease, namespace, use, done, len(hashes))

        def rest(done: int) -> Flow[int]:
            buffer = torch.empty((len(hashes) - done, namespace.layout.bytes_per_block),
                                 dtype=torch.uint8)
            got = yield from self._get_streamed(namespace, hashes[done:], buffer.view(-1),
                                                timeout_s)
            if got:
                yield Copy(use, list(range(done, done + got)), buffer[:got])
            return got

        return (yield from self._get_leased(namespace, hashes, read, rest, timeout_s))

    def _get_leased(
        self, namespace: Namespace, hashes: Sequence[bytes],
        read: Callable[[base.SlabMapping, pb.LeaseResponse, int], int | None],
        rest: Callable[[int], Flow[int]], timeout_s: float | None,
    ) -> Flow[int]:
        """A get through the slab (``read`` copies a lease's blocks, from block ``done`` on,
        and says which one was bad), read again once from a restarted server's; ``rest(done)``
        streams from block ``done`` on when the server is not on this host or HOST leased none."""
        for attempt in range(2):
            yield from self._describe()
            if self._slab is None:
                break
            try:
                with self._leasing():
                    return (yield from self._get_shared(namespace, hashes, read, rest,
                                                        timeout_s))
            except base.REMAP_ERRORS:
                if attempt:
                    raise
                self._forget_server()
        return (yield from rest(0))

    def _get_shared(
        self, namespace: Namespace, hashes: Sequence[bytes],
        read: Callable[[base.SlabMapping, pb.LeaseResponse, int], int | None],
        rest: Callable[[int], Flow[int]], timeout_s: float | None,
    ) -> Flow[int]:
        slab = self._slab
        assert slab is not None
        done = 0
        while done < len(hashes):
            request = self._acquire_request(namespace, hashes[done:])
            try:
                lease = yield from self._call("Acquire", request, timeout_s)
            except BaseException:
                self._requeue_releases(request.releases)
                raise
            bad: int | None = None
            # Until the copy is checked the client has kept nothing (a stale mapping raises
            # before it copies): the server counts hits only for what a client kept.
            release = pb.LeaseRequest(lease_id=lease.lease_id, num_copied=0)
            checked = False
            try:
                bad = yield Copy(read, slab, lease, done)
                release.num_copied = lease.num_blocks if bad is None else bad
                checked = True
            finally:
                if bad is not None:
                    release.corrupt_indices.append(bad)
                if checked and bad is None and self._carries_releases():
                    # Its pages stay leased until the release rides on the next call.
                    self._defer_release(release)
                else:
                    with contextlib.suppress(TierKVError):  # an expired lease: copy checked
                        yield from self._call("Release", release, retry=False)
            if bad is not None:
                return done + bad  # a damaged block ends the run: a miss, never its bytes
            count = lease.num_blocks
            done += count
            if count >= lease.num_cached:
                break  # a miss ends the run
            if count == 0:
                # Stored, but HOST could lease none of them (its room pinned, leased or in
                # use): the stream reads them where they are, without a page of HOST.
                done += yield from rest(done)
                break
        return done

    def _get_streamed(self, namespace: Namespace, hashes: Sequence[bytes], flat: torch.Tensor,
                      timeout_s: float | None) -> Flow[int]:
        """Get streams until the stored run ends (the server cuts one answer at its
        ``max_put_bytes`` and says ``more``)."""
        target, block_bytes = flat.numpy(), namespace.layout.bytes_per_block
        done = 0
        while done < len(hashes):
            part = target[done * block_bytes :]
            got, more = yield from self._retrying(GetStream(
                self._blocks_request(namespace, hashes[done:]),
                timeout_s or self.settings.timeout_s,
                lambda part=part: GetReceiver(part, block_bytes),  # type: ignore[misc]
            ))
            done += got
            if not more or not got:
                break
        return done

    def _get(self, namespace: Namespace, hashes: Sequence[bytes], device: str | torch.device,
             timeout_s: float | None) -> Flow[torch.Tensor]:
        layout = namespace.layout
        out = torch.empty((len(hashes), *layout.block_shape), dtype=layout.torch_dtype,
                          device=device)
        return out[: (yield from self._get_into(namespace, hashes, out, timeout_s))]

    # --- lookups, pins, deletes, stats --------------------------------------------------------

    def _lookup_now(self, namespace: Namespace, hashes: Sequence[bytes]) -> int | None:
        """The answer of ``_lookup`` when it needs no I/O at all (the server is described and
        its presence table answers), else None. Not a flow: a same-host lookup takes about
        5 us, and driving a generator would add a sixth to it."""
        self._check_mapping()
        return None if self._info is None else self._lookup_locally(namespace, hashes)

    def _lookup(self, namespace: Namespace, hashes: Sequence[bytes],
                timeout_s: float | None) -> Flow[int]:
        yield from self._describe()  # (a stale slab and its presence table are dropped first)
        local = self._lookup_locally(namespace, hashes)
        if local is not None:
            return local
        detail = yield from self._lookup_detail(namespace, hashes, False, 0.0, timeout_s)
        return detail.num_cached

    def _lookup_detail(self, namespace: Namespace, hashes: Sequence[bytes], prefetch: bool,
                       pin_ttl_s: float, timeout_s: float | None) -> Flow[LookupDetail]:
        response = yield from self._call(
            "Lookup", self._lookup_request(namespace, hashes, prefetch, pin_ttl_s), timeout_s
        )
        return lookup_from(response)

    def _count(self, method: str, request: Any, timeout_s: float | None) -> Flow[int]:
        """A call answered with a ``CountResponse``: its count."""
        return int((yield from self._call(method, request, timeout_s)).count)

    def _publish(self, namespace: Namespace, hashes: Sequence[bytes], wait_s: float,
                 timeout_s: float | None) -> Flow[int]:
        # The call's own deadline covers the server's wait for REMOTE.
        deadline_s = max(timeout_s or self.settings.timeout_s, wait_s + 1.0)
        return (yield from self._count("Publish", pb.PublishRequest(
            namespace=self._wire(namespace), hashes=list(hashes), timeout_s=wait_s,
        ), deadline_s))

    def _pin(self, namespace: Namespace, hashes: Sequence[bytes], ttl_s: float | None,
             timeout_s: float | None) -> Flow[int]:
        return (yield from self._count("Pin", pb.PinRequest(
            namespace=self._wire(namespace), hashes=list(hashes), ttl_s=ttl_s or 0.0,
        ), timeout_s))

    def _stats(self, max_namespaces: int, timeout_s: float | None) -> Flow[ServerStats]:
        if type(max_namespaces) is not int or not 0 <= max_namespaces <= _MAX_UINT32:
            raise InvalidArgumentError(
                f"max_namespaces must be an int in [0, {_MAX_UINT32}], got {max_namespaces!r}")
        response = yield from self._call(
            "Stats", pb.StatsRequest(max_namespaces=max_namespaces), timeout_s)
        return stats_from(response, TierStats, ServerStats, NamespaceStats, RemoteStats,
                          TenantTierStats)

    def _clear(self, tenant: str | None, model_id: str | None, namespace: Namespace | None,
               all_namespaces: bool, progress: Callable[[int, int], None] | None,
               timeout_s: float | None) -> Flow[ClearResult]:
        try:
            request = clear_request_to(tenant, model_id, namespace, all_namespaces)
        except (ValueError, TypeError) as exc:  # a field past the wire's bounds or of a bad type
            raise InvalidArgumentError(f"clear: {exc}") from None

        def on_message(message: pb.ClearProgress) -> None:
            if progress is not None:
                progress(int(message.num_blocks_done), int(message.num_blocks_total))

        # Sent again after UNAVAILABLE: a second clear of the same filters deletes what the
        # first did not get to, and nothing else.
        last = yield from self._retrying(ServerStream(
            "Clear", request, timeout_s or CLEAR_TIMEOUT_S, on_message))
        if last is None or not last.done:
            raise ServiceUnavailableError("the Clear stream ended before its counts")
        return clear_result_from(last, ClearResult)

    # --- sessions -----------------------------------------------------------------------------

    def _save_session(self, namespace: Namespace, session_id: str, token_ids: Sequence[int],
                      ttl_s: float | None, timeout_s: float | None) -> Flow[int]:
        response = yield from self._call("SaveSession", pb.SaveSessionRequest(
            namespace=self._wire(namespace), session_id=session_id,
            token_ids=list(token_ids), ttl_s=ttl_s or 0.0,
        ), timeout_s)
        return int(response.num_tokens)

    def _resume_session(self, session_id: str, timeout_s: float | None
                        ) -> Flow[ResumedSession]:
        response = yield from self._call("ResumeSession", pb.SessionRequest(session_id=session_id),
                                         timeout_s)
        namespace = namespace_from(response.namespace, "")
        return ResumedSession(namespace, tuple(response.token_ids),
                              int(response.num_cached_tokens))

    def _delete_session(self, session_id: str, timeout_s: float | None) -> Flow[bool]:
        response = yield from self._call("DeleteSession", pb.SessionRequest(session_id=session_id),
                                         timeout_s)
        return bool(response.deleted)

    def _list_sessions(self, timeout_s: float | None) -> Flow[list[SessionInfo]]:
        response = yield from self._call("ListSessions", pb.ListSessionsRequest(), timeout_s)
        return sessions_from(response, SessionInfo)
