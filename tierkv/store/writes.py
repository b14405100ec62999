"""The write path: ``put`` (write-back and write-through) and ``flush`` to disk.

Decisions:
1. Room is reserved before any byte is copied, and the blocks become visible (are published)
   only after every copy, and for write-through the disk commit, has completed. On any failure
   the reserved room is given back and nothing is visible: a failed put stores nothing.
2. Put is idempotent: a key already held in the target tier (or a faster one) is not copied
   again; it is only touched. Duplicate keys in one call are stored once.
3. Chains are touched tail first, so the head of a prefix is the last to be evicted.
"""

from __future__ import annotations

import torch

from tierkv.config import Priority, Tier, WritePolicy
from tierkv.errors import CapacityError, TierKVError
from tierkv.paging import Location
from tierkv.store.core import StoreCore
from tierkv.store.ledger import DOOMED, Entry, NamespaceState
from tierkv.store.moves import Mover
from tierkv.tiers.records import encode_record

_FLUSH_BATCH = 64


class Writer:
    """Writes for a ``TieredStore``."""

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
    ) -> int:
        """See ``TieredStore.put``."""
        core = self.core
        block_bytes = state.block_bytes
        new_indices, disk_indices, own = self._plan_put(state, keys, priority, policy, target)
        locations: list[Location] = []
        if new_indices:
            locations = self.mover.reserve_pages(target, [block_bytes] * len(new_indices), own)
        disk_reserved = False
        try:
            if new_indices:
                slab = core.paged[target].slab
                spans = slab.plan(locations, block_bytes, new_indices)
                core.engine.copy(lambda nb: slab.write(spans, flat, nb), slab.device, flat.device)
            if disk_indices:
                self._write_records(state, keys, flat, disk_indices, own)
                disk_reserved = True
        except BaseException:
            with core.lock:
                for location in locations:
                    core.release_pages_locked(target, location)
            raise
        with core.lock:
            core.counters.puts += 1
            num_stored = self._publish(state, keys, priority, target, new_indices, locations)
            if disk_reserved:
                num_on_disk = self._publish_disk(state, keys, priority, disk_indices)
                if target is Tier.DISK:
                    num_stored = num_on_disk
            touched = [state.blocks.get(key) for key in reversed(keys)]
            for entry in touched:
                if entry is not None:
                    core.touch_locked(entry)
        return num_stored

    def _plan_put(
        self, state: NamespaceState, keys: list[bytes], priority: Priority,
        policy: WritePolicy, target: Tier,
    ) -> tuple[list[int], list[int], frozenset[Entry]]:
        """Which blocks need a copy in ``target``, which a disk record, and the entries of the
        chain that exist already (never evicted to make room for the chain itself)."""
        core = self.core
        new_indices: list[int] = []
        disk_indices: list[int] = []
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
                    new_indices.append(index)
                wants_disk = policy is WritePolicy.WRITE_THROUGH or target is Tier.DISK
                if wants_disk and (entry is None or entry.disk is None):
                    disk_indices.append(index)
        return new_indices, disk_indices, frozenset(own)

    def _write_records(
        self, state: NamespaceState, keys: list[bytes], flat: torch.Tensor, indices: list[int],
        own: frozenset[Entry],
    ) -> None:
        """Write-through: durable disk records of ``indices`` before returning."""
        core = self.core
        block_bytes = state.block_bytes
        host = flat if flat.device.type == "cpu" else flat.cpu()
        array = host.numpy()
        fingerprint = state.namespace.layout.fingerprint
        records = [
            (state.id + keys[i], encode_record(
                state.id + keys[i], fingerprint, array[i * block_bytes : (i + 1) * block_bytes]
            ))
            for i in indices
        ]
        with core.lock:
            core.reserve_disk_locked(len(records), state.record_bytes, own)
            job = core.submit_disk_locked(records)
        try:
            core.wait_disk(job)
        except TierKVError:
            with core.lock:
                assert core.disk_ledger is not None
                core.disk_ledger.release_bytes(len(records) * state.record_bytes)
            raise

    def _entry_locked(self, state: NamespaceState, key: bytes, priority: Priority) -> Entry:
        entry = state.blocks.get(key)
        if entry is None:
            entry = Entry(key, state, priority)
            state.blocks[key] = entry
        return entry

    def _publish(
        self, state: NamespaceState, keys: list[bytes], priority: Priority, target: Tier,
        indices: list[int], locations: list[Location],
    ) -> int:
        """Link the new copies; returns how many were linked (a concurrent put may have won)."""
        core = self.core
        num_linked = 0
        for index, location in zip(indices, locations, strict=True):
            entry = self._entry_locked(state, keys[index], priority)
            if entry.residency(target) is None:
                core.link_locked(entry, target, location)
                num_linked += 1
            else:  # a concurrent put of the same key won
                core.release_pages_locked(target, location)
        return num_linked

    def _publish_disk(
        self, state: NamespaceState, keys: list[bytes], priority: Priority, indices: list[int]
    ) -> int:
        core = self.core
        num_linked = 0
        for index in indices:
            entry = self._entry_locked(state, keys[index], priority)
            if entry.disk is None:
                core.link_locked(entry, Tier.DISK, 0)
                num_linked += 1
            else:
                assert core.disk_ledger is not None
                core.disk_ledger.release_bytes(state.record_bytes)
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
                candidates = [node.owner for node in ledger.lru.iter_lru()]
                candidates += [e for e in core.pins.entries() if e.residency(tier) is not None]
            for start in range(0, len(candidates), _FLUSH_BATCH):
                with core.lock:
                    batch = [
                        e for e in candidates[start : start + _FLUSH_BATCH]
                        if e.disk is None and e.priority != DOOMED
                        and e.residency(tier) is not None
                    ]
                    for entry in batch:
                        entry.readers += 1
                try:
                    num_written += len(self.mover.copy_between(batch, tier, Tier.DISK)) if batch else 0
                except CapacityError:
                    return num_written
                finally:
                    with core.lock:
                        for entry in batch:
                            core.release_reader_locked(entry)
        return num_written
