"""What ``TieredStore.stats()`` and ``namespace_stats()`` return (the types: ``tierkv.types``):
snapshots of the books and counters, costing O(tiers + namespaces), never O(blocks).
Design: docs/design/operations.md#stats
"""
from __future__ import annotations

from collections.abc import Sized

from tierkv.keys import Namespace
from tierkv.store.core import StoreCore
from tierkv.store.leases import Leases
from tierkv.types import NamespaceStats, RemoteStats, StoreStats, TenantTierStats, TierStats


def snapshot(core: StoreCore, leases: Sized, num_sessions: int,
             remote: RemoteStats | None = None) -> StoreStats:
    """Every tier's bytes, blocks and counters, read under the store lock (consistent);
    ``leases``: the lease table (its size is read under the lock too); ``remote``: the REMOTE
    tier's figures (read under its own lock)."""
    with core.lock:
        tiers = {
            tier: TierStats(
                tier, ledger.capacity_bytes, ledger.used_bytes, ledger.num_blocks,
                ledger.counters.hits, ledger.counters.misses, ledger.counters.evictions,
                ledger.counters.promotions_in, ledger.counters.demotions_in, ledger.stored_bytes,
            )
            for tier, ledger in sorted(core.ledgers.items())
        }
        c = core.counters
        return StoreStats(
            tiers, len(core.namespaces), len(core.pins), c.promotions, c.demotions,
            c.failed_demotions, c.checksum_failures, c.puts, c.gets, dict(c.bytes_moved),
            len(leases), c.leases_expired, num_sessions, remote,
        )


def namespace_snapshot(
    core: StoreCore, sessions: dict[bytes, tuple[Namespace, int]], tenant: str | None
) -> list[NamespaceStats]:
    """Each namespace (of ``tenant``, or everyone's) that is registered or named by a session
    (``sessions``: id -> (namespace, sessions held)), largest ``stored_bytes`` first (ties by
    tenant, model id). O(namespaces)."""
    found: dict[bytes, NamespaceStats] = {}
    with core.lock:
        for namespace_id, state in core.namespaces.items():
            namespace = state.namespace
            if tenant is None or namespace.tenant == tenant:
                num_blocks = len(state.blocks)
                _, num_sessions = sessions.get(namespace_id, (namespace, 0))
                found[namespace_id] = NamespaceStats(namespace, num_blocks,
                                                     num_blocks * state.block_bytes, num_sessions)
    for namespace_id, (namespace, num_sessions) in sessions.items():
        if namespace_id not in found and (tenant is None or namespace.tenant == tenant):
            found[namespace_id] = NamespaceStats(namespace, 0, 0, num_sessions)
    return sorted(found.values(), key=lambda s: (-s.stored_bytes, s.namespace.tenant,
                                                 s.namespace.model_id))


def tenant_view(core: StoreCore, leases: Leases, num_sessions: int, tenant: str) -> StoreStats:
    """``tenant``'s own view of the store (``StoreStats.tenant``), under the store lock;
    ``leases``: the lease table; ``num_sessions``: the tenant's sessions.
    O(tiers + namespaces + pins + leases)."""
    with core.lock:
        shares = {tier: ledger.shares.of(tenant) for tier, ledger in sorted(core.ledgers.items())}
        tiers = {
            tier: TierStats(tier, s.cap_bytes, s.used_bytes, s.num_blocks, s.hits, s.misses,
                            s.evictions, s.promotions_in, s.demotions_in, s.stored_bytes)
            for tier, s in shares.items()
        }
        counters = core.counters_of_locked(tenant)
        return StoreStats(
            tiers,
            sum(1 for state in core.namespaces.values() if state.namespace.tenant == tenant),
            sum(1 for entry in core.pins.entries() if entry.ns.namespace.tenant == tenant),
            sum(t.promotions_in for t in tiers.values()),
            sum(t.demotions_in for t in tiers.values()),
            0, counters.checksum_failures, counters.puts, counters.gets, {},
            leases.num_of_locked(tenant), 0,
            num_sessions, None, tenant,
        )


def tenant_snapshot(core: StoreCore, tenant: str | None) -> list[TenantTierStats]:
    """Each tenant's (``tenant``'s, or everyone's known to the books) share of each tier, by
    tenant then tier. O(tenants x tiers)."""
    with core.lock:
        return sorted(
            (TenantTierStats(share.tenant, tier, share.share_bytes, share.cap_bytes,
                             share.used_bytes, share.evicted_by_others, share.num_blocks,
                             share.stored_bytes, share.hits, share.misses, share.evictions,
                             share.promotions_in, share.demotions_in)
             for tier, ledger in core.ledgers.items()
             for share in ([ledger.shares.of(tenant)] if tenant is not None
                           else ledger.shares.shares.values())),
            key=lambda s: (s.tenant, s.tier))
