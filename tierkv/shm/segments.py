"""The files tierkv keeps in ``/dev/shm``: their names, their locks, and sweeping the stale ones.

A HOST slab is a segment ``tierkv-<id>`` held under an exclusive ``flock`` for the life of its
server; beside it live ``<slab>-presence`` (the presence table) and ``<slab>-client-<id>`` (the
lock files of same-host clients, ``tierkv.shm.liveness``). A process that is SIGKILLed never
unlinks, so a new slab first removes every segment whose lock is free (its server is gone: the
kernel drops the lock with the process), with its companions. Creation and the sweep both run
under one lock file, so that a sweep never sees a file between its creation and its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "tierkv-"
_SWEEP_LOCK = "tierkv.sweep.lock"


@contextlib.contextmanager
def sweep_lock() -> Iterator[None]:
    """Serialises the creation of segments and lock files (slabs here, clients' lock files in
    ``tierkv.shm.liveness``) with sweeping, among the processes of this host: a sweep never
    sees a file between its creation and its lock."""
    # Read-only is enough for flock, and lets every user of the host take it.
    fd = os.open(SHM_DIR / _SWEEP_LOCK, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def hold_lock(path: Path) -> int:
    """An open descriptor of ``path`` holding an exclusive flock (kept until closed)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def try_lock(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` without waiting; False if someone else holds one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _is_free(path: Path) -> bool:
    """Whether nobody holds a flock on ``path`` (False if it cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return try_lock(fd)
    finally:
        os.close(fd)


def remove_stale_segments(name: str = "") -> list[str]:
    """Remove the shared-memory segments of servers that are gone (see the module docstring),
    and a segment named ``name`` if its server is gone; returns what was removed."""
    removed: list[str] = []
    try:
        names = sorted(entry.name for entry in os.scandir(SHM_DIR))
    except OSError:
        return removed
    slabs = {n for n in names if (n.startswith(SEGMENT_PREFIX) or n == name)
             and not n.endswith("-presence") and "-client-" not in n and n != _SWEEP_LOCK}
    gone = {slab for slab in slabs if _is_free(SHM_DIR / slab)}
    for entry in names:
        base = entry.removesuffix("-presence").split("-client-")[0]
        if base not in slabs and not entry.startswith(SEGMENT_PREFIX):
            continue  # not ours
        # A client lock file is stale when its own lock is free; the rest with their slab.
        own_lock = "-client-" in entry
        if _is_free(SHM_DIR / entry) if own_lock else base in gone or base not in slabs:
            with contextlib.suppress(OSError):
                (SHM_DIR / entry).unlink()
                removed.append(entry)
    if removed:
        log.warning("removed %d shared-memory segments left by servers that are gone: %s",
                    len(removed), ", ".join(removed[:8]))
    return removed
