"""Reading block records out of the DISK tier's LMDB map (``DiskTier.read_into``): split or
whole records, headers checked against key, layout and length, each payload chunk hashed right
after it lands in the destination; helper threads take blocks from ``PARALLEL_READ_BYTES`` on.
Design: docs/design/disk-records.md#10-reads-verify-as-they-copy-in-parallel-for-large-batches
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import lmdb
import numpy as np

from tierkv.checksums import copy_with_checksum, digest_value
from tierkv.tiers.lmdb_env import MapBounds
from tierkv.tiers.records import VERIFY_CHUNK_BYTES, RecordStatus, verify_record

# Reads of this many payload bytes or more are copied on every core.
PARALLEL_READ_BYTES = 4 * 1024 * 1024
NUM_COPY_HELPERS = max(1, min(3, (os.cpu_count() or 1) - 1))

_Parts = list[tuple[np.ndarray, np.ndarray]]  # (destination slice, source) in payload order


def read_batch(
    txn: lmdb.Transaction,
    dbs: tuple[lmdb._Database, lmdb._Database],
    bounds: MapBounds,
    requests: Sequence[tuple[bytes, np.ndarray]],
    fingerprint: str,
    payload_bytes: int,
    copiers: ThreadPoolExecutor,
    on_error: Callable[[BaseException], None],
) -> list[tuple[RecordStatus, int]]:
    """``DiskTier.read_into`` inside ``txn`` (a read transaction over ``dbs`` = blocks, heads):
    one ``(status, checksum)`` per ``(raw_key, destination)``. An LMDB error while looking
    records up leaves the rest CORRUPT (``on_error`` is told); the records found are read."""
    blocks_db, heads_db = dbs
    results = [(RecordStatus.CORRUPT, 0)] * len(requests)
    found: list[tuple[int, bytes]] = []
    jobs: list[_Parts] = []
    try:
        for index, (raw_key, destination) in enumerate(requests):
            body = txn.get(raw_key, db=blocks_db)
            if body is None:
                results[index] = (RecordStatus.MISSING, 0)
                continue
            parts = _payload_parts(txn.get(raw_key, db=heads_db), memoryview(body), bounds,
                                   raw_key, fingerprint, payload_bytes, destination)
            if parts is not None:
                found.append((index, parts[1]))
                jobs.append(parts[0])
    except lmdb.Error as exc:
        on_error(exc)
    large = len(jobs) * payload_bytes >= PARALLEL_READ_BYTES
    # Before the transaction ends: the payloads lie in its snapshot.
    copied = _Copies(jobs).run(copiers, NUM_COPY_HELPERS if large else 0)
    for (index, expected), checksum in zip(found, copied, strict=True):
        if checksum == digest_value(expected):
            results[index] = (RecordStatus.OK, checksum)
    return results


def _payload_parts(
    head: memoryview | bytes | None, body: memoryview, bounds: MapBounds, raw_key: bytes,
    fingerprint: str, payload_bytes: int, destination: np.ndarray,
) -> tuple[_Parts, bytes] | None:
    """The copies that move a record's payload into ``destination`` and its expected
    checksum, or None if its header does not match or a value lies outside the file (a
    damaged length: reading it could SIGBUS)."""
    head_view = None if head is None else memoryview(head)
    if not bounds.contains(body) or (head_view is not None and not bounds.contains(head_view)):
        return None
    verified = verify_record(head_view, body, raw_key, fingerprint, payload_bytes)
    if verified is None:
        return None
    parts: _Parts = []
    offset = 0
    for part in verified[0]:
        parts.append((destination[offset : offset + len(part)], np.frombuffer(part, np.uint8)))
        offset += len(part)
    return parts, verified[1]


class _Copies:
    """The payload copies of one read: the caller and its helpers each take the next block
    until none is left; each block's checksum is of its own copy."""

    def __init__(self, jobs: list[_Parts]) -> None:
        self._jobs = jobs
        self._values = [0] * len(jobs)
        self._next, self._left = 0, len(jobs)
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    def run(self, pool: ThreadPoolExecutor, num_helpers: int) -> list[int]:
        """Copy every block, on the caller's thread and ``num_helpers`` of ``pool``'s; the
        checksum of each. Raises the first error a copy raised, once no copy runs."""
        helpers: list[Future[None]] = []
        with contextlib.suppress(RuntimeError):  # shut down: the caller copies them all
            for _ in range(min(num_helpers, len(self._jobs) - 1)):
                helpers.append(pool.submit(self._work))
        self._work()
        with self._changed:
            self._changed.wait_for(lambda: not self._left)
            self._jobs = []  # a helper that starts now finds nothing, and holds no payload
        for helper in helpers:
            helper.cancel()
        if self._error is not None:
            raise self._error
        return self._values

    def _work(self) -> None:
        while True:
            with self._changed:
                if self._next >= len(self._jobs):
                    return
                index, self._next = self._next, self._next + 1
            try:
                self._values[index] = copy_with_checksum(self._jobs[index], VERIFY_CHUNK_BYTES)
            except BaseException as exc:  # raised on the caller's thread by run()
                self._error = exc
            with self._changed:
                self._left -= 1
                self._changed.notify_all()
