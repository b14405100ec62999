"""tierkv: a tiered KV-cache store for LLM inference.

Blocks of K/V tensors, keyed by the chained content hash of their tokens, are kept across GPU
HBM, shared host memory and LMDB on local disk. The first rule: a hit returns exactly the bytes
stored under that key, or is a miss; never anything else.
"""

from tierkv.client import AsyncClient, Client
from tierkv.config import (
    DiskTierConfig,
    GpuTierConfig,
    HostTierConfig,
    Priority,
    StoreConfig,
    Tier,
    WritePolicy,
)
from tierkv.errors import (
    AuthenticationError,
    CapacityError,
    ConfigError,
    DeadlineExceededError,
    DiskFullError,
    DiskIOError,
    IntegrityError,
    InvalidArgumentError,
    LeaseNotFoundError,
    LeaseStateError,
    NotFoundError,
    PermissionDeniedError,
    ServiceUnavailableError,
    SessionNotFoundError,
    StaleSlabError,
    StoreClosedError,
    TierKVError,
    UnknownNamespaceError,
)
from tierkv.hashing import ExtraKeys, MultiModalItem, block_hashes
from tierkv.keys import BlockHash, BlockKey, Namespace, NamespaceId
from tierkv.layout import DType, KVLayout
from tierkv.store import (
    ClearResult,
    NamespaceStats,
    ReadLease,
    StoreStats,
    TieredStore,
    TierStats,
    WriteLease,
)

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "BlockHash",
    "BlockKey",
    "CapacityError",
    "ClearResult",
    "Client",
    "ConfigError",
    "DType",
    "DeadlineExceededError",
    "DiskFullError",
    "DiskIOError",
    "DiskTierConfig",
    "ExtraKeys",
    "GpuTierConfig",
    "HostTierConfig",
    "IntegrityError",
    "InvalidArgumentError",
    "KVLayout",
    "NamespaceStats",
    "LeaseNotFoundError",
    "LeaseStateError",
    "MultiModalItem",
    "Namespace",
    "NotFoundError",
    "PermissionDeniedError",
    "NamespaceId",
    "Priority",
    "ReadLease",
    "ServiceUnavailableError",
    "SessionNotFoundError",
    "StaleSlabError",
    "StoreClosedError",
    "StoreConfig",
    "StoreStats",
    "Tier",
    "TierKVError",
    "TierStats",
    "TieredStore",
    "UnknownNamespaceError",
    "WriteLease",
    "WritePolicy",
    "block_hashes",
]

__version__ = "0.1.0"
