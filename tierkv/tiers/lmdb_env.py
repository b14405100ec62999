"""Opening the DISK tier's LMDB environment so that no file on disk can stop the process.
``DirectoryLock`` keeps every other process off the directory; ``open_environment`` checks the
data file against the map, walks every B-tree once and returns what it found. An unreadable
environment is moved aside (or, with ``on_corrupt="refuse"``, the open fails).
Design: docs/design/disk-records.md#opening-the-environment
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import numpy as np

from tierkv.config import DiskCorruptAction, DiskTierConfig
from tierkv.errors import ConfigError
from tierkv.tiers.lmdb_check import DamagedError, check_data_file
from tierkv.tiers.records import try_unseal

log = logging.getLogger(__name__)

LOCK_FILE_NAME = "tierkv.lock"
DATA_FILE_NAME = "data.mdb"
_LMDB_FILE_NAMES = (DATA_FILE_NAME, "lock.mdb")
DB_NAMES = (b"blocks", b"namespaces", b"sessions", b"heads")
"""The named databases of a disk store, in the order ``OpenedEnvironment.dbs`` holds them. A
block record is stored split (``tierkv.tiers.records.split_record``): its body under its key in
``blocks``, its head under the same key in ``heads``. A ``blocks`` value without a head is a
record stored whole, as stores written before the split hold them (still read, and verified the
same way)."""
TOKENS_DB = b"tokens"
"""Beside ``DB_NAMES``: a block's parent hash and tokens (``tierkv.store.tokens``), sealed, under
the block's key, written with its record and deleted with it (stores written before it have
none: their blocks recover without tokens)."""
# Errors about the environment around the files, not the files: never a reason to move aside.
_NOT_THE_FILES = (lmdb.ReadonlyError, lmdb.LockError, lmdb.ReadersFullError, lmdb.TlsFullError)
# Errors of a write that say the files are damaged (a full disk or map says nothing about them).
DAMAGED = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.InvalidError,
           lmdb.BadTxnError, lmdb.IncompatibleError)
# Put and deleted again at open, in the sessions DB (no session key starts with NUL).
_PROBE_KEY = b"\x00tierkv-open-probe"


class UnreadableError(Exception):
    """The environment's files cannot be read as a whole (internal to the open)."""


