"""Reading a DISK tier's LMDB store offline, changing nothing on disk (``tierkv inspect``).
Everything is read from one checked snapshot, held until ``close``; with no server running, a
server is kept off the directory meanwhile. A damaged or truncated file is an error, never a crash.
Design: docs/design/disk-records.md#offline-inspection
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import lmdb

from tierkv.errors import ConfigError
from tierkv.tiers.lmdb_check import DamagedError, check_data_file
from tierkv.tiers.lmdb_env import DATA_FILE_NAME, DB_NAMES, LOCK_FILE_NAME

_SNAPSHOT_TRIES = 5
"""Snapshots taken before a store a server is writing is reported damaged (decision 4): the
meta page is lost only to two commits between the transaction's start and the check's first
read, microseconds apart, and a store that is really damaged is walked this many times."""


class NotAStoreError(ConfigError):
    """The path is not a readable tierkv disk store (the message says why)."""


def share_directory(path: Path) -> tuple[bool, int | None]:
    """``(server_running, fd)``: whether another process (a server) holds the directory lock
    of ``path`` now, and else the lock file's descriptor holding a shared lock on it (None when
    there is no lock file), to close when the reading is done (decision 1). Opens the lock
    file read-only, never creating it."""
    try:
        fd = os.open(path / LOCK_FILE_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN), None
    return False, fd


class ReadOnlyStore:
    """A DISK tier's LMDB environment opened read-only (see the module docstring); use it in a
    ``with`` block. Raises ``NotAStoreError`` for a path that is not a readable tierkv store."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        data_file = self.path / DATA_FILE_NAME
        if not data_file.is_file():
            raise NotAStoreError(f"{self.path}: no LMDB data file ({DATA_FILE_NAME}) there")
        if data_file.stat().st_size == 0:  # LMDB itself says only "Bad file descriptor"
            raise NotAStoreError(f"{data_file} is empty (0 B): not a tierkv disk store")
        self.server_running, self._shared_fd = share_directory(self.path)
        self._txn: lmdb.Transaction | None = None
        try:
            self._env = lmdb.open(
                str(self.path), readonly=True, lock=self.server_running, create=False,
                max_dbs=5, subdir=True, map_size=max(data_file.stat().st_size, 1 << 20),
                readahead=False,
            )
        except BaseException as exc:
            self._unshare()
            if isinstance(exc, lmdb.Error):
                raise NotAStoreError(f"{self.path}: not an LMDB store ({exc})") from exc
            raise
        if self.server_running:  # decision 2: slots of dead inspections pin the server's pages
            with contextlib.suppress(lmdb.Error):
                self._env.reader_check()
        try:
            self._txn = self._snapshot(data_file)
            if self._txn.get(DB_NAMES[0]) is None:
                raise NotAStoreError(f"{self.path}: an LMDB store without a 'blocks' DB "
                                     "(not a tierkv disk store)")
            # A store written before records were split has no heads DB (decision 5).
            self._dbs = [self._env.open_db(name, txn=self._txn, create=False)
                         if name != b"heads" or self._txn.get(name) is not None else None
                         for name in DB_NAMES]
        except lmdb.Error as exc:
            self.close()
            raise NotAStoreError(f"{self.path}: unreadable LMDB store ({exc})") from exc
        except BaseException:
            self.close()
            raise

    def _snapshot(self, data_file: Path) -> lmdb.Transaction:
        """A read transaction whose snapshot passed the check (decisions 3 and 4)."""
        for attempt in range(_SNAPSHOT_TRIES):
            txn = self._env.begin(buffers=True)
            try:
                self._check(data_file, int(txn.id()))
            except NotAStoreError:
                txn.abort()
                if not self.server_running or attempt == _SNAPSHOT_TRIES - 1:
                    raise
                continue
            return txn
        raise AssertionError("unreachable")

    def _check(self, data_file: Path, txnid: int) -> None:
        """Decision 3: the file holds the commit ``txnid`` and its B-trees are well formed."""
        page_bytes = int(self._env.stat()["psize"])
        info = self._env.info()
        needed_bytes = (int(info["last_pgno"]) + 1) * page_bytes
        if data_file.stat().st_size < needed_bytes:
            raise NotAStoreError(f"{data_file} is shorter than its last commit uses "
                                 f"({needed_bytes} B): truncated")
        try:
            check_data_file(data_file, page_bytes, txnid)
        except (DamagedError, OSError) as exc:
            raise NotAStoreError(f"{data_file} is damaged: {exc}") from exc

    def records(self, db_index: int) -> Iterator[tuple[bytes, memoryview]]:
        """Every ``(key, value)`` of one DB (0 blocks, 1 namespaces, 2 sessions, 3 heads), in
        key order, from the store's one snapshot (decision 4); a value is valid until
        ``close``."""
        assert self._txn is not None, "the store is closed"
        db = self._dbs[db_index]
        if db is None:
            return
        for key, value in self._txn.cursor(db=db):
            yield bytes(key), memoryview(value)

    def block_records(self) -> Iterator[tuple[bytes, memoryview | None, memoryview | None]]:
        """Every block record as ``(key, head, body)`` in key order (decision 5): head None
        for a record stored whole, then every head whose body is lost, with body None."""
        assert self._txn is not None, "the store is closed"
        heads_db = self._dbs[3]
        heads_seen = 0
        for key, body in self.records(0):
            head = None if heads_db is None else self._txn.get(key, db=heads_db)
            heads_seen += head is not None
            yield key, None if head is None else memoryview(head), body
        if heads_db is not None and heads_seen < int(self._txn.stat(heads_db)["entries"]):
            for key, head in self.records(3):
                if self._txn.get(key, db=self._dbs[0]) is None:
                    yield key, head, None

    def close(self) -> None:
        """End the snapshot, close the environment and let servers start again (idempotent)."""
        if self._txn is not None:
            with contextlib.suppress(lmdb.Error):
                self._txn.abort()
            self._txn = None
        with contextlib.suppress(lmdb.Error):
            self._env.close()
        self._unshare()

    def _unshare(self) -> None:
        if self._shared_fd is not None:
            os.close(self._shared_fd)  # releases the shared lock
            self._shared_fd = None

    def __enter__(self) -> ReadOnlyStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
