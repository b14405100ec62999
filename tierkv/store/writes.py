"""The write path, one for every write: reserve -> fill -> ``commit(checksums)``. An embedded
``put`` is a reservation filled in process, a same-host write lease one with a TTL, a stream
Put one fed chunk by chunk, a REMOTE fill one filled from Redis. Nothing is visible before the
commit; a failed write stores nothing; writes are idempotent. ``flush`` writes disk records.
Design: docs/design/data-path.md#the-write-path
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tierkv.checksums import block_checksums
from tierkv.config import Priority, Tier, WritePolicy
from tierkv.errors import IntegrityError, TierKVError
from tierkv.paging import Location
from tierkv.store.core import StoreCore
from tierkv.store.index import DOOMED, Entry, NamespaceState
from tierkv.store.migrate import Mover
from tierkv.store.tokens import BlockTokens, pack_put
from tierkv.store.tokens import encode as encode_tokens
from tierkv.tiers.records import encode_records
from tierkv.types import PutDetail

_FLUSH_BATCH = 64


@dataclass(eq=False)
class PutPlan:
    """What a put (or a write lease) has to do."""

    new_indices: list[int] = field(default_factory=list)
    disk_indices: list[int] = field(default_factory=list)
    own: frozenset[Entry] = frozenset()
    # The stored blocks the write continues (its writer's parents): spared in the lowest tier
    # while anything else can go (a block stored behind an evicted parent is unreachable).
    parents: frozenset[Entry] = frozenset()

    @property
    def new_set(self) -> frozenset[int]:
        """``new_indices`` as a set."""
        return frozenset(self.new_indices)


@dataclass(eq=False)
class Reservation:
    """Room for one write, reserved before any byte moves: HOST or GPU pages for the blocks in
    ``locations`` (block index -> pages), and the plan's records still to write. Its writer
    fills the pages, then ``Writer.commit``s it with their checksums, or ``Writer.abort``s it;
    the lease table holds the reservations filled by clients (with a deadline)."""

    state: NamespaceState
    keys: list[bytes]
    priority: Priority
    target: Tier
    plan: PutPlan
    locations: dict[int, Location]
    detail: PutDetail | None = None  # what its writer said of the blocks (KV events, eviction order)


class Writer:
    """Writes for a ``TieredStore``: every write is a ``Reservation`` committed here."""

    def __init__(self, core: StoreCore, mover: Mover) -> None:
        self.core = core
        self.mover = mover

    def put(
        self,
        state: NamespaceState,
        keys: list[bytes],
        flat: torch.Tensor,
        priority: Priority,
        policy: WritePolicy,
        target: Tier,
        detail: PutDetail | None = None,
    ) -> int:
        """See ``TieredStore.put``: a reservation filled in process, from ``flat``."""
        block_bytes = state.block_bytes
        reservation = self.reserve(state, keys, priority, policy, target, detail=detail)
        reservation.detail = detail
        checksums: dict[int, int] = {}
        try:
            if reservation.locations:
                indices, locations = list(reservation.locations), list(reservation.locations.values())
                slab = self.core.paged[target].slab
                spans = slab.plan(locations, block_bytes, indices)
                self.core.engine.copy(lambda nb: slab.write(spans, flat, nb), slab.device,
                                      flat.device)
                if target is Tier.HOST:
                    checksums = self._host_checksums(flat, block_bytes, indices, locations)
            array = None
            if reservation.plan.disk_indices:
                array = (flat if flat.device.type == "cpu" else flat.cpu()).numpy()
            return self.commit(reservation, checksums, None if array is None else
                               lambda i: array[i * block_bytes : (i + 1) * block_bytes])
        except BaseException:
            self.abort(reservation)
            raise

    # --- reservations -----------------------------------------------------------------------

    def reserve(
        self, state: NamespaceState, keys: list[bytes], priority: Priority, policy: WritePolicy,
        target: Tier, *, pages_for_records: bool = False, detail: PutDetail | None = None,
    ) -> Reservation:
        """Plan the write of ``keys`` and reserve its pages in ``target`` (evicting as needed;
        ``CapacityError`` and nothing reserved when they do not fit). ``pages_for_records``:
        blocks that need only a disk record get pages too (a lease: its writer's bytes land in
        pages, and the records are written from there). ``detail``: the stored parents it names
        are spared in the lowest tier while anything else can go."""
        plan = self.plan(state, keys, priority, policy, target, detail)
        indices = plan.new_indices
        if pages_for_records:
            indices = sorted(set(plan.new_indices) | set(plan.disk_indices))
        return self.reserve_indices(state, keys, indices, priority, target, plan.own, plan=plan)

    def reserve_indices(
        self, state: NamespaceState, keys: list[bytes], indices: list[int], priority: Priority,
        target: Tier, own: frozenset[Entry], *, plan: PutPlan | None = None, wait: bool = True,
        drop: bool | None = None,
    ) -> Reservation:
        """Pages in ``target`` for the blocks ``indices`` of ``keys`` (a REMOTE fill names its
        own), never evicting ``own``; ``wait`` and ``drop`` as ``Mover.reserve_pages``."""
        locations = self.mover.reserve_pages(
            target, state, [state.block_bytes] * len(indices), own, wait=wait, drop=drop,
            spare=plan.parents if plan is not None else frozenset(),
        ) if indices else []
        return Reservation(state, keys, priority, target,
                           plan if plan is not None else PutPlan(new_indices=list(indices)),
                           dict(zip(indices, locations, strict=True)))

    def release(self, reservation: Reservation, indices: list[int]) -> None:
        """Give back the pages of ``indices`` (blocks the writer will not commit)."""
        with self.core.lock:
            for index in indices:
                location = reservation.locations.pop(index, None)
                if location is not None:
                    self.core.release_pages_locked(reservation.target, location,
                                                   reservation.state)

    def abort(self, reservation: Reservation) -> None:
        """Give back every page of ``reservation``: nothing of it becomes visible."""
        self.release(reservation, list(reservation.locations))

    def commit(
        self, reservation: Reservation, checksums: dict[int, int],
        payload_of: Callable[[int], np.ndarray] | None = None,
        expected: dict[int, int] | None = None, count_put: bool = True,
    ) -> int:
        """Make a filled reservation visible: the plan's disk records first (durable, their
        bytes from ``payload_of``, each checked against ``expected`` when given), then the
        pages (``checksums``: of each block in HOST, by index). Returns the blocks newly stored.
        On failure it raises with nothing visible; the caller gives the pages back."""
        state, keys, plan = reservation.state, reservation.keys, reservation.plan
        said = self._said(state, keys, reservation.detail)  # once: the records' and the index's
        if plan.disk_indices:
            assert payload_of is not None
            self.write_records(state, keys, plan, payload_of, expected, reservation.detail, said)
        locations, reservation.locations = reservation.locations, {}  # published: not ours
        return self.publish(state, keys, reservation.priority, reservation.target, plan,
                            locations, checksums, count_put, reservation.detail, said)

    def _host_checksums(
        self, flat: torch.Tensor, block_bytes: int, indices: list[int], locations: list[Location]
    ) -> dict[int, int]:
        """The checksums of the blocks just copied into HOST: of the caller's bytes when they
        are on the CPU (the writer's bytes), else of the pages."""
        if flat.device.type == "cpu":
            values = block_checksums(flat, block_bytes, indices)
        else:
            values = self.core.paged[Tier.HOST].slab.checksums(locations, block_bytes)
        return dict(zip(indices, values, strict=True))

    def plan(
        self, state: NamespaceState, keys: list[bytes], priority: Priority,
        policy: WritePolicy, target: Tier, detail: PutDetail | None = None,
    ) -> PutPlan:
        """Which blocks need a copy in ``target``, which a disk record, the entries of the chain
        that exist already (never evicted to make room for the chain itself) and the stored
        parents ``detail`` names (``PutPlan.parents``)."""
        core = self.core
        plan = PutPlan()
        seen: set[bytes] = set()
        own: set[Entry] = set()
        with core.lock:
            for index, key in enumerate(keys):
                if key in seen:
                    continue
                seen.add(key)
                entry = state.blocks.get(key)
                if entry is not None:
                    own.add(entry)
                    if priority > entry.priority:
                        core.set_priority_locked(entry, priority)
                top = entry.top_tier() if entry is not None else None
                if target is not Tier.DISK and (top is None or top > target):
                    plan.new_indices.append(index)
                wants_disk = policy is WritePolicy.WRITE_THROUGH or target is Tier.DISK
                if core.disk is None:  # a record for REMOTE only: of blocks new here
                    wants_disk = wants_disk and top is None
                if wants_disk and (entry is None or entry.disk is None):
                    plan.disk_indices.append(index)
            if detail is not None:
                named = (detail.parent_hash, *(detail.parent_hashes or ()))
                plan.parents = frozenset(
                    parent for parent_hash in named if parent_hash is not None
                    and (parent := state.blocks.get(parent_hash)) is not None
                    and parent not in own)
        plan.own = frozenset(own)
        return plan

    def write_records(
        self, state: NamespaceState, keys: list[bytes], plan: PutPlan,
        payload_of: Callable[[int], np.ndarray], expected: dict[int, int] | None,
        detail: PutDetail | None, said: list[BlockTokens | None],
    ) -> dict[int, int]:
        """Write-through: durable disk records of the plan's ``disk_indices`` (bytes from
        ``payload_of``) before returning; their disk room is reserved, and given back on failure.
        Returns the checksum of each record's payload, by block index.

        ``expected``: the checksum each block's bytes must have (a client's, checked at
        commit). Each record is checked against it on its own copy of the bytes, so that what
        is written is exactly what was verified; ``IntegrityError`` (nothing written) if not.
        ``detail`` and ``said`` (``_said``'s tokens of each block): each record's parent and
        tokens (``tierkv.store.tokens``) ride beside it.

        Blocks that got a disk copy since the plan was made (making room for the put can demote
        the chain's own blocks to disk) are dropped from ``plan.disk_indices`` and not written
        twice.
        """
        core = self.core
        with core.lock:
            plan.disk_indices = [
                i for i in plan.disk_indices
                if (entry := state.blocks.get(keys[i])) is None or entry.disk is None
            ]
        indices, own = plan.disk_indices, plan.own
        if not indices:
            return {}
        fingerprint = state.fingerprint
        records: list[tuple[bytes, bytearray]] = []
        checksums: dict[int, int] = {}
        raw_keys = [state.id + keys[i] for i in indices]
        # Without a disk, REMOTE's writer is the records' only reader: it gives them back.
        spill = core.spill
        encoded = encode_records(raw_keys, fingerprint, [payload_of(i) for i in indices],
                                 spill.record_buffers if spill and core.disk is None else None)
        for i, raw_key, (record, value) in zip(indices, raw_keys, encoded, strict=True):
            checksums[i] = value
            records.append((raw_key, record))
        bad = [i for i in indices if expected is not None and checksums[i] != expected[i]]
        if bad:
            with core.lock:
                core.count_checksum_failures_locked(state, len(bad))
            raise IntegrityError(
                f"{len(bad)} of {len(indices)} blocks differ from what their writer wrote "
                f"(first: block {bad[0]}); nothing is stored"
            )
        if spill is not None:
            # Write-through reaches REMOTE too, without waiting, and at once: its write then
            # runs while the disk commits. Should the commit fail, REMOTE still holds verified
            # bytes of these keys: a cache may hold a block its writer was told failed.
            spill.offer(records)
        if core.disk is None:
            return checksums
        with core.lock:
            core.reserve_disk_locked(len(records), state.record_bytes,
                                     core.share_of_locked(state, Tier.DISK), own, plan.parents)
            job = core.submit_disk_locked(records, token_puts=_token_records(
                keys, indices, raw_keys, detail, said))
        try:
            core.wait_disk(job)
        except TierKVError:
            with core.lock:
                core.release_records_locked(state, len(records))
            raise
        return checksums

    def publish(
        self, state: NamespaceState, keys: list[bytes], priority: Priority, target: Tier,
        plan: PutPlan, locations: dict[int, Location], checksums: dict[int, int],
        count_put: bool, detail: PutDetail | None, said: list[BlockTokens | None],
    ) -> int:
        """Make a put visible: link the copies in ``target`` (``locations`` by block index, with
        their ``checksums`` in HOST; room reserved for blocks another put stored meanwhile is
        given back) and, when the plan wrote records, on disk. Returns the blocks newly stored
        in ``target``. ``count_put``: False for blocks a read brought from REMOTE; ``detail``:
        what the writer said of the blocks, for their KV events; ``said``: their tokens (``_said``)."""
        core = self.core
        new, blocks = plan.new_set, state.blocks
        with_records = bool(plan.disk_indices) and core.disk is not None
        with core.lock:
            core.count_put_locked(state, count_put)
            if any(tokens is not None for tokens in said):
                self._fill_tokens_locked(state, keys, said)
            num_stored = 0
            # Tail first, each block linked or touched where it is met: the head ends most
            # recently used, in one pass over the keys (this runs for every block of a put).
            # A put that continues a stored chain goes just behind its parent, so that a
            # chain saved in several puts is still evicted tail first (docs/design/
            # eviction.md#chains).
            anchors = _anchors(detail, keys, blocks)
            for index in range(len(keys) - 1, -1, -1):
                entry = blocks.get(keys[index])
                location = locations.get(index)
                parent = anchors[index] if anchors else None
                if location is not None:
                    if index in new and (entry is None or entry.residency(target) is None):
                        if entry is None:
                            entry = self._entry_locked(state, keys[index], priority,
                                                       _parent_hash(detail, keys, index),
                                                       said[index])
                        core.link_locked(entry, target, location, checksums.get(index), parent)
                        num_stored += 1
                        if ((entry.gpu is not None) + (entry.host is not None)
                                + (entry.disk is not None)) > 1:
                            core.touch_locked(entry, parent)  # its copies in the other tiers
                        continue
                    # A concurrent put of the same key won, or only its record was wanted.
                    core.release_pages_locked(target, location, state)
                if entry is not None and not with_records:
                    core.touch_locked(entry, parent)
            if with_records:
                num_on_disk = self._publish_disk(state, keys, priority, plan.disk_indices,
                                                 detail, said)
                if target is Tier.DISK:
                    num_stored = num_on_disk
                for index in range(len(keys) - 1, -1, -1):  # the records' blocks, tail first
                    touched = blocks.get(keys[index])
                    if touched is not None:
                        core.touch_locked(touched, anchors[index] if anchors else None)
            if core.sketch is not None:  # the adaptive policy counts a put as a use
                core.use_locked([entry for key in keys
                                 if (entry := blocks.get(key)) is not None])
        return num_stored

    def _fill_tokens_locked(self, state: NamespaceState, keys: list[bytes],
                            said: list[BlockTokens | None]) -> None:
        """Give the tokens a writer says now to stored blocks that had none (brought back from
        REMOTE, say), and announce their copies again with them: a router can place them now."""
        for key, tokens in zip(keys, said, strict=True):
            entry = state.blocks.get(key)
            if entry is not None and entry.tokens is None and tokens is not None:
                entry.tokens = tokens
                self.core.announce_locked(entry)

    def _said(self, state: NamespaceState, keys: list[bytes], detail: PutDetail | None
              ) -> list[BlockTokens | None]:
        """Each block's tokens, kept only for a publisher of KV events that publishes them
        (token ids are prompt content)."""
        events = self.core.events
        if events is None or not events.keep_tokens:
            detail = None
        return pack_put(detail, len(keys), state.namespace.layout.block_size)

    def _entry_locked(self, state: NamespaceState, key: bytes, priority: Priority,
                      parent: bytes | None, tokens: BlockTokens | None) -> Entry:
        """``key``'s entry, made if new (an existing one got the put's tokens already:
        ``_fill_tokens_locked``)."""
        entry = state.blocks.get(key)
        if entry is None:
            entry = Entry(key, state, priority, parent, tokens)
            self.core.index_locked(entry)
        return entry

    def _publish_disk(
        self, state: NamespaceState, keys: list[bytes], priority: Priority, indices: list[int],
        detail: PutDetail | None, said: list[BlockTokens | None],
    ) -> int:
        core = self.core
        num_linked = 0
        for index in indices:
            entry = self._entry_locked(state, keys[index], priority,
                                       _parent_hash(detail, keys, index), said[index])
            if entry.disk is None:
                core.link_locked(entry, Tier.DISK, 0)
                num_linked += 1
            else:
                core.release_records_locked(state, 1)
        return num_linked

    def flush_to_disk(self) -> int:
        """Write every GPU/HOST-only block to disk, least recently used first (so the most
        recent end up most recent on disk too); returns how many were written."""
        core = self.core
        if core.disk is None:
            return 0
        num_written = 0
        for tier in sorted(core.paged):
            with core.lock:
                ledger = core.ledgers[tier]
                candidates = [node.owner for lru in ledger.shares.lrus()
                              for node in lru.iter_lru()]
                candidates += [e for e in core.pins.entries() if e.residency(tier) is not None]
            for start in range(0, len(candidates), _FLUSH_BATCH):
                with core.busy() as marks:
                    with core.lock:
                        for entry in candidates[start : start + _FLUSH_BATCH]:
                            if (entry.disk is None and entry.priority != DOOMED
                                    and entry.residency(tier) is not None):
                                marks.add_locked(entry)
                    batch = marks.entries
                    # A batch that does not fit comes back empty (copy_between says so).
                    num_written += len(self.mover.copy_between(batch, tier, Tier.DISK)) if batch else 0
        return num_written


def _token_records(keys: list[bytes], indices: list[int], raw_keys: list[bytes],
                   detail: PutDetail | None, said: list[BlockTokens | None]
                   ) -> list[tuple[bytes, bytes]]:
    """What rides beside the records of ``indices``: each block's parent and tokens."""
    return [(raw_key, encode_tokens(_parent_hash(detail, keys, index), said[index]))
            for index, raw_key in zip(indices, raw_keys, strict=True)]


def _parent_hash(detail: PutDetail | None, keys: list[bytes], index: int) -> bytes | None:
    """Block ``index``'s parent: what the writer said, else the put's previous key."""
    return (detail or _NO_DETAIL).parent_of(index, keys)


_NO_DETAIL = PutDetail()


def _anchors(detail: PutDetail | None, keys: list[bytes],
             blocks: dict[bytes, Entry]) -> list[Entry | None] | None:
    """For each block of a put, the stored block its chain continues (the parent of the first
    block of its run in the put), which the run is linked behind; None when the writer named
    no stored parent (the usual put of a new chain: every block most recently used)."""
    if detail is None:
        return None
    if not detail.parent_hashes:
        parent = None if detail.parent_hash is None else blocks.get(detail.parent_hash)
        return None if parent is None else [parent] * len(keys)
    anchors: list[Entry | None] = []
    for index, parent_hash in enumerate(detail.parent_hashes):
        if parent_hash is None:
            anchors.append(None)
        elif index and parent_hash == keys[index - 1]:
            anchors.append(anchors[-1])  # the same run
        else:
            anchors.append(blocks.get(parent_hash))
    return anchors if any(anchor is not None for anchor in anchors) else None
