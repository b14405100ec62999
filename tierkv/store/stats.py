"""What ``TieredStore.stats()`` returns: a snapshot of the books and the counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tierkv.config import Tier
from tierkv.store.books import StoreCore


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier at one instant. ``used_bytes`` counts reserved in-flight copies too, and never
    exceeds ``capacity_bytes``."""

    tier: Tier
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int
    misses: int
    evictions: int
    promotions_in: int
    demotions_in: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    """The whole store at one instant."""

    tiers: dict[Tier, TierStats]
    num_namespaces: int
    num_pinned: int
    promotions: int
    demotions: int
    failed_demotions: int
    checksum_failures: int
    puts: int
    gets: int

    def as_dict(self) -> dict[str, Any]:
        """Plain data (tier names as keys), for JSON and the wire."""
        data = asdict(self)
        data["tiers"] = {
            tier.label: {k: v for k, v in asdict(stats).items() if k != "tier"}
            for tier, stats in self.tiers.items()
        }
        return data


def snapshot(core: StoreCore) -> StoreStats:
    """Every tier's bytes, blocks and counters, read under the store lock (consistent)."""
    with core.lock:
        tiers = {
            tier: TierStats(
                tier, ledger.capacity_bytes, ledger.used_bytes, ledger.num_blocks,
                ledger.counters.hits, ledger.counters.misses, ledger.counters.evictions,
                ledger.counters.promotions_in, ledger.counters.demotions_in,
            )
            for tier, ledger in sorted(core.ledgers.items())
        }
        c = core.counters
        return StoreStats(
            tiers, len(core.namespaces), len(core.pins), c.promotions, c.demotions,
            c.failed_demotions, c.checksum_failures, c.puts, c.gets,
        )
