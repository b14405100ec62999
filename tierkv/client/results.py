"""What the client's calls give back, where the wire's message is not the answer itself.

``Client.stats()`` answers with the same type as ``TieredStore.stats()`` (``StoreStats``), and
what only a server reports with it: its largest namespaces. ``clear`` answers with
``tierkv.types.ClearResult`` (as ``TieredStore.clear``), ``lookup_detail`` with
``tierkv.wire.convert.LookupDetail``, ``describe`` with ``tierkv.wire.convert.ServerInfo``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tierkv.types import NamespaceStats, StoreStats, TenantTierStats


@dataclass(frozen=True, slots=True)
class ServerStats(StoreStats):
    """A server's ``StoreStats`` (``num_leases``: the shared-memory leases open on it, read and
    write, every client's, 0 once every put and get has finished) and ``namespaces``: its
    largest namespaces by stored bytes, largest first (at most the ``max_namespaces`` asked
    for; only the caller's own tenant's unless the server names it an admin tenant; empty
    from a server older than this field); ``tenants``: each tenant's share of each tier, the
    caller's own tenant's only unless it is an admin tenant (empty from an older server)."""

    namespaces: tuple[NamespaceStats, ...] = ()
    tenants: tuple[TenantTierStats, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """``StoreStats.as_dict`` with each namespace as plain data too (for JSON)."""
        data = StoreStats.as_dict(self)  # (not super(): a slots dataclass has no __class__ cell)
        data["namespaces"] = [n.as_dict() for n in self.namespaces]
        data["tenants"] = [{**asdict(t), "tier": t.tier.label} for t in self.tenants]
        return data
