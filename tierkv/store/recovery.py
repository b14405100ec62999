"""Rebuilding the index from the DISK tier when a store opens, from what the environment's walk
found (keys and sizes only; records are verified when read), and the namespace descriptors
stored beside the blocks. Bad descriptors, orphan blocks and wrong-size records are dropped and
counted. Design: docs/design/disk-records.md#recovery
"""
from __future__ import annotations

import logging

from tqdm import tqdm

from tierkv.config import Priority, Tier
from tierkv.errors import InvalidArgumentError, TierKVError
from tierkv.keys import BlockKey
from tierkv.store.core import StoreCore
from tierkv.store.index import Entry
from tierkv.store.namespaces import namespace_state, parse_descriptor
from tierkv.store.tokens import BlockTokens
from tierkv.store.tokens import decode as decode_tokens

log = logging.getLogger(__name__)
PROGRESS_FROM_BLOCKS = 10_000
"""Fewer blocks recover in well under a second: no progress bar for them."""


def _told(record: bytes | None, block_size: int) -> tuple[bytes | None, BlockTokens | None]:
    """A block's parent and tokens, as its writer said them (a bad or missing record: none)."""
    told = None if record is None else decode_tokens(record, block_size)
    return (None, None) if told is None else told


def recover(core: StoreCore, show_progress: bool = False) -> int:
    """Load namespaces and block keys from disk into ``core``; returns the blocks recovered.
    ``show_progress``: draw a progress bar (on stderr) over the blocks when there are at least
    ``PROGRESS_FROM_BLOCKS`` of them."""
    disk, ledger = core.disk, core.disk_ledger
    if disk is None or ledger is None:
        return 0
    with core.lock:  # counters are guarded by the store lock
        core.counters.checksum_failures += disk.num_unreadable_records
    for ns_id, data in disk.load_namespaces().items():
        try:
            namespace = parse_descriptor(ns_id, data)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("unreadable namespace descriptor %s (its blocks are dropped): %s",
                      ns_id.hex(), exc)
            with core.lock:
                core.counters.checksum_failures += 1
            continue
        core.namespaces[ns_id] = namespace_state(namespace)
    num_recovered = 0
    said = disk.take_tokens()
    surplus: list[bytes] = []
    orphans: dict[bytes, int] = {}  # namespace id -> blocks whose descriptor is lost
    num_found = disk.num_found_blocks
    with core.lock, tqdm(total=num_found, unit="block", unit_scale=True, desc="recovering disk index",
                         disable=not (show_progress and num_found >= PROGRESS_FROM_BLOCKS),
                         miniters=PROGRESS_FROM_BLOCKS // 10) as bar:
        for raw_key, size in disk.scan_blocks():
            bar.update()
            try:
                key = BlockKey.from_raw(raw_key)
            except InvalidArgumentError:
                core.counters.checksum_failures += 1
                surplus.append(raw_key)
                continue
            state = core.namespaces.get(key.namespace_id)
            if state is None or size != state.record_bytes:
                # A torn record of a known namespace, or a block whose descriptor is lost.
                core.counters.checksum_failures += 1
                if state is None:
                    ns_id = bytes(key.namespace_id)
                    orphans[ns_id] = orphans.get(ns_id, 0) + 1
                surplus.append(raw_key)
                continue
            if not ledger.try_reserve_bytes(size, core.share_of_locked(state, Tier.DISK)):
                surplus.append(raw_key)
                continue
            block_hash = bytes(key.block_hash)
            entry = Entry(block_hash, state, Priority.NORMAL,
                          *_told(said.get(raw_key), state.namespace.layout.block_size))
            core.index_locked(entry)
            core.link_locked(entry, Tier.DISK, 0)
            num_recovered += 1
        for ns_id, num_orphans in orphans.items():
            log.error("%d disk blocks of namespace %s dropped: its descriptor is lost",
                      num_orphans, ns_id.hex())
        if surplus:
            log.warning("dropping %d disk records (unknown, wrong size or over budget)", len(surplus))
            core.queue_deletes_locked(surplus)
    try:
        core.flush_deletes()
    except TierKVError as exc:  # the index no longer has them; they go with the next write
        log.warning("dropping surplus disk records failed (will retry): %s", exc)
    return num_recovered
