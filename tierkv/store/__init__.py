"""The embedded, in-process tiered store."""

from tierkv.store.stats import StoreStats, TierStats
from tierkv.store.tiered import TieredStore

__all__ = ["StoreStats", "TierStats", "TieredStore"]
