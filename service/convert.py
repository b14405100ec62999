"""Wire messages <-> tierkv objects, server side (namespaces are in ``tierkv.codec``).

Only what the wire alone can get wrong is validated here; everything else is validated by the
store (and mapped to status codes in ``errors``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.config import Priority, Tier, WritePolicy
from tierkv.errors import InvalidArgumentError
from tierkv.paging import BlockExtents
from tierkv.store import StoreStats
from tierkv.store.leases import ReadLease, WriteLease
from tierkv.store.validation import check_lookup_hashes
from tierkv.wire import tierkv_pb2 as pb

_POLICIES: dict[int, WritePolicy | None] = {
    pb.WRITE_POLICY_UNSPECIFIED: None,
    pb.WRITE_POLICY_WRITE_BACK: WritePolicy.WRITE_BACK,
    pb.WRITE_POLICY_WRITE_THROUGH: WritePolicy.WRITE_THROUGH,
}
_PRIORITIES: dict[int, Priority] = {
    pb.PRIORITY_UNSPECIFIED: Priority.NORMAL,
    pb.PRIORITY_LOW: Priority.LOW,
    pb.PRIORITY_NORMAL: Priority.NORMAL,
    pb.PRIORITY_HIGH: Priority.HIGH,
    pb.PRIORITY_SESSION: Priority.SESSION,
}


def hashes_within(hashes: Sequence[bytes], max_hashes: int) -> Sequence[bytes]:
    """The request's hashes, checked for count only (for calls whose store method checks the
    lengths itself)."""
    if len(hashes) > max_hashes:
        raise InvalidArgumentError(
            f"{len(hashes)} hashes in one call; at most {max_hashes} (split the chain)"
        )
    return hashes


def hashes_from(hashes: Sequence[bytes], max_hashes: int) -> Sequence[bytes]:
    """The request's hashes (as given: no copy), checked for count and, with the store's own
    rule, length: before a Put's bytes are received, not after."""
    hashes_within(hashes, max_hashes)
    check_lookup_hashes(hashes)
    return hashes


def write_policy_from(value: int) -> WritePolicy | None:
    """None means the server's default."""
    if value not in _POLICIES:
        raise InvalidArgumentError(f"unknown write_policy {value}")
    return _POLICIES[value]


def priority_from(value: int) -> Priority:
    """Unspecified means normal."""
    if value not in _PRIORITIES:
        raise InvalidArgumentError(f"unknown priority {value}")
    return _PRIORITIES[value]


def ttl_from(value: float) -> float | None:
    """0 means no TTL (until unpinned / the default); the store checks the rest."""
    return None if value == 0 else value


def lease_to(lease: ReadLease | WriteLease, slab_id: bytes) -> pb.LeaseResponse:
    """The wire form of a lease in the slab ``slab_id``."""
    def blocks(items: list[BlockExtents]) -> list[pb.BlockExtents]:
        return [
            pb.BlockExtents(extents=[pb.Extent(offset=o, length=n) for o, n in extents])
            for extents in items
        ]

    if isinstance(lease, ReadLease):
        return pb.LeaseResponse(lease_id=lease.lease_id, num_blocks=len(lease.blocks),
                                blocks=blocks(lease.blocks), expires_in_s=lease.expires_in_s,
                                num_cached=lease.num_cached, slab_id=slab_id,
                                checksums=lease.checksums)
    return pb.LeaseResponse(lease_id=lease.lease_id, num_blocks=len(lease.write_indices),
                            blocks=blocks(lease.blocks), write_indices=lease.write_indices,
                            expires_in_s=lease.expires_in_s, slab_id=slab_id)


def stats_to(stats: StoreStats, num_leases: int) -> pb.StatsResponse:
    """The wire form of a stats snapshot."""
    tiers = [
        pb.TierStats(
            tier=tier.label, capacity_bytes=s.capacity_bytes, used_bytes=s.used_bytes,
            num_blocks=s.num_blocks, hits=s.hits, misses=s.misses, evictions=s.evictions,
            promotions_in=s.promotions_in, demotions_in=s.demotions_in,
        )
        for tier, s in stats.tiers.items()
    ]
    return pb.StatsResponse(
        tiers=tiers, num_namespaces=stats.num_namespaces, num_pinned=stats.num_pinned,
        promotions=stats.promotions, demotions=stats.demotions,
        failed_demotions=stats.failed_demotions, checksum_failures=stats.checksum_failures,
        puts=stats.puts, gets=stats.gets, num_leases=num_leases,
    )


def tier_counts(counts: dict[Tier, int]) -> dict[str, int]:
    """``LookupResponse`` fields from ``TieredStore.locate``."""
    return {
        "num_cached": sum(counts.values()),
        "num_gpu": counts[Tier.GPU],
        "num_host": counts[Tier.HOST],
        "num_disk": counts[Tier.DISK],
    }
