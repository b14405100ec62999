"""``TieredStore``'s same-host data plane: leases on HOST pages and the slab's identity.

Mixed into ``TieredStore`` (which provides the state named below); the lease table itself is
``tierkv.store.leases``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.config import Priority, StoreConfig, WritePolicy
from tierkv.errors import ConfigError, StaleSlabError
from tierkv.keys import Namespace
from tierkv.store.books import StoreCore
from tierkv.store.lease_writer import LeaseWriter
from tierkv.store.leases import Leases, ReadLease, WriteLease
from tierkv.store.ledger import NamespaceState
from tierkv.store.validation import check_hashes
from tierkv.tiers.host import HostSlab


class LeaseMethods:
    """The lease calls of ``TieredStore`` (see ``tierkv.store.leases`` for the contract)."""

    config: StoreConfig
    _core: StoreCore
    _host: HostSlab
    _leases: Leases

    def _state(self, namespace: Namespace) -> NamespaceState:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    def _fill_remote(self, state: NamespaceState, keys: list[bytes]) -> None:
        raise NotImplementedError

    def _writes_through(self) -> bool:
        return self._core.disk is not None or self._core.to_remote is not None

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
        state = self._state(namespace)
        self._check_slab(slab_id)
        keys = check_hashes(hashes)
        self._fill_remote(state, keys)
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
    ) -> WriteLease:
        """Reserve HOST pages for writing the blocks of ``hashes`` in place; ``commit`` (with
        the checksum of each block written) or ``abort`` before the lease expires. Same errors
        as ``put``; ``slab_id`` and ``client_id`` as for ``acquire``."""
        state = self._state(namespace)
        keys = check_hashes(hashes)
        self._check_slab(slab_id)
        return self._leases.allocate(state, keys, ttl_s, owner, Priority(priority),
                                     self._lease_policy(write_policy), client_id=client_id)

    def allocate_in_process(
        self, namespace: Namespace, hashes: Sequence[bytes], owner: str = "", *,
        priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
    ) -> WriteLease:
        """A write lease that this process fills itself through ``lease_writer`` (the server's
        stream Put). It never expires (``expires_in_s`` is infinite), so its pages cannot be
        handed to another block while the writer is still copying: end it yourself, ``commit``
        or ``abort`` in a ``finally``. Its commit takes the writer's checksums (or, given none,
        hashes the pages). Otherwise as ``allocate``."""
        state = self._state(namespace)
        keys = check_hashes(hashes)
        return self._leases.allocate(state, keys, None, owner, Priority(priority),
                                     self._lease_policy(write_policy), in_process=True)

    def lease_writer(self, lease: WriteLease, owner: str = "") -> LeaseWriter:
        """A ``LeaseWriter`` that copies the blocks of ``lease`` (of ``allocate_in_process``),
        given as one byte stream in block order, into their pages, hashing each block as it
        lands; use it in a ``with`` block, then ``commit(lease.lease_id, owner,
        writer.checksums)``. ``LeaseNotFoundError`` if the lease is not live, ``LeaseStateError``
        for a client's lease (only its client writes its pages)."""
        self._check_open()
        return self._leases.lease_writer(lease.lease_id, owner)

    def _lease_policy(self, write_policy: WritePolicy | None) -> WritePolicy:
        policy = write_policy or self.config.write_policy
        if policy is WritePolicy.WRITE_THROUGH and not self._writes_through():
            raise ConfigError("allocate: write_through needs a disk tier (--disk-path) or a "
                              "REMOTE tier (--remote)")
        return policy

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

    # --- the slab --------------------------------------------------------------------------

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
    def host_shm_name(self) -> str:
        """Name of the HOST slab's shared-memory segment (for same-host clients)."""
        return self._host.shm_name

    @property
    def host_pinned(self) -> bool:
        """Whether the HOST slab is page-locked for CUDA copies (only when CUDA is present)."""
        return self._host.pinned
