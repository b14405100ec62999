"""Leases on HOST pages, the same-host zero-copy path: ``acquire``/``release`` to read,
``allocate``/``commit``/``abort`` to write, and ``LeaseWriter``, which fills a write lease from a
byte stream in this process (the server's stream Put). A lease expires (except one this process
fills), belongs to its owner, and a commit is checked against the writer's checksums.
Design: docs/design/leases.md
"""
from __future__ import annotations

import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from tierkv.checks import check_ttl
from tierkv.config import Priority, Tier, WritePolicy
from tierkv.errors import (
    IntegrityError,
    InvalidArgumentError,
    LeaseNotFoundError,
    LeaseStateError,
)
from tierkv.paging import BlockExtents, CopySpan, Location, block_extents, copy_spans, location_num_pages
from tierkv.shm.liveness import ClientWatch, Liveness
from tierkv.store.core import StoreCore
from tierkv.store.index import DOOMED, Entry, NamespaceState, leading_run
from tierkv.store.migrate import Mover
from tierkv.store.writes import Reservation, Writer
from tierkv.types import PutDetail

DEFAULT_LEASE_TTL_S = 30.0
MIN_LEASE_TTL_S = 0.1
MAX_LEASE_TTL_S = 600.0
# How long the pages of an expired write lease of a live client stay out of the free pool.
QUARANTINE_S = MAX_LEASE_TTL_S
_NUM_REMEMBERED = 4096


@dataclass(frozen=True, slots=True)
class ReadLease:
    """Granted by ``acquire``: ``blocks[i]`` says where block ``i`` lies in the HOST slab.

    ``num_cached`` leading hashes were stored; only the first ``len(blocks)`` of them could be
    leased (HOST room is finite): acquire the rest after releasing this one.
    """

    lease_id: bytes
    blocks: list[BlockExtents]
    num_cached: int
    expires_in_s: float
    checksums: list[int]


@dataclass(frozen=True, slots=True)
class WriteLease:
    """Granted by ``allocate``: write block ``write_indices[i]`` into ``blocks[i]``, then commit.
    Blocks not listed are stored already."""

    lease_id: bytes
    write_indices: list[int]
    blocks: list[BlockExtents]
    expires_in_s: float


@dataclass(frozen=True, slots=True)
class _ReadCount:
    """What a read lease's release counts: the tier each leased block was read from, and
    whether the lease reached the end of the stored run (the block after it is a miss)."""

    state: NamespaceState
    tiers: list[Tier]
    ends_run: bool


@dataclass(eq=False)
class _Read:
    owner: str
    client_id: str
    deadline_s: float
    entries: list[Entry]
    count: _ReadCount


@dataclass(eq=False)
class _Write:
    """A write lease: a reservation its client (or this process's stream) fills by deadline."""

    owner: str
    client_id: str
    deadline_s: float
    reservation: Reservation
    # False for a lease written by this process itself (the stream Put): it has no client
    # checksums to check, and the pages are hashed at commit instead.
    verify: bool = True


@dataclass(eq=False)
class _Quarantined:
    client_id: str
    until_s: float
    locations: list[Location]
    state: NamespaceState  # whose tenant the pages are charged to until they are freed


