"""The embedded, in-process tiered store.

What is exported here is the store's public API: the server (``tierkv.service``) and every
other user import from this package only, never from its modules. Its errors are
``tierkv.errors``'s.
"""

from tierkv.checks import check_lookup_hashes, check_out, check_ttl
from tierkv.store.events import (
    CLEARED,
    REMOTE_TIER,
    REMOVED,
    SNAPSHOT,
    STORED,
    EventLog,
    EventRecord,
    Snapshot,
    StoredBlock,
)
from tierkv.store.inspection import BadRecord, DiskReport, NamespaceReport, inspect_disk
from tierkv.store.leases import LeaseWriter, ReadLease, WriteLease, received_blocks
from tierkv.store.tiered import TieredStore
from tierkv.store.tokens import BlockTokens, extra_key, lora_name, token_ids
from tierkv.types import (
    ClearResult,
    NamespaceStats,
    RemoteStats,
    SessionInfo,
    StoreStats,
    TenantTierStats,
    TierStats,
    layout_label,
    parse_layout_label,
    route_label,
)

__all__ = [
    "CLEARED",
    "REMOTE_TIER",
    "REMOVED",
    "SNAPSHOT",
    "STORED",
    "BadRecord",
    "EventLog",
    "EventRecord",
    "Snapshot",
    "StoredBlock",
    "BlockTokens",
    "extra_key",
    "lora_name",
    "token_ids",
    "ClearResult",
    "DiskReport",
    "LeaseWriter",
    "NamespaceReport",
    "NamespaceStats",
    "ReadLease",
    "RemoteStats",
    "SessionInfo",
    "StoreStats",
    "TenantTierStats",
    "TierStats",
    "TieredStore",
    "WriteLease",
    "check_lookup_hashes",
    "check_out",
    "check_ttl",
    "inspect_disk",
    "layout_label",
    "parse_layout_label",
    "received_blocks",
    "route_label",
]
