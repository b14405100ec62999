"""``TieredStore``: the embedded, in-process store (the server wraps one of these).

Contract (the first rule of the design): a hit returns exactly the bytes stored under that key,
or is a miss; never anything else. A put is acknowledged only once its blocks are stored (and,
``write_through``, durable on disk); bad input raises before anything is stored.

Thread safety: every method may be called from any number of threads at once. The ``a*``
coroutines run the blocking work on the store's worker threads and never block the event loop.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import torch

from tierkv.config import Priority, StoreConfig, Tier, WritePolicy
from tierkv.errors import (
    ConfigError,
    InvalidArgumentError,
    StoreClosedError,
    TierKVError,
    UnknownNamespaceError,
)
from tierkv.keys import Namespace
from tierkv.shm.liveness import ClientWatch
from tierkv.shm.presence import PresenceTable
from tierkv.store import namespaces, recovery
from tierkv.store.async_api import AsyncMethods
from tierkv.store.books import StoreCore
from tierkv.store.clearing import Clearer, ClearResult, Progress, namespace_filter
from tierkv.store.lease_api import LeaseMethods
from tierkv.store.leases import Leases
from tierkv.store.ledger import NamespaceState, PagedLedger
from tierkv.store.moves import Mover
from tierkv.store.reads import Reader
from tierkv.store.session_api import SessionMethods
from tierkv.store.sessions import SessionTable
from tierkv.store.stats import NamespaceStats, StoreStats, namespace_snapshot, snapshot
from tierkv.store.validation import check_blocks, check_hashes, check_lookup_hashes, check_ttl
from tierkv.store.writes import Writer
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.gpu import DeviceSlab
from tierkv.tiers.host import HostSlab

if TYPE_CHECKING:
    from tierkv.store.remote_link import RemoteLink

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


class TieredStore(AsyncMethods, LeaseMethods, SessionMethods):
    """KV blocks across GPU, HOST and DISK tiers, keyed by ``(namespace, block hash)``.

    Open it with a ``StoreConfig``; with a disk tier, blocks written there by an earlier process
    (``write_through``, or flushed at close) are served again. Close it (or use ``with``) to
    flush HOST-only blocks to disk and release the shared-memory slab.
    """

    def __init__(
        self,
        config: StoreConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        show_progress: bool = False,
    ) -> None:
        self.config = config
        self._closed = False
        self._host = HostSlab(config.host, show_progress)
        self._gpu: DeviceSlab | None = None
        self._disk: DiskTier | None = None
        self._presence: PresenceTable | None = None
        try:
            paged = {Tier.HOST: PagedLedger(Tier.HOST, self._host)}
            if config.gpu.enabled:
                self._gpu = DeviceSlab(config.gpu)
                paged[Tier.GPU] = PagedLedger(Tier.GPU, self._gpu)
            if config.disk is not None:
                self._disk = DiskTier(config.disk)
            if config.presence_slots:
                self._presence = PresenceTable(config.presence_slots,
                                               f"{self._host.shm_name}-presence")
            self._core = StoreCore(config, paged, self._disk, clock, self._presence)
            self.num_recovered_blocks = recovery.recover(self._core, show_progress)
            self._sessions = SessionTable(self._disk)
        except BaseException:
            self._release_resources()
            raise
        self._executor = ThreadPoolExecutor(config.num_workers, "tierkv-store")
        mover = Mover(self._core)
        self._reader = Reader(self._core, mover, self._executor)
        self._writer = Writer(self._core, mover)
        self._retired = namespaces.RetiredNamespaces()
        self._clearer = Clearer(self._core, self._sessions)
        self._leases = Leases(self._core, mover, self._writer,
                              ClientWatch(self.client_lock_prefix, clock), clock)
        self._remote: RemoteLink | None = None
        if config.remote is not None:  # connects in the background: never blocks the start
            # Imported here: a store without a REMOTE tier never loads redis-py.
            from tierkv.store.remote_link import RemoteLink
            from tierkv.tiers.remote import RemoteTier

            self._remote = RemoteLink(self._core, mover, self._writer, RemoteTier(config.remote))
            self._core.to_remote = self._remote.offer
            self._core.record_buffers = self._remote.record_buffers
            if self._disk is not None:
                self._disk.on_demote = self._remote.offer_demoted
            else:
                self._core.demote_to_remote = self._remote.demote

    # --- namespaces -----------------------------------------------------------------------

    def register(self, namespace: Namespace) -> None:
        """Make ``namespace`` usable (idempotent). With a disk tier its descriptor is stored, so
        a reopened store knows it. Raises ``ConfigError`` if one block does not fit a tier."""
        self._check_open()
        state = recovery.namespace_state(namespace)
        for ledger in self._core.ledgers.values():
            size = state.record_bytes if ledger.tier is Tier.DISK else state.block_bytes
            if not ledger.fits(size):
                raise ConfigError(
                    f"{ledger.tier.label} tier budget ({ledger.capacity_bytes} B) is smaller than "
                    f"one block of {namespace.model_id} ({size} B); raise the "
                    f"--{ledger.tier.label}-bytes budget"
                )
        with self._core.lock:
            if namespace.id in self._core.namespaces:
                return
            # A removed namespace whose state a write lease still holds gets that state back.
            state = self._retired.revive(namespace.id) or state
            self._core.namespaces[namespace.id] = state
            job = None
            if self._core.disk is not None:
                descriptor = recovery.namespace_descriptor(namespace)
                job = self._core.submit_disk_locked(namespace_puts=[(namespace.id, descriptor)])
        if job is not None:
            job.future.result()

    def is_registered(self, namespace: Namespace) -> bool:
        """Whether ``namespace`` is usable (registered now, or recovered from disk)."""
        return namespace.id in self._core.namespaces

    def num_namespaces(self, tenant: str | None = None) -> int:
        """How many namespaces are registered (of ``tenant`` only, when given)."""
        with self._core.lock:
            states = list(self._core.namespaces.values())
        return len(states) if tenant is None else sum(
            1 for state in states if state.namespace.tenant == tenant
        )

    def prune_namespaces(self, tenant: str | None = None) -> list[Namespace]:
        """Unregister the namespaces (of ``tenant``, or of everyone) that hold no block and no
        session, and delete their disk descriptors (durably, unless the disk fails: then they
        come back at the next start). Returns the namespaces removed; using one of them needs
        ``register`` again (which keeps the blocks of write leases granted before)."""
        self._check_open()
        with self._core.lock:
            empty = namespaces.empty_namespaces_locked(self._core, tenant)
        with_sessions = {
            (name, session.model_id)
            for name in {namespace.tenant for namespace in empty}
            for session in self.list_sessions(name)
        }
        candidates = [ns for ns in empty if (ns.tenant, ns.model_id) not in with_sessions]
        with self._core.lock:
            removed, job = namespaces.remove_locked(self._core, self._retired, candidates)
        if job is not None:
            try:
                job.future.result()
            except TierKVError as exc:  # kept on disk: they are registered again at restart
                log.warning("could not delete %d namespace descriptors: %s", len(removed), exc)
        return removed

    def _state(self, namespace: Namespace) -> NamespaceState:
        self._check_open()
        if not isinstance(namespace, Namespace):
            raise InvalidArgumentError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        state = self._core.namespaces.get(namespace.id)
        if state is None:
            raise UnknownNamespaceError(
                f"namespace {namespace.model_id!r} (tenant {namespace.tenant!r}, tp "
                f"{namespace.tp_rank}/{namespace.tp_size}) is not registered; call "
                "store.register(namespace) first"
            )
        return state

    # --- the block API --------------------------------------------------------------------

    def put(
        self,
        namespace: Namespace,
        hashes: Sequence[bytes],
        blocks: torch.Tensor,
        *,
        priority: Priority = Priority.NORMAL,
        write_policy: WritePolicy | None = None,
        tier: Tier | None = None,
    ) -> int:
        """Store ``blocks`` (``[n, *layout.block_shape]``) under ``hashes`` (n of them).

        Goes to ``tier`` (default: GPU for a CUDA tensor when the GPU tier is on, else HOST);
        ``write_through`` also writes DISK before returning, and queues the blocks for REMOTE
        (without a disk tier, only that). Keys already there keep their one
        copy (put is idempotent). Returns the number of blocks newly stored in ``tier``. Raises
        ``CapacityError`` when they do not fit even after eviction; nothing is then stored.
        """
        state = self._state(namespace)
        keys = check_hashes(hashes)
        flat = check_blocks(state.namespace.layout, blocks, len(keys))
        policy = write_policy or self.config.write_policy
        target = tier if tier is not None else self._default_tier(flat)
        if target not in self._core.ledgers:
            raise ConfigError(f"put: the {target.label} tier is not configured")
        if policy is WritePolicy.WRITE_THROUGH and not self._writes_through():
            raise ConfigError("put: write_through needs a disk tier (--disk-path) or a REMOTE "
                              "tier (--remote)")
        return self._writer.put(state, keys, flat, Priority(priority), policy, target)

    def _default_tier(self, flat: torch.Tensor) -> Tier:
        return Tier.GPU if flat.is_cuda and Tier.GPU in self._core.paged else Tier.HOST

    def lookup(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are stored in some tier (a prefix-cache match)."""
        state = self._state(namespace)
        if isinstance(hashes, bytes | bytearray | memoryview | str):
            check_lookup_hashes(hashes)
        blocks = state.blocks
        num_found = 0
        with self._core.lock:
            for block_hash in hashes:
                if block_hash not in blocks:
                    break
                num_found += 1
        check_lookup_hashes(hashes, num_found)
        if self._remote is None or num_found >= len(hashes):
            return num_found
        return self._remote.lookup_suffix(state, check_hashes(hashes), num_found)

    @property
    def has_remote_tier(self) -> bool:
        """Whether a REMOTE tier is configured (lookups and reads may then go past the local
        tiers)."""
        return self._remote is not None

    def extend_lookup(self, namespace: Namespace, hashes: Sequence[bytes], num_local: int) -> int:
        """``lookup`` given that the first ``num_local`` hashes are held locally: how many
        leading ``hashes`` are held locally or in REMOTE (``num_local`` without REMOTE)."""
        if self._remote is None or num_local >= len(hashes):
            return num_local
        return self._remote.lookup_suffix(self._state(namespace), check_hashes(hashes), num_local)

    def locate(self, namespace: Namespace, hashes: Sequence[bytes]) -> dict[Tier, int]:
        """How many of the leading stored blocks of ``hashes`` have their fastest copy in each
        tier (their sum is ``lookup``)."""
        state = self._state(namespace)
        if isinstance(hashes, bytes | bytearray | memoryview | str):
            check_lookup_hashes(hashes)
        find = state.blocks.get
        num_gpu = num_host = num_disk = 0
        with self._core.lock:  # one tight loop: every remote lookup runs it
            for block_hash in hashes:
                entry = find(block_hash)
                if entry is None:
                    break
                if entry.gpu is not None:
                    num_gpu += 1
                elif entry.host is not None:
                    num_host += 1
                else:
                    num_disk += 1
        check_lookup_hashes(hashes, num_gpu + num_host + num_disk)
        return {Tier.GPU: num_gpu, Tier.HOST: num_host, Tier.DISK: num_disk}

    def get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor, *,
                 missed_after: bool = False) -> int:
        """Copy the leading stored blocks of ``hashes`` into ``out[:k]``; returns ``k``.

        ``out`` is ``[>= n, *block_shape]`` of the layout's dtype, on the CPU or a CUDA device,
        contiguous; reuse it across calls for speed. Rows past ``k`` are unspecified. A hit is
        counted for each block returned, a miss for the block that ended the run;
        ``missed_after``: the caller cut ``hashes`` where the stored run of its own, longer
        request ended, so that one miss is counted even when every block is returned.
        """
        state = self._state(namespace)
        keys = check_hashes(hashes)
        self._fill_remote(state, keys)
        return self._reader.get_into(state, keys, out, missed_after)

    def get(
        self, namespace: Namespace, hashes: Sequence[bytes], device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        """The leading stored blocks of ``hashes``, as a new ``[k, *block_shape]`` tensor."""
        state = self._state(namespace)
        layout = state.namespace.layout
        out = torch.empty((len(hashes), *layout.block_shape), dtype=layout.torch_dtype, device=device)
        return out[: self.get_into(namespace, hashes, out)]

    def prefetch(
        self, namespace: Namespace, hashes: Sequence[bytes], tier: Tier = Tier.HOST
    ) -> Future[int]:
        """Bring the leading stored blocks of ``hashes`` up into ``tier`` in the background;
        the future gives how many leading blocks are then in ``tier`` or above."""
        state = self._state(namespace)
        keys = check_hashes(hashes)
        if tier not in self._core.paged:
            raise ConfigError(f"prefetch: the {tier.label} tier is not configured")
        return self._executor.submit(self._prefetch, state, keys, tier)

    def _prefetch(self, state: NamespaceState, keys: list[bytes], tier: Tier) -> int:
        self._fill_remote(state, keys)
        return self._reader.prefetch(state, keys, tier)

    def _fill_remote(self, state: NamespaceState, keys: list[bytes]) -> None:
        """Bring the blocks of the chain only REMOTE holds into HOST (a read that would miss)."""
        if self._remote is not None:
            self._remote.fill(state, keys)

    def flush_remote(self, timeout_s: float | None = None) -> bool:
        """Wait until the records queued for REMOTE have been sent (True when there is no
        REMOTE tier); False if ``timeout_s`` ran out first."""
        return self._remote is None or self._remote.flush(timeout_s)

    def pin(self, namespace: Namespace, hashes: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Keep the leading stored blocks of ``hashes`` from eviction until ``unpin`` (or for
        ``ttl_s`` seconds). Returns how many were pinned."""
        state = self._state(namespace)
        keys = check_hashes(hashes)
        ttl = check_ttl(ttl_s)
        core = self._core
        num_pinned = 0
        with core.lock:
            core.expire_pins_locked()  # expired pins go now, not only under eviction
            for key in keys:
                entry = state.blocks.get(key)
                if entry is None:
                    break
                if core.pins.pin(entry, ttl):
                    core.unlink_all_locked(entry)
                num_pinned += 1
        return num_pinned

    def unpin(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """Drop one pin from each stored block of ``hashes``; returns how many were pinned."""
        state = self._state(namespace)
        keys = check_hashes(hashes)
        core = self._core
        num_unpinned = 0
        with core.lock:
            core.expire_pins_locked()
            for key in keys:
                entry = state.blocks.get(key)
                if entry is None or entry not in core.pins:
                    continue
                num_unpinned += 1
                if core.pins.unpin(entry):
                    core.relink_locked(entry)
        return num_unpinned

    def delete(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """Remove the blocks of ``hashes`` from every tier; returns how many were stored.

        They are misses at once, REMOTE included (its copies are deleted before this returns,
        unless their node is down). Their disk records are deleted durably before this returns
        (those of blocks being read at that moment go when the read ends). If the disk cannot
        commit the deletes (``DiskFullError``), they stay queued and ride in the next write.
        """
        state = self._state(namespace)
        keys = check_hashes(hashes)
        num_deleted = 0
        # REMOTE's copies too, or the next read would bring them back.
        with self._forgetting(raw_keys=[state.id + key for key in keys]):
            with self._core.lock:
                for key in keys:
                    entry = state.blocks.get(key)
                    if entry is not None:
                        self._core.doom_locked(entry)
                        num_deleted += 1
                job = self._core.submit_deletes_locked()
            if job is not None:
                self._core.wait_disk(job)
        return num_deleted

    def _forgetting(self, raw_keys: Sequence[bytes] = (), namespace_ids: Sequence[bytes] = ()
                    ) -> contextlib.AbstractContextManager[None]:
        if self._remote is None:
            return contextlib.nullcontext()
        return self._remote.forgetting(raw_keys, namespace_ids)

    def wait_for_background(self, timeout_s: float | None = None) -> bool:
        """Wait until the background promotions started so far have finished (for tests,
        benchmarks and orderly shutdown); False if ``timeout_s`` ran out first."""
        self._check_open()
        return self._reader.wait_for_background(timeout_s)

    def stats(self) -> StoreStats:
        """A consistent snapshot of every tier's bytes, blocks and counters (``num_pinned``
        counts only pins that have not expired)."""
        self._check_open()
        with self._core.lock:
            self._core.expire_pins_locked()
        remote = self._remote.stats() if self._remote is not None else None
        return snapshot(self._core, self._leases, self._sessions.num_sessions, remote)

    def namespace_stats(self, tenant: str | None = None) -> list[NamespaceStats]:
        """Each namespace (of ``tenant``, or everyone's) that is registered or named by a
        session: its blocks, their bytes (each block once) and its sessions, largest first.
        O(namespaces): the counts are kept up to date as blocks and sessions come and go."""
        self._check_open()
        return namespace_snapshot(self._core, self._sessions.counts_by_namespace(), tenant)

    def clear(
        self, *, tenant: str | None = None, model_id: str | None = None,
        namespace: Namespace | None = None, progress: Progress | None = None,
    ) -> ClearResult:
        """Delete every block (in every tier, disk included; pinned ones too) and every session
        of the namespaces matching all the filters given (none given: every namespace);
        ``progress(num_blocks_done, num_blocks_total)`` is called as it goes, from this thread.
        Blocks being read or copied are misses at once too (``num_busy`` counts them: their
        room comes back when the reads end); namespaces stay registered; the
        disk deletes are durable on return (see ``tierkv.store.clearing``). Safe against
        concurrent calls of every kind. ``InvalidArgumentError`` for a filter of the wrong type.
        """
        self._check_open()
        matches = namespace_filter(tenant, model_id, namespace)
        with self._core.lock:
            cleared = [s.id for s in self._core.namespaces.values() if matches(s.namespace)]
        # The REMOTE copies of the namespaces this store knows, too.
        with self._forgetting(namespace_ids=cleared):
            return self._clearer.clear(matches, progress)

    def _submit(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        self._check_open()
        return self._executor.submit(fn, *args, **kwargs)

    # --- lifecycle ------------------------------------------------------------------------

    def flush(self) -> int:
        """Write every block that is only in GPU/HOST to DISK; returns how many were written."""
        self._check_open()
        return self._writer.flush_to_disk()

    def close(self, flush: bool = True) -> None:
        """Stop accepting calls, finish background work, optionally ``flush``, release the tiers.
        Idempotent."""
        if self._closed:
            return
        try:
            self._executor.shutdown(wait=True)
            if self._disk is not None:  # background promotions from disk run there
                self._disk.readers.shutdown(wait=True)
            if flush and self._disk is not None:
                self._writer.flush_to_disk()
            if self._remote is not None:
                self._remote.close()
        finally:
            self._closed = True
            self._release_resources()

    def presence_info(self, tenant: str) -> tuple[str, bytes]:
        """``(shared-memory name, tenant key)`` of the presence table, or ``("", b"")`` when it
        is off (see ``tierkv.shm.presence``)."""
        if self._presence is None or not self._presence.enabled:
            return "", b""
        return self._presence.name, self._presence.tenant_key(tenant)

    def _release_resources(self) -> None:
        if self._presence is not None:
            self._presence.close()
        if self._disk is not None:
            self._disk.close()
        if self._gpu is not None:
            self._gpu.close()
        self._host.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
