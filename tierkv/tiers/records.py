"""The on-disk record of one block: a checksummed header followed by the payload.

Layout: ``b"TKV1"`` | header length (u32, little endian) | msgpack header | payload.
The header holds the format version, the 48-byte key, the layout fingerprint, the payload length
and the xxh3-64 checksum of the payload. A record is served only if every one of those matches
what the reader expects; anything else (a torn write, a flipped byte, another layout, another
key) is a miss.
"""

from __future__ import annotations

import enum
import struct

import msgpack
import numpy as np
import xxhash

MAGIC = b"TKV1"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sI")
_MAX_HEADER_BYTES = 4096


class RecordStatus(enum.Enum):
    """Outcome of reading one record."""

    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"


def checksum(payload: memoryview | np.ndarray) -> bytes:
    """xxh3-64 of the payload, 8 bytes (tens of GB/s: never the bottleneck of a disk read).

    Bytes rather than an int so that the header, and so the record, has a fixed size.
    """
    digest: bytes = xxhash.xxh3_64_digest(payload)  # type: ignore[arg-type]  # ndarray is a buffer
    return digest


def encode_record(raw_key: bytes, fingerprint: str, payload: np.ndarray) -> bytearray:
    """One record holding ``payload`` (flat uint8), ready to be written as one LMDB value."""
    header = msgpack.packb(
        {
            "v": FORMAT_VERSION,
            "k": raw_key,
            "fp": fingerprint,
            "n": int(payload.size),
            "c": checksum(payload),
        }
    )
    record = bytearray(_PREFIX.size + len(header) + payload.size)
    _PREFIX.pack_into(record, 0, MAGIC, len(header))
    start = _PREFIX.size + len(header)
    record[_PREFIX.size : start] = header
    np.frombuffer(record, np.uint8, offset=start)[:] = payload
    return record


def record_size(header_key: bytes, fingerprint: str, payload_bytes: int) -> int:
    """The exact size ``encode_record`` produces, without building it (for budget checks)."""
    header = msgpack.packb(
        {"v": FORMAT_VERSION, "k": header_key, "fp": fingerprint, "n": payload_bytes,
         "c": bytes(8)}
    )
    return _PREFIX.size + len(header) + payload_bytes


def verify_header(
    value: memoryview, raw_key: bytes, fingerprint: str, payload_bytes: int
) -> tuple[memoryview, bytes] | None:
    """``(payload, expected checksum)`` of ``value`` if its header matches what the reader
    expects, else None. The payload itself is not yet verified: see ``checksum``."""
    if len(value) < _PREFIX.size:
        return None
    magic, header_len = _PREFIX.unpack_from(value, 0)
    if magic != MAGIC or header_len > _MAX_HEADER_BYTES:
        return None
    start = _PREFIX.size + header_len
    if len(value) != start + payload_bytes:
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


def decode_record(
    value: memoryview, raw_key: bytes, fingerprint: str, payload_bytes: int
) -> memoryview | None:
    """The verified payload of ``value``, or None when anything in it is wrong."""
    verified = verify_header(value, raw_key, fingerprint, payload_bytes)
    if verified is None:
        return None
    payload, expected = verified
    return payload if checksum(payload) == expected else None
