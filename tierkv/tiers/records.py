"""The on-disk record of one block: a checksummed header followed by the payload, split into
head and body for the DISK tier (``split_record``), and the *sealed* envelope of the small
records (namespace descriptors, sessions). A record is served only if its whole header matches;
anything else, and any seal that does not open, is unreadable, never misread.
Design: docs/design/integrity.md#3-a-record-is-served-only-if-all-of-its-header-matches
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

import msgpack
import numpy as np
import xxhash

from tierkv.buffers import BufferPool
from tierkv.checksums import copy_with_checksum, copy_with_checksums, value_digest
from tierkv.keys import RAW_BLOCK_KEY_BYTES
from tierkv.layout import KVLayout

MAGIC = b"TKV1"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sI")
_MAX_HEADER_BYTES = 4096
SEAL_MAGIC = b"TKS1"
_SEAL_PREFIX = struct.Struct("<4s8s")
# Copied, then hashed while still in the cache. Measured on DISK reads of 64 MiB (2 MiB L2 a
# core): 512 KiB ~ 256 KiB on one thread, and 10-15% faster than it on two; 1 MiB ~ 512 KiB
# on two, slower on one.
VERIFY_CHUNK_BYTES = 512 * 1024
# LMDB's page header (PAGEHDRSZ, 64-bit builds), which starts the first page of an overflow value.
LMDB_OVERFLOW_HEADER_BYTES = 16
# A record's head of at most this many bytes stays in a leaf page: LMDB moves a value to overflow
# pages when its node (8 B + key + value) passes ~2,038 B on 4 KiB pages.
HEAD_INLINE_MAX_BYTES = 1024


class RecordStatus(enum.Enum):
    """Outcome of reading one record."""

    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"


def _header(raw_key: bytes, fingerprint: str, payload_bytes: int, digest: bytes) -> bytes:
    header: bytes = msgpack.packb(
        {"v": FORMAT_VERSION, "k": raw_key, "fp": fingerprint, "n": payload_bytes, "c": digest}
    )
    return header


def encode_record(raw_key: bytes, fingerprint: str, payload: np.ndarray) -> tuple[bytearray, int]:
    """One record holding ``payload`` (flat uint8), ready to be written as one LMDB value, and
    the checksum (``tierkv.checksums``) of the payload it holds.

    The payload is copied and hashed in one pass; the header (fixed size, since the checksum is
    8 bytes) is written in front of it afterwards. The checksum is of the record's own copy:
    compare it with the block's known checksum before writing, so that bytes changed in the
    source meanwhile never become a record that verifies.
    """
    header_bytes = len(_header(raw_key, fingerprint, payload.size, bytes(8)))
    start = _PREFIX.size + header_bytes
    record = bytearray(start + payload.size)
    # One pass in cache-sized chunks: each is hashed right after it lands, while in the cache.
    value = copy_with_checksum([(np.frombuffer(record, np.uint8, offset=start), payload)],
                               VERIFY_CHUNK_BYTES)
    header = _header(raw_key, fingerprint, payload.size, value_digest(value))
    assert len(header) == header_bytes
    _PREFIX.pack_into(record, 0, MAGIC, header_bytes)
    record[_PREFIX.size : start] = header
    return record, value


def encode_records(raw_keys: Sequence[bytes], fingerprint: str, payloads: Sequence[np.ndarray],
                   buffers: BufferPool | None = None) -> list[tuple[bytearray, int]]:
    """``encode_record`` of many blocks, their copies and hashes spread over every core (as
    ``copy_with_checksums`` does); each record's checksum is of its own copy. ``buffers``:
    where the records' buffers come from (default: new ones)."""
    if len(payloads) < 2 and buffers is None:
        return [encode_record(raw, fingerprint, payload)
                for raw, payload in zip(raw_keys, payloads, strict=True)]
    starts: list[int] = []
    records: list[bytearray] = []
    for raw, payload in zip(raw_keys, payloads, strict=True):
        start = _PREFIX.size + len(_header(raw, fingerprint, payload.size, bytes(8)))
        starts.append(start)
        size = start + payload.size
        records.append(buffers.take(size, exact=True) if buffers is not None else bytearray(size))
    values = copy_with_checksums([
        [(np.frombuffer(record, np.uint8, offset=start), payload)]
        for record, start, payload in zip(records, starts, payloads, strict=True)
    ])
    for raw, record, start, payload, value in zip(raw_keys, records, starts, payloads, values,
                                                  strict=True):
        header = _header(raw, fingerprint, payload.size, value_digest(value))
        _PREFIX.pack_into(record, 0, MAGIC, len(header))
        record[_PREFIX.size : start] = header
    return list(zip(records, values, strict=True))


def record_size(raw_key: bytes, fingerprint: str, payload_bytes: int) -> int:
    """The exact size ``encode_record`` produces, without building it (for budget checks)."""
    return _PREFIX.size + len(_header(raw_key, fingerprint, payload_bytes, bytes(8))) + payload_bytes


