"""Leases, lookups, stats, clears and server facts <-> their wire messages (both sides).

The wire sits below the store and the client: it never imports the store's types. What it
converts from is described by the protocols below (the store's leases and stats match them),
and ``stats_from`` builds the caller's own stats types, named by the caller. The field tables
``TIER_STATS_FIELDS`` / ``STORE_STATS_FIELDS`` are the fields both sides name alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, TypeVar

import msgpack

from tierkv.config import Tier
from tierkv.errors import InvalidArgumentError
from tierkv.keys import Namespace
from tierkv.types import PutDetail
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire.enums import TIER_FROM_LABEL, tier_from_label
from tierkv.wire.namespaces import namespace_from, namespace_to

Extents = Sequence[tuple[int, int]]
"""Where one block lies in a slab: ``(offset, length)`` pieces, in the block's byte order."""


class ReadLeaseView(Protocol):
    """What the wire needs of a read lease (``tierkv.ReadLease``)."""

    @property
    def lease_id(self) -> bytes: ...
    @property
    def blocks(self) -> Sequence[Extents]: ...
    @property
    def num_cached(self) -> int: ...
    @property
    def expires_in_s(self) -> float: ...
    @property
    def checksums(self) -> Sequence[int]: ...


class WriteLeaseView(Protocol):
    """What the wire needs of a write lease (``tierkv.WriteLease``)."""

    @property
    def lease_id(self) -> bytes: ...
    @property
    def write_indices(self) -> Sequence[int]: ...
    @property
    def blocks(self) -> Sequence[Extents]: ...
    @property
    def expires_in_s(self) -> float: ...


def blocks_to(blocks: Sequence[Extents]) -> list[pb.BlockExtents]:
    """The wire form of per-block extent lists."""
    return [
        pb.BlockExtents(extents=[pb.Extent(offset=o, length=n) for o, n in extents])
        for extents in blocks
    ]


def extents_from(block: pb.BlockExtents) -> list[tuple[int, int]]:
    """One block's ``(offset, length)`` pieces from the wire."""
    return [(extent.offset, extent.length) for extent in block.extents]


def blocks_from(blocks: Sequence[pb.BlockExtents]) -> list[list[tuple[int, int]]]:
    """Per-block extent lists from the wire (what the store's lease gave)."""
    return [extents_from(block) for block in blocks]


def _extent_fields(blocks: Sequence[Extents], packed: bool) -> dict[str, Any]:
    """A lease's extents as ``LeaseResponse`` fields: ``blocks`` (a message a block), or the
    packed arrays (``packed``: the caller asked for them)."""
    if not packed:
        return {"blocks": blocks_to(blocks)}
    fields: dict[str, Any] = {
        "extent_offsets": [offset for extents in blocks for offset, _ in extents],
        "extent_lengths": [length for extents in blocks for _, length in extents],
    }
    if any(len(extents) != 1 for extents in blocks):
        fields["extent_counts"] = [len(extents) for extents in blocks]
    return fields


def lease_blocks_from(lease: pb.LeaseResponse) -> list[list[tuple[int, int]]]:
    """Each leased block's ``(offset, length)`` pieces, from whichever form the server sent
    (``blocks``, or the packed arrays); a response whose arrays do not describe
    ``num_blocks`` blocks raises ``ValueError``."""
    if lease.blocks:
        blocks = blocks_from(lease.blocks)
    else:
        offsets, lengths = list(lease.extent_offsets), list(lease.extent_lengths)
        if len(offsets) != len(lengths):
            raise ValueError(f"a lease has {len(offsets)} extent offsets and {len(lengths)} "
                             "lengths")
        pieces = list(zip(offsets, lengths, strict=True))
        counts = list(lease.extent_counts)
        if not counts:
            blocks = [[piece] for piece in pieces]
        else:
            if sum(counts) != len(pieces):
                raise ValueError(f"a lease's extent counts add up to {sum(counts)}, not to "
                                 f"its {len(pieces)} extents")
            blocks, start = [], 0
            for count in counts:
                blocks.append(pieces[start : start + count])
                start += count
    if len(blocks) != lease.num_blocks:
        raise ValueError(f"a lease of {lease.num_blocks} blocks describes {len(blocks)}")
    return blocks


