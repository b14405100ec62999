"""Whether a same-host client is still alive: the flock it holds on its lock file.
``ALIVE`` (lock held: its expired write leases stay quarantined), ``GONE`` (lock free: its leases
are reclaimed), ``UNKNOWN`` (no file: lease TTLs alone decide, the checksums catch a late write).
Design: docs/design/leases.md#5-a-stalled-writer-keeps-its-pages-quarantined
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path

from tierkv.shm.segments import SHM_DIR, sweep_lock, try_lock

_CLIENT_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
# A live client is probed again after this long (a probe is three system calls).
_PROBE_INTERVAL_S = 0.25
_MAX_KNOWN = 65536


class Liveness(enum.Enum):
    """What a client's lock file says."""

    ALIVE = "alive"
    GONE = "gone"
    UNKNOWN = "unknown"


def client_lock_path(prefix: str, client_id: str) -> Path | None:
    """The lock file of ``client_id`` (None for an id that cannot name a file safely)."""
    if not prefix or not _CLIENT_ID.fullmatch(client_id):
        return None
    return SHM_DIR / f"{prefix}{client_id}"


class ClientWatch:
    """Probes the lock files of lease holders (an answer other than ``GONE`` is kept for
    ``_PROBE_INTERVAL_S``: the probe runs under the store's lock)."""

    def __init__(self, prefix: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.prefix = prefix
        self._clock = clock
        self._known: dict[str, tuple[float, Liveness]] = {}
        self._inodes: dict[str, int] = {}  # of the lock file each live client was seen holding

    def state(self, client_id: str) -> Liveness:
        """``client_id``'s liveness now."""
        path = client_lock_path(self.prefix, client_id)
        if path is None:
            return Liveness.UNKNOWN
        now = self._clock()
        known = self._known.get(client_id)
        if known is not None and known[0] > now:
            return known[1]
        state, inode = _probe(path, self._inodes.get(client_id))
        if len(self._known) > _MAX_KNOWN:
            self._known.clear()
            self._inodes.clear()
        if state is Liveness.GONE:
            self._known.pop(client_id, None)
            self._inodes.pop(client_id, None)
        else:
            self._known[client_id] = (now + _PROBE_INTERVAL_S, state)
            if state is Liveness.ALIVE:
                self._inodes[client_id] = inode
        return state

    def forget_all(self) -> None:
        """Drop every kept answer: the next ``state`` of each client probes its file."""
        self._known.clear()


def _probe(path: Path, inode: int | None) -> tuple[Liveness, int]:
    """The liveness a lock file says, and its inode. Only a regular file counts and, once a
    client was seen alive, only the file it locked (``inode``): a file another process puts
    in its place says nothing of that client."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return Liveness.UNKNOWN, 0
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or inode not in (None, status.st_ino):
            return Liveness.UNKNOWN, 0
        if not try_lock(fd):
            return Liveness.ALIVE, status.st_ino
        with contextlib.suppress(OSError):
            path.unlink()  # under our lock: a new holder would have made a new file
    finally:
        os.close(fd)
    return Liveness.GONE, status.st_ino


class ClientLock:
    """The client side: hold the lock file of ``client_id`` until ``close``."""

    def __init__(self, prefix: str, client_id: str) -> None:
        path = client_lock_path(prefix, client_id)
        if path is None:
            raise ValueError(f"client id {client_id!r} cannot name a lock file")
        self.path = path
        with sweep_lock():  # a server's sweep must not remove the file before it is locked
            self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if not try_lock(self._fd):
                os.close(self._fd)
                self._fd = None
                raise ValueError(f"{path} is locked by another client with the same id")

    def close(self, unlink: bool = True) -> None:
        """Let the lock go (after the slab is unmapped), removing the file first unless
        ``unlink`` is False: a client closed in the middle of a lease leaves the file, so that
        the server finds it unlocked (the client is gone) rather than missing (unknown) and
        takes its leases back at once; the server removes it then. Idempotent."""
        if self._fd is None:
            return
        if unlink:
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = None
