"""Block hashes, namespaces and block keys: what a block is stored under.

A block is named by ``BlockKey(namespace, block_hash)``. The namespace separates everything that
must never share KV (model, layout and dtype, TP rank and size, tenant); the block hash is the
chained content hash of the block's tokens (see ``tierkv.hashing``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from tierkv.errors import InvalidArgumentError
from tierkv.layout import KVLayout

BLOCK_HASH_BYTES = 32
NAMESPACE_ID_BYTES = 16
# A block's key on disk: its namespace id, then its hash.
RAW_BLOCK_KEY_BYTES = NAMESPACE_ID_BYTES + BLOCK_HASH_BYTES


class BlockHash(bytes):
    """A 32-byte chained block hash (SHA-256). Its own type so that it is never confused with
    payload bytes or a namespace id; it compares and hashes like the bytes it holds."""

    __slots__ = ()

    def __new__(cls, value: bytes | bytearray | memoryview) -> BlockHash:
        if len(value) != BLOCK_HASH_BYTES:
            raise InvalidArgumentError(
                f"a block hash is {BLOCK_HASH_BYTES} bytes, got {len(value)} bytes"
            )
        return super().__new__(cls, value)

    def __repr__(self) -> str:
        return f"BlockHash({self.hex()[:16]}…)"


class NamespaceId(bytes):
    """The 16-byte key prefix derived from a ``Namespace``."""

    __slots__ = ()

    def __new__(cls, value: bytes | bytearray | memoryview) -> NamespaceId:
        if len(value) != NAMESPACE_ID_BYTES:
            raise InvalidArgumentError(
                f"a namespace id is {NAMESPACE_ID_BYTES} bytes, got {len(value)} bytes"
            )
        return super().__new__(cls, value)

    def __repr__(self) -> str:
        return f"NamespaceId({self.hex()})"


DEFAULT_TENANT = "default"
"""The tenant of every call to a server without tokens, and of a ``Namespace`` by default."""

@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must never be mixed between cached blocks.

    Contract: two namespaces that differ in any field have different ``id`` values, so the same
    tokens cached for two tenants (or two layouts, or two TP ranks) are two different keys. In a
    server the tenant comes from the caller's credentials, never from the request.
    """

    model_id: str
    layout: KVLayout
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str = DEFAULT_TENANT
    id: NamespaceId = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise InvalidArgumentError("Namespace.model_id must not be empty")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgumentError(
                f"Namespace: tp_rank must be in [0, tp_size), got rank {self.tp_rank} "
                f"of size {self.tp_size}"
            )
        text = "\x00".join(
            (
                "tierkv-ns-v1",
                self.model_id,
                self.layout.fingerprint,
                str(self.tp_rank),
                str(self.tp_size),
                self.tenant,
            )
        )
        digest = hashlib.sha256(text.encode()).digest()[:NAMESPACE_ID_BYTES]
        object.__setattr__(self, "id", NamespaceId(digest))

    def with_tenant(self, tenant: str) -> Namespace:
        """The same namespace for another tenant (used by the server, from credentials)."""
        return Namespace(self.model_id, self.layout, self.tp_rank, self.tp_size, tenant)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """The full name of one stored block; ``raw`` is its 48-byte on-disk key."""

    namespace_id: NamespaceId
    block_hash: BlockHash

    @property
    def raw(self) -> bytes:
        """``namespace_id + block_hash`` (the LMDB key)."""
        return self.namespace_id + self.block_hash

    @classmethod
    def from_raw(cls, raw: bytes) -> BlockKey:
        """Inverse of ``raw``."""
        if len(raw) != RAW_BLOCK_KEY_BYTES:
            raise InvalidArgumentError(
                f"a raw block key is {RAW_BLOCK_KEY_BYTES} bytes, got {len(raw)}")
        return cls(NamespaceId(raw[:NAMESPACE_ID_BYTES]), BlockHash(raw[NAMESPACE_ID_BYTES:]))
