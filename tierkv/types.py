"""The answers both sides give: the result types of the store's calls, which the client returns too.

Below the store and the client (both import it; it imports neither), so that a client process
never loads the store, its tiers or LMDB.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tierkv.config import Tier
from tierkv.errors import InvalidArgumentError
from tierkv.keys import Namespace
from tierkv.layout import DType, KVLayout


@dataclass(frozen=True, slots=True)
class TenantTierStats:
    """One tenant's share of one tier at one instant (``TenantShares``). ``used_bytes``: what it
    holds there, reserved room included, in whole pages (paged tiers) or record bytes (DISK);
    ``share_bytes``: what it is guaranteed (no other tenant's write evicts its blocks while
    ``used_bytes <= share_bytes``); ``cap_bytes``: the most it may hold; ``evicted_by_others``:
    its blocks evicted there to make room for another tenant, since start (only ever while it
    held more than its share). The rest are its part of the tier's ``TierStats``: its blocks
    there and their KV bytes, its reads' hits and misses there, its blocks evicted from there
    (by anyone), promoted and demoted into it."""

    tenant: str
    tier: Tier
    share_bytes: int
    cap_bytes: int
    used_bytes: int
    evicted_by_others: int
    num_blocks: int = 0
    stored_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions_in: int = 0
    demotions_in: int = 0


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier at one instant. ``used_bytes`` counts reserved in-flight copies too, and never
    exceeds ``capacity_bytes``. ``stored_bytes``: the KV bytes of the blocks the tier holds (a
    block's ``layout.bytes_per_block``), so ``utilisation`` says how much of what the tier uses
    is KV: the rest is page rounding and in-flight copies (HOST, GPU) or record headers
    (DISK, whose ``used_bytes`` are its records' bytes; LMDB's own pages beside them, ~1.7% at
    64 KiB blocks, are in ``tierkv bench store --only utilisation``)."""

    tier: Tier
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int
    misses: int
    evictions: int
    promotions_in: int
    demotions_in: int
    stored_bytes: int = 0

    @property
    def utilisation(self) -> float | None:
        """``stored_bytes / used_bytes``; None while the tier uses nothing."""
        return self.stored_bytes / self.used_bytes if self.used_bytes else None


@dataclass(frozen=True, slots=True)
class RemoteStats:
    """The REMOTE tier at one instant (``StoreStats.remote``; None when it is off).

    ``hits``: blocks read from REMOTE into HOST; ``misses``: reads that asked REMOTE for a
    block it did not give (absent, node down, or ``corrupt``: a record that failed its checks);
    ``errors``/``skipped``: node calls that failed, keys not asked because their node's breaker
    was open; ``written``/``demoted``: records REMOTE stored, of write-through puts and of DISK
    evictions; ``queue_drops``: records dropped because the write queue was full;
    ``write_failures``: records sent that REMOTE did not store (their node down or slow);
    ``budget_drops``: records dropped because their tenant had written its
    ``tenant_write_bytes`` of the interval already.
    """

    connected: bool
    hits: int
    misses: int
    corrupt: int
    lookups: int
    errors: int
    skipped: int
    bytes_read: int
    bytes_written: int
    written: int
    demoted: int
    queue_drops: int
    write_failures: int
    queued_bytes: int
    budget_drops: int = 0


def route_label(route: tuple[Tier, Tier]) -> str:
    """``"host->disk"``: how ``StoreStats.as_dict`` names a ``bytes_moved`` key."""
    return f"{route[0].label}->{route[1].label}"


@dataclass(frozen=True, slots=True)
class StoreStats:
    """The whole store at one instant.

    ``bytes_moved``: payload bytes copied between tiers by promotions and demotions since
    start, keyed ``(source tier, destination tier)`` (routes never taken are absent).
    ``num_leases``: shared-memory leases open now (read and write, every client's, the
    server's own stream-Put leases included); ``leases_expired``: leases ended since start
    because their deadline passed or their client was gone. ``num_sessions``: chat sessions
    held, every tenant's (an expired one counts until it is dropped, which is lazy).

    ``tenant``: None for the whole store; a tenant's name for that tenant's own view
    (``TieredStore.stats(tenant)``, and what a server shows a caller that is not an admin
    tenant): each tier's figures are its own (``capacity_bytes`` is its cap there), and so are
    ``num_namespaces``, ``num_pinned``, ``puts``, ``gets``, ``promotions``, ``demotions``,
    ``checksum_failures`` (of its blocks), ``num_leases`` and ``num_sessions``; the figures
    kept for the store only (``failed_demotions``, ``leases_expired``, ``bytes_moved``,
    ``remote``, and the bad records recovery dropped at start) read 0, empty and None there.
    """

    tiers: dict[Tier, TierStats]
    num_namespaces: int
    num_pinned: int
    promotions: int
    demotions: int
    failed_demotions: int
    checksum_failures: int
    puts: int
    gets: int
    bytes_moved: dict[tuple[Tier, Tier], int]
    num_leases: int
    leases_expired: int
    num_sessions: int
    remote: RemoteStats | None = None
    tenant: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain data (tier names as keys, ``bytes_moved`` keyed ``"host->disk"``), for JSON
        and the wire."""
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["tiers"] = {
            tier.label: {k: v for k, v in asdict(stats).items() if k != "tier"}
            for tier, stats in self.tiers.items()
        }
        data["bytes_moved"] = {route_label(route): num_bytes
                               for route, num_bytes in sorted(self.bytes_moved.items())}
        data["remote"] = None if self.remote is None else asdict(self.remote)
        return data


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    """One namespace at one instant: its blocks (each once, whatever tiers hold it), their
    payload bytes (``num_blocks * layout.bytes_per_block``) and the sessions that name it."""

    namespace: Namespace
    num_blocks: int
    stored_bytes: int
    num_sessions: int

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON: tenant, model id, layout (``layout_label``), TP rank and size,
        and the counts."""
        namespace = self.namespace
        return {
            "tenant": namespace.tenant, "model_id": namespace.model_id,
            "layout": layout_label(namespace.layout), "tp_rank": namespace.tp_rank,
            "tp_size": namespace.tp_size, "num_blocks": self.num_blocks,
            "stored_bytes": self.stored_bytes, "num_sessions": self.num_sessions,
        }