class DirectoryLock:
    """An exclusive ``flock`` on ``<path>/tierkv.lock`` (decision 1). Released by ``release``
    (idempotent) or by the kernel when the process ends."""

    def __init__(self, path: Path) -> None:
        lock_path = path / LOCK_FILE_NAME
        try:
            self._fd: int | None = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(f"disk path: cannot create the lock file {lock_path}: {exc}") from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self.release()
            raise ConfigError(
                f"disk path {path}: another tierkv process holds it (lock {lock_path}: {exc}); "
                "stop that process or give this one another --disk-path"
            ) from exc

    def release(self) -> None:
        """Drop the lock (closing the file releases it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(slots=True)
class MapBounds:
    """Where LMDB mapped ``data.mdb`` in this process, to tell whether a value's bytes lie
    inside the file (decision 3). ``start`` is None where ``/proc/self/maps`` is not available:
    then nothing is checked."""

    data_file: Path
    start: int | None
    file_bytes: int = 0

    def contains(self, value: memoryview) -> bool:
        """Whether every byte of ``value`` (a buffer LMDB handed out) lies inside the file."""
        if self.start is None or not len(value):
            return True
        end = int(np.frombuffer(value, np.uint8).ctypes.data) + len(value) - self.start
        if end <= self.file_bytes:
            return True
        # Our own commits grow the file; look again before calling the value damaged.
        with contextlib.suppress(OSError):
            self.file_bytes = self.data_file.stat().st_size
        return end <= self.file_bytes


@dataclass(slots=True)
class OpenedEnvironment:
    """An open environment, its three DBs, and what the walk at open found."""

    env: lmdb.Environment
    dbs: tuple[lmdb._Database, ...]  # in the order of DB_NAMES
    bounds: MapBounds
    blocks: list[tuple[bytes, int]] = field(default_factory=list)
    """(key, record size: head and body) of every block record; -1 for a head whose body is
    lost (a size no namespace has, so recovery deletes it)."""
    namespaces: dict[bytes, bytes] = field(default_factory=dict)  # unsealed bodies
    sessions: dict[bytes, bytes] = field(default_factory=dict)  # unsealed bodies
    tokens_db: lmdb._Database | None = None
    tokens: dict[bytes, bytes] = field(default_factory=dict)
    """Unsealed bodies of ``TOKENS_DB`` (a bad one is left out and counted)."""
    num_unreadable_records: int = 0
    moved_aside_to: Path | None = None


def open_environment(config: DiskTierConfig) -> OpenedEnvironment:
    """Open (or create) the environment at ``config.path``; the caller holds its lock.

    An unreadable one is moved aside and replaced by a fresh one, or refused with
    ``ConfigError`` when ``config.on_corrupt`` says so. ``ConfigError`` also when LMDB cannot
    open even a fresh environment there.
    """
    try:
        return _open_checked(config)
    except UnreadableError as exc:
        reason = str(exc)
    if config.on_corrupt is DiskCorruptAction.REFUSE:
        raise ConfigError(
            f"disk path {config.path}: the LMDB store there is unreadable ({reason}); it was left "
            "as it is. Move it away, or run with --disk-on-corrupt move_aside"
        )
    moved_to = _move_aside(config.path)
    log.error(
        "DISK TIER UNREADABLE at %s (%s): moved its files to %s and started an empty store; "
        "every block and session in it is gone from this server", config.path, reason, moved_to,
    )
    try:
        opened = _open_checked(config)
    except UnreadableError as exc:
        raise ConfigError(f"disk path {config.path}: a fresh LMDB store is unreadable: {exc}") from exc
    opened.moved_aside_to = moved_to
    return opened


def _open_checked(config: DiskTierConfig) -> OpenedEnvironment:
    data_file = config.path / DATA_FILE_NAME
    with contextlib.suppress(FileNotFoundError):
        # LMDB would quietly start an empty store in an empty file: say that one was lost.
        if data_file.stat().st_size == 0:
            raise UnreadableError(f"{data_file} is empty (0 B)")
    try:
        env = lmdb.open(
            str(config.path), map_size=config.map_size_bytes, max_dbs=5, max_readers=1024,
            writemap=False, meminit=False, lock=True,
        )
    except _NOT_THE_FILES as exc:
        raise ConfigError(f"disk path: cannot open an LMDB store at {config.path}: {exc}") from exc
    except lmdb.Error as exc:
        raise UnreadableError(f"open: {exc}") from exc
    try:
        env.reader_check()
        file_bytes = _check_file_covers_map(env, data_file)
        try:
            check_data_file(data_file, int(env.stat()["psize"]), int(env.info()["last_txnid"]))
        except (DamagedError, OSError) as exc:
            raise UnreadableError(f"structure: {exc}") from exc
        try:
            _check_blocks_db_exists(env)
            dbs = tuple(env.open_db(name) for name in DB_NAMES)
            opened = OpenedEnvironment(env, dbs, MapBounds(data_file, None, file_bytes),
                                       tokens_db=env.open_db(TOKENS_DB))
            opened.bounds.start = _map_start(env, opened.bounds)
            _walk(opened)
        except lmdb.Error as exc:
            raise UnreadableError(f"walk: {type(exc).__name__}: {exc}") from exc
        _probe_write(opened)
    except BaseException:
        env.close()
        raise
    return opened


def _check_file_covers_map(env: lmdb.Environment, data_file: Path) -> int:
    """The data file's size, after checking that it holds every page the last commit uses and
    extending it to the map size (decision 2). Raises ``UnreadableError`` if it does not."""
    page_bytes = int(env.stat()["psize"])
    info = env.info()
    needed_bytes = (int(info["last_pgno"]) + 1) * page_bytes
    try:
        file_bytes = data_file.stat().st_size
    except OSError as exc:
        raise UnreadableError(f"cannot stat {data_file}: {exc}") from exc
    if file_bytes < needed_bytes:
        raise UnreadableError(
            f"{data_file} is {file_bytes} B but its last commit uses {needed_bytes} B "
            "(truncated: a full disk or a partial copy)"
        )
    map_bytes = int(info["map_size"])
    if file_bytes < map_bytes:
        try:
            os.truncate(data_file, map_bytes)  # sparse: no blocks are allocated
        except OSError as exc:  # values are still bounds-checked (decision 3)
            log.warning("cannot extend %s to the map size (%d B): %s", data_file, map_bytes, exc)
        else:
            file_bytes = map_bytes
    return file_bytes


def _map_start(env: lmdb.Environment, bounds: MapBounds) -> int | None:
    """The address the data file is mapped at: the mapping of ``/proc/self/maps`` that holds a
    value LMDB hands out from a page known to be inside the file (the main DB's)."""
    with env.begin(buffers=True) as txn:
        value = txn.get(DB_NAMES[0])
        if value is None or not len(value):
            return None
        address = int(np.frombuffer(value, np.uint8).ctypes.data)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, _, rest = line.partition(" ")
                low, _, high = span.partition("-")
                if int(low, 16) <= address < int(high, 16) and rest.rstrip().endswith(
                    DATA_FILE_NAME
                ):
                    offset = int(rest.split()[1], 16)
                    return int(low, 16) - offset
    except OSError:
        pass
    log.warning("cannot locate LMDB's map of %s: values are not bounds-checked", bounds.data_file)
    return None


def _check_blocks_db_exists(env: lmdb.Environment) -> None:
    """An environment with commits that has no ``blocks`` DB is foreign or has a damaged main
    B-tree: opening it would quietly create empty DBs over its data (decision 4)."""
    if not int(env.info()["last_txnid"]):
        return  # a new environment
    with env.begin() as txn:
        if txn.get(DB_NAMES[0]) is None:
            raise UnreadableError("it has commits but no 'blocks' DB (not a tierkv store?)")


def _walk(opened: OpenedEnvironment) -> None:
    """Read every key and value size (and the small records) once (decision 4)."""
    blocks_db, namespaces_db, sessions_db, heads_db = opened.dbs
    with opened.env.begin(buffers=True) as txn:
        _walk_blocks(txn, blocks_db, heads_db, opened.blocks)
        assert opened.tokens_db is not None
        for name, db, found in ((b"namespaces", namespaces_db, opened.namespaces),
                                (b"sessions", sessions_db, opened.sessions),
                                (TOKENS_DB, opened.tokens_db, opened.tokens)):
            num_entries = 0
            for key, value in txn.cursor(db=db):
                num_entries += 1
                raw_key = bytes(key)
                body = try_unseal(raw_key, value) if opened.bounds.contains(value) else None
                if body is None:
                    opened.num_unreadable_records += 1
                    log.error("disk record %r in the %s DB failed its checksum; ignored",
                              raw_key, name.decode())
                else:
                    found[raw_key] = body
            _check_entries(txn, db, name, num_entries)


def _walk_blocks(txn: lmdb.Transaction, blocks_db: lmdb._Database, heads_db: lmdb._Database,
                 found: list[tuple[bytes, int]]) -> None:
    """Append ``(key, record size)`` of every block record to ``found``: the bodies and heads,
    both in key order, walked side by side (a dict of every head would double what a walk of
    millions of records holds), then each head without a body, with size -1."""
    heads = iter(txn.cursor(db=heads_db))
    orphans: list[bytes] = []
    num_bodies = num_heads = 0
    head_key, head_bytes = _next_head(heads)
    for key, value in txn.cursor(db=blocks_db):
        num_bodies += 1
        raw_key, size = bytes(key), len(value)
        while head_key is not None and head_key < raw_key:
            orphans.append(head_key)
            num_heads += 1
            head_key, head_bytes = _next_head(heads)
        if head_key == raw_key:
            size += head_bytes
            num_heads += 1
            head_key, head_bytes = _next_head(heads)
        found.append((raw_key, size))
    while head_key is not None:
        orphans.append(head_key)
        num_heads += 1
        head_key, head_bytes = _next_head(heads)
    _check_entries(txn, blocks_db, b"blocks", num_bodies)
    _check_entries(txn, heads_db, b"heads", num_heads)
    found.extend((key, -1) for key in orphans)


def _next_head(heads: Iterator[tuple[bytes | memoryview, bytes | memoryview]]
               ) -> tuple[bytes | None, int]:
    """The next head's key and size (None at the end)."""
    item = next(heads, None)
    return (None, 0) if item is None else (bytes(item[0]), len(item[1]))


def _probe_write(opened: OpenedEnvironment) -> None:
    """One commit that allocates pages from the free list (decision 4)."""
    try:
        with opened.env.begin(write=True, db=opened.dbs[2]) as txn:
            txn.put(_PROBE_KEY, b"")
            txn.delete(_PROBE_KEY)
    except DAMAGED as exc:
        raise UnreadableError(f"probe write: {type(exc).__name__}: {exc}") from exc
    except lmdb.Error as exc:  # a full disk: the store can still serve what it holds
        log.warning("the probe write at open failed (the store may be full): %s", exc)


def _check_entries(txn: lmdb.Transaction, db: lmdb._Database, name: bytes, num_walked: int) -> None:
    num_stated = int(txn.stat(db)["entries"])
    if num_walked != num_stated:
        raise UnreadableError(
            f"the {name.decode()} DB states {num_stated} entries but {num_walked} can be reached"
        )


def _move_aside(path: Path) -> Path:
    """Rename the LMDB files into a new ``corrupt-*`` folder of ``path`` (decision 5)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    destination = path / f"corrupt-{stamp}-{os.getpid()}"
    suffix = 0
    while destination.exists():
        suffix += 1
        destination = path / f"corrupt-{stamp}-{os.getpid()}-{suffix}"
    try:
        destination.mkdir()
        for name in _LMDB_FILE_NAMES:
            if (path / name).exists():
                os.replace(path / name, destination / name)
    except OSError as exc:
        raise ConfigError(
            f"disk path {path}: the LMDB store there is unreadable and could not be moved "
            f"aside ({exc}); move it away by hand"
        ) from exc
    return destination
