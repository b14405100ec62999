"""tierkv: a tiered KV-cache store for LLM inference.

Blocks of K/V tensors, keyed by the chained content hash of their tokens, are kept across GPU
HBM, shared host memory and LMDB on local disk. The first rule: a hit returns exactly the bytes
stored under that key, or is a miss; never anything else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierkv.block_store import AsyncBlockStore, BlockStore
    from tierkv.client import AsyncClient, Client
    from tierkv.config import (
        DiskTierConfig,
        GpuTierConfig,
        HostTierConfig,
        Priority,
        StoreConfig,
        TenantShares,
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
        TenantTierStats,
        TieredStore,
        TierStats,
        WriteLease,
    )
    from tierkv.types import PutDetail, ResumedSession, SessionInfo

    def _conforming(store: TieredStore, client: Client, async_client: AsyncClient
                    ) -> tuple[BlockStore, BlockStore, AsyncBlockStore]:
        """mypy's proof that the three classes have ``BlockStore``'s calls (issue 44)."""
        return store, client, async_client

# Names are imported on first use (PEP 562): `import tierkv` alone, or a command such as
# `tierkv health` that needs none of them, does not pay for torch and the client (1.3 s here).
_MODULE_OF: dict[str, str] = {
    "AsyncBlockStore": "tierkv.block_store",
    "BlockStore": "tierkv.block_store",
    "AsyncClient": "tierkv.client",
    "Client": "tierkv.client",
    "DiskTierConfig": "tierkv.config",
    "GpuTierConfig": "tierkv.config",
    "HostTierConfig": "tierkv.config",
    "Priority": "tierkv.config",
    "StoreConfig": "tierkv.config",
    "TenantShares": "tierkv.config",
    "Tier": "tierkv.config",
    "WritePolicy": "tierkv.config",
    "AuthenticationError": "tierkv.errors",
    "CapacityError": "tierkv.errors",
    "ConfigError": "tierkv.errors",
    "DeadlineExceededError": "tierkv.errors",
    "DiskFullError": "tierkv.errors",
    "DiskIOError": "tierkv.errors",
    "IntegrityError": "tierkv.errors",
    "InvalidArgumentError": "tierkv.errors",
    "LeaseNotFoundError": "tierkv.errors",
    "LeaseStateError": "tierkv.errors",
    "NotFoundError": "tierkv.errors",
    "PermissionDeniedError": "tierkv.errors",
    "ServiceUnavailableError": "tierkv.errors",
    "SessionNotFoundError": "tierkv.errors",
    "StaleSlabError": "tierkv.errors",
    "StoreClosedError": "tierkv.errors",
    "TierKVError": "tierkv.errors",
    "UnknownNamespaceError": "tierkv.errors",
    "ExtraKeys": "tierkv.hashing",
    "MultiModalItem": "tierkv.hashing",
    "block_hashes": "tierkv.hashing",
    "BlockHash": "tierkv.keys",
    "BlockKey": "tierkv.keys",
    "Namespace": "tierkv.keys",
    "NamespaceId": "tierkv.keys",
    "DType": "tierkv.layout",
    "KVLayout": "tierkv.layout",
    "ClearResult": "tierkv.store",
    "NamespaceStats": "tierkv.store",
    "ReadLease": "tierkv.store",
    "StoreStats": "tierkv.store",
    "TenantTierStats": "tierkv.store",
    "TieredStore": "tierkv.store",
    "TierStats": "tierkv.store",
    "WriteLease": "tierkv.store",
    "PutDetail": "tierkv.types",
    "ResumedSession": "tierkv.types",
    "SessionInfo": "tierkv.types",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_OF])


__all__ = [
    "AsyncBlockStore",
    "AsyncClient",
    "BlockStore",
    "ResumedSession",
    "SessionInfo",
    "PutDetail",
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
    "TenantShares",
    "TenantTierStats",
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