def block_record_bytes(layout: KVLayout) -> int:
    """What one block of ``layout`` occupies in the DISK tier's budget: its whole record."""
    return record_size(bytes(RAW_BLOCK_KEY_BYTES), layout.fingerprint, layout.bytes_per_block)


def split_record(record: bytes | bytearray | memoryview,
                 page_bytes: int) -> tuple[memoryview, memoryview]:
    """``(head, body)`` of ``record``, stored as two LMDB values by the DISK tier: ``body`` the
    record's last bytes, as many as fill whole overflow pages of ``page_bytes`` (LMDB's page
    size) with the header LMDB puts in front of them, and ``head`` the rest, which always
    holds the whole record header. When the rest would be too large for a leaf page, ``body``
    is the whole payload (its last page then partly empty). A record that fits a leaf page is
    stored whole: ``head`` empty, ``body`` the record (one value, as before the split)."""
    view = memoryview(record)
    if len(view) < _PREFIX.size:
        raise ValueError("not a record")
    header_end = _PREFIX.size + _PREFIX.unpack_from(view, 0)[1]
    payload_bytes = len(view) - header_end
    fill = (payload_bytes + LMDB_OVERFLOW_HEADER_BYTES) // page_bytes * page_bytes \
        - LMDB_OVERFLOW_HEADER_BYTES
    if fill > 0 and len(view) - fill <= HEAD_INLINE_MAX_BYTES:
        body_bytes = fill
    elif len(view) <= HEAD_INLINE_MAX_BYTES:
        body_bytes = len(view)
    else:
        body_bytes = payload_bytes
    split = len(view) - body_bytes
    return view[:split], view[split:]


def verify_header(
    value: memoryview, raw_key: bytes, fingerprint: str, payload_bytes: int,
    body_bytes: int = 0,
) -> tuple[memoryview, bytes] | None:
    """``(payload, expected checksum)`` of ``value`` if its header matches what the reader
    expects, else None. The payload itself is not yet verified: see ``checksum``.

    ``body_bytes``: ``value`` is a record's head (``split_record``) and its body of this many
    bytes follows it; the payload returned is then the part of it in the head (the body is
    the rest)."""
    if len(value) < _PREFIX.size:
        return None
    magic, header_len = _PREFIX.unpack_from(value, 0)
    if magic != MAGIC or header_len > _MAX_HEADER_BYTES:
        return None
    start = _PREFIX.size + header_len
    if len(value) < start or len(value) + body_bytes != start + payload_bytes:
        return None
    try:
        header = msgpack.unpackb(value[_PREFIX.size : start])
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    if not isinstance(header, dict) or (
        header.get("v") != FORMAT_VERSION
        or header.get("k") != raw_key
        or header.get("fp") != fingerprint
        or header.get("n") != payload_bytes
    ):
        return None
    expected = header.get("c")
    if not isinstance(expected, bytes):
        return None
    return value[start:], expected


def verify_record(
    head: memoryview | None, body: memoryview, raw_key: bytes, fingerprint: str,
    payload_bytes: int,
) -> tuple[list[memoryview], bytes] | None:
    """``(payload parts, expected checksum)`` of a block record stored as ``head`` and ``body``
    (``split_record``; head None: stored whole) if its header matches what the reader expects,
    else None. The parts are the payload's bytes in order (empty ones left out); they are not
    yet verified against the checksum."""
    if head is None:
        verified = verify_header(body, raw_key, fingerprint, payload_bytes)
        return None if verified is None else ([verified[0]], verified[1])
    verified = verify_header(head, raw_key, fingerprint, payload_bytes, len(body))
    if verified is None:
        return None
    return [part for part in (verified[0], body) if len(part)], verified[1]


def _seal_digest(key: bytes, body: bytes | memoryview) -> bytes:
    # The key's length goes first, so that (key, body) pairs cannot collide by shifting bytes.
    hasher = xxhash.xxh3_64(struct.pack("<I", len(key)))
    hasher.update(key)
    hasher.update(body)
    digest: bytes = hasher.digest()
    return digest


def seal(key: bytes, body: bytes) -> bytes:
    """``body`` in a checksummed envelope bound to the LMDB ``key`` it is stored under."""
    return _SEAL_PREFIX.pack(SEAL_MAGIC, _seal_digest(key, body)) + body


def try_unseal(key: bytes, value: bytes | memoryview) -> bytes | None:
    """The body ``seal(key, body)`` wrapped, or None if ``value`` is not exactly that."""
    if len(value) < _SEAL_PREFIX.size:
        return None
    magic, digest = _SEAL_PREFIX.unpack_from(value, 0)
    body = value[_SEAL_PREFIX.size :]
    if magic != SEAL_MAGIC or digest != _seal_digest(key, body):
        return None
    return bytes(body)
