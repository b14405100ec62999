"""``tierkv.Client``: the blocking client SDK of the sidecar.

Same methods as the embedded ``TieredStore`` (put, lookup, get, get_into, pin, unpin, delete,
stats, sessions). Bulk bytes go through the server's shared-memory slab when the server is on
this host (leases: allocate -> copy -> commit, acquire -> copy -> release), else through chunked
streams. Every call has a deadline; UNAVAILABLE is retried with backoff; failures raise the
tierkv exception of their status code.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import torch

from tierkv.client import base
from tierkv.codec import namespace_from_wire
from tierkv.config import Priority, WritePolicy
from tierkv.errors import InvalidArgumentError, ServiceUnavailableError, TierKVError
from tierkv.keys import Namespace
from tierkv.store.validation import check_out
from tierkv.wire import tierkv_pb2 as pb

R = TypeVar("R")


class Client(base.ClientBase):
    """A connection to a ``tierkv serve`` sidecar. Use as a context manager, or ``close()``."""

    def __init__(self, target: str = base.DEFAULT_TARGET, **settings: Any) -> None:
        super().__init__(target, settings)
        self._channel, self._stub, self._put_stream = base.open_channel(grpc, target,
                                                                         self.settings)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel and unmap the slab. Calls afterwards raise
        ``ServiceUnavailableError``."""
        self._unmap()
        self._channel.close()

    # --- plumbing -----------------------------------------------------------------------------

    def _call(self, method: str, request: Any, timeout_s: float | None = None,
              retry: bool = True) -> Any:
        return self._retrying(
            lambda: getattr(self._stub, method)(
                request, timeout=timeout_s or self.settings.timeout_s,
                metadata=self._metadata,
            ),
            retry,
        )

    def _retrying(self, attempt: Callable[[], R], retry: bool = True) -> R:
        settings = self.settings
        if self._closed:
            raise ServiceUnavailableError("this client is closed")
        for number in range(settings.retries + 1):
            try:
                return attempt()
            except grpc.RpcError as exc:
                if retry and base.is_retryable(exc) and number < settings.retries:
                    time.sleep(settings.backoff_s * 2**number)
                    continue
                raise base.error_from(exc) from None
            except ValueError as exc:  # grpc's "closed channel": closed by another thread
                if self._closed and not isinstance(exc, TierKVError):
                    raise ServiceUnavailableError("this client was closed during the call") from None
                raise
        raise AssertionError("unreachable")

    def describe(self) -> pb.DescribeResponse:
        """The server's facts (slab, host, limits); fetched once, and again when the server's
        slab went away (it restarted)."""
        self._check_mapping()
        if self._info is None:
            self._info = self._call("Describe", pb.DescribeRequest())
            self._adopt(self._info)
        return self._info

    @property
    def uses_shared_memory(self) -> bool:
        """Whether bulk bytes go through the server's shared-memory slab."""
        self.describe()
        return self._slab is not None

    # --- the block API ------------------------------------------------------------------------

    def put(
        self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
        priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
        timeout_s: float | None = None,
    ) -> int:
        """Store ``blocks`` under ``hashes``; returns the blocks newly stored."""
        flat = base.block_bytes_of(blocks, namespace)
        if len(hashes) != blocks.shape[0]:
            raise InvalidArgumentError(f"got {len(hashes)} hashes but {blocks.shape[0]} blocks")
        for attempt in range(2):
            self.describe()
            if self._slab is None:
                break
            try:
                with self._leasing():
                    return self._put_shared(namespace, hashes, flat, priority, write_policy,
                                            timeout_s)
            except base.REMAP_ERRORS:
                if attempt:
                    raise
                self._forget_server()  # a restarted server: map its new slab and write again
        return int(self._retrying(lambda: self._put_stream(
            base.put_chunks(namespace, hashes, flat, write_policy, priority),
            timeout=timeout_s or self.settings.timeout_s, metadata=self._metadata,
        )).count)

    def _put_shared(
        self, namespace: Namespace, hashes: Sequence[bytes], flat: torch.Tensor,
        priority: Priority, write_policy: WritePolicy | None, timeout_s: float | None,
    ) -> int:
        slab = self._slab
        assert slab is not None
        lease = self._call(
            "Allocate", self._allocate_request(namespace, hashes, priority, write_policy), timeout_s
        )
        granted_s = time.monotonic()
        try:
            commit = self._fill_lease(slab, lease, namespace, flat, granted_s)
        except BaseException:
            with contextlib.suppress(TierKVError):  # the lease may be gone with its server
                self._call("Abort", pb.LeaseRequest(lease_id=lease.lease_id), retry=False)
            raise
        return int(self._call("Commit", commit, timeout_s, retry=False).count)

    def lookup(self, namespace: Namespace, hashes: Sequence[bytes], *,
               timeout_s: float | None = None) -> int:
        """How many leading ``hashes`` are cached (short chains, on the same host, from the
        shared presence table without a call)."""
        self.describe()  # (a stale slab and its presence table are dropped first)
        local = self._lookup_locally(namespace, hashes)
        if local is not None:
            return local
        return int(self.lookup_detail(namespace, hashes, timeout_s=timeout_s).num_cached)

    def lookup_detail(
        self, namespace: Namespace, hashes: Sequence[bytes], *, prefetch: bool = False,
        pin_ttl_s: float = 0.0, timeout_s: float | None = None,
    ) -> pb.LookupResponse:
        """The cached prefix with per-tier counts; optionally prefetch it into HOST and pin it."""
        response: pb.LookupResponse = self._call(
            "Lookup", self._lookup_request(namespace, hashes, prefetch, pin_ttl_s), timeout_s
        )
        return response

    def prefetch(self, namespace: Namespace, hashes: Sequence[bytes], *,
                 timeout_s: float | None = None) -> int:
        """Bring the cached prefix into HOST; returns its length."""
        return int(self.lookup_detail(namespace, hashes, prefetch=True,
                                      timeout_s=timeout_s).num_cached)

    def get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor, *,
                 timeout_s: float | None = None) -> int:
        """Copy the leading cached blocks into ``out[:k]``; returns ``k``."""
        flat = check_out(namespace.layout, out, len(hashes))
        target = flat if flat.device.type == "cpu" else torch.empty(flat.numel(), dtype=torch.uint8)
        num_blocks: int | None = None
        for attempt in range(2):
            self.describe()
            if self._slab is None:
                break
            try:
                with self._leasing():
                    num_blocks = self._get_shared(namespace, hashes, target, timeout_s)
                break
            except base.REMAP_ERRORS:
                if attempt:
                    raise
                self._forget_server()
        if num_blocks is None:
            num_blocks = self._get_streamed(namespace, hashes, target, timeout_s)
        if target is not flat:
            size = num_blocks * namespace.layout.bytes_per_block
            flat[:size].copy_(target[:size])
        return num_blocks

    def _get_shared(self, namespace: Namespace, hashes: Sequence[bytes], flat: torch.Tensor,
                    timeout_s: float | None) -> int:
        slab = self._slab
        assert slab is not None
        done = 0
        while done < len(hashes):
            lease = self._call("Acquire", self._acquire_request(namespace, hashes[done:]),
                               timeout_s)
            bad: int | None = None
            release = pb.LeaseRequest(lease_id=lease.lease_id)
            try:
                bad = self._read_lease(slab, lease, namespace, flat, done)
            finally:
                if bad is not None:
                    release.corrupt_indices.append(bad)
                with contextlib.suppress(TierKVError):  # an expired lease: the copy is checked
                    self._call("Release", release, retry=False)
            if bad is not None:
                return done + bad  # a damaged block ends the run: a miss, never its bytes
            count = len(lease.blocks)
            done += count
            if count == 0 or count >= lease.num_cached:
                break  # a miss ends the run (or HOST could lease none: stop, never spin)
        return done

    def _get_streamed(self, namespace: Namespace, hashes: Sequence[bytes], flat: torch.Tensor,
                      timeout_s: float | None) -> int:
        request = self._blocks_request(namespace, hashes)
        target = flat.numpy()

        def attempt() -> int:
            num_blocks, received = 0, 0
            responses: Iterator[pb.GetChunk] = self._stub.Get(
                request, timeout=timeout_s or self.settings.timeout_s,
                metadata=self._metadata,
            )
            for index, chunk in enumerate(responses):
                if index == 0:
                    num_blocks = chunk.num_blocks
                size = len(chunk.data)
                target[received : received + size] = memoryview(chunk.data)
                received += size
            if received != num_blocks * namespace.layout.bytes_per_block:
                raise ServiceUnavailableError("the Get stream ended early")
            return num_blocks

        return self._retrying(attempt)

    def get(self, namespace: Namespace, hashes: Sequence[bytes],
            device: str | torch.device = "cpu", *, timeout_s: float | None = None) -> torch.Tensor:
        """The leading cached blocks as a new ``[k, *block_shape]`` tensor."""
        layout = namespace.layout
        out = torch.empty((len(hashes), *layout.block_shape), dtype=layout.torch_dtype,
                          device=device)
        return out[: self.get_into(namespace, hashes, out, timeout_s=timeout_s)]

    def pin(self, namespace: Namespace, hashes: Sequence[bytes], ttl_s: float | None = None, *,
            timeout_s: float | None = None) -> int:
        """Pin the cached prefix (until ``unpin``, or for ``ttl_s``); returns how many."""
        return int(self._call("Pin", pb.PinRequest(
            namespace=self._wire(namespace), hashes=list(hashes), ttl_s=ttl_s or 0.0,
        ), timeout_s).count)

    def unpin(self, namespace: Namespace, hashes: Sequence[bytes], *,
              timeout_s: float | None = None) -> int:
        """Drop one pin of each; returns how many were pinned."""
        return int(self._call("Unpin", self._blocks_request(namespace, hashes), timeout_s).count)

    def delete(self, namespace: Namespace, hashes: Sequence[bytes], *,
               timeout_s: float | None = None) -> int:
        """Delete the blocks; returns how many were stored."""
        return int(self._call("Delete", self._blocks_request(namespace, hashes), timeout_s).count)

    def stats(self, *, timeout_s: float | None = None) -> pb.StatsResponse:
        """The server's tier and counter snapshot."""
        response: pb.StatsResponse = self._call("Stats", pb.StatsRequest(), timeout_s)
        return response

    # --- sessions -----------------------------------------------------------------------------

    def save_session(self, namespace: Namespace, session_id: str, token_ids: Sequence[int],
                     ttl_s: float | None = None, *, timeout_s: float | None = None) -> int:
        """Store a session's token ids durably; returns their number."""
        return int(self._call("SaveSession", pb.SaveSessionRequest(
            namespace=self._wire(namespace), session_id=session_id,
            token_ids=list(token_ids), ttl_s=ttl_s or 0.0,
        ), timeout_s).num_tokens)

    def resume_session(self, session_id: str, *,
                       timeout_s: float | None = None) -> tuple[Namespace, list[int], int]:
        """``(namespace, token ids, number of leading tokens cached)`` of a saved session."""
        response = self._call("ResumeSession", pb.SessionRequest(session_id=session_id), timeout_s)
        namespace = namespace_from_wire(response.namespace, "")
        return namespace, list(response.token_ids), int(response.num_cached_tokens)

    def delete_session(self, session_id: str, *, timeout_s: float | None = None) -> bool:
        """Delete a session; True if it existed."""
        return bool(self._call("DeleteSession", pb.SessionRequest(session_id=session_id),
                               timeout_s).deleted)

    def list_sessions(self, *, timeout_s: float | None = None) -> list[pb.SessionInfo]:
        """The caller's sessions."""
        return list(self._call("ListSessions", pb.ListSessionsRequest(), timeout_s).sessions)



