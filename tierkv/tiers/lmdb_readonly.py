"""Reading a DISK tier's LMDB store offline, changing nothing on disk (``tierkv inspect``).

Decisions:
1. No server holds the directory (its ``tierkv.lock`` is free): the environment is opened
   read-only without LMDB's lock file (``readonly=True, lock=False``). LMDB then opens
   ``data.mdb`` with ``O_RDONLY`` and never opens ``lock.mdb``: no byte and no mtime of any
   file changes, and nothing is created (not even a missing directory).
2. A server in another process holds the directory: the environment is opened read-only *with*
   the lock file, as one more LMDB reader. Its slot in ``lock.mdb`` (which the server writes
   anyway) keeps the server from reusing the pages of the snapshot being read: without it a
   commit could recycle them under the reader, and LMDB ``abort()``s on a page of the wrong
   type. Never open it so from inside the process that serves the store: LMDB forbids two
   opens of one environment in a process (closing one drops the other's ``fcntl`` locks).
3. Before LMDB walks anything, the file must hold every page of the last commit and
   ``tierkv.tiers.lmdb_check`` must find every B-tree well formed (as at a server's open), so
   a damaged or truncated file is a clear error, never a crash. Then every value LMDB hands out
   lies inside the file.
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


class NotAStoreError(ConfigError):
    """The path is not a readable tierkv disk store (the message says why)."""


def server_holds(path: Path) -> bool:
    """Whether another process (a server) holds the directory lock of ``path`` now. Opens the
    lock file read-only (never creating it) and takes a shared lock for an instant."""
    try:
        fd = os.open(path / LOCK_FILE_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # closing releases the shared lock
    return False


class ReadOnlyStore:
    """A DISK tier's LMDB environment opened read-only (see the module docstring); use it in a
    ``with`` block. Raises ``NotAStoreError`` for a path that is not a readable tierkv store."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        data_file = self.path / DATA_FILE_NAME
        if not data_file.is_file():
            raise NotAStoreError(f"{self.path}: no LMDB data file ({DATA_FILE_NAME}) there")
        self.server_running = server_holds(self.path)
        try:
            self._env = lmdb.open(
                str(self.path), readonly=True, lock=self.server_running, create=False,
                max_dbs=4, subdir=True, map_size=max(data_file.stat().st_size, 1 << 20),
                readahead=False,
            )
        except lmdb.Error as exc:
            raise NotAStoreError(f"{self.path}: not an LMDB store ({exc})") from exc
        try:
            self._check(data_file)
            with self._env.begin() as txn:
                if txn.get(DB_NAMES[0]) is None:
                    raise NotAStoreError(f"{self.path}: an LMDB store without a 'blocks' DB "
                                         "(not a tierkv disk store)")
            self._dbs = [self._env.open_db(name, create=False) for name in DB_NAMES]
        except lmdb.Error as exc:
            self._env.close()
            raise NotAStoreError(f"{self.path}: unreadable LMDB store ({exc})") from exc
        except BaseException:
            self._env.close()
            raise

    def _check(self, data_file: Path) -> None:
        """Decision 3: the file holds the last commit and its B-trees are well formed."""
        page_bytes = int(self._env.stat()["psize"])
        info = self._env.info()
        needed_bytes = (int(info["last_pgno"]) + 1) * page_bytes
        if data_file.stat().st_size < needed_bytes:
            raise NotAStoreError(f"{data_file} is shorter than its last commit uses "
                                 f"({needed_bytes} B): truncated")
        try:
            check_data_file(data_file, page_bytes, int(info["last_txnid"]))
        except (DamagedError, OSError) as exc:
            raise NotAStoreError(f"{data_file} is damaged: {exc}") from exc

    def records(self, db_index: int) -> Iterator[tuple[bytes, memoryview]]:
        """Every ``(key, value)`` of one DB (0 blocks, 1 namespaces, 2 sessions), in key order,
        from one read transaction; a value is valid only until the next one is given."""
        with self._env.begin(db=self._dbs[db_index], buffers=True) as txn:
            for key, value in txn.cursor():
                yield bytes(key), memoryview(value)

    def close(self) -> None:
        """Close the environment (idempotent)."""
        with contextlib.suppress(lmdb.Error):
            self._env.close()

    def __enter__(self) -> ReadOnlyStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