def layout_label(layout: KVLayout) -> str:
    """A layout in one short word for tables: ``"32x8x128/16/fp16"`` (layers x KV heads x
    head dim / block size / dtype); ``"27x1x576+0/64/bf16"`` where V's head size differs from
    K's (here none: an MLA latent)."""
    value = "" if layout.head_dim_v is None else f"+{layout.head_dim_v}"
    return (f"{layout.num_layers}x{layout.num_kv_heads}x{layout.head_dim}{value}/"
            f"{layout.block_size}/{layout.dtype.value}")


def parse_layout_label(text: str) -> KVLayout:
    """Inverse of ``layout_label``; ``InvalidArgumentError`` (``ConfigError``) naming the
    expected form for anything else."""
    dims, _, rest = text.partition("/")
    block_size, _, dtype = rest.partition("/")
    parts = dims.split("x")
    head, plus, value = parts[-1].partition("+") if parts else ("", "", "")
    numbers = (*parts[:-1], head, block_size, *((value,) if plus else ()))
    if len(parts) != 3 or not all(p.isdigit() for p in numbers) or not dtype:
        raise InvalidArgumentError(
            f"layout {text!r}: expected LAYERSxKV_HEADSxHEAD_DIM[+V_HEAD_DIM]/BLOCK_SIZE/DTYPE, "
            "e.g. 32x8x128/16/fp16"
        )
    return KVLayout(int(parts[0]), int(parts[1]), int(head), int(block_size), DType.parse(dtype),
                    int(value) if plus else None)



@dataclass(frozen=True, slots=True)
class ClearResult:
    """What a clear removed: from ``num_namespaces`` matching namespaces, ``num_blocks`` blocks
    of ``cleared_bytes`` payload bytes (each block once, whatever tiers held it) and
    ``num_sessions`` sessions. ``num_busy`` of those blocks were being read or copied: misses
    already, their room comes back when those reads end."""

    num_namespaces: int
    num_blocks: int
    cleared_bytes: int
    num_sessions: int
    num_busy: int



@dataclass(frozen=True, slots=True)
class ResumedSession:
    """What ``resume_session`` gives back: the caller prefills only
    ``token_ids[num_cached_tokens:]``."""

    namespace: Namespace
    token_ids: tuple[int, ...]
    num_cached_tokens: int



@dataclass(frozen=True, slots=True)
class SessionInfo:
    """One session, as ``list_sessions`` reports it."""

    session_id: str
    model_id: str
    num_tokens: int
    last_use_unix_s: float


@dataclass(frozen=True, slots=True)
class PutDetail:
    """What a writer may say of the blocks of one put, for the sidecar's KV events and its
    eviction order (a block continuing a stored chain is evicted before its parent; never
    stored): ``token_ids``, every block's tokens in block order (``layout.block_size`` each;
    empty: none given); ``parent_hash``, the hash of the block before the first (None: the
    first block starts its chain, or unknown), the put's blocks being one chain; or
    ``parent_hashes``, each block's parent (None: a chain starts there), for a put of several
    chains; ``lora_name``; ``extra_keys``, one entry per block (vLLM's
    ``BlockStored.extra_keys``; empty: none). Routers match token ids against prompts, so they
    are prompt content: the sidecar publishes them only when asked to."""

    token_ids: tuple[int, ...] = ()
    parent_hash: bytes | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] = ()
    parent_hashes: tuple[bytes | None, ...] = ()

    def check(self, num_blocks: int, block_size: int) -> None:
        """``InvalidArgumentError`` unless it fits a put of ``num_blocks`` blocks."""
        if self.token_ids and len(self.token_ids) != num_blocks * block_size:
            raise InvalidArgumentError(
                f"token_ids: {len(self.token_ids)} tokens for {num_blocks} blocks of "
                f"{block_size} tokens (give every block's tokens, or none)")
        if self.token_ids and not 0 <= min(self.token_ids) <= max(self.token_ids) < 1 << 32:
            raise InvalidArgumentError("token_ids: every token id is in [0, 2**32)")
        if self.extra_keys and len(self.extra_keys) != num_blocks:
            raise InvalidArgumentError(
                f"extra_keys: {len(self.extra_keys)} entries for {num_blocks} blocks (one a "
                "block, or none)")
        if self.parent_hash is not None and len(self.parent_hash) != 32:
            raise InvalidArgumentError("parent_hash: a block hash is 32 bytes")
        if self.parent_hashes and len(self.parent_hashes) != num_blocks:
            raise InvalidArgumentError(
                f"parent_hashes: {len(self.parent_hashes)} for {num_blocks} blocks (one a "
                "block, or none)")
        if any(parent is not None and len(parent) != 32 for parent in self.parent_hashes):
            raise InvalidArgumentError("parent_hashes: a block hash is 32 bytes")

    def parent_of(self, index: int, hashes: Sequence[bytes]) -> bytes | None:
        """Block ``index``'s parent among the put's ``hashes``."""
        if self.parent_hashes:
            return self.parent_hashes[index]
        return hashes[index - 1] if index else self.parent_hash

    def tokens_of(self, index: int, block_size: int) -> list[int]:
        """Block ``index``'s tokens (empty when none were given)."""
        return list(self.token_ids[index * block_size : (index + 1) * block_size])
