"""The embedded, in-process tiered store.

What is exported here is the store's public API: the server (``tierkv.service``) and every
other user import from this package only, never from its modules. Its errors are
``tierkv.errors``'s.
"""

from tierkv.store.clearing import ClearResult
from tierkv.store.inspection import BadRecord, DiskReport, NamespaceReport, inspect_disk
from tierkv.store.lease_writer import LeaseWriter
from tierkv.store.leases import ReadLease, WriteLease, received_blocks
from tierkv.store.sessions import SessionInfo
from tierkv.store.stats import (
    NamespaceStats,
    RemoteStats,
    StoreStats,
    TierStats,
    layout_label,
    parse_layout_label,
    route_label,
)
from tierkv.store.tiered import TieredStore
from tierkv.store.validation import check_lookup_hashes, check_out, check_ttl

__all__ = [
    "BadRecord",
    "ClearResult",
    "DiskReport",
    "LeaseWriter",
    "NamespaceReport",
    "NamespaceStats",
    "ReadLease",
    "RemoteStats",
    "SessionInfo",
    "StoreStats",
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