def read_lease_to(lease: ReadLeaseView, slab_id: bytes, packed: bool = False
                  ) -> pb.LeaseResponse:
    """The wire form of a read lease in the slab ``slab_id`` (``packed``: its extents in the
    packed arrays)."""
    return pb.LeaseResponse(lease_id=lease.lease_id, num_blocks=len(lease.blocks),
                            expires_in_s=lease.expires_in_s, num_cached=lease.num_cached,
                            slab_id=slab_id, checksums=lease.checksums,
                            **_extent_fields(lease.blocks, packed))


def write_lease_to(lease: WriteLeaseView, slab_id: bytes, packed: bool = False
                   ) -> pb.LeaseResponse:
    """The wire form of a write lease in the slab ``slab_id`` (``packed`` as for reads)."""
    return pb.LeaseResponse(lease_id=lease.lease_id, num_blocks=len(lease.write_indices),
                            write_indices=lease.write_indices, expires_in_s=lease.expires_in_s,
                            slab_id=slab_id, **_extent_fields(lease.blocks, packed))


# --- lookups -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LookupDetail:
    """A cached prefix: its length, how many of its blocks have their fastest copy in each
    tier, and how many the call pinned."""

    num_cached: int
    num_gpu: int
    num_host: int
    num_disk: int
    num_pinned: int
    num_remote: int = 0


def lookup_to(counts: Mapping[Tier, int], num_pinned: int = 0, num_remote: int = 0
              ) -> pb.LookupResponse:
    """The wire form of ``TieredStore.sidecar.locate``'s counts (and the pins a lookup took, and the
    blocks after them only the REMOTE tier holds)."""
    return pb.LookupResponse(
        num_cached=sum(counts.values()) + num_remote, num_gpu=counts[Tier.GPU],
        num_host=counts[Tier.HOST], num_disk=counts[Tier.DISK], num_pinned=num_pinned,
        num_remote=num_remote,
    )


def lookup_from(response: pb.LookupResponse) -> LookupDetail:
    """A ``LookupResponse`` as a ``LookupDetail``."""
    return LookupDetail(response.num_cached, response.num_gpu, response.num_host,
                        response.num_disk, response.num_pinned, response.num_remote)


# --- stats ---------------------------------------------------------------------------------

TIER_STATS_FIELDS = ("capacity_bytes", "used_bytes", "num_blocks", "hits", "misses",
                     "evictions", "promotions_in", "demotions_in", "stored_bytes")
"""The fields of one tier's stats, named alike by ``tierkv.TierStats`` and the wire."""
STORE_STATS_FIELDS = ("num_namespaces", "num_pinned", "promotions", "demotions",
                      "failed_demotions", "checksum_failures", "puts", "gets", "num_leases",
                      "leases_expired", "num_sessions")
"""The store-wide counters, named alike by ``tierkv.StoreStats`` and the wire (``tiers`` and
``bytes_moved`` have their own messages)."""
NAMESPACE_STATS_FIELDS = ("num_blocks", "stored_bytes", "num_sessions")
"""The counts of one namespace, named alike by ``tierkv.types.NamespaceStats`` and the wire."""
REMOTE_STATS_FIELDS = ("connected", "hits", "misses", "corrupt", "lookups", "errors", "skipped",
                       "bytes_read", "bytes_written", "written", "demoted", "queue_drops",
                       "write_failures", "queued_bytes", "budget_drops")
