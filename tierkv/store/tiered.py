"""``TieredStore``: the embedded, in-process store (the server wraps one of these).

Contract (the first rule of the design): a hit returns exactly the bytes stored under that key,
or is a miss; never anything else. A put is acknowledged only once its blocks are stored (and,
``write_through``, durable on disk); bad input raises before anything is stored.

Thread safety: every method may be called from any number of threads at once. The ``a*``
coroutines run the blocking work on the store's worker threads and never block the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import torch

from tierkv.block_store import DEFAULT_PUBLISH_WAIT_S
from tierkv.checks import (
    check_blocks,
    check_detail,
    check_hashes,
    check_lookup_hashes,
    check_ttl,
)
from tierkv.config import Priority, StoreConfig, TenantShares, Tier, WritePolicy
from tierkv.errors import (
    ConfigError,
    InvalidArgumentError,
    StoreClosedError,
    TierKVError,
    UnknownNamespaceError,
)
from tierkv.eviction import EvictionPolicy
from tierkv.hashing import DEFAULT_ALGORITHM, HashAlgorithm, block_hashes
from tierkv.keys import DEFAULT_TENANT, Namespace
from tierkv.shm.liveness import ClientWatch
from tierkv.shm.presence import PresenceTable
from tierkv.store import namespaces, recovery
from tierkv.store.clearing import Clearer, Progress, namespace_filter
from tierkv.store.core import Spill, StoreCore
from tierkv.store.events import EventLog
from tierkv.store.index import NamespaceState, PagedLedger, leading_count, leading_run
from tierkv.store.leases import Leases
from tierkv.store.migrate import Mover
from tierkv.store.reads import Reader
from tierkv.store.sessions import SessionTable, TokenIds
from tierkv.store.sidecar import SidecarPort
from tierkv.store.stats import namespace_snapshot, snapshot, tenant_snapshot, tenant_view
from tierkv.store.writes import Writer
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.gpu import DeviceSlab
from tierkv.tiers.host import HostSlab
from tierkv.types import (
    ClearResult,
    NamespaceStats,
    PutDetail,
    ResumedSession,
    SessionInfo,
    StoreStats,
    TenantTierStats,
)

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


class TieredStore:
    """KV blocks across GPU, HOST and DISK tiers, keyed by ``(namespace, block hash)``.

    Open it with a ``StoreConfig``; with a disk tier, blocks written there by an earlier process
    (``write_through``, or flushed at close) are served again. Close it (or use ``with``) to
    flush HOST-only blocks to disk and release the shared-memory slab. ``eviction``: the policy
    that picks victims in every tier (default ``tierkv.eviction.EvictionPolicy``: tenants asked
    in ``ask_tenants``' order, LRU within priority classes, lowest class first). ``events``:
    where every copy that becomes readable or goes is recorded, for a KV-event publisher
    (``tierkv.store.events``; None: nowhere). A ``tierkv.BlockStore``; the calls only a server
    makes are on ``sidecar``.
    """

    def __init__(
        self,
        config: StoreConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        show_progress: bool = False,
        eviction: EvictionPolicy | None = None,
        events: EventLog | None = None,
    ) -> None:
        self.config = config
        self._closed = False
        self._host = HostSlab(config.host, show_progress)
        self._gpu: DeviceSlab | None = None
        self._disk: DiskTier | None = None
        self._presence: PresenceTable | None = None
        try:
            paged = {Tier.HOST: PagedLedger(Tier.HOST, self._host, config.tenants)}
            if config.gpu.enabled:
                self._gpu = DeviceSlab(config.gpu)
                paged[Tier.GPU] = PagedLedger(Tier.GPU, self._gpu, config.tenants)
            if config.disk is not None:
                self._disk = DiskTier(config.disk)
            if config.presence_slots:
                self._presence = PresenceTable(config.presence_slots,
                                               f"{self._host.shm_name}-presence")
            self._core = StoreCore(config, paged, self._disk, clock, self._presence, eviction)
            self.num_recovered_blocks = recovery.recover(self._core, show_progress)
            # From here on: what recovery found is restated by the publisher's first resync.
            self._core.events = events
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
                              ClientWatch(f"{self._host.shm_name}-client-", clock), clock)
        self._remote: Spill | None = None  # REMOTE, called through the Spill protocol only
        if config.remote is not None:  # connects in the background: never blocks the start
            # Imported here: a store without a REMOTE tier never loads redis-py.
            from tierkv.store.remote import RemoteLink
            from tierkv.tiers.remote import RemoteTier

            remote = RemoteLink(self._core, mover, self._writer, RemoteTier(config.remote))
            self._core.attach_spill(remote)
            self._remote = remote
        self.sidecar = SidecarPort(self._core, self._leases, self._host, self._presence,
                                   self._remote, self._state, self._check_open)
        """The calls only a server makes (leases, the slab's facts, event restating...)."""

    # --- namespaces -----------------------------------------------------------------------

    def register(self, namespace: Namespace) -> None:
        """Make ``namespace`` usable (idempotent). With a disk tier its descriptor is stored, so
        a reopened store knows it. Raises ``ConfigError`` if one block does not fit a tier."""
        self._check_open()
        state = namespaces.namespace_state(namespace)
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
                descriptor = namespaces.namespace_descriptor(namespace)
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
            for session in self.list_sessions(tenant=name)
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
        detail: PutDetail | None = None,
    ) -> int:
        """Store ``blocks`` (``[n, *layout.block_shape]``) under ``hashes`` (n of them).

        Goes to ``tier`` (default: GPU for a CUDA tensor when the GPU tier is on, else HOST);
        ``write_through`` also writes DISK before returning, and queues the blocks for REMOTE
        (without a disk tier, only that). Keys already there keep their one
        copy (put is idempotent). Returns the number of blocks newly stored in ``tier``. Raises
        ``CapacityError`` when they do not fit even after eviction; nothing is then stored.
        ``detail``: what the writer says of the blocks, for KV events and the eviction order
        (a block named as a parent is evicted after its descendants); never stored.
        """
        state = self._state(namespace)
        keys = check_hashes(hashes)
        flat = check_blocks(state.namespace.layout, blocks, len(keys))
        target = tier if tier is not None else self._default_tier(flat)
        if target not in self._core.ledgers:
            raise ConfigError(f"put: the {target.label} tier is not configured")
        policy = self._core.write_policy(write_policy, "put")
        check_detail(detail, len(keys), state.namespace.layout.block_size)
        return self._writer.put(state, keys, flat, Priority(priority), policy, target, detail)

    def _default_tier(self, flat: torch.Tensor) -> Tier:
        return Tier.GPU if flat.is_cuda and Tier.GPU in self._core.paged else Tier.HOST

    def lookup(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are stored in some tier (a prefix-cache match)."""
        state = self._state(namespace)
        if isinstance(hashes, bytes | bytearray | memoryview | str):
            check_lookup_hashes(hashes)
        with self._core.lock:
            num_found = leading_count(state.blocks, hashes)
        check_lookup_hashes(hashes, num_found)
        if self._remote is None or num_found >= len(hashes):
            return num_found
        return self._remote.lookup_suffix(state, check_hashes(hashes), num_found)

    def publish(self, namespace: Namespace, hashes: Sequence[bytes], *,
                wait_s: float = DEFAULT_PUBLISH_WAIT_S) -> int:
        """Make the leading held blocks of ``hashes`` readable from REMOTE, where every store
        sharing it looks, and wait up to ``wait_s`` until they are: how many leading
        ``hashes`` REMOTE then holds (what was dropped on the way, or is not held here, is
        not). Without a REMOTE tier: ``lookup`` (this store is where its readers look)."""
        state = self._state(namespace)
        keys = check_hashes(hashes)
        if self._remote is None:
            return self.lookup(namespace, keys)
        return self._remote.publish(state, keys, wait_s,
                                    lambda missing: self._local_copies(state, missing))

    def _local_copies(self, state: NamespaceState, keys: list[bytes]) -> torch.Tensor:
        """The leading blocks of ``keys`` the local tiers hold, checked, as a new tensor (no
        fill from REMOTE: ``publish`` asks for the ones REMOTE lacks). Not a hit: nobody is
        served them, so the tenant's hits and the tiers' stay as they were."""
        layout = state.namespace.layout
        out = torch.empty((len(keys), *layout.block_shape), dtype=layout.torch_dtype)
        return out[: self._reader.get_into(state, keys, out, served=False)]

    @property
    def has_remote_tier(self) -> bool:
        """Whether a REMOTE tier is configured (lookups and reads may then go past the local
        tiers)."""
        return self._remote is not None

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

    def prefetch(self, namespace: Namespace, hashes: Sequence[bytes],
                 tier: Tier = Tier.HOST) -> int:
        """Bring the leading stored blocks of ``hashes`` up into ``tier`` and wait; returns how
        many leading blocks are then in ``tier`` or above."""
        return self.prefetch_async(namespace, hashes, tier).result()

    def prefetch_async(self, namespace: Namespace, hashes: Sequence[bytes],
                       tier: Tier = Tier.HOST) -> Future[int]:
        """``prefetch`` in the background (on a worker thread)."""
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
            self._remote.fetch(state, keys)

    def flush_remote(self, timeout_s: float | None = None) -> bool:
        """Wait until the records queued for REMOTE have been sent (True when there is no
        REMOTE tier); False if ``timeout_s`` ran out first."""
        return self._remote is None or self._remote.flush(timeout_s)

    def pin(self, namespace: Namespace, hashes: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Keep the leading stored blocks of ``hashes`` from eviction until ``unpin`` (or for
        ``ttl_s`` seconds). Returns how many were pinned: the run ends at the first block not
        stored, or, with tenants' shares, at the first whose pin would take its tenant's pinned
        bytes in a tier past its guaranteed share there."""
        state = self._state(namespace)
        keys = check_hashes(hashes)
        ttl = check_ttl(ttl_s)
        core = self._core
        with core.lock:
            core.expire_pins_locked()  # expired pins go now, not only under eviction
            run = leading_run(state.blocks, keys)
            room = core.unevictable_room_locked(state)
            if room is not None:
                run = run[:core.pins.num_affordable(run, room, core.held_bytes)]
            for entry in run:
                if core.pins.pin(entry, ttl):
                    core.unlink_all_locked(entry)
        return len(run)

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

    def stats(self, tenant: str | None = None) -> StoreStats:
        """A consistent snapshot of every tier's bytes, blocks and counters (``num_pinned``
        counts only pins that have not expired); with ``tenant``, that tenant's own view
        (``StoreStats.tenant`` says what it holds)."""
        self._check_open()
        with self._core.lock:
            self._core.expire_pins_locked()
        if tenant is not None:
            num_sessions = sum(count for namespace, count
                               in self._sessions.counts_by_namespace().values()
                               if namespace.tenant == tenant)
            return tenant_view(self._core, self._leases, num_sessions, tenant)
        remote = self._remote.stats() if self._remote is not None else None
        return snapshot(self._core, self._leases, self._sessions.num_sessions, remote)

    def tenant_stats(self, tenant: str | None = None) -> list[TenantTierStats]:
        """``tenant``'s share of each tier (or every tenant's the store has met), by tenant
        then tier: what it is guaranteed, its cap, what it holds and what it lost to others."""
        self._check_open()
        return tenant_snapshot(self._core, tenant)

    def set_tenant_shares(self, tenants: TenantShares) -> None:
        """Adopt new shares and caps at once (a reload): who may lose blocks to another
        tenant's write changes with the next write that needs room; nothing is evicted now.
        ``ConfigError``, with nothing changed, for shares that do not fit a tier."""
        self._check_open()
        with self._core.lock:
            self._core.configure_tenants_locked(tenants)

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

    # --- the asynchronous calls: the blocking ones on the store's worker threads ----------

    def put_async(self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
                  priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
                  tier: Tier | None = None, detail: PutDetail | None = None) -> Future[int]:
        """``put`` on a worker thread."""
        return self._submit(self.put, namespace, hashes, blocks, priority=priority,
                            write_policy=write_policy, tier=tier, detail=detail)

    def get_async(self, namespace: Namespace, hashes: Sequence[bytes],
                  device: str | torch.device = "cpu") -> Future[torch.Tensor]:
        """``get`` on a worker thread."""
        return self._submit(self.get, namespace, hashes, device)

    def get_into_async(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor, *,
                       missed_after: bool = False) -> Future[int]:
        """``get_into`` on a worker thread."""
        return self._submit(self.get_into, namespace, hashes, out, missed_after=missed_after)

    async def aput(self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
                   priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
                   tier: Tier | None = None, detail: PutDetail | None = None) -> int:
        """``put`` without blocking the event loop."""
        return await asyncio.wrap_future(self.put_async(
            namespace, hashes, blocks, priority=priority, write_policy=write_policy, tier=tier,
            detail=detail))

    async def aget(self, namespace: Namespace, hashes: Sequence[bytes],
                   device: str | torch.device = "cpu") -> torch.Tensor:
        """``get`` without blocking the event loop."""
        return await asyncio.wrap_future(self.get_async(namespace, hashes, device))

    async def aget_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor, *,
                        missed_after: bool = False) -> int:
        """``get_into`` without blocking the event loop."""
        return await asyncio.wrap_future(
            self.get_into_async(namespace, hashes, out, missed_after=missed_after))

    async def aprefetch(self, namespace: Namespace, hashes: Sequence[bytes],
                        tier: Tier = Tier.HOST) -> int:
        """``prefetch``, awaited."""
        return await asyncio.wrap_future(self.prefetch_async(namespace, hashes, tier))

    async def alookup(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        """``lookup`` on a worker thread (it takes the store lock)."""
        return await asyncio.wrap_future(self._submit(self.lookup, namespace, hashes))

    # --- the slab --------------------------------------------------------------------------

    # --- chat sessions (the table: tierkv.store.sessions) --------------------------------

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
        self, session_id: str, *, tenant: str = DEFAULT_TENANT, seed: str | None = None,
        algorithm: HashAlgorithm = DEFAULT_ALGORITHM,
    ) -> ResumedSession:
        """``tenant``'s session: its namespace and token ids, and how many leading tokens are cached (whole
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
        hashes = block_hashes(tokens, block_size, seed, algorithm=algorithm)
        num_blocks = self.lookup(namespace, hashes)
        self._refresh(self._state(namespace), check_hashes(hashes[:num_blocks]))
        return ResumedSession(namespace, tuple(tokens.tolist()), num_blocks * block_size)

    def _refresh(self, state: NamespaceState, keys: list[bytes]) -> None:
        """Touch the leading stored blocks of ``keys`` tail first, as a read does (a resumed
        session is read next: its history must not be the next victim)."""
        with self._core.lock:
            self._core.touch_run_locked(leading_run(state.blocks, keys))

    def delete_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT) -> bool:
        """Delete ``tenant``'s session (durably, with a disk tier); True if it existed and had not
        expired. Its blocks stay until evicted or ``delete``d."""
        self._check_open()
        return self._sessions.delete(tenant, session_id)

    def list_sessions(self, *, tenant: str = DEFAULT_TENANT) -> list[SessionInfo]:
        """The tenant's sessions that have not expired, sorted by ``session_id``."""
        self._check_open()
        return self._sessions.list_for(tenant)

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
