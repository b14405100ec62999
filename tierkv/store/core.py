"""Placement: reserving room in a tier, eviction with demotion, promotion, publishing copies.

``StoreCore`` holds the lock and the books (namespaces, ledgers, pins). Every method whose name
ends in ``_locked`` must be called with ``core.lock`` held; every other method takes the lock
itself and never holds it while bytes are copied.

Decisions:
1. Room is made by eviction from the LRU end of the lowest priority class. A victim with no copy
   below is demoted (GPU -> HOST -> DISK) before its pages are freed; one that has a copy below,
   or sits in the lowest tier, is dropped. A busy or pinned block is never a victim.
2. A destination copy is published only after its bytes (and, for DISK, its commit) are
   complete; the source stays readable until then.
3. Record deletes are queued and ride in the next disk write, in order and in the same
   transaction as the puts that reuse their bytes, so the committed disk never exceeds its
   budget; deletes with no write to ride on are submitted alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tierkv.config import StoreConfig, Tier
from tierkv.errors import CapacityError, TierKVError
from tierkv.eviction import Residency
from tierkv.migration import CopyEngine
from tierkv.paging import Location, location_num_pages
from tierkv.store.ledger import DOOMED, DiskLedger, Entry, Ledger, NamespaceState, PagedLedger
from tierkv.store.pins import PinTable
from tierkv.tiers.disk import DiskTier, DiskWrite
from tierkv.tiers.records import RecordStatus, encode_record

log = logging.getLogger(__name__)

# How long a reservation waits for room held by in-flight reads and copies.
_RESERVE_WAIT_S = 5.0
_RESERVE_POLL_S = 0.02


@dataclass(eq=False)
class GlobalCounters:
    """Store-wide counters (reported by ``stats``)."""

    promotions: int = 0
    demotions: int = 0
    failed_demotions: int = 0
    checksum_failures: int = 0
    puts: int = 0
    gets: int = 0


class StoreCore:
    """The lock, the books and the moves between tiers."""

    def __init__(
        self,
        config: StoreConfig,
        paged: dict[Tier, PagedLedger],
        disk: DiskTier | None,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.lock = threading.Lock()
        # Notified whenever room may have been freed (a reader finished, pages were released).
        self.changed = threading.Condition(self.lock)
        self.namespaces: dict[bytes, NamespaceState] = {}
        self.paged = paged
        self.disk = disk
        self.disk_ledger = DiskLedger(disk.config.capacity_bytes) if disk is not None else None
        self.ledgers: dict[Tier, Ledger] = dict(paged)
        if self.disk_ledger is not None:
            self.ledgers[Tier.DISK] = self.disk_ledger
        self.pins = PinTable(clock)
        self.engine = CopyEngine()
        self.counters = GlobalCounters()
        self._pending_deletes: list[bytes] = []

    # --- books ----------------------------------------------------------------------------

    def tier_below(self, tier: Tier) -> Tier | None:
        """The next enabled tier below ``tier``."""
        for lower in Tier:
            if lower > tier and lower in self.ledgers:
                return lower
        return None

    def link_locked(self, entry: Entry, tier: Tier, location: Location) -> None:
        """Give ``entry`` a (complete) copy in ``tier`` at ``location``."""
        node: Residency[Entry] = Residency(entry, location)
        entry.set_residency(tier, node)
        ledger = self.ledgers[tier]
        ledger.num_blocks += 1
        if entry not in self.pins:
            ledger.lru.push_mru(node, entry.priority)

    def drop_locked(self, entry: Entry, tier: Tier) -> None:
        """Remove ``entry``'s copy in ``tier`` and free its room; forget the entry if it was the
        last copy. A paged copy must not be busy (its pages would be reused under a reader)."""
        node = entry.residency(tier)
        assert node is not None
        ledger = self.ledgers[tier]
        ledger.lru.remove(node)
        entry.set_residency(tier, None)
        ledger.num_blocks -= 1
        if isinstance(ledger, PagedLedger):
            ledger.release(node.location)
            self.changed.notify_all()
        else:
            assert isinstance(ledger, DiskLedger)
            ledger.release_bytes(entry.ns.record_bytes)
            self._pending_deletes.append(entry.raw_key)
        if entry.top_tier() is None:
            self.forget_locked(entry)

    def forget_locked(self, entry: Entry) -> None:
        """Take an entry out of its namespace's index and the pin table."""
        blocks = entry.ns.blocks
        if blocks.get(entry.block_hash) is entry:
            del blocks[entry.block_hash]
        self.pins.forget(entry)

    def doom_locked(self, entry: Entry) -> None:
        """Delete ``entry``: at once if idle, else when its last reader is done."""
        self.forget_locked(entry)
        for tier in Tier:
            node = entry.residency(tier)
            if node is not None:
                self.ledgers[tier].lru.remove(node)
        entry.priority = DOOMED
        if entry.readers == 0:
            self._drop_all_locked(entry)

    def release_reader_locked(self, entry: Entry) -> None:
        """One read of ``entry`` is done."""
        entry.readers -= 1
        if entry.readers == 0:
            if entry.priority == DOOMED:
                self._drop_all_locked(entry)
                self.submit_deletes_locked()  # the delete() that doomed it did not wait for these
            self.changed.notify_all()

    def _drop_all_locked(self, entry: Entry) -> None:
        for tier in Tier:
            if entry.residency(tier) is not None:
                self.drop_locked(entry, tier)

    def set_priority_locked(self, entry: Entry, priority: int) -> None:
        """Move ``entry`` to another priority class in every tier it is linked in."""
        if entry.priority in (priority, DOOMED):
            return
        entry.priority = priority
        for tier in Tier:
            node = entry.residency(tier)
            if node is not None and node.linked:
                self.ledgers[tier].lru.touch(node, priority)

    def touch_locked(self, entry: Entry) -> None:
        """Mark ``entry`` most recently used in every tier it is in."""
        for tier in Tier:
            node = entry.residency(tier)
            if node is not None:
                self.ledgers[tier].lru.touch(node, entry.priority)

    def relink_locked(self, entry: Entry) -> None:
        """Link an entry's copies back into their LRU lists (after its pins went)."""
        for tier in Tier:
            node = entry.residency(tier)
            if node is not None and not node.linked:
                self.ledgers[tier].lru.push_mru(node, entry.priority)

    def unlink_all_locked(self, entry: Entry) -> None:
        """Take an entry's copies out of the LRU lists (it was pinned)."""
        for tier in Tier:
            node = entry.residency(tier)
            if node is not None:
                self.ledgers[tier].lru.remove(node)

    def expire_pins_locked(self) -> None:
        """Unpin entries whose TTL ran out."""
        for entry in self.pins.pop_expired():
            self.relink_locked(entry)

    # --- disk writes ----------------------------------------------------------------------

    def submit_disk_locked(
        self, puts: Sequence[tuple[bytes, bytes | bytearray]] = (),
        namespace_puts: Sequence[tuple[bytes, bytes]] = (),
    ) -> DiskWrite:
        """Queue a disk write carrying every pending delete (order matters: see decision 3)."""
        assert self.disk is not None
        job = DiskWrite(puts, self._pending_deletes, namespace_puts)
        self._pending_deletes = []
        self.disk.submit(job)
        return job

    def queue_deletes_locked(self, raw_keys: Sequence[bytes]) -> None:
        """Delete records the index does not know (they ride in the next disk write)."""
        self._pending_deletes.extend(raw_keys)

    def submit_deletes_locked(self) -> DiskWrite | None:
        """Submit the pending record deletes now, if there are any."""
        if self.disk is None or not self._pending_deletes:
            return None
        return self.submit_disk_locked()

    def wait_disk(self, job: DiskWrite) -> None:
        """Wait for ``job``; if it failed, queue its deletes again (they must not be lost: the
        index already forgot those records) and raise its error."""
        try:
            job.future.result()
        except TierKVError:
            if job.block_deletes:
                with self.lock:
                    self._pending_deletes[:0] = job.block_deletes
            raise

    def flush_deletes(self) -> None:
        """Submit pending record deletes now and wait until they are durable.

        Raises ``DiskFullError`` (or ``TierKVError``) if they could not be committed; they stay
        queued and ride in the next disk write.
        """
        with self.lock:
            job = self.submit_deletes_locked()
        if job is not None:
            self.wait_disk(job)

    # --- reserving room -------------------------------------------------------------------

    def reserve_pages(self, tier: Tier, sizes_bytes: list[int]) -> list[Location]:
        """Pages in ``tier`` for blocks of ``sizes_bytes``, evicting (and demoting) as needed.

        When the room is held by blocks that are being read or copied, waits for them (up to
        ``_RESERVE_WAIT_S``). Raises ``CapacityError`` when the rest is pinned, or the wait
        runs out; nothing is then reserved.
        """
        ledger = self.paged[tier]
        pages_needed = sum(ledger.pages_for(size) for size in sizes_bytes)
        deadline = time.monotonic() + _RESERVE_WAIT_S
        while True:
            with self.lock:
                locations = ledger.try_reserve(sizes_bytes)
                if locations is not None:
                    return locations
                shortfall = pages_needed - ledger.allocator.num_free_pages
                victims, busy_pages = self._pick_victims_locked(ledger, shortfall)
                if not victims:
                    if busy_pages < shortfall or time.monotonic() > deadline:
                        break
                    self.changed.wait(_RESERVE_POLL_S)
                    continue
            self._evict(ledger, victims)
        raise CapacityError(
            f"{tier.label} tier: no room for {len(sizes_bytes)} block(s) "
            f"({pages_needed} pages of {ledger.slab.page_bytes} B) in "
            f"{ledger.capacity_bytes} B: the rest is pinned or in use"
        )

    def _pick_victims_locked(
        self, ledger: PagedLedger, pages_needed: int
    ) -> tuple[list[Entry], int]:
        """Busy-marked victims worth ``pages_needed``, or ``([], pages that are busy now)``:
        pages held by readers or in-flight copies, which will be evictable later."""
        self.expire_pins_locked()
        victims: list[Entry] = []
        pages = busy_pages = linked_pages = 0
        for node in ledger.lru.iter_lru():
            num_pages = location_num_pages(node.location)
            linked_pages += num_pages
            if node.owner.readers:
                busy_pages += num_pages
                continue
            node.owner.readers += 1
            victims.append(node.owner)
            pages += num_pages
            if pages >= pages_needed:
                return victims, 0
        for entry in victims:
            self.release_reader_locked(entry)
        pinned_pages = sum(
            location_num_pages(node.location)
            for node in (e.residency(ledger.tier) for e in self.pins.entries())
            if node is not None
        )
        used_pages = ledger.allocator.num_pages - ledger.allocator.num_free_pages
        in_flight_pages = used_pages - linked_pages - pinned_pages
        return [], busy_pages + pages + in_flight_pages

    def reserve_disk_locked(self, num_records: int, record_bytes: int) -> None:
        """Reserve room for records, dropping LRU records (no copies needed) to make it."""
        ledger = self.disk_ledger
        assert ledger is not None
        needed = num_records * record_bytes
        if ledger.try_reserve_bytes(needed):
            return
        self.expire_pins_locked()
        shortfall = ledger.used_bytes + needed - ledger.capacity_bytes
        victims: list[Entry] = []
        for node in ledger.lru.iter_lru():
            if shortfall <= 0:
                break
            if node.owner.readers:
                continue
            victims.append(node.owner)
            shortfall -= node.owner.ns.record_bytes
        if shortfall > 0:
            raise CapacityError(
                f"disk tier: no room for {num_records} record(s) of {record_bytes} B in "
                f"{ledger.capacity_bytes} B: the rest is pinned or in use"
            )
        for entry in victims:
            self.drop_locked(entry, Tier.DISK)
            ledger.counters.evictions += 1
        reserved = ledger.try_reserve_bytes(needed)
        assert reserved

    # --- moves ----------------------------------------------------------------------------

    def _evict(self, ledger: PagedLedger, victims: list[Entry]) -> None:
        """Demote or drop busy-marked victims out of ``ledger``'s tier; frees their pages."""
        tier = ledger.tier
        lower = self.tier_below(tier)
        to_demote = [e for e in victims if lower is not None and not self._has_copy_below(e, tier)]
        demoted: set[Entry] = set()
        if to_demote and lower is not None:
            demoted = self.copy_between(to_demote, tier, lower)
        with self.lock:
            for entry in victims:
                if entry.priority != DOOMED and entry.residency(tier) is not None:
                    self.drop_locked(entry, tier)
                    ledger.counters.evictions += 1
                if entry in to_demote and entry not in demoted:
                    self.counters.failed_demotions += 1
                self.release_reader_locked(entry)

    def _has_copy_below(self, entry: Entry, tier: Tier) -> bool:
        return any(entry.residency(lower) is not None for lower in Tier if lower > tier)

    def copy_between(self, entries: list[Entry], source: Tier, destination: Tier) -> set[Entry]:
        """Copy busy-marked ``entries`` from ``source`` into ``destination`` and publish them
        there; returns those that made it (the others did not fit or failed a check)."""
        try:
            if destination is Tier.DISK:
                done = self._write_records(entries, source)
            else:
                done = self._copy_paged(entries, source, destination)
        except CapacityError as exc:
            log.debug("%s -> %s: %s", source.label, destination.label, exc)
            return set()
        with self.lock:
            if destination < source:
                self.counters.promotions += len(done)
                self.ledgers[destination].counters.promotions_in += len(done)
            else:
                self.counters.demotions += len(done)
                self.ledgers[destination].counters.demotions_in += len(done)
        return done

    def _copy_paged(self, entries: list[Entry], source: Tier, destination: Tier) -> set[Entry]:
        sizes = [entry.ns.block_bytes for entry in entries]
        locations = self.reserve_pages(destination, sizes)
        if source is Tier.DISK:
            readable = self._read_disk_into_pages(entries, locations, destination)
        else:
            self._copy_pages(entries, locations, source, destination)
            readable = list(entries)
        return self._publish(entries, readable, locations, destination)

    def _copy_pages(
        self, entries: list[Entry], locations: list[Location], source: Tier, destination: Tier
    ) -> None:
        src, dst = self.paged[source].slab, self.paged[destination].slab
        pairs = []
        for entry, location in zip(entries, locations, strict=True):
            node = entry.residency(source)
            assert node is not None
            block_bytes = entry.ns.block_bytes
            pairs.append((dst.plan([location], block_bytes), src.plan([node.location], block_bytes)))

        def issue(non_blocking: bool) -> None:
            for dst_spans, src_spans in pairs:
                for (d_off, _, length), (s_off, _, _) in zip(dst_spans, src_spans, strict=False):
                    dst.tensor[d_off : d_off + length].copy_(
                        src.tensor[s_off : s_off + length], non_blocking=non_blocking
                    )

        # Two paged locations of one block can split at different page boundaries; go through
        # a flat staging copy when they do (rare: only for scattered pages).
        if all(len(d) == len(s) == 1 for d, s in pairs):
            self.engine.copy(issue, dst.device, src.device)
            return
        for entry, location in zip(entries, locations, strict=True):
            flat = self.read_block(entry, source)
            self.write_block(destination, location, flat)

    def read_block(self, entry: Entry, tier: Tier) -> torch.Tensor:
        """A flat copy of ``entry``'s bytes in paged ``tier`` (entry busy-marked)."""
        node = entry.residency(tier)
        assert node is not None
        slab = self.paged[tier].slab
        out = torch.empty(entry.ns.block_bytes, dtype=torch.uint8, device=slab.device)
        spans = slab.plan([node.location], entry.ns.block_bytes)
        self.engine.copy(lambda nb: slab.read(spans, out, nb), out.device, slab.device)
        return out

    def write_block(self, tier: Tier, location: Location, flat: torch.Tensor) -> None:
        """Copy a flat block into reserved pages of ``tier``."""
        slab = self.paged[tier].slab
        spans = slab.plan([location], flat.numel())
        self.engine.copy(lambda nb: slab.write(spans, flat, nb), slab.device, flat.device)

    def host_bytes(self, entry: Entry, tier: Tier) -> np.ndarray:
        """``entry``'s bytes in paged ``tier`` as a CPU array (a view when possible)."""
        node = entry.residency(tier)
        assert node is not None
        slab = self.paged[tier].slab
        if slab.device.type == "cpu":
            view = slab.view(node.location, entry.ns.block_bytes)
            if view is not None:
                return view.numpy()
        return self.read_block(entry, tier).cpu().numpy()

    def _read_disk_into_pages(
        self, entries: list[Entry], locations: list[Location], destination: Tier
    ) -> list[Entry]:
        slab = self.paged[destination].slab
        targets: list[tuple[Entry, torch.Tensor, torch.Tensor | None]] = []
        for entry, location in zip(entries, locations, strict=True):
            size = entry.ns.block_bytes
            view = slab.view(location, size) if slab.device.type == "cpu" else None
            if view is not None:
                targets.append((entry, view, None))
            else:  # scattered pages or a device slab: read into staging, then scatter
                targets.append((entry, torch.empty(size, dtype=torch.uint8), torch.empty(0)))
        ok = self.read_disk([(entry, target.numpy()) for entry, target, _ in targets])
        readable: list[Entry] = []
        for (entry, target, staged), good, location in zip(targets, ok, locations, strict=True):
            if good:
                if staged is not None:
                    self.write_block(destination, location, target)
                readable.append(entry)
        return readable

    def read_disk(self, requests: Sequence[tuple[Entry, np.ndarray]]) -> list[bool]:
        """Read each entry's verified record into its destination array; one flag per request.

        A missing or bad record drops the entry's disk copy (a bad one is counted); its flag is
        False and its destination must not be used.
        """
        assert self.disk is not None
        by_namespace: dict[NamespaceState, list[int]] = {}
        for index, (entry, _) in enumerate(requests):
            by_namespace.setdefault(entry.ns, []).append(index)
        ok = [False] * len(requests)
        failed: list[tuple[Entry, RecordStatus]] = []
        for ns, indices in by_namespace.items():
            statuses = self.disk.read_into(
                [(requests[i][0].raw_key, requests[i][1]) for i in indices],
                ns.fingerprint, ns.block_bytes,
            )
            for i, status in zip(indices, statuses, strict=True):
                ok[i] = status is RecordStatus.OK
                if not ok[i]:
                    failed.append((requests[i][0], status))
        if failed:
            self._drop_bad_records(failed)
        return ok

    def _drop_bad_records(self, failed: list[tuple[Entry, RecordStatus]]) -> None:
        with self.lock:
            for entry, status in failed:
                if status is RecordStatus.CORRUPT:
                    self.counters.checksum_failures += 1
                    log.warning("disk record %s failed its checks; dropped", entry.raw_key.hex())
                # Safe although the entry is busy: LMDB readers see a snapshot, and nothing
                # reuses a record's bytes in place.
                if entry.disk is not None and entry.priority != DOOMED:
                    self.drop_locked(entry, Tier.DISK)
            job = self.submit_deletes_locked()
        if job is not None:
            try:
                self.wait_disk(job)
            except TierKVError as exc:  # the read already reports a miss; the delete is retried
                log.warning("deleting bad records failed (will retry): %s", exc)

    def _write_records(self, entries: list[Entry], source: Tier) -> set[Entry]:
        assert self.disk is not None
        records = [
            (entry.raw_key, encode_record(
                entry.raw_key, entry.ns.fingerprint, self.host_bytes(entry, source)
            ))
            for entry in entries
        ]
        with self.lock:
            by_size: dict[int, int] = {}
            for entry in entries:
                by_size[entry.ns.record_bytes] = by_size.get(entry.ns.record_bytes, 0) + 1
            reserved: list[tuple[int, int]] = []
            try:
                for size, count in by_size.items():
                    self.reserve_disk_locked(count, size)
                    reserved.append((count, size))
            except CapacityError:
                for count, size in reserved:
                    self.disk_ledger.release_bytes(count * size)  # type: ignore[union-attr]
                raise
            job = self.submit_disk_locked(records)
        try:
            self.wait_disk(job)
        except TierKVError as exc:
            log.warning("writing %d records to disk failed: %s", len(records), exc)
            with self.lock:
                for entry in entries:
                    self.disk_ledger.release_bytes(entry.ns.record_bytes)  # type: ignore[union-attr]
            return set()
        return self._publish(entries, entries, [0] * len(entries), Tier.DISK)

    def _publish(
        self,
        entries: list[Entry],
        complete: list[Entry],
        locations: Sequence[Location],
        tier: Tier,
    ) -> set[Entry]:
        """Make finished copies visible in ``tier``; give back the room of the others."""
        done: set[Entry] = set()
        complete_set = set(complete)
        with self.lock:
            for entry, location in zip(entries, locations, strict=True):
                if entry in complete_set and entry.priority != DOOMED and entry.residency(tier) is None:
                    self.link_locked(entry, tier, location)
                    done.add(entry)
                else:
                    self.release_room_locked(tier, entry, location)
        return done

    def release_room_locked(self, tier: Tier, entry: Entry, location: Location) -> None:
        """Give back room reserved for ``entry`` in ``tier`` that will not be used."""
        if tier is Tier.DISK:
            assert self.disk_ledger is not None
            self.disk_ledger.release_bytes(entry.ns.record_bytes)
        else:
            self.release_pages_locked(tier, location)

    def release_pages_locked(self, tier: Tier, location: Location) -> None:
        """Give back reserved pages that will not be used."""
        self.paged[tier].release(location)
        self.changed.notify_all()