"""The REMOTE tier's figures, named alike by ``tierkv.types.RemoteStats`` and the wire."""
TENANT_STATS_FIELDS = ("share_bytes", "cap_bytes", "used_bytes", "evicted_by_others",
                       "num_blocks", "stored_bytes", "hits", "misses", "evictions",
                       "promotions_in", "demotions_in")
"""One tenant's share of one tier, named alike by ``tierkv.types.TenantTierStats`` and the
wire (``tenant`` and ``tier`` besides)."""

S = TypeVar("S")


class StoreStatsView(Protocol):
    """What the wire needs of a stats snapshot (``tierkv.StoreStats``: its ``tiers`` map a
    ``Tier`` to an object with ``TIER_STATS_FIELDS``, its ``bytes_moved`` a ``(source,
    destination)`` pair of tiers to bytes, itself has ``STORE_STATS_FIELDS``)."""

    @property
    def tiers(self) -> Mapping[Tier, Any]: ...
    @property
    def bytes_moved(self) -> Mapping[tuple[Tier, Tier], int]: ...


class TenantStatsView(Protocol):
    """What the wire needs of one tenant's share of a tier (``tierkv.types.TenantTierStats``:
    also ``TENANT_STATS_FIELDS``)."""

    @property
    def tenant(self) -> str: ...
    @property
    def tier(self) -> Tier: ...


class NamespaceStatsView(Protocol):
    """What the wire needs of one namespace's stats (``tierkv.types.NamespaceStats``: also
    ``NAMESPACE_STATS_FIELDS``)."""

    @property
    def namespace(self) -> Namespace: ...


def stats_to(stats: StoreStatsView, namespaces: Sequence[NamespaceStatsView] = (),
             tenants: Sequence[TenantStatsView] = ()) -> pb.StatsResponse:
    """The wire form of a stats snapshot and of the namespaces and tenants' shares reported
    with it."""
    tiers = [
        pb.TierStats(tier=tier.label, **{name: getattr(s, name) for name in TIER_STATS_FIELDS})
        for tier, s in stats.tiers.items()
    ]
    moved = [pb.BytesMoved(source=source.label, destination=destination.label,
                           num_bytes=num_bytes)
             for (source, destination), num_bytes in sorted(stats.bytes_moved.items())]
    remote = getattr(stats, "remote", None)
    return pb.StatsResponse(
        tiers=tiers, bytes_moved=moved, tenant=getattr(stats, "tenant", None) or "",
        namespaces=[namespace_stats_to(n) for n in namespaces],
        tenants=[pb.TenantTierStats(tenant=t.tenant, tier=t.tier.label,
                                    **{name: getattr(t, name) for name in TENANT_STATS_FIELDS})
                 for t in tenants],
        remote=None if remote is None else pb.RemoteStats(
            **{name: getattr(remote, name) for name in REMOTE_STATS_FIELDS}),
        **{name: getattr(stats, name) for name in STORE_STATS_FIELDS},
    )


def namespace_stats_to(stats: NamespaceStatsView) -> pb.NamespaceStats:
    """The wire form of one namespace's stats (its tenant travels here: an operator's view)."""
    return pb.NamespaceStats(tenant=stats.namespace.tenant,
                             namespace=namespace_to(stats.namespace),
                             **{name: getattr(stats, name) for name in NAMESPACE_STATS_FIELDS})


