"""The REMOTE tier's Redis keys: ``tkv:1:{<tag>}:<namespace id hex>:<block hash hex>``.

The namespace id covers model, layout, TP rank/size and tenant, so a tenant's key can never
name another tenant's block. The tag (the first two bytes of the block hash, in hex) is what
Redis hashes to place the key: block hashes are uniform, so keys spread over every slot, and the
slots of 8,192 keys are one table lookup (65,536 tags) instead of 8,192 CRCs in Python. Keys
are built as numpy rows, without a Python step per key.
"""

from __future__ import annotations

import binascii
from collections.abc import Sequence

import numpy as np

from tierkv.keys import NAMESPACE_ID_BYTES, RAW_BLOCK_KEY_BYTES

KEY_PREFIX = b"tkv:1:"
NUM_SLOTS = 16384
# Key layout (see the module docstring): prefix, "{tag}:" (tag: the first 2 hash bytes in hex), namespace id
# hex, ":", block hash hex.
_TAG_AT = len(KEY_PREFIX) + 1
_NS_AT = _TAG_AT + 4 + 2
_HASH_AT = _NS_AT + 2 * NAMESPACE_ID_BYTES + 1
KEY_BYTES = _HASH_AT + 2 * (RAW_BLOCK_KEY_BYTES - NAMESPACE_ID_BYTES)
# The slot of each of the 65,536 tags: a key's slot is the CRC16 of its tag alone.
_TAG_SLOTS = np.array([binascii.crc_hqx(b"%04x" % tag, 0) % NUM_SLOTS for tag in range(1 << 16)],
                      dtype=np.int32)
# One key as a RESP bulk string: "$110\r\n" key "\r\n".
BULK_HEAD = b"$%d\r\n" % KEY_BYTES
BULK_BYTES = len(BULK_HEAD) + KEY_BYTES + 2


_HASH_BYTES = RAW_BLOCK_KEY_BYTES - NAMESPACE_ID_BYTES


def _key_rows(namespace_hex: np.ndarray, hashes: bytes, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys (one ``KEY_BYTES`` row each) and slots of ``count`` hashes joined in ``hashes``
    under the namespace ids whose hex is ``namespace_hex`` (one row, or one per hash)."""
    hashed = np.frombuffer(hashes, np.uint8).reshape(count, _HASH_BYTES)
    hexed = np.frombuffer(hashes.hex().encode(), np.uint8).reshape(count, 2 * _HASH_BYTES)
    keys = np.empty((count, KEY_BYTES), np.uint8)
    keys[:, : len(KEY_PREFIX)] = np.frombuffer(KEY_PREFIX, np.uint8)
    keys[:, _TAG_AT - 1] = ord("{")
    keys[:, _TAG_AT : _TAG_AT + 4] = hexed[:, :4]
    keys[:, _TAG_AT + 4 : _NS_AT] = np.frombuffer(b"}:", np.uint8)
    keys[:, _NS_AT : _HASH_AT - 1] = namespace_hex
    keys[:, _HASH_AT - 1] = ord(":")
    keys[:, _HASH_AT:] = hexed
    slots: np.ndarray = _TAG_SLOTS[hashed[:, 0].astype(np.int32) << 8 | hashed[:, 1]]
    return keys, slots


def block_keys(namespace_id: bytes, hashes: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The Redis keys and slots of one namespace's block hashes, built without a Python step
    per key (a Lookup of 8,192 hashes names 8,192 keys): the namespace's hex is one row."""
    namespace_hex = np.frombuffer(namespace_id.hex().encode(), np.uint8)
    return _key_rows(namespace_hex, b"".join(hashes), len(hashes))


def raw_block_keys(raw_keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """``block_keys`` of 48-byte raw block keys (namespace id + hash), any namespaces."""
    count = len(raw_keys)
    raw = np.frombuffer(b"".join(raw_keys), np.uint8).reshape(count, RAW_BLOCK_KEY_BYTES)
    namespace_hex = np.frombuffer(raw[:, :NAMESPACE_ID_BYTES].tobytes().hex().encode(),
                                  np.uint8).reshape(count, 2 * NAMESPACE_ID_BYTES)
    return _key_rows(namespace_hex, raw[:, NAMESPACE_ID_BYTES:].tobytes(), count)


def key_matrix(raw_keys: Sequence[bytes]) -> np.ndarray:
    """The Redis keys of 48-byte raw block keys, one ``KEY_BYTES`` row each."""
    return raw_block_keys(raw_keys)[0]


def key_slots(raw_keys: Sequence[bytes]) -> np.ndarray:
    """The cluster slot of each raw block key's Redis key (from its tag, via ``_TAG_SLOTS``)."""
    return raw_block_keys(raw_keys)[1]



def remote_key(raw_key: bytes) -> bytes:
    """The Redis key of one 48-byte raw block key (see the module docstring)."""
    return key_matrix([raw_key]).tobytes()
