"""HOST tier: a paged slab in POSIX shared memory, pre-faulted, pinned for CUDA when present.

Shared memory (``/dev/shm``) lets same-host clients map the slab and copy blocks without going
through a socket. The segment is created at start and unlinked at close.

A process that is SIGKILLed (systemd does that when a stop times out) never unlinks, and a
production slab is tens of GiB. So the slab's segment is held under an exclusive ``flock`` for
the slab's life, and a new slab first removes every ``tierkv-`` segment whose lock is free: its
server is gone (the kernel drops the lock with the process). Its companions (``-presence``, and
``-client-*`` lock files whose own lock is free) go with it. Creation and the sweep both run
under one lock file, so that a sweep never sees a segment between its creation and its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from tierkv.config import HostTierConfig, MiB
from tierkv.errors import ConfigError
from tierkv.tiers.paged import PagedSlab

log = logging.getLogger(__name__)

_PREFAULT_CHUNK_BYTES = 64 * MiB
_PROGRESS_FROM_BYTES = 512 * MiB
SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "tierkv-"
_SWEEP_LOCK = "tierkv.sweep.lock"


class HostSlab(PagedSlab):
    """The HOST tier's slab. ``shm_name`` is what a client passes to ``SharedMemory(name)``."""

    def __init__(self, config: HostTierConfig, show_progress: bool = False) -> None:
        num_pages = config.capacity_bytes // config.page_bytes
        size_bytes = num_pages * config.page_bytes
        name = config.shm_name or f"{SEGMENT_PREFIX}{secrets.token_hex(6)}"
        self._lock_fd: int | None = None
        with sweep_lock():
            remove_stale_segments(name)
            try:
                self._shm = shared_memory.SharedMemory(name=name, create=True, size=size_bytes)
            except FileExistsError:
                raise ConfigError(
                    f"host shm_name: a shared-memory segment named {name!r} already exists and "
                    "its server is alive; pick another name"
                ) from None
            except OSError as exc:
                raise ConfigError(
                    f"host capacity_bytes: cannot create {size_bytes} bytes of shared memory "
                    f"({exc}); lower --host-bytes or enlarge /dev/shm"
                ) from exc
            self._lock_fd = _hold_lock(SHM_DIR / self._shm.name)
        self.shm_name = self._shm.name
        # New for every slab: a lease names it, so that a client mapping of an earlier slab
        # (of a server that restarted) is refused instead of written through.
        self.slab_id = secrets.token_bytes(16)
        self._array: np.ndarray | None = np.ndarray((size_bytes,), np.uint8, buffer=self._shm.buf)
        super().__init__(torch.from_numpy(self._array), config.page_bytes)
        if config.prefault:
            self._prefault(show_progress and size_bytes >= _PROGRESS_FROM_BYTES)
        self._cuda_registered = _cuda_host_register(self.tensor)

    @property
    def pinned(self) -> bool:
        """Whether the slab is registered with CUDA (page-locked)."""
        return self._cuda_registered

    def _prefault(self, show_progress: bool) -> None:
        # First writes to fresh shared-memory pages are ~30x slower than rewrites; pay once here.
        assert self._array is not None
        size = self._array.size
        with tqdm(
            total=size, unit="B", unit_scale=True, desc="pre-faulting host slab",
            disable=not show_progress,
        ) as bar:
            for offset in range(0, size, _PREFAULT_CHUNK_BYTES):
                chunk = self._array[offset : offset + _PREFAULT_CHUNK_BYTES]
                chunk.fill(0)
                bar.update(chunk.size)

    def close(self) -> None:
        """Unpin, unmap and unlink the segment. Idempotent."""
        if self._array is None:
            return
        if self._cuda_registered:
            torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
                self.tensor.data_ptr()
            )
        super().close()
        self._array = None
        try:
            self._shm.close()
        except BufferError:
            # A view is still alive somewhere; the mapping goes when it does.
            log.warning("host slab %s still has live views at close", self.shm_name)
        with contextlib.suppress(FileNotFoundError):  # removed by hand, or by a sweep
            self._shm.unlink()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


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


def _hold_lock(path: Path) -> int:
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


def _cuda_host_register(tensor: torch.Tensor) -> bool:
    """Pin the slab for fast, asynchronous GPU copies, when CUDA is present."""
    if not torch.cuda.is_available() or tensor.numel() == 0:
        return False
    result = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
        tensor.data_ptr(), tensor.numel(), 0
    )
    if int(result) != 0:
        log.warning("cudaHostRegister of the host slab failed (%s); copies will be slower", result)
        return False
    return True
