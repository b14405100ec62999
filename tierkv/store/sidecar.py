"""``SidecarPort``: the calls only a server makes on its store (``store.sidecar``).

Same-host leases on HOST pages (acquire/release, allocate/commit/abort, the server's own
stream-Put leases), the slab's facts a client maps it by, the presence table's name, and what a
KV-event publisher and a lookup with tier counts read (locate, extend_lookup, restate_events,
blocks_by_tier, remote_hashes). Users of the store need none of it; ``tierkv.service`` (and the
benchmarks of that data plane) reach it as ``store.sidecar``, and ``tests/test_import_rules.py``
keeps everyone else away. The store owns the state; this holds references, nothing of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tierkv.checks import check_detail, check_hashes, check_lookup_hashes
from tierkv.config import Priority, Tier, WritePolicy
from tierkv.errors import ConfigError, StaleSlabError
from tierkv.keys import Namespace
from tierkv.shm.presence import PresenceTable
from tierkv.store.core import Spill, StoreCore
from tierkv.store.index import NamespaceState, leading_run
from tierkv.store.leases import Leases, LeaseWriter, ReadLease, WriteLease
from tierkv.tiers.host import HostSlab
from tierkv.types import PutDetail


class SidecarPort:
    """The server's calls on one ``TieredStore`` (see the module docstring)."""

    def __init__(self, core: StoreCore, leases: Leases, host: HostSlab,
                 presence: PresenceTable | None, remote: Spill | None,
                 state_of: Callable[[Namespace], NamespaceState],
                 check_open: Callable[[], None]) -> None:
        self._core, self._leases, self._host = core, leases, host
        self._presence, self._remote = presence, remote
        self._state_of, self._check_open = state_of, check_open

    def extend_lookup(self, namespace: Namespace, hashes: Sequence[bytes], num_local: int) -> int:
        """``lookup`` given that the first ``num_local`` hashes are held locally: how many
        leading ``hashes`` are held locally or in REMOTE (``num_local`` without REMOTE)."""
        if self._remote is None or num_local >= len(hashes):
            return num_local
        return self._remote.lookup_suffix(self._state_of(namespace), check_hashes(hashes), num_local)

    def locate(self, namespace: Namespace, hashes: Sequence[bytes]) -> dict[Tier, int]:
        """How many of the leading stored blocks of ``hashes`` have their fastest copy in each
        tier (their sum is ``lookup``)."""
        state = self._state_of(namespace)
        if isinstance(hashes, bytes | bytearray | memoryview | str):
            check_lookup_hashes(hashes)
        with self._core.lock:
            run = leading_run(state.blocks, hashes)
            num_gpu = num_host = 0
            for entry in run:  # one pass: every remote lookup runs it
                if entry.gpu is not None:
                    num_gpu += 1
                elif entry.host is not None:
                    num_host += 1
        num_disk = len(run) - num_gpu - num_host
        check_lookup_hashes(hashes, len(run))
        return {Tier.GPU: num_gpu, Tier.HOST: num_host, Tier.DISK: num_disk}

    def restate_events(self, namespace_ids: Sequence[bytes] | None = None) -> list[Namespace]:
        """Record the whole holding of the namespaces ``namespace_ids`` (None: every one
        registered) in the event log, each at one instant under the store lock, so that a
        publisher restates them (a resync); returns the namespaces restated. Needs ``events``."""
        self._check_open()
        core = self._core
        if core.events is None:
            raise ConfigError("restate_events: this store records no events")
        restated: list[Namespace] = []
        with core.lock:
            ids = list(core.namespaces) if namespace_ids is None else list(namespace_ids)
        for namespace_id in ids:  # one lock hold a namespace: others' puts go on in between
            with core.lock:
                state = core.namespaces.get(bytes(namespace_id))
                if state is not None:
                    core.snapshot_events_locked(state)
                    restated.append(state.namespace)
        return restated

    def blocks_by_tier(self, namespace: Namespace) -> dict[Tier, list[bytes]]:
        """The hashes of ``namespace``'s blocks each local tier holds a readable copy of now
        (a block may be in several), at one instant. O(blocks of the namespace)."""
        state = self._state_of(namespace)
        with self._core.lock:
            return {Tier(tier): [entry.block_hash for entry in entries]
                    for tier, entries in self._core.holding_locked(state).items()}

    def remote_hashes(self, namespace_id: bytes) -> list[bytes]:
        """The block hashes REMOTE holds now under ``namespace_id`` (a scan of every node:
        O(keys); nodes that are down are skipped); empty without a REMOTE tier."""
        self._check_open()
        if self._remote is None:
            return []
        return self._remote.hashes_in(namespace_id)

    def acquire(
        self, namespace: Namespace, hashes: Sequence[bytes], ttl_s: float | None = None,
        owner: str = "", *, slab_id: bytes = b"", client_id: str = "",
    ) -> ReadLease:
        """Lease the leading stored blocks of ``hashes`` in the HOST slab for reading in place;
        ``release`` it when done (it expires after ``ttl_s``, default 30 s). The lease gives
        each block's checksum: verify the bytes copied out against it.

        ``slab_id``: the slab the caller has mapped (``host_slab_id``); another one raises
        ``StaleSlabError``. ``client_id``: names the caller's lock file (see
        ``tierkv.shm.liveness``), so that its leases end at once when it dies."""
        state = self._state_of(namespace)
        self._check_slab(slab_id)
        keys = check_hashes(hashes)
        if self._remote is not None:
            self._remote.fetch(state, keys)
        return self._leases.acquire(state, keys, ttl_s, owner, client_id)

    def release(self, lease_id: bytes, owner: str = "", corrupt_indices: Sequence[int] = (),
                num_copied: int | None = None) -> None:
        """End a read lease (``LeaseNotFoundError`` / ``LeaseStateError`` if it is not live);
        ``corrupt_indices``: leased blocks whose copy failed its checksum (checked again here,
        deleted if damaged); ``num_copied``: how many leading blocks the caller kept (None: all
        before the first corrupt one); only those stay counted as hits."""
        self._check_open()
        self._leases.release(lease_id, owner, corrupt_indices, num_copied)

    def allocate(
        self, namespace: Namespace, hashes: Sequence[bytes], ttl_s: float | None = None,
        owner: str = "", *, priority: Priority = Priority.NORMAL,
        write_policy: WritePolicy | None = None, slab_id: bytes = b"", client_id: str = "",
        detail: PutDetail | None = None,
    ) -> WriteLease:
        """Reserve HOST pages for writing the blocks of ``hashes`` in place; ``commit`` (with
        the checksum of each block written) or ``abort`` before the lease expires. Same errors
        as ``put``; ``slab_id`` and ``client_id`` as for ``acquire``; ``detail`` as ``put``'s."""
        state = self._state_of(namespace)
        keys = check_hashes(hashes)
        self._check_slab(slab_id)
        check_detail(detail, len(keys), state.namespace.layout.block_size)
        return self._leases.allocate(state, keys, ttl_s, owner, Priority(priority),
                                     self._core.write_policy(write_policy, "allocate"), client_id=client_id,
                                     detail=detail)

    def allocate_in_process(
        self, namespace: Namespace, hashes: Sequence[bytes], owner: str = "", *,
        priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
        detail: PutDetail | None = None,
    ) -> WriteLease:
        """A write lease that this process fills itself through ``lease_writer`` (the server's
        stream Put). It never expires (``expires_in_s`` is infinite), so its pages cannot be
        handed to another block while the writer is still copying: end it yourself, ``commit``
        or ``abort`` in a ``finally``. Its commit takes the writer's checksums (or, given none,
        hashes the pages). Otherwise as ``allocate``."""
        state = self._state_of(namespace)
        keys = check_hashes(hashes)
        check_detail(detail, len(keys), state.namespace.layout.block_size)
        return self._leases.allocate(state, keys, None, owner, Priority(priority),
                                     self._core.write_policy(write_policy, "allocate"), in_process=True,
                                     detail=detail)

    def lease_writer(self, lease: WriteLease, owner: str = "") -> LeaseWriter:
        """A ``LeaseWriter`` that copies the blocks of ``lease`` (of ``allocate_in_process``),
        given as one byte stream in block order, into their pages, hashing each block as it
        lands; use it in a ``with`` block, then ``commit(lease.lease_id, owner,
        writer.checksums)``. ``LeaseNotFoundError`` if the lease is not live, ``LeaseStateError``
        for a client's lease (only its client writes its pages)."""
        self._check_open()
        return self._leases.lease_writer(lease.lease_id, owner)

    def commit(self, lease_id: bytes, owner: str = "", checksums: Sequence[int] | None = None
               ) -> int:
        """Make a write lease's blocks visible at once; returns the blocks newly stored.
        ``checksums``: one per written block, in ``write_indices`` order (``tierkv.checksums``
        of the bytes written); ``IntegrityError`` and nothing stored when the pages differ."""
        self._check_open()
        return self._leases.commit(lease_id, owner, checksums)

    def _check_slab(self, slab_id: bytes) -> None:
        if slab_id and slab_id != self._host.slab_id:
            raise StaleSlabError(
                "the lease names a slab this server does not have: the client's mapping is of "
                "an earlier server; describe the server again and remap"
            )

    def abort(self, lease_id: bytes, owner: str = "") -> None:
        """Drop a write lease: none of its blocks becomes visible."""
        self._check_open()
        self._leases.abort(lease_id, owner)

    def expire_leases(self) -> int:
        """End every lease past its deadline (a server calls this periodically)."""
        self._check_open()
        return self._leases.expire()

    @property
    def num_leases(self) -> int:
        """Leases granted and not yet ended."""
        return len(self._leases)

    @property
    def host_slab_id(self) -> bytes:
        """The HOST slab's identity: new for every store (leases name it)."""
        return self._host.slab_id

    @property
    def client_lock_prefix(self) -> str:
        """Same-host clients hold ``/dev/shm/<this><client id>`` locked while they map the slab
        (``tierkv.shm.liveness``)."""
        return f"{self._host.shm_name}-client-"

    @property
    def num_quarantined_pages(self) -> int:
        """HOST pages held back from expired write leases of clients that are still alive."""
        return self._leases.num_quarantined_pages

    @property
    def host_capacity_bytes(self) -> int:
        """The HOST slab's size (what a same-host client maps)."""
        return self._core.paged[Tier.HOST].capacity_bytes

    @property
    def host_shm_name(self) -> str:
        """Name of the HOST slab's shared-memory segment (for same-host clients)."""
        return self._host.shm_name

    @property
    def host_pinned(self) -> bool:
        """Whether the HOST slab is page-locked for CUDA copies (only when CUDA is present)."""
        return self._host.pinned

    def presence_info(self, tenant: str) -> tuple[str, bytes]:
        """``(shared-memory name, tenant key)`` of the presence table, or ``("", b"")`` when it
        is off (see ``tierkv.shm.presence``)."""
        if self._presence is None or not self._presence.enabled:
            return "", b""
        return self._presence.name, self._presence.tenant_key(tenant)
