"""The store's side of the REMOTE tier: write-through and evictions queued without waiting, local
misses filled into HOST from REMOTE and verified, lookups for the suffix the local tiers lack,
and what ``delete``/``clear`` took out lately (so that nothing brings it back). Redis never
raises to the caller. Design: docs/design/remote.md#the-stores-side
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tierkv.buffers import BufferPool
from tierkv.checksums import copy_with_checksums, value_digest
from tierkv.config import Priority, Tier
from tierkv.errors import CapacityError
from tierkv.keys import NAMESPACE_ID_BYTES
from tierkv.paging import Location
from tierkv.store.core import StoreCore
from tierkv.store.events import REMOTE_TIER
from tierkv.store.index import DOOMED, Entry, NamespaceState
from tierkv.store.migrate import Mover
from tierkv.store.writes import Writer
from tierkv.tiers.records import encode_records, verify_header
from tierkv.tiers.remote import RemoteCounters, RemoteTier
from tierkv.types import RemoteStats

log = logging.getLogger(__name__)

# Records sent to Redis in one pipelined batch (per node, at once).
_WRITE_BATCH_BYTES = 64 << 20
# Rounds a fill waits for other fills of the same blocks before it gives up on them.
_FILL_ATTEMPTS = 3


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    lookups: int = 0
    written: int = 0
    demoted: int = 0
    queue_drops: int = 0
    write_failures: int = 0
    budget_drops: int = 0


@dataclass(slots=True)
class _Budget:
    """What one tenant's records took of this node's REMOTE writes in the current window."""

    window_start_s: float
    num_bytes: int = 0


class RemoteLink:
    """Queues writes to a ``RemoteTier``, fills local misses from it and extends lookups."""

    def __init__(self, core: StoreCore, mover: Mover, writer: Writer, remote: RemoteTier) -> None:
        self.core = core
        self.mover = mover
        self.writer = writer
        self.remote = remote
        self._counters = _Counters()
        self._lock = threading.Condition()
        # (raw key, record, demoted?, TTL in seconds) waiting to be written.
        self._queue: deque[tuple[bytes, bytes | bytearray, bool, int]] = deque()
        self._budgets: dict[str, _Budget] = {}  # by tenant (``tenant_write_bytes``)
        self._queued_bytes = 0
        self._num_writing = 0
        self._num_purging = 0  # forgets deleting from REMOTE now: no batch starts meanwhile
        self._closed = False
        self.forgotten = Forgotten()
        # How long a forget waits for a batch being written (the tier's own deadline).
        self._deadline_s = remote.config.timeout_s + remote.config.max_fetch_bytes / 1e9
        # Buffers of records sent, for the next ones (REMOTE-only write-through: see books).
        self.record_buffers = BufferPool(_WRITE_BATCH_BYTES * 2)
        # Block keys being fetched by a fill, and the event set when it is done.
        self._filling: dict[bytes, threading.Event] = {}
        self._thread = threading.Thread(target=self._write_loop, name="tierkv-remote-writer",
                                        daemon=True)
        self._thread.start()

    # --- writes (docs/design/remote.md, the store's side 1) ---------------------

    def offer(self, records: Sequence[tuple[bytes, bytes | bytearray]],
              evicted_s: Sequence[float] | None = None) -> int:
        """Queue ``(raw key, record)`` pairs for REMOTE without waiting; returns how many were
        queued (the rest found the queue full and were dropped, counted). ``evicted_s``: for
        demotions, when each block was evicted: one a delete forgets since is dropped, never
        sent back into REMOTE (``Forgotten``)."""
        limit = self.remote.config.queue_bytes
        num_queued = 0
        demoted = evicted_s is not None
        # The check and the enqueue under one lock: a forget's purge (which takes it after
        # the forget began) finds what was queued before, and what comes after sees it.
        with self._lock:
            if evicted_s is not None:
                with self.forgotten.lock:
                    records = [item for item, seen_s in zip(records, evicted_s, strict=True)
                               if not self.forgotten.forbids_locked(item[0], seen_s)]
            if self._closed:
                return 0
            config = self.remote.config
            now_s = time.monotonic()
            per_tenant = bool(config.tenant_write_bytes or config.tenant_ttl_s)
            for raw_key, record in records:
                tenant = self._tenant_of(raw_key) if per_tenant else ""
                if self._queued_bytes + len(record) > limit:
                    self._counters.queue_drops += 1
                    continue
                if config.tenant_write_bytes and not self._admit_locked(tenant, len(record),
                                                                        now_s):
                    self._counters.budget_drops += 1
                    continue
                self._queue.append((raw_key, record, demoted, config.ttl_s_of(tenant)))
                self._queued_bytes += len(record)
                num_queued += 1
            if num_queued:
                self._lock.notify_all()
        return num_queued

    def _tenant_of(self, raw_key: bytes) -> str:
        """The tenant of a record's namespace ("" for one removed since). Read without the
        store lock, which a caller of ``offer`` may hold: one dict lookup, atomic under the
        GIL; namespaces are only added and removed under the lock."""
        state = self.core.namespaces.get(raw_key[:NAMESPACE_ID_BYTES])
        return "" if state is None else state.namespace.tenant

    def _admit_locked(self, tenant: str, num_bytes: int, now_s: float) -> bool:
        """Whether ``tenant``'s budget of this window has ``num_bytes`` left (then taken)."""
        config = self.remote.config
        budget = self._budgets.get(tenant)
        if budget is None or now_s - budget.window_start_s >= config.tenant_write_interval_s:
            budget = self._budgets[tenant] = _Budget(now_s)
        if budget.num_bytes + num_bytes > config.tenant_write_bytes:
            return False
        budget.num_bytes += num_bytes
        return True

    def offer_demoted(self, records: Sequence[tuple[bytes, bytes | bytearray, float]]) -> None:
        """Evictions from the lowest local tier: DISK's records, read just before they were
        deleted, or (without a disk) HOST's blocks as records; each with when it was evicted."""
        self.offer([(raw_key, record) for raw_key, record, _ in records],
                   [evicted_s for _, _, evicted_s in records])

    def demote(self, entries: list[Entry]) -> None:
        """Without a disk tier, HOST's victims (busy-marked, about to be dropped) as records
        for REMOTE, each checked against the block's checksum on its own copy: a stray write
        into the pages is never sent."""
        host = self.core.paged[Tier.HOST]
        by_namespace: dict[NamespaceState, list[Entry]] = {}
        with self.core.lock:  # a delete that dooms them later is running by now (Forgotten)
            seen_s = time.monotonic()
            for entry in entries:
                if entry.priority != DOOMED and entry.host is not None:
                    by_namespace.setdefault(entry.ns, []).append(entry)
        records: list[tuple[bytes, bytes | bytearray, float]] = []
        damaged: dict[NamespaceState, int] = {}
        for ns, batch in by_namespace.items():
            encoded = encode_records([e.raw_key for e in batch], ns.fingerprint,
                                     [self.mover.host_bytes(e, Tier.HOST) for e in batch])
            for entry, (record, value) in zip(batch, encoded, strict=True):
                if entry.host is None:
                    continue
                if value == host.checksum_of(entry.host.location):
                    records.append((entry.raw_key, record, seen_s))
                else:
                    damaged[ns] = damaged.get(ns, 0) + 1
        if damaged:
            log.warning("%d blocks evicted from HOST failed their checksum; not sent to REMOTE",
                        sum(damaged.values()))
            with self.core.lock:
                for ns, num_damaged in damaged.items():
                    self.core.count_checksum_failures_locked(ns, num_damaged)
        if records:
            self.offer_demoted(records)

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while (not self._queue or self._num_purging) and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                taken_s = time.monotonic()
                batch: list[tuple[bytes, bytes | bytearray, bool, int]] = []
                num_bytes = 0
                while self._queue and num_bytes < _WRITE_BATCH_BYTES:
                    item = self._queue.popleft()
                    batch.append(item)
                    num_bytes += len(item[1])
                self._num_writing = len(batch)
            stored = np.zeros(len(batch), bool)
            try:
                stored = self.remote.put([(raw_key, record) for raw_key, record, _, _ in batch],
                                         [ttl_s for _, _, _, ttl_s in batch])
            except Exception:  # RemoteTier answers, never raises; a bug must not stop writes
                log.exception("writing %d records to the remote tier failed", len(batch))
            # What a failed node did not store is dropped (counted): REMOTE is a cache, and
            # its breaker already said the node is gone.
            if self.core.disk is None:  # nothing else reads them (see ``Writer.write_records``)
                # Only those a node stored: a node that missed the deadline may still be
                # sending from its buffers.
                self.record_buffers.give([record for (_, record, _, _), ok
                                          in zip(batch, stored, strict=True) if ok])
            demoted = np.array([item[2] for item in batch], bool)  # (see ``offer``)
            events = self.core.events
            if events is not None:  # readable there now (records a forget purged never got here)
                # Not those a forget began on since the batch was taken: its delete may have
                # gone first, and said so (a batch past the purge's wait): under-reported,
                # never a copy announced that Redis does not hold.
                with self.forgotten.lock:
                    for (raw_key, _, _, _), ok in zip(batch, stored, strict=True):
                        state = (self.core.namespaces.get(raw_key[:NAMESPACE_ID_BYTES])
                                 if ok and not self.forgotten.forbids_locked(raw_key, taken_s)
                                 else None)
                        if state is not None:
                            events.stored(state, REMOTE_TIER, raw_key[NAMESPACE_ID_BYTES:])
            with self._lock:
                self._queued_bytes -= num_bytes
                self._num_writing = 0
                self._counters.written += int(np.count_nonzero(stored & ~demoted))
                self._counters.demoted += int(np.count_nonzero(stored & demoted))
                self._counters.write_failures += int(np.count_nonzero(~stored))
                self._lock.notify_all()

    @contextlib.contextmanager
    def forgetting(self, raw_keys: Sequence[bytes] = (), namespace_ids: Sequence[bytes] = ()
                   ) -> Iterator[None]:
        """Around a ``delete``'s or ``clear``'s doom of the local copies: then delete the
        blocks (``raw_keys``, or every block of ``namespace_ids``) from REMOTE too. From the
        start no fill publishes them and no demotion sends them (``Forgotten``); at the end
        records of them still queued are dropped, a batch being written is waited for (within
        the tier's deadline), and REMOTE's copies are deleted (what a node that is down holds
        stays until its TTL or eviction)."""
        # (begin takes the lock a fill holds between its check and its publish)
        forgetting = self.forgotten.begin(raw_keys, namespace_ids)
        try:
            yield
            self._purge(forgetting)
        finally:
            self.forgotten.end(forgetting)

    def _purge(self, forgetting: Forgetting) -> None:
        def matches(raw_key: bytes) -> bool:
            return raw_key in forgetting.raw_keys or raw_key[:NAMESPACE_ID_BYTES] in \
                forgetting.namespace_ids

        deadline = time.monotonic() + self._deadline_s
        with self._lock:
            kept = [item for item in self._queue if not matches(item[0])]
            self._queued_bytes -= sum(len(record) for key, record, _, _ in self._queue
                                      if matches(key))
            self._queue = deque(kept)
            while self._num_writing and not self._closed and time.monotonic() < deadline:
                self._lock.wait(max(0.0, deadline - time.monotonic()))
            # Until the deletes are done and said, no batch starts: a write of a key offered
            # after the purge began lands after its delete (and its STORED after the REMOVED).
            self._num_purging += 1
        try:
            for namespace_id in forgetting.namespace_ids:
                deleted = self.remote.delete_namespace(namespace_id)
                self._report_removed(namespace_id + block_hash for block_hash in deleted)
            if forgetting.raw_keys:
                self.remote.delete(list(forgetting.raw_keys))
                self._report_removed(forgetting.raw_keys)
        finally:
            with self._lock:
                self._num_purging -= 1
                self._lock.notify_all()

    def _report_removed(self, raw_keys: Iterable[bytes]) -> None:
        """Record REMOTE's copies of ``raw_keys`` gone (of namespaces still registered)."""
        events = self.core.events
        if events is None:
            return
        for raw_key in raw_keys:
            state = self.core.namespaces.get(raw_key[:NAMESPACE_ID_BYTES])
            if state is not None:
                events.removed(state, REMOTE_TIER, raw_key[NAMESPACE_ID_BYTES:])

    def hashes_in(self, namespace_id: bytes) -> list[bytes]:
        """The block hashes REMOTE holds under ``namespace_id`` now (a scan of every node)."""
        return self.remote.hashes_in(namespace_id)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every record queued so far has been sent (or dropped); False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._queue or self._num_writing:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._lock.wait(remaining)
        return True

    def publish(self, state: NamespaceState, keys: Sequence[bytes], timeout_s: float,
                read: Callable[[list[bytes]], torch.Tensor]) -> int:
        """Send what REMOTE lacks of ``keys`` from the local copies (``read``: the leading
        held ones of the keys given, verified on the way, as a tensor of blocks), and wait up
        to ``timeout_s`` for what was queued before and for them: how many leading ``keys``
        REMOTE then holds (by asking it). Blocks only a write-back sidecar holds reach REMOTE
        this way long before their eviction would send them."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        self.flush(timeout_s)  # write-through records of the puts before it go first
        held = self.remote.exists_in(state.id, keys)
        missing = [keys[int(i)] for i in np.flatnonzero(~held)]
        if missing:
            blocks = read(missing)
            if len(blocks):
                raw_keys = [state.id + key for key in missing[: len(blocks)]]
                payloads = blocks.reshape(len(blocks), -1).view(torch.uint8).numpy()
                encoded = encode_records(raw_keys, state.fingerprint, list(payloads))
                self.offer([(raw_key, record) for raw_key, (record, _) in
                            zip(raw_keys, encoded, strict=True)])
                self.flush(max(0.0, deadline - time.monotonic()))
                held = self.remote.exists_in(state.id, keys)
        return int(np.argmin(held)) if not held.all() else len(keys)

    # --- reads (docs/design/remote.md, the store's side 2, 3) -------------------

    def _local_run_locked(self, state: NamespaceState, keys: Sequence[bytes], start: int
                          ) -> tuple[int, list[int]]:
        """From ``start``: the end of the run held locally, and the indices after it that no
        local tier holds."""
        find = state.blocks.get  # one tight loop: a Lookup of 8,192 hashes runs it under the lock
        absent = [i for i in range(start, len(keys))
                  if (entry := find(keys[i])) is None or entry.priority == DOOMED
                  or entry.top_tier() is None]
        return (absent[0] if absent else len(keys)), absent

    def lookup_suffix(self, state: NamespaceState, keys: Sequence[bytes], num_local: int) -> int:
        """How many leading ``keys`` are held locally or in REMOTE, given that the first
        ``num_local`` are held locally."""
        with self.core.lock:
            end, absent = self._local_run_locked(state, keys, num_local)
        if not absent:
            return end
        suffix = keys[num_local:] if len(absent) == len(keys) - num_local else [
            keys[i] for i in absent]
        held = self.remote.exists_in(state.id, suffix)
        with self._lock:
            self._counters.lookups += 1
        first_missing = int(np.argmin(held)) if not held.all() else len(absent)
        return absent[first_missing] if first_missing < len(absent) else len(keys)

    def fetch(self, state: NamespaceState, keys: Sequence[bytes]) -> int:
        """Bring the blocks of ``keys``' leading run that only REMOTE holds into HOST (up to
        what one fetch and HOST can take); returns how many were brought.

        Readers of the same blocks at once fetch them once: a block another fill is fetching
        is waited for (bounded), never fetched and placed twice (which would evict other
        blocks for copies that are then thrown away)."""
        core = self.core
        host = core.paged[Tier.HOST]
        max_blocks = max(1, min(self.remote.config.max_fetch_bytes // state.block_bytes,
                                host.slab.num_pages // host.pages_for(state.block_bytes)))
        wait_s = self.remote.config.timeout_s + 1.0
        for _ in range(_FILL_ATTEMPTS):
            with core.lock:
                _, absent = self._local_run_locked(state, keys, 0)
            if not absent:
                return 0
            # Only up to the next block that neither side can have: the run ends at a local
            # miss that REMOTE does not fill, so fetching past ``max_blocks`` is waste.
            absent = absent[:max_blocks]
            raw_keys = [state.id + keys[i] for i in absent]
            mine = threading.Event()
            with self._lock:
                others = {self._filling[k] for k in raw_keys if k in self._filling}
                if not others:
                    self._filling.update(dict.fromkeys(raw_keys, mine))
            if others:
                for event in others:
                    event.wait(wait_s)
                continue  # what they brought is local now: look again
            try:
                return self._fill_claimed(state, keys, absent)
            finally:
                with self._lock:
                    for raw_key in raw_keys:
                        if self._filling.get(raw_key) is mine:
                            del self._filling[raw_key]
                mine.set()
        return 0

    def _fill_claimed(self, state: NamespaceState, keys: Sequence[bytes], absent: list[int]
                      ) -> int:
        """``fill`` of the blocks at ``absent`` (claimed by this thread)."""
        block_bytes = state.block_bytes
        started_s = time.monotonic()  # before the fetch: a forget from now on wins
        values = self.remote.get([state.id + keys[i] for i in absent])
        wanted: list[tuple[int, memoryview, bytes]] = []
        corrupt: list[int] = []  # the index of a record that failed its checks, if one did
        for index, value in zip(absent, values, strict=True):
            if value is None:
                break
            checked = verify_header(memoryview(value), state.id + keys[index], state.fingerprint,
                                    block_bytes)
            if checked is None:
                corrupt.append(index)
                break
            wanted.append((index, checked[0], checked[1]))
        num_good, num_brought, bad_payload = self._bring_into_host(
            state, keys, wanted, started_s) if wanted else (0, 0, None)
        if bad_payload is not None:
            corrupt.append(bad_payload)
        num_corrupt = len(corrupt)
        with self._lock:
            counters = self._counters
            counters.hits += num_brought
            counters.corrupt += num_corrupt
            if num_good < len(absent):  # the block that ended the run (or found no room)
                counters.misses += 1
        if num_corrupt:
            log.warning("a remote record of %s failed its checks; served as a miss and deleted",
                        state.namespace.model_id)
            # Garbage for every reader: deleted, as DISK deletes its own (a good record of the
            # same key written meanwhile goes too: a miss, never wrong bytes), as a delete is.
            with self.forgetting(raw_keys=[state.id + keys[index] for index in corrupt]):
                pass
        return num_brought

    def _bring_into_host(self, state: NamespaceState, keys: Sequence[bytes],
                         wanted: list[tuple[int, memoryview, bytes]], started_s: float
                         ) -> tuple[int, int, int | None]:
        """Copy verified payloads into fresh HOST pages, hashing each as it lands; publish the
        leading run whose hashes match their records' and that no forget since ``started_s``
        names. Returns its length, how many of it were new in HOST (a put may have stored some
        meanwhile), and the index of the payload that failed its checksum and ended it (None:
        none did).

        The room is made as a put makes it (victims demoted, or dropped when there is no tier
        below), but never by evicting the chain's own local blocks, and never by waiting for
        pages in use: a read must not wait seconds on a REMOTE fill."""
        core = self.core
        block_bytes = state.block_bytes
        with core.lock:
            own = frozenset(entry for key in keys if (entry := state.blocks.get(key)) is not None)
        indices = [index for index, _, _ in wanted]
        try:
            reservation = self.writer.reserve_indices(state, list(keys), indices, Priority.NORMAL,
                                                      Tier.HOST, own, wait=False, drop=True)
        except CapacityError:
            return 0, 0, None
        locations = list(reservation.locations.values())
        try:
            num_good, actual = self._copy_verified(locations, wanted, block_bytes)
        except BaseException:
            self.writer.abort(reservation)  # nothing is published: every page comes back
            raise
        bad_payload = indices[num_good] if num_good < len(wanted) else None
        with self.forgotten.lock:  # a forget that begins now waits for this publish
            for number, (index, _, _) in enumerate(wanted[:num_good]):
                if self.forgotten.forbids_locked(state.id + keys[index], started_s):
                    num_good = number  # deleted meanwhile: the run ends before it
                    break
            self.writer.release(reservation, indices[num_good:])
            reservation.plan.new_indices = indices[:num_good]
            if not num_good:
                return 0, 0, bad_payload
            checksums = dict(zip(indices, actual, strict=False))
            num_new = self.writer.commit(reservation, checksums, count_put=False)
        return num_good, num_new, bad_payload

    def _copy_verified(self, locations: list[Location], wanted: list[tuple[int, memoryview, bytes]],
                       block_bytes: int) -> tuple[int, list[int]]:
        """Copy the payloads into their pages, hashing each as it lands; the length of the
        leading run whose hashes match their records', and every copy's hash."""
        slab = self.core.paged[Tier.HOST].slab
        targets: list[tuple[np.ndarray, torch.Tensor | None]] = []
        for location in locations:
            view = slab.view(location, block_bytes)
            if view is None:  # scattered pages: stage, then scatter
                staged = torch.empty(block_bytes, dtype=torch.uint8)
                targets.append((staged.numpy(), staged))
            else:
                targets.append((view.numpy(), None))
        actual = copy_with_checksums([
            [(target, np.frombuffer(payload, np.uint8))]
            for (target, _), (_, payload, _) in zip(targets, wanted, strict=True)
        ])
        num_good = 0
        for value, (_, _, expected) in zip(actual, wanted, strict=True):
            if value_digest(value) != expected:
                break
            num_good += 1
        for (_, staging), location in zip(targets[:num_good], locations, strict=False):
            if staging is not None:
                self.mover.write_block(Tier.HOST, location, staging)
        return num_good, actual

    # --- the rest --------------------------------

    def stats(self) -> RemoteStats:
        """The counters and the tier's own."""
        tier: RemoteCounters = self.remote.counters_snapshot()
        with self._lock:
            c = self._counters
            return RemoteStats(
                self.remote.is_connected, c.hits, c.misses, c.corrupt, c.lookups,
                tier.num_errors, tier.num_skipped, tier.bytes_read, tier.bytes_written,
                c.written, c.demoted, c.queue_drops, c.write_failures, self._queued_bytes,
                c.budget_drops,
            )

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Send what is queued (for up to ``flush_timeout_s``), then stop and disconnect."""
        self.flush(flush_timeout_s)
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._lock.notify_all()
        self._thread.join(timeout=flush_timeout_s)
        self.remote.close()


# --- what delete() and clear() took out of REMOTE lately
KEEP_S = 60.0
# Finished forgets' keys remembered at most (the oldest go first): 64K x ~100 B. Running
# forgets are always consulted in full.
MAX_KEYS = 1 << 16


@dataclass(eq=False)
class Forgetting:
    """One forget in progress (``Forgotten.begin``)."""

    raw_keys: frozenset[bytes]
    namespace_ids: frozenset[bytes]
    started_s: float = field(default_factory=time.monotonic)


class Forgotten:
    """Forgets running now and those ended lately (see the module docstring)."""

    def __init__(self, keep_s: float = KEEP_S, max_keys: int = MAX_KEYS) -> None:
        self.keep_s = keep_s
        self.max_keys = max_keys
        self.lock = threading.Lock()
        """Held by a fill across its check and its publish, and by ``begin``: a forget that
        begins after a fill's check waits for the fill to publish, then dooms what it did."""
        self._active: set[Forgetting] = set()
        self._keys: OrderedDict[bytes, float] = OrderedDict()  # key -> when its forget ended
        self._namespaces: dict[bytes, float] = {}

    def begin(self, raw_keys: Sequence[bytes] = (), namespace_ids: Sequence[bytes] = ()
              ) -> Forgetting:
        """Start forgetting ``raw_keys`` and every key of ``namespace_ids``: call before the
        local copies are doomed, and ``end`` once REMOTE's are deleted."""
        forgetting = Forgetting(frozenset(raw_keys), frozenset(namespace_ids))
        with self.lock:
            self._active.add(forgetting)
        return forgetting

    def end(self, forgetting: Forgetting) -> None:
        """The forget is done (REMOTE's copies deleted, or given up on)."""
        now = time.monotonic()
        with self.lock:
            self._active.discard(forgetting)
            for raw_key in forgetting.raw_keys:
                self._keys[raw_key] = now
                self._keys.move_to_end(raw_key)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
            for namespace_id in forgetting.namespace_ids:
                self._namespaces[namespace_id] = now
            expired = [n for n, when in self._namespaces.items() if now - when > self.keep_s]
            for namespace_id in expired:
                del self._namespaces[namespace_id]

    def forbids_locked(self, raw_key: bytes, seen_s: float) -> bool:
        """Whether what saw ``raw_key`` at ``seen_s`` must drop it (``lock`` held)."""
        namespace_id = raw_key[:NAMESPACE_ID_BYTES]
        for forgetting in self._active:
            if raw_key in forgetting.raw_keys or namespace_id in forgetting.namespace_ids:
                return True
        ended = self._keys.get(raw_key)
        if ended is not None and ended >= seen_s:
            return True
        ended = self._namespaces.get(namespace_id)
        return ended is not None and ended >= seen_s

    def forbids(self, raw_key: bytes, seen_s: float) -> bool:
        """``forbids_locked``, taking the lock."""
        with self.lock:
            return self.forbids_locked(raw_key, seen_s)
