"""A presence table in shared memory: same-host clients answer small lookups without an RPC.
The server keeps one per-tenant 64-bit fingerprint per stored key (open addressing, writers under
the store's lock, a sequence number readers retry on); a hit is advice, a later get may miss.
Design: docs/design/paging.md#presence-in-shared-memory
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import secrets
from collections.abc import Sequence
from multiprocessing import shared_memory

import numpy as np

EMPTY = 0
_HEADER_WORDS = 4  # magic, sequence, number of slots, enabled
_MAGIC = 0x544B5650524553  # "TKVPRES"
_MAX_PROBE_RETRIES = 8


def fingerprint(tenant_key: bytes, core_id: bytes, block_hash: bytes) -> int:
    """The table value of one key (never EMPTY)."""
    digest = hashlib.blake2b(core_id + block_hash, key=tenant_key, digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1


class Fingerprinter:
    """``fingerprint`` of one namespace's keys (one tenant key, one core id), with the keyed
    hash of that prefix computed once: each key then costs the hash of its own bytes only."""

    __slots__ = ("_prefix",)

    def __init__(self, tenant_key: bytes, core_id: bytes) -> None:
        self._prefix = hashlib.blake2b(core_id, key=tenant_key, digest_size=8)

    def __call__(self, block_hash: bytes) -> int:
        hasher = self._prefix.copy()
        hasher.update(block_hash)
        return int.from_bytes(hasher.digest(), "little") | 1


class PresenceTable:
    """The server side: creates the segment and keeps it in step with the store's index.

    Not thread-safe: the store calls it under its lock. Its words are read and written through
    a ``memoryview`` of 64-bit items (aligned 8-byte stores, as the readers' numpy view
    expects), a third of numpy's cost per scalar: it runs for every block stored or dropped.
    """

    def __init__(self, num_slots: int, name: str) -> None:
        if num_slots & (num_slots - 1):
            raise ValueError("presence table slots must be a power of two")
        size_bytes = (_HEADER_WORDS + num_slots) * 8
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=size_bytes)
        self.name = self._shm.name
        self.num_slots = num_slots
        buffer = self._shm.buf
        assert buffer is not None
        words: np.ndarray = np.ndarray((_HEADER_WORDS + num_slots,), np.uint64, buffer=buffer)
        words[_HEADER_WORDS:].fill(EMPTY)
        words[:_HEADER_WORDS] = (_MAGIC, 0, num_slots, 1)
        del words
        items = buffer[:size_bytes].cast("Q")
        self._words: memoryview | None = items
        self._slots = items[_HEADER_WORDS:]
        self._mask = num_slots - 1
        self._num_live = 0
        self._secret = secrets.token_bytes(32)

    def tenant_key(self, tenant: str) -> bytes:
        """The fingerprint key of ``tenant`` (handed to that tenant's clients only)."""
        return hashlib.blake2b(tenant.encode(), key=self._secret, digest_size=16).digest()

    @property
    def enabled(self) -> bool:
        """False once the table was turned off for lack of room."""
        return self._words is not None and self._words[3] == 1

    def add(self, value: int) -> bool:
        """Record a key (by its fingerprint); False if the table is (now) turned off."""
        words = self._words
        if words is None or words[3] != 1:
            return False
        words[1] += 1  # odd: a change is under way (readers retry)
        if (self._num_live + 1) * 2 > self.num_slots:
            words[3] = 0
            words[1] += 1
            return False
        slots, mask = self._slots, self._mask
        index = value & mask
        while slots[index] != EMPTY:
            index = (index + 1) & mask
        slots[index] = value
        self._num_live += 1
        words[1] += 1
        return True

    def remove(self, value: int) -> None:
        """Forget a key: empty its slot, then shift back the entries after it in its probe run
        that would otherwise no longer be found."""
        words = self._words
        if words is None or words[3] != 1:
            return
        slots, mask = self._slots, self._mask
        hole = value & mask
        while slots[hole] != value:
            if slots[hole] == EMPTY:
                return
            hole = (hole + 1) & mask
        words[1] += 1
        slots[hole] = EMPTY
        index = hole
        while True:
            index = (index + 1) & mask
            current = slots[index]
            if current == EMPTY:
                break
            home = current & mask
            # The entry may stay if its home lies cyclically in (hole, index].
            stays = (hole < home <= index) if hole <= index else (home > hole or home <= index)
            if not stays:
                slots[hole] = current
                slots[index] = EMPTY
                hole = index
        self._num_live -= 1
        words[1] += 1

    def close(self) -> None:
        """Unmap and unlink the segment. Idempotent."""
        if self._words is None:
            return
        self._slots.release()
        self._words.release()
        self._words = None
        self._shm.close()
        with contextlib.suppress(FileNotFoundError):  # removed by hand, or by a sweep
            self._shm.unlink()


class PresenceView:
    """The client side: the table mapped read-only, probed for leading runs of keys."""

    def __init__(self, name: str, tenant_key: bytes, core_id: bytes | None = None) -> None:
        fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._words: np.ndarray = np.frombuffer(self._map, np.uint64)
        if int(self._words[0]) != _MAGIC:
            raise ValueError(f"/dev/shm/{name} is not a tierkv presence table")
        self._slots = self._words[_HEADER_WORDS:]
        self._mask = int(self._words[2]) - 1
        self.tenant_key = tenant_key

    def count_leading(self, core_id: bytes, hashes: Sequence[bytes]) -> int | None:
        """How many leading ``hashes`` are present, or None when the table cannot answer now
        (turned off, or changing under every retry): ask over RPC then."""
        values = [fingerprint(self.tenant_key, core_id, h) for h in hashes]
        return self.count_leading_values(values)

    def count_leading_values(self, values: Sequence[int]) -> int | None:
        """``count_leading`` for fingerprints computed already."""
        words, slots, mask = self._words, self._slots, self._mask
        for _ in range(_MAX_PROBE_RETRIES):
            if int(words[3]) != 1:
                return None
            sequence = int(words[1])
            if sequence & 1:
                continue
            count = 0
            for value in values:
                index, current = value & mask, EMPTY
                for _ in range(mask + 1):  # bounded even if it reads a change half made
                    current = int(slots[index])
                    if current in (value, EMPTY):
                        break
                    index = (index + 1) & mask
                if current != value:
                    break
                count += 1
            if int(words[1]) == sequence:
                return count
        return None

    def close(self) -> None:
        """Unmap (once no array view of it is left)."""
        del self._slots, self._words
        with contextlib.suppress(BufferError):
            self._map.close()
