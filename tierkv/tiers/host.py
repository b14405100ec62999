"""HOST tier: a paged slab in POSIX shared memory, pre-faulted, pinned for CUDA when present,
so same-host clients can map it. The segment is held under a ``flock`` for the slab's life; a new
slab first sweeps the segments (and companions) of servers that are gone.
Design: docs/design/paging.md#the-host-slab
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from multiprocessing import shared_memory

import numpy as np
import torch
from tqdm import tqdm

from tierkv.config import HostTierConfig, MiB
from tierkv.errors import ConfigError
from tierkv.shm.segments import SEGMENT_PREFIX, SHM_DIR, hold_lock, remove_stale_segments, sweep_lock
from tierkv.tiers.paged import PagedSlab

log = logging.getLogger(__name__)

_PREFAULT_CHUNK_BYTES = 64 * MiB
_PROGRESS_FROM_BYTES = 512 * MiB


class HostSlab(PagedSlab):
    """The HOST tier's slab. ``shm_name`` is what a client passes to ``SharedMemory(name)``."""

    def __init__(self, config: HostTierConfig, show_progress: bool = False) -> None:
        num_pages = config.capacity_bytes // config.page_bytes
        size_bytes = num_pages * config.page_bytes
        name = config.shm_name or f"{SEGMENT_PREFIX}{secrets.token_hex(6)}"
        self._lock_fd: int | None = None
        with sweep_lock():
            remove_stale_segments(name)
            if config.prefault:
                _check_room(size_bytes)
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
            self._lock_fd = hold_lock(SHM_DIR / self._shm.name)
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


def _check_room(size_bytes: int) -> None:
    """``ConfigError`` when ``/dev/shm`` has less room than ``size_bytes``. Checked before the
    segment is made: the pre-fault of a slab larger than the room left would end the process
    with SIGBUS, and Python 3.11's ``SharedMemory`` answers a failed ``ftruncate`` with a
    resource-tracker traceback after the error."""
    try:
        fs = os.statvfs(SHM_DIR)
    except OSError:  # no /dev/shm to ask: SharedMemory will say what is wrong
        return
    room_bytes = fs.f_bavail * fs.f_frsize
    if size_bytes > room_bytes:
        raise ConfigError(
            f"host capacity_bytes: {size_bytes} bytes of shared memory asked for, {room_bytes} "
            f"free in {SHM_DIR}; lower --host-bytes or enlarge /dev/shm"
        )