def stats_from(response: pb.StatsResponse, tier_stats: Callable[..., Any],
               store_stats: Callable[..., S], namespace_stats: Callable[..., Any],
               remote_stats: Callable[..., Any], tenant_stats: Callable[..., Any]) -> S:
    """A ``StatsResponse`` as ``store_stats(tiers=..., bytes_moved=..., namespaces=...,
    tenants=..., tenant=..., **counters)`` (``tenant`` None: the whole server's figures),
    each tier as ``tier_stats(tier=Tier, **fields)``, each
    namespace as ``namespace_stats(namespace=Namespace, **counts)``, the REMOTE tier's as
    ``remote_stats(**fields)``, each tenant's share as ``tenant_stats(tenant=str, tier=Tier,
    **fields)`` (the client passes ``tierkv.TierStats``, its ``ServerStats``,
    ``tierkv.types.NamespaceStats``, ``RemoteStats`` and ``TenantTierStats``: the wire is below
    the types).
    Tiers with a label this side does not know (a newer server's) are left out, and so are the
    moves between them and namespaces that do not parse; an older server's missing fields read
    as 0 and empty."""
    tiers = {
        tier_from_label(t.tier): tier_stats(
            tier=tier_from_label(t.tier), **{name: getattr(t, name) for name in TIER_STATS_FIELDS}
        )
        for t in response.tiers
        if t.tier in TIER_FROM_LABEL
    }
    moved = {
        (TIER_FROM_LABEL[m.source], TIER_FROM_LABEL[m.destination]): m.num_bytes
        for m in response.bytes_moved
        if m.source in TIER_FROM_LABEL and m.destination in TIER_FROM_LABEL
    }
    namespaces = []
    for n in response.namespaces:
        try:
            namespace = namespace_from(n.namespace, n.tenant)
        except ValueError:  # a newer server's layout this side cannot read: left out
            continue
        namespaces.append(namespace_stats(
            namespace=namespace, **{name: getattr(n, name) for name in NAMESPACE_STATS_FIELDS}))
    remote = remote_stats(**{name: getattr(response.remote, name) for name in REMOTE_STATS_FIELDS}
                          ) if response.HasField("remote") else None
    tenants = tuple(
        tenant_stats(tenant=t.tenant, tier=TIER_FROM_LABEL[t.tier],
                        **{name: getattr(t, name) for name in TENANT_STATS_FIELDS})
        for t in response.tenants if t.tier in TIER_FROM_LABEL)
    return store_stats(tiers=tiers, bytes_moved=moved, namespaces=tuple(namespaces),
                       remote=remote, tenants=tenants, tenant=response.tenant or None,
                       **{name: getattr(response, name) for name in STORE_STATS_FIELDS})


# --- clear ---------------------------------------------------------------------------------

CLEAR_RESULT_FIELDS = ("num_namespaces", "num_blocks", "cleared_bytes", "num_sessions",
                       "num_busy")
"""The counts of a clear, named alike by ``tierkv.types.ClearResult`` and ``ClearProgress``."""


def clear_request_to(tenant: str | None, model_id: str | None, namespace: Namespace | None,
                     all_namespaces: bool) -> pb.ClearRequest:
    """The wire form of a clear's filters (the namespace's own tenant does not travel:
    ``tenant`` names it)."""
    request = pb.ClearRequest(tenant=tenant or "", model_id=model_id or "", all=all_namespaces)
    if namespace is not None:
        request.namespace.CopyFrom(namespace_to(namespace))
    return request


def clear_progress_to(num_blocks_done: int, num_blocks_total: int) -> pb.ClearProgress:
    """A progress message of a Clear stream."""
    return pb.ClearProgress(num_blocks_done=num_blocks_done, num_blocks_total=num_blocks_total)


def clear_result_to(result: Any, num_blocks_total: int) -> pb.ClearProgress:
    """The last message of a Clear stream: ``done`` and the counts (``result`` has
    ``CLEAR_RESULT_FIELDS``)."""
    return pb.ClearProgress(num_blocks_done=num_blocks_total, num_blocks_total=num_blocks_total,
                            done=True, **{name: getattr(result, name)
                                          for name in CLEAR_RESULT_FIELDS})


def clear_result_from(message: pb.ClearProgress, clear_result: Callable[..., S]) -> S:
    """The counts of a Clear stream's last message as ``clear_result(**counts)`` (the client
    passes ``tierkv.types.ClearResult``)."""
    return clear_result(**{name: getattr(message, name) for name in CLEAR_RESULT_FIELDS})


