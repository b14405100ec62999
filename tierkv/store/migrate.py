"""Moves between tiers: making room (eviction with demotion), promotion, copies, disk records.
``Mover`` takes ``core.lock`` to change the books and never holds it while bytes are copied; a
destination copy is published only once complete. Victims come from ``core.eviction``.
Design: docs/design/eviction.md#moves-between-tiers
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from tierkv.config import Tier
from tierkv.errors import CapacityError, TierKVError
from tierkv.eviction import Residency
from tierkv.logs import Throttle
from tierkv.paging import Location, location_num_pages
from tierkv.store.core import StoreCore
from tierkv.store.index import DOOMED, Entry, NamespaceState, PagedLedger
from tierkv.store.tenants import TenantShare
from tierkv.store.tokens import encode as encode_tokens
from tierkv.tiers.paged import PagedSlab
from tierkv.tiers.records import RecordStatus, encode_record

log = logging.getLogger(__name__)
FAILED_WRITE_LOG_INTERVAL_S = 10.0

# How long promotions pass over a block whose demotion failed before they try it again (the
# disk may have room by then); docs/design/eviction.md, moves 4.
UNDEMOTABLE_RETRY_S = 30.0
# How long a reservation waits for room held by in-flight reads and copies.
_RESERVE_WAIT_S = 5.0
_RESERVE_POLL_S = 0.02


def _num_pages(node: Residency[Entry]) -> int:
    return location_num_pages(node.location)



class Mover:
    """Reserves room and copies blocks between the tiers of one store."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        # A failing disk fails every demotion batch: one line a while, with the count.
        self._failed_writes = Throttle(FAILED_WRITE_LOG_INTERVAL_S)

    def reserve_pages(
        self,
        tier: Tier,
        state: NamespaceState,
        sizes_bytes: list[int],
        exclude: frozenset[Entry] = frozenset(),
        wait: bool = True,
        drop: bool | None = None,
        spare: frozenset[Entry] = frozenset(),
    ) -> list[Location]:
        """Pages in ``tier`` for blocks of ``sizes_bytes`` of ``state``'s tenant (held by it
        from now on), evicting (and demoting) as needed: victims as
        ``StoreCore.pick_victims_locked`` chooses them (the tenant's own past its cap, others'
        only past their share).

        ``exclude`` are never victims (a put's own chain); ``spare`` are victims in the lowest
        tier only when nothing else is left (the blocks a put continues). With ``wait`` (a
        put), room held by blocks being read or copied, here and in the tier a victim is
        demoted to, is waited for (up to ``_RESERVE_WAIT_S``). Without it (a promotion or a
        REMOTE fill, which hold blocks themselves and could wait for their own), it fails at
        once. ``drop`` (default: as ``wait``): victims that cannot be demoted are dropped (a
        put, a REMOTE fill), else kept and passed over from then on (a promotion; eviction.md,
        moves 4). Raises ``CapacityError`` when there is no room; nothing is then reserved.
        """
        ledger = self.core.paged[tier]
        pages_needed = sum(ledger.pages_of(sizes_bytes))
        may_drop = wait if drop is None else drop
        deadline = time.monotonic() + _RESERVE_WAIT_S
        with self.core.lock:  # made on first use: never two shares of one tenant
            share = self.core.share_of_locked(state, tier)
        while True:
            with self.core.lock:
                if share.used_bytes + pages_needed * ledger.slab.page_bytes <= share.cap_bytes:
                    locations = ledger.try_reserve(sizes_bytes, share)
                    if locations is not None:
                        return locations
                victims, shortfall, busy_pages = self._pick_victims_locked(
                    ledger, share, pages_needed, exclude, may_drop, spare)
                if not victims:
                    if not wait or busy_pages < shortfall or time.monotonic() > deadline:
                        break
                    self.core.changed.wait(_RESERVE_POLL_S)
                    continue
                leaving = self._leaving_locked(ledger, victims)
            try:
                freed = self._evict(ledger, victims, wait, may_drop, share)
            finally:
                with self.core.lock:
                    for owner, num_bytes in leaving:
                        owner.leaving_bytes -= num_bytes
            if not freed:
                break
        raise CapacityError(
            f"{tier.label} tier: no room for {len(sizes_bytes)} block(s) "
            f"({pages_needed} pages of {ledger.slab.page_bytes} B) in "
            f"{ledger.capacity_bytes} B for tenant {share.tenant!r}: the rest is pinned or in "
            "use, or guaranteed to other tenants"
        )

    def _leaving_locked(self, ledger: PagedLedger, victims: list[Entry]
                        ) -> list[tuple[TenantShare, int]]:
        """Count the victims' bytes as leaving their owners' shares (credited back by the
        caller once they are dropped or kept): until then no other pick, made while this
        eviction demotes them without the lock, may count those bytes as its owners' to give
        (tenants.md, 2)."""
        leaving = [(self.core.share_of_locked(entry.ns, ledger.tier),
                    location_num_pages(node.location) * ledger.slab.page_bytes)
                   for entry in victims
                   for node in (entry.residency(ledger.tier),) if node is not None]
        for owner, num_bytes in leaving:
            owner.leaving_bytes += num_bytes
        return leaving

    def _pick_victims_locked(
        self, ledger: PagedLedger, share: TenantShare, pages_needed: int,
        exclude: frozenset[Entry], may_drop: bool, spare: frozenset[Entry] = frozenset(),
    ) -> tuple[list[Entry], int, int]:
        """Busy-marked victims that make room for ``pages_needed`` of ``share``'s tenant, or
        ``([], pages it lacks, pages that are busy now)``: pages held by readers or in-flight
        copies, which will be evictable later (waiting is worth it only if those cover it).
        Without ``may_drop``, blocks whose demotion failed are passed over
        (docs/design/eviction.md, moves 4)."""
        core = self.core
        core.expire_pins_locked()
        undemotable = {} if may_drop else core.undemotable
        retry_before_s = core.clock() - UNDEMOTABLE_RETRY_S
        picked, missing = core.pick_victims_locked(
            ledger, share, pages_needed, _num_pages,
            lambda owner: owner in exclude or undemotable.get(owner, -math.inf) > retry_before_s,
            spare,
        )
        if not missing:
            for entry in picked.owners:
                core.mark_busy_locked(entry)
            return picked.owners, 0, 0
        # Room that may come free by waiting: pages readers hold among those it may take, and
        # pages reserved by copies in flight (used, but neither linked nor pinned; a walk of
        # the tier, on this failing path only).
        pinned_pages = sum(
            location_num_pages(node.location)
            for node in (e.residency(ledger.tier) for e in self.core.pins.entries())
            if node is not None
        )
        linked_pages = sum(_num_pages(node) for lru in ledger.shares.lrus()
                           for node in lru.iter_lru())
        used_pages = ledger.allocator.num_pages - ledger.allocator.num_free_pages
        in_flight_pages = used_pages - linked_pages - pinned_pages
        return [], missing + picked.size, picked.busy_size + picked.size + in_flight_pages

    # --- copies between tiers ----------------------------------------------------------------

    def _evict(self, ledger: PagedLedger, victims: list[Entry], wait: bool, may_drop: bool,
               requester: TenantShare) -> bool:
        """Demote or drop busy-marked victims out of ``ledger``'s tier, freeing their pages;
        False if one kept its pages.

        A victim someone started reading after it was picked keeps its pages (freeing them
        under a reader would hand it another block's bytes). A victim that does not fit the next
        tier down goes to the one below it. A victim whose demotion failed is counted (once)
        and marked, then dropped if ``may_drop``, else kept (eviction.md, moves 4). ``wait``: demotions
        wait for room below held by copies.
        """
        tier = ledger.tier
        core = self.core
        lower = core.tier_below(tier)
        to_demote = [e for e in victims if lower is not None and not self._has_copy_below(e, tier)]
        demoted: set[Entry] = set()
        if to_demote and lower is not None:
            # The victims are busy (ours): room below must never wait for them, nor evict them
            # again once they land there.
            ours = frozenset(victims)
            demoted = self.copy_between(to_demote, tier, lower, wait=wait, exclude=ours)
            if len(demoted) < len(to_demote):  # all or nothing did not fit: one at a time
                for entry in to_demote:
                    if entry not in demoted:
                        demoted |= self.copy_between([entry], tier, lower, wait=wait,
                                                     exclude=ours)
            further = core.tier_below(lower)
            rest = [entry for entry in to_demote if entry not in demoted]
            if rest and further is not None:  # the next tier is full of pins: skip it
                demoted |= self.copy_between(rest, tier, further, wait=wait, exclude=ours)
        if lower is None and core.spill is not None and tier is Tier.HOST:
            # No disk: the lowest local tier's evictions go to REMOTE (as DISK's do), and are
            # then dropped here as before.
            core.spill.demote([e for e in victims if not self._has_copy_below(e, tier)])
        all_freed = True
        with core.lock:
            for entry in victims:
                failed = entry in to_demote and entry not in demoted
                if failed and entry.residency(tier) is not None:
                    if entry not in core.undemotable:
                        core.counters.failed_demotions += 1
                    core.undemotable[entry] = core.clock()
                if entry.readers > 1 or (failed and not may_drop):
                    all_freed = False  # a reader came after it was picked, or it is kept
                elif entry.priority != DOOMED and entry.residency(tier) is not None:
                    core.count_eviction_locked(entry, tier, requester)
                    core.drop_locked(entry, tier)
                core.release_busy_locked(entry)
        return all_freed

    def _has_copy_below(self, entry: Entry, tier: Tier) -> bool:
        return any(entry.residency(lower) is not None for lower in Tier if lower > tier)

    def copy_between(
        self, entries: list[Entry], source: Tier, destination: Tier, wait: bool = True,
        exclude: frozenset[Entry] = frozenset(),
    ) -> set[Entry]:
        """Copy busy-marked ``entries`` from ``source`` into ``destination`` and publish them
        there; returns those that made it (the others did not fit or failed a check).
        ``wait`` and ``exclude`` (never evicted for the room, never waited for) go to the
        reservation."""
        try:
            if destination is Tier.DISK:
                done = self._write_records(entries, source, exclude)
            else:
                done = self._copy_paged(entries, source, destination, wait, exclude)
        except CapacityError as exc:
            log.debug("%s -> %s: %s", source.label, destination.label, exc)
            return set()
        moved_bytes = sum(entry.ns.block_bytes for entry in done)  # one sum per batch
        with self.core.lock:
            bytes_moved = self.core.counters.bytes_moved
            route = (source, destination)
            bytes_moved[route] = bytes_moved.get(route, 0) + moved_bytes
            if destination < source:
                self.core.counters.promotions += len(done)
                self.core.ledgers[destination].counters.promotions_in += len(done)
                for entry in done:
                    self.core.share_of_locked(entry.ns, destination).promotions_in += 1
            else:
                self.core.counters.demotions += len(done)
                self.core.ledgers[destination].counters.demotions_in += len(done)
                for entry in done:
                    self.core.share_of_locked(entry.ns, destination).demotions_in += 1
        return done

    def promote(self, entries: Sequence[Entry], destination: Tier) -> set[Entry]:
        """Give each of ``entries`` (a chain, head first) that has no copy in paged
        ``destination`` one there, copied from its fastest copy; returns those copied. The one
        way blocks are brought up a tier: reads promote what they served, ``prefetch`` and
        read leases bring blocks up (a lease brings GPU-only blocks into HOST too).

        Deleted entries are skipped. Only what the tier can hold at all is tried, head first;
        when a batch does not fit at once (other blocks hold the room), its leading blocks
        that do fit are brought up one at a time. It never waits for room and never drops a
        block to make it: the entries are busy-marked here for the copy (and a lease holds
        others itself), so waiting could wait for them. Raises what the copy raises.
        """
        core = self.core
        ledger = core.paged[destination]
        by_source: dict[Tier, list[Entry]] = {}
        done: set[Entry] = set()
        # The chain's own copies there are never evicted to make room for the rest of it: a
        # read that brought a tail up by pushing its head down would leave the head in the
        # slower tier, where a router walking fastest tier first stops (docs/events.md).
        chain = frozenset(entries)
        with core.busy() as marks:
            with core.lock:
                room_pages = ledger.allocator.num_pages
                for entry in entries:
                    top = entry.top_tier()
                    if (top is None or entry.priority == DOOMED
                            or entry.residency(destination) is not None):
                        continue
                    room_pages -= ledger.pages_for(entry.ns.block_bytes)
                    if room_pages < 0:
                        break
                    marks.add_locked(entry)
                    by_source.setdefault(top, []).append(entry)
            for source, batch in by_source.items():
                copied = self.copy_between(batch, source, destination, wait=False,
                                           exclude=chain)
                done |= copied
                if copied:
                    continue  # what is left failed its checks (it is doomed now), not for room
                for entry in batch:  # no room for the batch at once: one at a time, head first
                    with core.lock:
                        gone = entry.priority == DOOMED or entry.residency(source) is None
                    if gone:
                        break  # it failed its checks in the batch copy: never copied twice
                    one = self.copy_between([entry], source, destination, wait=False,
                                            exclude=chain)
                    if not one:
                        break  # the tier is full (or the block was damaged): the chain ends
                    done |= one
        return done

    def _copy_paged(
        self, entries: list[Entry], source: Tier, destination: Tier, wait: bool,
        exclude: frozenset[Entry],
    ) -> set[Entry]:
        by_tenant: dict[str, list[Entry]] = {}
        for entry in entries:
            by_tenant.setdefault(entry.ns.namespace.tenant, []).append(entry)
        if len(by_tenant) > 1:  # each tenant's copies are charged to it, and make room as it
            done: set[Entry] = set()
            for group in by_tenant.values():
                try:
                    done |= self._copy_paged(group, source, destination, wait, exclude)
                except CapacityError as exc:
                    log.debug("%s -> %s: %s", source.label, destination.label, exc)
            return done
        sizes = [entry.ns.block_bytes for entry in entries]
        locations = self.reserve_pages(destination, entries[0].ns, sizes, exclude, wait)
        checksums: dict[Entry, int] = {}
        if source is Tier.DISK:
            # A HOST copy's checksum is the record's, verified as it was copied in; never a
            # hash of the pages afterwards, which would take in a stray write made meanwhile.
            checksums = self._read_disk_into_pages(entries, locations, destination)
            readable = list(checksums)
        else:
            self._copy_pages(entries, locations, source, destination)
            # Checked after the copy: the HOST source was intact until the copy was done.
            readable = self.intact(entries, source)
            if destination is Tier.HOST:  # from the GPU, which no other process writes
                slab = self.core.paged[Tier.HOST].slab
                checksums = {entry: slab.checksum(location, entry.ns.block_bytes)
                             for entry, location in zip(entries, locations, strict=True)}
        return self._publish(entries, readable, locations, destination, checksums)

    def intact(self, entries: list[Entry], tier: Tier) -> list[Entry]:
        """The busy-marked ``entries`` whose copy in paged ``tier`` still matches its checksum
        (HOST: the only tier other processes write into); the others are counted and deleted."""
        if tier is not Tier.HOST:
            return entries
        ledger = self.core.paged[tier]
        good: list[Entry] = []
        damaged: list[Entry] = []
        for entry in entries:
            node = entry.residency(tier)
            assert node is not None
            actual = ledger.slab.checksum(node.location, entry.ns.block_bytes)
            (good if actual == ledger.checksum_of(node.location) else damaged).append(entry)
        self.drop_damaged(damaged, tier)
        return good

    def drop_damaged(self, entries: Sequence[Entry], tier: Tier) -> None:
        """Count and delete blocks whose bytes in ``tier`` failed their checksum."""
        if entries:
            with self.core.lock:
                for entry in entries:
                    self.core.damaged_locked(entry, tier)

    def _copy_pages(
        self, entries: list[Entry], locations: list[Location], source: Tier, destination: Tier
    ) -> None:
        src, dst = self.core.paged[source].slab, self.core.paged[destination].slab
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
            self.core.engine.copy(issue, dst.device, src.device)
            return
        for entry, location in zip(entries, locations, strict=True):
            flat = self.read_block(entry, source)
            self.write_block(destination, location, flat)

    def read_block(self, entry: Entry, tier: Tier) -> torch.Tensor:
        """A flat copy of ``entry``'s bytes in paged ``tier`` (entry busy-marked)."""
        node = entry.residency(tier)
        assert node is not None
        slab = self.core.paged[tier].slab
        out = torch.empty(entry.ns.block_bytes, dtype=torch.uint8, device=slab.device)
        spans = slab.plan([node.location], entry.ns.block_bytes)
        self.core.engine.copy(lambda nb: slab.read(spans, out, nb), out.device, slab.device)
        return out

    def write_block(self, tier: Tier, location: Location, flat: torch.Tensor) -> None:
        """Copy a flat block into reserved pages of ``tier``."""
        slab = self.core.paged[tier].slab
        spans = slab.plan([location], flat.numel())
        self.core.engine.copy(lambda nb: slab.write(spans, flat, nb), slab.device, flat.device)

    def host_view(self, slab: PagedSlab, location: Location, block_bytes: int) -> np.ndarray:
        """The bytes of a block at ``location`` of a CPU slab (a view when its pages are
        adjacent, else a gathered copy)."""
        view = slab.view(location, block_bytes)
        if view is None:
            view = torch.empty(block_bytes, dtype=torch.uint8)
            slab.read(slab.plan([location], block_bytes), view, False)
        return view.numpy()

    def host_bytes(self, entry: Entry, tier: Tier) -> np.ndarray:
        """``entry``'s bytes in paged ``tier`` as a CPU array (a view when possible)."""
        node = entry.residency(tier)
        assert node is not None
        slab = self.core.paged[tier].slab
        if slab.device.type == "cpu":
            return self.host_view(slab, node.location, entry.ns.block_bytes)
        return self.read_block(entry, tier).cpu().numpy()

    def _read_disk_into_pages(
        self, entries: list[Entry], locations: list[Location], destination: Tier
    ) -> dict[Entry, int]:
        """Read the entries' records into their pages; the verified checksum of each entry
        that was read."""
        slab = self.core.paged[destination].slab
        targets: list[tuple[Entry, torch.Tensor, torch.Tensor | None]] = []
        for entry, location in zip(entries, locations, strict=True):
            size = entry.ns.block_bytes
            view = slab.view(location, size) if slab.device.type == "cpu" else None
            if view is not None:
                targets.append((entry, view, None))
            else:  # scattered pages or a device slab: read into staging, then scatter
                targets.append((entry, torch.empty(size, dtype=torch.uint8), torch.empty(0)))
        read = self.read_disk([(entry, target.numpy()) for entry, target, _ in targets])
        readable: dict[Entry, int] = {}
        for (entry, target, staged), value, location in zip(targets, read, locations, strict=True):
            if value is not None:
                if staged is not None:
                    self.write_block(destination, location, target)
                readable[entry] = value
        return readable

    def read_disk(self, requests: Sequence[tuple[Entry, np.ndarray]]) -> list[int | None]:
        """Read each entry's verified record into its destination array; per request, the
        record's checksum, or None.

        A missing or bad record drops the entry's disk copy (a bad one is counted); its result
        is None and its destination must not be used.
        """
        assert self.core.disk is not None
        by_namespace: dict[NamespaceState, list[int]] = {}
        for index, (entry, _) in enumerate(requests):
            by_namespace.setdefault(entry.ns, []).append(index)
        read: list[int | None] = [None] * len(requests)
        failed: list[tuple[Entry, RecordStatus]] = []
        for ns, indices in by_namespace.items():
            results = self.core.disk.read_into(
                [(requests[i][0].raw_key, requests[i][1]) for i in indices],
                ns.fingerprint, ns.block_bytes,
            )
            for i, (status, value) in zip(indices, results, strict=True):
                if status is RecordStatus.OK:
                    read[i] = value
                else:
                    failed.append((requests[i][0], status))
        if failed:
            self._drop_bad_records(failed)
        return read

    def _drop_bad_records(self, failed: list[tuple[Entry, RecordStatus]]) -> None:
        with self.core.lock:
            for entry, status in failed:
                if status is RecordStatus.CORRUPT:
                    self.core.count_checksum_failures_locked(entry.ns)
                    log.warning("disk record %s failed its checks; dropped", entry.raw_key.hex())
                # Safe although the entry is busy: LMDB readers see a snapshot, and nothing
                # reuses a record's bytes in place.
                if entry.disk is not None and entry.priority != DOOMED:
                    self.core.drop_locked(entry, Tier.DISK)
            job = self.core.submit_deletes_locked()
        if job is not None:
            try:
                self.core.wait_disk(job)
            except TierKVError as exc:  # the read already reports a miss; the delete is retried
                log.warning("deleting bad records failed (will retry): %s", exc)

    def _write_records(
        self, entries: list[Entry], source: Tier, exclude: frozenset[Entry]
    ) -> set[Entry]:
        assert self.core.disk is not None
        records: list[tuple[bytes, bytearray]] = []
        written: list[Entry] = []
        damaged: list[Entry] = []
        for entry in entries:
            record, value = encode_record(entry.raw_key, entry.ns.fingerprint,
                                          self.host_bytes(entry, source))
            # The record's own copy must be the block's bytes: a stray write into its HOST
            # pages before or during the copy must not become a record that verifies.
            if source is Tier.HOST and value != self._host_checksum(entry):
                damaged.append(entry)
                continue
            records.append((entry.raw_key, record))
            written.append(entry)
        self.drop_damaged(damaged, source)
        entries = written
        with self.core.lock:
            # Each namespace's records are charged to its tenant (and make room as it).
            by_state: dict[NamespaceState, int] = {}
            for entry in entries:
                by_state[entry.ns] = by_state.get(entry.ns, 0) + 1
            reserved: list[tuple[NamespaceState, int]] = []
            try:
                for state, count in by_state.items():
                    self.core.reserve_disk_locked(count, state.record_bytes,
                                                  self.core.share_of_locked(state, Tier.DISK), exclude)
                    reserved.append((state, count))
            except CapacityError:
                for state, count in reserved:
                    self.core.release_records_locked(state, count)
                raise
            job = self.core.submit_disk_locked(records, token_puts=[
                (entry.raw_key, encode_tokens(entry.parent, entry.tokens)) for entry in entries])
        try:
            self.core.wait_disk(job)
        except TierKVError as exc:
            num_failures = self._failed_writes.admit()
            if num_failures:
                log.warning("writing records to disk failed (%d batches since the last line, "
                            "this one of %d): %s", num_failures, len(records), exc)
            with self.core.lock:
                for entry in entries:
                    self.core.release_records_locked(entry.ns, 1)
            return set()
        return self._publish(entries, entries, [0] * len(entries), Tier.DISK, {})

    def _host_checksum(self, entry: Entry) -> int:
        node = entry.residency(Tier.HOST)
        assert node is not None
        return self.core.paged[Tier.HOST].checksum_of(node.location)

    def _publish(
        self,
        entries: list[Entry],
        complete: list[Entry],
        locations: Sequence[Location],
        tier: Tier,
        checksums: dict[Entry, int],
    ) -> set[Entry]:
        """Make finished copies visible in ``tier`` (HOST copies with their ``checksums``); give
        back the room of the others."""
        done: set[Entry] = set()
        complete_set = set(complete)
        with self.core.lock:
            # Heads first, each copy linked just behind its parent's copy in ``tier`` where
            # that is held: a chain demoted or promoted in several batches is still evicted
            # tail first there (docs/design/eviction.md#chains).
            for entry, location in _heads_first(entries, locations):
                if entry in complete_set and entry.priority != DOOMED and entry.residency(tier) is None:
                    parent = None if entry.parent is None else entry.ns.blocks.get(entry.parent)
                    self.core.link_locked(entry, tier, location, checksums.get(entry),
                                          parent=parent)
                    done.add(entry)
                else:
                    self.core.release_room_locked(tier, entry, location)
                    if tier is Tier.DISK and entry in complete_set:
                        self._delete_orphan_locked(entry)
        return done

    def _delete_orphan_locked(self, entry: Entry) -> None:
        """A record was committed for an entry deleted meanwhile: delete it too, unless a newer
        entry of the same key holds a record there (a restart must not bring the block back)."""
        current = entry.ns.blocks.get(entry.block_hash)
        if current is None or current.disk is None:
            self.core.queue_deletes_locked([entry.raw_key])
            self.core.submit_deletes_locked()


def _heads_first(entries: Sequence[Entry], locations: Sequence[Location]
                 ) -> list[tuple[Entry, Location]]:
    """``entries`` with their ``locations``, each after its parent where both are in the batch
    (a batch of victims comes tail first)."""
    in_batch = {(id(entry.ns), entry.block_hash): index for index, entry in enumerate(entries)}
    ordered: list[tuple[Entry, Location]] = []
    placed = [False] * len(entries)
    for start in range(len(entries)):
        path: list[int] = []
        index: int | None = start
        while index is not None and not placed[index]:
            placed[index] = True
            path.append(index)
            entry = entries[index]
            index = None if entry.parent is None else in_batch.get((id(entry.ns), entry.parent))
        ordered.extend((entries[i], locations[i]) for i in reversed(path))
    return ordered
