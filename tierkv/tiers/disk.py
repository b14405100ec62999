"""DISK tier: checksummed block records in LMDB, written by one dedicated thread.
The tier only moves bytes (the store decides what to write and delete): writes are group-committed
on the writer thread, each job's future resolved once durable; reads run on the caller's or the
tier's reader threads and verify what they copy. Namespace and session records live beside blocks.
Design: docs/design/disk-records.md#the-disk-tier
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import lmdb
import numpy as np

from tierkv.config import DiskTierConfig, MiB
from tierkv.errors import ConfigError, DiskFullError, DiskIOError, StoreClosedError, TierKVError
from tierkv.logs import Throttle, log_event
from tierkv.tiers.disk_reads import NUM_COPY_HELPERS, read_batch
from tierkv.tiers.lmdb_env import DAMAGED, DirectoryLock, MapBounds, open_environment
from tierkv.tiers.records import RecordStatus, seal, split_record

log = logging.getLogger(__name__)

# Jobs committed in one transaction until their records reach this size.
_GROUP_COMMIT_BYTES = 256 * MiB
# Deletes per transaction when salvaging the deletes of a job that did not fit.
_SALVAGE_DELETES = 4
# Free map pages kept for deletes and B-tree copies (at least; 1% of the map when larger).
_RESERVE_PAGES = 64
READER_CHECK_INTERVAL_S = 10.0
# An EIO with less free space than a failed write needs plus this is a full disk (decision 8).
_FULL_DISK_MARGIN_BYTES = 4 * MiB
DISK_ERROR_LOG_INTERVAL_S = 10.0


@dataclass(slots=True)
class DiskWrite:
    """One atomic change: records to put and keys to delete, in the blocks, namespace and
    session DBs."""

    block_puts: Sequence[tuple[bytes, bytes | bytearray]] = ()
    block_deletes: Sequence[bytes] = ()
    namespace_puts: Sequence[tuple[bytes, bytes]] = ()
    session_puts: Sequence[tuple[bytes, bytes]] = ()
    session_deletes: Sequence[bytes] = ()
    namespace_deletes: Sequence[bytes] = ()
    token_puts: Sequence[tuple[bytes, bytes]] = ()
    """The parent and tokens of blocks of ``block_puts`` (``TOKENS_DB``); a block's are deleted
    with its record."""
    block_takes: Sequence[tuple[bytes, float]] = ()
    """Deleted block keys (each with a time the caller gets back) whose records are read just
    before the delete, into ``taken``: a caller that hands evicted records on (a lower tier)."""
    taken: list[tuple[bytes, bytes, float]] = field(default_factory=list)
    """``(key, record, time)`` of each of ``block_takes`` that was there, head and body joined;
    complete when ``future`` is done (whether or not the write succeeded)."""
    future: Future[None] = field(default_factory=Future)

    @property
    def num_bytes(self) -> int:
        """Bytes of block and session records this job writes."""
        return (sum(len(value) for _, value in self.block_puts)
                + sum(len(value) for _, value in self.session_puts)
                + sum(len(value) for _, value in self.token_puts))

    @property
    def has_puts(self) -> bool:
        """Whether the job writes anything (else it only deletes)."""
        return bool(self.block_puts or self.namespace_puts or self.session_puts)


_ERROR_KINDS = ("full", "io", "other")


class DiskTier:
    """An LMDB environment at ``config.path`` with its writer thread and reader threads."""

    def __init__(self, config: DiskTierConfig) -> None:
        """Lock ``config.path`` and open it (see decision 6). Raises ``ConfigError`` if another
        process holds the path, or if the store there is unreadable and ``config.on_corrupt``
        is ``refuse``; ``moved_aside_to`` names where an unreadable one went otherwise."""
        self.config = config
        try:
            config.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"disk path: cannot create {config.path}: {exc}") from exc
        self._lock = DirectoryLock(config.path)
        try:
            opened = open_environment(config)
        except BaseException:
            self._lock.release()
            raise
        self._pid = os.getpid()
        self._env = opened.env
        self._bounds: MapBounds = opened.bounds
        self._found_blocks: list[tuple[bytes, int]] | None = opened.blocks
        self._found_namespaces = opened.namespaces
        self._found_sessions = opened.sessions
        self._found_tokens: dict[bytes, bytes] | None = opened.tokens
        assert opened.tokens_db is not None
        self._tokens = opened.tokens_db
        self.num_unreadable_records = opened.num_unreadable_records
        """Namespace and session records found at open that failed their checksum."""
        self.moved_aside_to = opened.moved_aside_to
        """Where an unreadable environment found at open was moved (None: it was readable)."""
        self._page_bytes = int(self._env.stat()["psize"])
        self._blocks, self._namespaces, self._sessions, self._heads = opened.dbs
        self._queue: queue.SimpleQueue[DiskWrite | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="tierkv-disk-writer", daemon=True)
        self._writer.start()
        self.readers = ThreadPoolExecutor(config.num_reader_threads, "tierkv-disk-read")
        self._copiers = ThreadPoolExecutor(NUM_COPY_HELPERS, "tierkv-disk-copy")
        self._num_reads = 0
        self._reads_idle = threading.Condition()
        self._closed = False
        self._error_lines = {kind: Throttle(DISK_ERROR_LOG_INTERVAL_S) for kind in _ERROR_KINDS}
        self._next_reader_check_s = time.monotonic() + READER_CHECK_INTERVAL_S

    # --- recovery -----------------------------------------------------------------------------

    @property
    def num_found_blocks(self) -> int:
        """Block keys found at open that ``scan_blocks`` has not given out yet."""
        return len(self._found_blocks or ())

    def scan_blocks(self) -> Iterator[tuple[bytes, int]]:
        """Every block key found at open with its record size, in key order, then any record
        head whose body is lost, with size -1 (no payload is read). Given out once: the list is
        dropped as it is consumed (it can be large)."""
        found, self._found_blocks = self._found_blocks or [], None
        yield from found

    def load_namespaces(self) -> dict[bytes, bytes]:
        """Every namespace descriptor found at open whose checksum held, by namespace id."""
        return dict(self._found_namespaces)

    def take_tokens(self) -> dict[bytes, bytes]:
        """Every block's parent-and-tokens body found at open whose checksum held, by block key
        (``TOKENS_DB``); given out once."""
        found, self._found_tokens = self._found_tokens or {}, None
        return found

    def load_sessions(self) -> dict[bytes, bytes]:
        """Every session record found at open whose checksum held, by session key."""
        return dict(self._found_sessions)

    # --- writes -------------------------------------------------------------------------------

    def submit(self, job: DiskWrite) -> Future[None]:
        """Queue ``job``; its future resolves once it is committed and synced, or fails with
        ``DiskFullError`` (map or disk full) or ``TierKVError``, having changed nothing."""
        self._check_process()
        if self._closed:
            job.future.set_exception(TierKVError("the disk tier is closed"))
        else:
            self._queue.put(job)
        return job.future

    def _write_loop(self) -> None:
        stopping = False
        while not stopping:
            job = self._queue.get()
            if job is None:
                break
            batch, num_bytes = [job], job.num_bytes
            while num_bytes < _GROUP_COMMIT_BYTES:
                try:
                    following = self._queue.get_nowait()
                except queue.Empty:
                    break
                if following is None:
                    stopping = True
                    break
                batch.append(following)
                num_bytes += following.num_bytes
            self._commit_group(batch)

    def _clear_dead_readers(self) -> int:
        """Reclaim the reader slots of dead processes (decision 3); how many were freed."""
        self._next_reader_check_s = time.monotonic() + READER_CHECK_INTERVAL_S
        try:
            num_freed = int(self._env.reader_check())
        except lmdb.Error as exc:
            self._log_error("reader check", exc)
            return 0
        if num_freed:
            log.warning("freed %d LMDB reader slots of dead processes (their snapshots kept "
                        "freed pages from reuse)", num_freed)
        return num_freed

    def _commit_with_reader_check(self, batch: list[DiskWrite]) -> None:
        if time.monotonic() >= self._next_reader_check_s:
            self._clear_dead_readers()
        try:
            self._commit(batch)
        except lmdb.MapFullError:
            # A dead reader may be all that keeps the freed pages from reuse.
            if not self._clear_dead_readers():
                raise
            self._commit(batch)

    def _read_takes(self, batch: list[DiskWrite]) -> None:
        """Read the records of each job's ``block_takes`` (still there: only this thread
        deletes) into its ``taken``."""
        jobs = [job for job in batch if job.block_takes]
        if not jobs:
            return
        try:
            with self._env.begin(buffers=True) as txn:
                for job in jobs:
                    for key, seen_s in job.block_takes:
                        body = txn.get(key, db=self._blocks)
                        if body is not None:
                            head = txn.get(key, db=self._heads)
                            record = bytes(body) if head is None else b"".join((head, body))
                            job.taken.append((key, record, seen_s))
        except Exception as exc:  # taking is best effort; the deletes must go on
            self._log_error("take", exc)

    def _commit_group(self, batch: list[DiskWrite]) -> None:
        self._read_takes(batch)
        try:
            self._commit_with_reader_check(batch)
        except (lmdb.Error, OSError, DiskFullError) as exc:
            if len(batch) == 1:
                self._fail(batch[0], exc)
                return
            # One job may be the one that does not fit; give every job its own chance.
            for job in batch:
                try:
                    self._commit([job])
                except (lmdb.Error, OSError, DiskFullError) as single_exc:
                    self._fail(job, single_exc)
                else:
                    job.future.set_result(None)
            return
        for job in batch:
            job.future.set_result(None)

    def _check_headroom(self, txn: lmdb.Transaction, batch: list[DiskWrite]) -> None:
        """Refuse puts that would leave the map with fewer than ``_RESERVE_PAGES`` free pages:
        a map that is full to the last page cannot even commit a delete."""
        num_put_bytes = sum(job.num_bytes for job in batch)
        if not num_put_bytes:
            return
        page_bytes = self._page_bytes
        used_pages = 0
        stats = [txn.stat(db) for db in (self._blocks, self._namespaces, self._sessions,
                                         self._heads)]
        for stat in (*stats, self._env.stat()):
            used_pages += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        num_records = sum(len(job.block_puts) + len(job.session_puts) for job in batch)
        needed_pages = -(-num_put_bytes // page_bytes) + 2 * num_records
        map_pages = self.config.map_size_bytes // page_bytes
        reserve_pages = max(_RESERVE_PAGES, map_pages // 100)
        if used_pages + needed_pages + reserve_pages > map_pages:
            raise DiskFullError(
                f"disk: LMDB map ({self.config.map_size_bytes} B) has no room for "
                f"{num_put_bytes} B more; raise --disk-bytes or free blocks"
            )

    def _fail(self, job: DiskWrite, exc: BaseException) -> None:
        """Resolve a job that did not commit. Its deletes are retried alone, a few per
        transaction (a nearly full map still has room for small ones): a delete-only job then
        succeeds; a job with puts still fails (its deletes are idempotent if queued again)."""
        salvaged = self._salvage_deletes(job.block_deletes, self._blocks, self._heads,
                                         self._tokens)
        salvaged = self._salvage_deletes(job.session_deletes, self._sessions) and salvaged
        if salvaged and not job.has_puts:
            job.future.set_result(None)
        else:
            error = self._disk_error(exc, job.num_bytes)
            self._log_error("write", error)
            job.future.set_exception(error)

    def _salvage_deletes(self, keys: Sequence[bytes], *dbs: lmdb._Database) -> bool:
        for start in range(0, len(keys), _SALVAGE_DELETES):
            try:
                with self._env.begin(write=True) as txn:
                    for key in keys[start : start + _SALVAGE_DELETES]:
                        for db in dbs:
                            txn.delete(key, db=db)
            except (lmdb.Error, OSError) as exc:
                self._log_error("delete", exc)
                return False
        return True

    def _commit(self, batch: list[DiskWrite]) -> None:
        with self._env.begin(write=True) as txn:
            self._check_headroom(txn, batch)
            for job in batch:
                for key in job.block_deletes:
                    txn.delete(key, db=self._blocks)
                    txn.delete(key, db=self._heads)
                    txn.delete(key, db=self._tokens)
                for key, value in job.block_puts:
                    head, body = split_record(value, self._page_bytes)
                    txn.put(key, body, db=self._blocks)
                    if len(head):
                        txn.put(key, head, db=self._heads)
                    else:  # stored whole: no head, not even one of the key's last record
                        txn.delete(key, db=self._heads)
                    txn.delete(key, db=self._tokens)  # the last record's, if any
                for key, value in job.token_puts:
                    txn.put(key, seal(key, value), db=self._tokens)
                for key in job.namespace_deletes:
                    txn.delete(key, db=self._namespaces)
                for key, value in job.namespace_puts:
                    txn.put(key, seal(key, value), db=self._namespaces)
                for key in job.session_deletes:
                    txn.delete(key, db=self._sessions)
                for key, value in job.session_puts:
                    txn.put(key, seal(key, value), db=self._sessions)

    # --- reads --------------------------------------------------------------------------------

    def read_into(
        self,
        requests: Sequence[tuple[bytes, np.ndarray]],
        fingerprint: str,
        payload_bytes: int,
    ) -> list[tuple[RecordStatus, int]]:
        """Copy the verified payload of each ``(raw_key, destination)`` into its destination
        (flat uint8), in one read transaction; one ``(status, checksum)`` per request, the
        checksum (``tierkv.checksums``) being the record's, verified, when the status is OK.

        ``MISSING``: no record. ``CORRUPT``: the record failed a check; its destination may then
        hold garbage and must not be used. Raises ``StoreClosedError`` once the tier is closed.
        Large batches are copied on every core (decision 10).
        """
        self._check_process()
        with self._reads_idle:
            if self._closed:
                raise StoreClosedError("the disk tier is closed")
            self._num_reads += 1
        try:
            return self._read_batch(requests, fingerprint, payload_bytes)
        finally:
            with self._reads_idle:
                self._num_reads -= 1
                if not self._num_reads:
                    self._reads_idle.notify_all()

    def _read_batch(
        self, requests: Sequence[tuple[bytes, np.ndarray]], fingerprint: str, payload_bytes: int,
    ) -> list[tuple[RecordStatus, int]]:
        try:
            with self._env.begin(buffers=True) as txn:
                return read_batch(txn, (self._blocks, self._heads), self._bounds, requests,
                                  fingerprint, payload_bytes, self._copiers,
                                  lambda exc: self._log_error("read", exc))
        except lmdb.Error as exc:
            self._log_error("read", exc)
            return [(RecordStatus.CORRUPT, 0)] * len(requests)

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued writes, sync and close. Idempotent."""
        if self._closed or os.getpid() != self._pid:
            return
        with self._reads_idle:
            self._closed = True
        self._queue.put(None)
        self._writer.join()
        self.readers.shutdown(wait=True)
        with self._reads_idle:  # no payload may be read from the map once it is unmapped
            self._reads_idle.wait_for(lambda: not self._num_reads)
        self._copiers.shutdown(wait=True)
        self._env.sync(True)
        self._env.close()
        self._lock.release()

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise TierKVError("an LMDB environment cannot be used across fork(); open the store in the child")

    def _log_error(self, op: str, exc: BaseException) -> None:
        """Log a failed ``op`` (write, delete, read) as ``disk_error``, throttled by kind
        (decision 9): a full disk is a warning, anything else an error."""
        kind = "full" if isinstance(exc, DiskFullError) else (
            "io" if isinstance(exc, DiskIOError | OSError | lmdb.Error) else "other")
        num_errors = self._error_lines[kind].admit()
        if num_errors:
            level = logging.WARNING if kind == "full" else logging.ERROR
            log_event(log, level, "disk_error",
                      f"disk {op} failed ({num_errors} {kind} errors since the last line): {exc}",
                      op=op, kind=kind, path=str(self.config.path), error=str(exc),
                      num_errors=num_errors, interval_s=DISK_ERROR_LOG_INTERVAL_S)

    def _disk_error(self, exc: BaseException, num_bytes: int) -> TierKVError:
        """What a write of ``num_bytes`` that failed with ``exc`` is reported as (decision 8)."""
        if isinstance(exc, TierKVError):
            return exc
        if isinstance(exc, lmdb.MapFullError):
            return DiskFullError(
                "disk: LMDB map is full; raise --disk-bytes (the map is sized from it) or free "
                "blocks"
            )
        if isinstance(exc, DAMAGED):
            return DiskIOError(
                f"disk: the LMDB store at {self.config.path} is damaged ({exc}); it is checked "
                "(and moved aside if need be) when the server starts again"
            )
        message = str(exc)
        if getattr(exc, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in message:
            return DiskFullError(f"disk: no space left on the device at {self.config.path}: {exc}")
        if getattr(exc, "errno", None) == errno.EIO or os.strerror(errno.EIO) in message:
            try:
                stats = os.statvfs(self.config.path)
            except OSError:
                return DiskIOError(f"disk: I/O error at {self.config.path}: {exc}")
            free_bytes = stats.f_bavail * stats.f_frsize
            if free_bytes < num_bytes + _FULL_DISK_MARGIN_BYTES:
                return DiskFullError(
                    f"disk: the filesystem at {self.config.path} is full ({free_bytes} B free; "
                    f"a write of {num_bytes} B failed: {exc}); free space or lower --disk-bytes"
                )
            return DiskIOError(
                f"disk: I/O error at {self.config.path} with {free_bytes} B free (a failing "
                f"device?): {exc}"
            )
        return TierKVError(f"disk write failed: {exc}")