# --- server facts --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What Describe tells a client: the server's version and limits, its HOST slab (shared
    memory name, size, page size, generation ``slab_id``), its host (boot id), the seed of
    session hashes, the presence table and the prefix of client lock files ("" / b"": none)."""

    version: str
    shm_name: str
    shm_size_bytes: int
    page_bytes: int
    host_id: str
    max_hashes_per_call: int
    max_chunk_bytes: int
    hash_seed: str
    presence_shm_name: str
    presence_key: bytes
    slab_id: bytes
    client_lock_prefix: str
    has_remote_tier: bool = False
    carries_releases: bool = False


# --- sessions ------------------------------------------------------------------------------

SESSION_INFO_FIELDS = ("session_id", "model_id", "num_tokens", "last_use_unix_s")
"""The fields of ``tierkv.types.SessionInfo``, named alike on the wire."""


def sessions_to(sessions: Sequence[Any]) -> pb.ListSessionsResponse:
    """The wire form of ``TieredStore.list_sessions``'s answer (objects with
    ``SESSION_INFO_FIELDS``)."""
    return pb.ListSessionsResponse(sessions=[
        pb.SessionInfo(**{name: getattr(s, name) for name in SESSION_INFO_FIELDS})
        for s in sessions
    ])


def sessions_from(response: pb.ListSessionsResponse, session_info: Callable[..., S]) -> list[S]:
    """Each session of a ``ListSessionsResponse`` as ``session_info(**fields)`` (the client
    passes ``tierkv.types.SessionInfo``: the wire is below the types)."""
    return [session_info(**{name: getattr(s, name) for name in SESSION_INFO_FIELDS})
            for s in response.sessions]


def server_info_to(info: ServerInfo) -> pb.DescribeResponse:
    """The wire form of the server's facts."""
    return pb.DescribeResponse(**{f.name: getattr(info, f.name) for f in fields(ServerInfo)})


def server_info_from(response: pb.DescribeResponse) -> ServerInfo:
    """A ``DescribeResponse`` as ``ServerInfo``."""
    return ServerInfo(**{f.name: getattr(response, f.name) for f in fields(ServerInfo)})


# --- a put's detail (KV events) -----------------------------------------------------------------


def put_detail_to(detail: PutDetail | None) -> pb.PutDetail | None:
    """The wire form of a put's detail (None: nothing said)."""
    if detail is None:
        return None
    return pb.PutDetail(
        token_ids=detail.token_ids, parent_hash=detail.parent_hash or b"",
        lora_name=detail.lora_name or "",
        extra_keys=msgpack.packb([None if keys is None else list(keys)
                                  for keys in detail.extra_keys], use_bin_type=True)
        if detail.extra_keys else b"",
        parent_hashes=[parent or b"" for parent in detail.parent_hashes],
    )


def put_detail_from(message: Any, present: bool) -> PutDetail | None:
    """A put's detail from its wire form (``present``: the request set the field);
    ``InvalidArgumentError`` for extra keys that are not one msgpack array a block."""
    if not present:
        return None
    extra_keys: tuple[tuple[Any, ...] | None, ...] = ()
    if message.extra_keys:
        try:
            decoded = msgpack.unpackb(message.extra_keys, raw=False, use_list=True)
        except (ValueError, msgpack.ExtraData) as exc:
            raise InvalidArgumentError(f"PutDetail.extra_keys: not msgpack ({exc})") from None
        if not isinstance(decoded, list) or not all(
                keys is None or isinstance(keys, list) for keys in decoded):
            raise InvalidArgumentError("PutDetail.extra_keys: one array (or nil) a block")
        extra_keys = tuple(None if keys is None else tuple(keys) for keys in decoded)
    return PutDetail(tuple(message.token_ids), bytes(message.parent_hash) or None,
                     message.lora_name or None, extra_keys,
                     tuple(bytes(parent) or None for parent in message.parent_hashes))