class Leases:
    """The lease table of one store (guarded by the store lock)."""

    def __init__(
        self, core: StoreCore, mover: Mover, writer: Writer, watch: ClientWatch,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = core
        self.mover = mover
        self.writer = writer
        self.watch = watch
        self._clock = clock
        self._active: dict[bytes, _Read | _Write] = {}
        self._finished: OrderedDict[bytes, tuple[str, str]] = OrderedDict()
        # Read leases that expired, until their release counts them (as many as _finished).
        self._expired_counts: OrderedDict[bytes, _ReadCount] = OrderedDict()
        self._quarantine: list[_Quarantined] = []

    def __len__(self) -> int:
        return len(self._active)

    def num_of_locked(self, tenant: str) -> int:
        """Leases open now on ``tenant``'s blocks or room, read and write (O(leases))."""
        return sum(1 for lease in self._active.values()
                   if (lease.count.state if isinstance(lease, _Read)
                       else lease.reservation.state).namespace.tenant == tenant)

    @property
    def num_quarantined_pages(self) -> int:
        """HOST pages held back from expired write leases of live clients."""
        with self.core.lock:
            return sum(location_num_pages(loc) for q in self._quarantine for loc in q.locations)

    # --- reads -------------------------------------

    def acquire(
        self, state: NamespaceState, keys: list[bytes], ttl_s: float | None, owner: str,
        client_id: str = "",
    ) -> ReadLease:
        """Lease the leading stored blocks of ``keys`` in HOST (see the module docstring)."""
        ttl = _check_lease_ttl(ttl_s)
        core = self.core
        host = core.paged[Tier.HOST]
        # Only what HOST can hold at once is leased (and marked read); the caller asks again
        # for the rest. Marking more would leave no victims to make room with. With tenants'
        # shares, no more than what the tenant's HOST share leaves after its pins and live read
        # leases: blocks read cannot be evicted, and a tenant reading past its share would
        # hold room guaranteed to others (docs/design/tenants.md, 3). What is planned is
        # charged at once, so that two acquires at once cannot both take the same room.
        max_blocks = max(1, host.slab.num_pages // host.pages_for(state.block_bytes))
        block_room = self._block_room(state)
        planned: list[Entry] = []
        tiers: list[Tier] = []  # where each planned block's fastest copy was
        with core.lock:
            self._expire_locked()
            share = core.share_of_locked(state, Tier.HOST)
            room = core.unevictable_room_locked(state)
            if room is not None:
                max_blocks = min(max_blocks, max(0, room[Tier.HOST] // block_room))
            run = leading_run(state.blocks, keys, readable=True)
            num_cached = len(run)
            for entry in run[:max_blocks]:
                tier = entry.top_tier()
                assert tier is not None  # (readable)
                core.mark_busy_locked(entry)
                planned.append(entry)
                tiers.append(tier)
            share.read_bytes += len(planned) * block_room
        try:
            self.mover.promote(planned, Tier.HOST)
        except BaseException:
            # Nothing is leased: the marks go, or the blocks could never be evicted again.
            with core.lock:
                share.read_bytes -= len(planned) * block_room
                for entry in planned:
                    core.release_busy_locked(entry)
            raise
        leased: list[Entry] = []
        blocks: list[BlockExtents] = []
        checksums: list[int] = []
        with core.lock:
            for entry in planned:
                node = entry.host
                if len(leased) < len(blocks) or node is None or entry.priority == DOOMED:
                    blocks.append([])  # the leading run ends here; the rest is not leased
                    core.release_busy_locked(entry)
                    continue
                leased.append(entry)
                blocks.append(self._extents(node.location, entry.ns.block_bytes))
                checksums.append(host.checksum_of(node.location))
            share.read_bytes -= (len(planned) - len(leased)) * block_room
            core.touch_run_locked(leased)  # a read refreshes what it serves
            # A read of stored blocks that leased none of them is counted by the read that
            # serves them instead (the SDK streams them): one read, one get.
            if leased or not num_cached:
                core.count_get_locked(state)
            lease_id = self._new_id()
            self._active[lease_id] = _Read(
                owner, client_id, self._clock() + ttl, leased,
                _ReadCount(state, tiers[: len(leased)],
                           ends_run=len(leased) == num_cached < len(keys)))
        return ReadLease(lease_id, blocks[: len(leased)], num_cached, ttl, checksums)

    def release(self, lease_id: bytes, owner: str, corrupt_indices: Sequence[int] = (),
                num_copied: int | None = None) -> None:
        """End a read lease: its blocks may be evicted again, and the blocks the client kept
        are counted (docs/design/leases.md, 6). ``corrupt_indices``: leased blocks whose copy failed its
        checksum at the client; each is checked here (the client's word alone deletes
        nothing) and deleted if its pages really are damaged. ``num_copied``: how many leading
        blocks the client kept (None: all before the first corrupt one). A lease that expired
        is still counted by its release, which then raises ``LeaseStateError``."""
        with self.core.lock:
            try:
                lease = self._take_locked(lease_id, owner, "released")
            except LeaseStateError:
                expired = self._expired_counts.pop(lease_id, None)
                if expired is not None and self._finished.get(lease_id, ("",))[0] == owner:
                    self._count_release_locked(expired, corrupt_indices, num_copied)
                raise
            assert isinstance(lease, _Read)
            self._count_release_locked(lease.count, corrupt_indices, num_copied)
        try:
            indices = sorted(i for i in set(corrupt_indices) if 0 <= i < len(lease.entries))
            suspects = [lease.entries[i] for i in indices]
            self.mover.intact(suspects, Tier.HOST)  # still busy-marked: the pages stay put
        finally:
            with self.core.lock:
                for entry in lease.entries:
                    self.core.release_busy_locked(entry)

    def _count_release_locked(self, count: _ReadCount, corrupt_indices: Sequence[int],
                              num_copied: int | None) -> None:
        """Count what the client of a released read lease received (docs/design/leases.md, 6)."""
        kept = received_blocks(len(count.tiers), corrupt_indices, num_copied)
        damaged = kept < len(count.tiers) and kept in corrupt_indices
        # The miss: the block that ended the client's read.
        self.core.count_served_locked(count.state, count.tiers[:kept], damaged or (
            kept == len(count.tiers) and count.ends_run))

    # --- writes ------------------------------------

    def allocate(
        self, state: NamespaceState, keys: list[bytes], ttl_s: float | None, owner: str,
        priority: Priority, policy: WritePolicy, *, in_process: bool = False,
        client_id: str = "", detail: PutDetail | None = None,
    ) -> WriteLease:
        """Reserve HOST pages for the blocks of ``keys`` that need bytes (see the module
        docstring; ``in_process``: filled through ``lease_writer``, never reaped, see
        ``TieredStore.sidecar.allocate_in_process``). Raises ``CapacityError`` when they do not fit;
        nothing is then reserved."""
        ttl = math.inf if in_process else _check_lease_ttl(ttl_s)
        host = self.core.paged[Tier.HOST]
        with self.core.lock:
            if host.allocator.num_free_pages < len(keys) * host.pages_for(state.block_bytes):
                # Short of room: it may be held by clients that died a moment ago, so ask
                # their lock files now rather than what was found out a moment ago.
                self.watch.forget_all()
            self._expire_locked()
        reservation = self.writer.reserve(state, keys, priority, policy, Tier.HOST,
                                          pages_for_records=True, detail=detail)
        reservation.detail = detail
        write_indices, locations = list(reservation.locations), list(reservation.locations.values())
        lease = _Write(owner, client_id, self._clock() + ttl, reservation, verify=not in_process)
        with self.core.lock:
            lease_id = self._new_id()
            self._active[lease_id] = lease
        blocks = [self._extents(location, state.block_bytes) for location in locations]
        return WriteLease(lease_id, write_indices, blocks, ttl)

    def lease_writer(self, lease_id: bytes, owner: str) -> LeaseWriter:
        """A ``LeaseWriter`` into the pages of ``owner``'s live in-process write lease
        (``LeaseNotFoundError`` if there is none; ``LeaseStateError`` for a client's lease,
        whose pages only that client writes)."""
        host = self.core.paged[Tier.HOST].slab
        with self.core.lock:  # no reaping here: an in-process lease never expires
            lease = self._active.get(lease_id)
            if lease is None or lease.owner != owner or not isinstance(lease, _Write):
                raise LeaseNotFoundError(f"no write lease {lease_id.hex()}")
            if lease.verify:
                raise LeaseStateError(
                    f"lease {lease_id.hex()} is a client's: only a lease of allocate_in_process "
                    "is written by the store"
                )
            reservation = lease.reservation
            indices, locations = list(reservation.locations), list(reservation.locations.values())
            block_bytes, num_blocks = reservation.state.block_bytes, len(reservation.keys)
        spans = copy_spans(locations, host.page_bytes, block_bytes, indices)
        return LeaseWriter(host.tensor.numpy().data, spans, indices, block_bytes,
                           num_blocks * block_bytes)

    def commit(self, lease_id: bytes, owner: str, checksums: Sequence[int] | None = None) -> int:
        """Make a write lease's blocks visible (write-through records first); returns the blocks
        newly stored. ``checksums``: one per written block, in ``write_indices`` order, of the
        bytes the client copied (required for an expiring lease; see docs/design/leases.md, 4). On failure
        the pages are given back and nothing becomes visible."""
        with self.core.lock:
            lease = self._take_locked(lease_id, owner, "committed")
            assert isinstance(lease, _Write)
        reservation = lease.reservation
        state, slab, locations = reservation.state, self.core.paged[Tier.HOST].slab, \
            reservation.locations  # read by the records, before the publish takes them
        try:
            recorded = self._commit_checksums(lease, checksums)
            # Each record is checked against them on its own copy of the pages: what reaches
            # the disk is what the client wrote, whatever writes into the pages meanwhile.
            return self.writer.commit(
                reservation, recorded,
                lambda i: self.mover.host_view(slab, locations[i], state.block_bytes),
                expected=recorded,
            )
        except BaseException:
            self._give_back(lease)
            with self.core.lock:  # a retry is told what happened, not "already committed"
                self._remember_locked(lease_id, owner, "refused at its commit")
            raise

    def _commit_checksums(
        self, lease: _Write, checksums: Sequence[int] | None
    ) -> dict[int, int]:
        """The checksum of each written block, by block index. A client's lease takes the
        client's, one per written block (``InvalidArgumentError`` otherwise); with
        ``verify_commit`` the pages are hashed and must equal them (``IntegrityError``), without
        it they are recorded as sent and every later read checks the pages against them
        (docs/design/leases.md, 4). A lease this process wrote itself (``verify`` off) takes
        the checksums it computed while writing, or its pages' when it gives none."""
        slab = self.core.paged[Tier.HOST].slab
        reservation = lease.reservation
        block_bytes = reservation.state.block_bytes
        indices = sorted(reservation.locations)
        if checksums is None or len(checksums) != len(indices):
            if lease.verify:
                raise InvalidArgumentError(
                    f"commit needs one checksum per written block ({len(indices)}), got "
                    f"{0 if checksums is None else len(checksums)}"
                )
            checksums = slab.checksums([reservation.locations[i] for i in indices], block_bytes)
        if not lease.verify or not self.core.config.verify_commit:
            return dict(zip(indices, checksums, strict=True))
        values = slab.checksums([reservation.locations[i] for i in indices], block_bytes)
        actual = dict(zip(indices, values, strict=True))
        bad = [i for i, claimed in zip(indices, checksums, strict=True) if actual[i] != claimed]
        if bad:
            with self.core.lock:
                self.core.count_checksum_failures_locked(reservation.state, len(bad))
            raise IntegrityError(
                f"{len(bad)} of {len(actual)} blocks in the slab differ from what the client "
                f"wrote (first: block {bad[0]}); nothing is stored. A client mapping of an "
                "earlier server, or a write after the lease expired, does this"
            )
        return actual

    def abort(self, lease_id: bytes, owner: str) -> None:
        """Give a write lease's pages back; none of its blocks becomes visible."""
        with self.core.lock:
            lease = self._take_locked(lease_id, owner, "aborted")
            assert isinstance(lease, _Write)
        self._give_back(lease)

    def _give_back(self, lease: _Write) -> None:
        self.writer.abort(lease.reservation)

    # --- bookkeeping

    def expire(self) -> int:
        """End every lease past its deadline; returns how many."""
        with self.core.lock:
            return self._expire_locked()

    def _expire_locked(self) -> int:
        """End leases past their deadline and every lease of a client that is gone; free
        quarantined pages whose client is gone or whose time is up."""
        now = self._clock()
        liveness: dict[str, Liveness] = {}

        def state_of(client_id: str) -> Liveness:
            if client_id not in liveness:
                liveness[client_id] = self.watch.state(client_id)
            return liveness[client_id]

        expired = [lid for lid, lease in self._active.items()
                   if lease.deadline_s <= now or state_of(lease.client_id) is Liveness.GONE]
        self.core.counters.leases_expired += len(expired)
        for lease_id in expired:
            lease = self._active.pop(lease_id)
            self._remember_locked(lease_id, lease.owner, "expired")
            if isinstance(lease, _Read):
                self._end_read_locked(lease)
                for entry in lease.entries:
                    self.core.release_busy_locked(entry)
                self._expired_counts[lease_id] = lease.count
                while len(self._expired_counts) > _NUM_REMEMBERED:
                    self._expired_counts.popitem(last=False)
            elif lease.verify and state_of(lease.client_id) is Liveness.ALIVE:
                self._quarantine.append(_Quarantined(lease.client_id, now + QUARANTINE_S,
                                                     list(lease.reservation.locations.values()),
                                                     lease.reservation.state))
            else:
                for location in lease.reservation.locations.values():
                    self.core.release_pages_locked(Tier.HOST, location, lease.reservation.state)
        if self._quarantine:
            kept: list[_Quarantined] = []
            for held in self._quarantine:
                if held.until_s > now and state_of(held.client_id) is Liveness.ALIVE:
                    kept.append(held)
                    continue
                for location in held.locations:  # its tenant held them until now
                    self.core.release_pages_locked(Tier.HOST, location, held.state)
            self._quarantine = kept
        return len(expired)

    def _block_room(self, state: NamespaceState) -> int:
        """HOST bytes (whole pages) one block of ``state`` takes."""
        host = self.core.paged[Tier.HOST]
        return host.pages_for(state.block_bytes) * host.slab.page_bytes

    def _end_read_locked(self, read: _Read) -> None:
        """``read`` is over: what it held of its tenant's HOST is free to evict again."""
        state = read.count.state
        self.core.share_of_locked(state, Tier.HOST).read_bytes -= (
            len(read.entries) * self._block_room(state))

    def _take_locked(self, lease_id: bytes, owner: str, outcome: str) -> _Read | _Write:
        """End ``owner``'s lease ``lease_id`` (of the kind ``outcome`` implies) and return it."""
        kind = _Read if outcome == "released" else _Write
        self._expire_locked()
        lease = self._active.get(lease_id)
        if lease is None or lease.owner != owner or not isinstance(lease, kind):
            finished = self._finished.get(lease_id)
            if finished is not None and finished[0] == owner:
                raise LeaseStateError(f"lease {lease_id.hex()} was already {finished[1]}")
            raise LeaseNotFoundError(f"no {kind.__name__[1:].lower()} lease {lease_id.hex()}")
        del self._active[lease_id]
        if isinstance(lease, _Read):
            self._end_read_locked(lease)
        self._remember_locked(lease_id, owner, outcome)
        return lease

    def _remember_locked(self, lease_id: bytes, owner: str, outcome: str) -> None:
        self._finished[lease_id] = (owner, outcome)
        while len(self._finished) > _NUM_REMEMBERED:
            self._finished.popitem(last=False)

    def _new_id(self) -> bytes:
        return secrets.token_bytes(16)

    def _extents(self, location: Location, block_bytes: int) -> BlockExtents:
        return block_extents(location, self.core.paged[Tier.HOST].slab.page_bytes, block_bytes)


def received_blocks(num_leased: int, corrupt_indices: Sequence[int],
                    num_copied: int | None) -> int:
    """How many leading blocks of a read lease of ``num_leased`` its client kept, by what it
    said at release: none past the first corrupt one, nor past ``num_copied``."""
    kept = num_leased if num_copied is None else max(0, min(num_leased, num_copied))
    return min([kept, *(i for i in corrupt_indices if i >= 0)])


def _check_lease_ttl(ttl_s: float | None) -> float:
    if ttl_s is None or ttl_s == 0:  # 0: the wire's "unset"
        return DEFAULT_LEASE_TTL_S
    checked = check_ttl(ttl_s, MAX_LEASE_TTL_S, "lease_ttl_s")
    assert checked is not None
    if checked < MIN_LEASE_TTL_S:  # such a lease would expire before the client could use it
        raise InvalidArgumentError(
            f"lease_ttl_s must be in [{MIN_LEASE_TTL_S}, {MAX_LEASE_TTL_S:.0f}] seconds, got {ttl_s}"
        )
    return checked


# --- the in-process writer: a write lease filled from a byte stream
class LeaseWriter:
    """Routes ``total_bytes`` of stream, in order, into the pages of one write lease.

    Handed out by ``TieredStore.sidecar.lease_writer``. It holds a view of the HOST slab, which cannot
    be unmapped while the view lives: use it in a ``with`` block (``checksums``, ``complete``
    and ``received_bytes`` stay readable after it).
    """

    def __init__(
        self, slab: memoryview, spans: list[CopySpan], write_indices: Sequence[int],
        block_bytes: int, total_bytes: int,
    ) -> None:
        """``spans``: ``(slab offset, stream offset, length)``, in stream order, of the blocks
        ``write_indices`` (ascending)."""
        self._slab = slab
        self._spans = spans
        self._next_span = 0
        self._block_bytes = block_bytes
        self._write_indices = list(write_indices)
        self._hashers = {index: xxhash.xxh3_64() for index in self._write_indices}
        self.total_bytes = total_bytes
        self.received_bytes = 0

    def write(self, data: memoryview) -> None:
        """Copy the next ``len(data)`` bytes of the stream to where they belong
        (``InvalidArgumentError`` past ``total_bytes``)."""
        start = self.received_bytes
        end = start + len(data)
        if end > self.total_bytes:
            raise InvalidArgumentError(f"more than the {self.total_bytes} bytes the blocks hold")
        spans, slab = self._spans, self._slab
        while self._next_span < len(spans):
            slab_offset, stream_offset, length = spans[self._next_span]
            if stream_offset >= end:
                break
            low, high = max(start, stream_offset), min(end, stream_offset + length)
            slab[slab_offset + low - stream_offset : slab_offset + high - stream_offset] = (
                data[low - start : high - start]
            )
            self._hash(data, start, low, high)
            if stream_offset + length > end:
                break  # the span goes on in the next chunk
            self._next_span += 1
        self.received_bytes = end

    def _hash(self, data: memoryview, start: int, low: int, high: int) -> None:
        """Feed stream bytes ``[low, high)`` (``data`` begins at ``start``) to their blocks."""
        block_bytes = self._block_bytes
        while low < high:
            index = low // block_bytes
            piece_end = min(high, (index + 1) * block_bytes)
            self._hashers[index].update(data[low - start : piece_end - start])
            low = piece_end

    @property
    def checksums(self) -> list[int]:
        """The checksum of each written block (``tierkv.checksums``), in ``write_indices``
        order; valid once ``complete``."""
        return [self._hashers[index].intdigest() for index in self._write_indices]

    @property
    def complete(self) -> bool:
        """Whether every byte of the blocks has arrived."""
        return self.received_bytes == self.total_bytes

    def close(self) -> None:
        """Release the slab view (writing afterwards raises ``ValueError``). Idempotent."""
        self._slab.release()

    def __enter__(self) -> LeaseWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
