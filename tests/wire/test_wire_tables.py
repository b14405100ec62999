"""Every wire table round-trips every value, and covers every value the .proto defines.

Adding a status code, an enum value or a stats field is a change in ``tierkv.wire`` alone: a
value missing from a table fails here, not in production.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import grpc
import pytest

from tierkv import errors
from tierkv.client import LookupDetail, ServerInfo, ServerStats
from tierkv.client.base import error_from, is_retryable
from tierkv.config import Priority, Tier, WritePolicy
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
from tierkv.keys import Namespace
from tierkv.layout import DType, KVLayout
from tierkv.service.errors import status_of
from tierkv.store import (
    ClearResult,
    NamespaceStats,
    ReadLease,
    RemoteStats,
    SessionInfo,
    StoreStats,
    TenantTierStats,
    TierStats,
    WriteLease,
)
from tierkv.wire import convert, enums, status
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire.namespaces import namespace_from, namespace_to

Code = grpc.StatusCode

# What the server answers each exception with, and what the client then raises: every class
# of tierkv.errors (and the disk tier's), as the two tables did before they became one.
SERVED = [
    (InvalidArgumentError("x"), Code.INVALID_ARGUMENT, InvalidArgumentError),
    (ConfigError("x"), Code.INVALID_ARGUMENT, InvalidArgumentError),
    (UnknownNamespaceError("x"), Code.INVALID_ARGUMENT, InvalidArgumentError),
    (ValueError("x"), Code.INVALID_ARGUMENT, InvalidArgumentError),
    (CapacityError("x"), Code.RESOURCE_EXHAUSTED, CapacityError),
    (DiskFullError("x"), Code.RESOURCE_EXHAUSTED, CapacityError),
    (LeaseNotFoundError("x"), Code.NOT_FOUND, NotFoundError),
    (NotFoundError("x"), Code.UNAVAILABLE, ServiceUnavailableError),  # (never raised bare)
    (SessionNotFoundError("x"), Code.NOT_FOUND, NotFoundError),
    (LeaseStateError("x"), Code.FAILED_PRECONDITION, LeaseStateError),
    (StoreClosedError("x"), Code.UNAVAILABLE, ServiceUnavailableError),
    (DeadlineExceededError("x"), Code.DEADLINE_EXCEEDED, DeadlineExceededError),
    (StaleSlabError("x"), Code.ABORTED, StaleSlabError),
    (PermissionDeniedError("x"), Code.PERMISSION_DENIED, PermissionDeniedError),
    (IntegrityError("x"), Code.DATA_LOSS, IntegrityError),
    (DiskIOError("x"), Code.DATA_LOSS, IntegrityError),
    # A failing store (not the caller's input) is logged and served as UNAVAILABLE.
    (TierKVError("x"), Code.UNAVAILABLE, ServiceUnavailableError),
    (ServiceUnavailableError("x"), Code.UNAVAILABLE, ServiceUnavailableError),
    (AuthenticationError("x"), Code.UNAVAILABLE, ServiceUnavailableError),
]
# Codes only grpc or the server's refusals produce, and what the client raises for them.
CLIENT_ONLY = {
    Code.UNAUTHENTICATED: AuthenticationError,
    Code.CANCELLED: ServiceUnavailableError,
}


class RpcError(grpc.RpcError):
    """A failed call as grpc raises it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(("exc", "code", "raised"), SERVED, ids=lambda v: type(v).__name__)
def test_every_exception_round_trips_through_its_status_code(
    exc: BaseException, code: grpc.StatusCode, raised: type[TierKVError],
) -> None:
    assert status_of(exc) == (code, "x")
    error = error_from(RpcError(*status_of(exc)))
    assert type(error) is raised and str(error) == f"{code.name}: x"


def test_every_status_code_has_a_client_exception() -> None:
    for code, kind in CLIENT_ONLY.items():
        assert type(error_from(RpcError(code, "m"))) is kind
    named = {row.code for row in status.STATUS_TABLE}
    for code in Code:
        expected = status.error_of(code) if code in named else TierKVError
        assert type(error_from(RpcError(code, "m"))) is expected
    assert {c for c in Code if is_retryable(RpcError(c, ""))} == {Code.UNAVAILABLE,
                                                                  Code.CANCELLED}


def test_every_tierkv_error_class_is_served_by_a_row_or_on_purpose_by_none() -> None:
    served = {type(exc) for exc, *_ in SERVED}
    every = {kind for kind in vars(errors).values()
             if isinstance(kind, type) and issubclass(kind, BaseException)}
    assert every <= served | {BaseException, Exception}


def test_status_messages_are_cut_and_unknown_errors_are_internal(
        caplog: pytest.LogCaptureFixture) -> None:
    code, message = status_of(InvalidArgumentError("y" * 5000))
    assert code == Code.INVALID_ARGUMENT and message == "y" * 1024 + "..."
    with caplog.at_level(logging.ERROR):
        assert status_of(RuntimeError("boom")) == (
            Code.INTERNAL, "internal error (logged by the server)")
        assert status_of(TierKVError("disk")) == (Code.UNAVAILABLE, "disk")
    assert "boom" in caplog.text and "store error: disk" in caplog.text


# --- enums -------------------------------------------------------------------------------------


def test_write_policies_round_trip_and_cover_the_proto() -> None:
    for policy in [None, *WritePolicy]:
        assert enums.write_policy_from(enums.write_policy_to(policy)) is policy
    assert set(enums.WRITE_POLICY_FROM_WIRE) == set(pb.WritePolicy.values())
    with pytest.raises(InvalidArgumentError, match="unknown write_policy 9"):
        enums.write_policy_from(9)


def test_priorities_round_trip_and_cover_the_proto() -> None:
    for priority in Priority:
        assert enums.priority_from(enums.priority_to(priority)) is priority
        assert enums.priority_to(int(priority)) == enums.priority_to(priority)  # type: ignore[arg-type]
    assert set(enums.PRIORITY_FROM_WIRE) == set(pb.Priority.values())
    assert enums.priority_from(pb.PRIORITY_UNSPECIFIED) is Priority.NORMAL
    with pytest.raises(InvalidArgumentError, match="unknown priority 9"):
        enums.priority_from(9)


def test_tiers_round_trip_and_cover_the_proto() -> None:
    assert set(enums.TIER_TO_WIRE) == set(Tier)
    assert set(enums.TIER_FROM_WIRE) == set(pb.Tier.values()) - {pb.TIER_UNSPECIFIED}
    for tier in Tier:
        assert enums.TIER_FROM_WIRE[enums.TIER_TO_WIRE[tier]] is tier
        assert enums.tier_from_label(tier.label) is tier
    with pytest.raises(InvalidArgumentError):
        enums.tier_from_label("tape")


# --- namespaces --------------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", [
    Namespace("m", KVLayout(2, 4, 8)),
    Namespace("llama/3-8b", KVLayout(32, 8, 128, 32, DType.BF16), tp_rank=3, tp_size=4),
    Namespace("x" * 256, KVLayout(1, 1, 1, 1, DType.FP32)),
], ids=["defaults", "sharded", "longest"])
def test_namespaces_round_trip_without_their_tenant(namespace: Namespace) -> None:
    wire = namespace_to(namespace)
    assert namespace_from(wire, "acme") == namespace.with_tenant("acme")
    parsed = pb.Namespace.FromString(wire.SerializeToString())
    assert namespace_from(parsed, namespace.tenant) == namespace


def test_unset_namespace_fields_take_the_defaults_and_bad_ones_are_named() -> None:
    spec = pb.Namespace(model_id="m", num_layers=2, num_kv_heads=4, head_dim=8)
    assert namespace_from(spec, "t") == Namespace("m", KVLayout(2, 4, 8), tenant="t")
    with pytest.raises(InvalidArgumentError, match="model_id"):
        namespace_from(pb.Namespace(model_id="x" * 257, num_layers=1), "")
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        namespace_from(pb.Namespace(model_id="m", num_layers=1, head_dim=1), "")


# --- leases, lookups, stats, describe ----------------------------------------------------------

BLOCKS = [[(0, 4096)], [(8192, 1024), (16384, 3072)], [(2**40, 4096)]]


def test_read_leases_round_trip() -> None:
    lease = ReadLease(b"id", BLOCKS, num_cached=5, expires_in_s=2.5, checksums=[1, 2**64 - 1, 3])
    wire = pb.LeaseResponse.FromString(convert.read_lease_to(lease, b"slab").SerializeToString())
    assert convert.blocks_from(wire.blocks) == BLOCKS
    assert (wire.lease_id, wire.num_blocks, wire.num_cached, wire.expires_in_s) == (b"id", 3, 5, 2.5)
    assert (list(wire.checksums), wire.slab_id, list(wire.write_indices)) == (
        [1, 2**64 - 1, 3], b"slab", [])


@pytest.mark.parametrize("blocks", [BLOCKS, [[(0, 4096)], [(8192, 4096)]], []],
                         ids=["split-block", "one-run-each", "empty"])
@pytest.mark.parametrize("packed", [False, True], ids=["messages", "packed"])
def test_both_forms_of_a_leases_extents_decode_alike(blocks: list[list[tuple[int, int]]],
                                                     packed: bool) -> None:
    """A client asks for packed extents; a server that predates them sends messages: the
    client reads either, and only one is on the wire."""
    lease = ReadLease(b"id", blocks, num_cached=len(blocks), expires_in_s=1.0,
                      checksums=list(range(len(blocks))))
    wire = pb.LeaseResponse.FromString(
        convert.read_lease_to(lease, b"slab", packed).SerializeToString())
    assert convert.lease_blocks_from(wire) == blocks
    assert bool(wire.blocks) == (not packed and bool(blocks))
    assert bool(wire.extent_offsets) == (packed and bool(blocks))
    one_each = all(len(extents) == 1 for extents in blocks)
    assert bool(wire.extent_counts) == (packed and not one_each)
    write = WriteLease(b"w", list(range(len(blocks))), blocks, expires_in_s=1.0)
    wire = pb.LeaseResponse.FromString(
        convert.write_lease_to(write, b"slab", packed).SerializeToString())
    assert convert.lease_blocks_from(wire) == blocks


@pytest.mark.parametrize("fields", [
    {"num_blocks": 2, "extent_offsets": [0, 4096], "extent_lengths": [4096]},
    {"num_blocks": 2, "extent_offsets": [0, 4096], "extent_lengths": [4096, 4096],
     "extent_counts": [1, 2]},
    {"num_blocks": 3, "extent_offsets": [0, 4096], "extent_lengths": [4096, 4096]},
    {"num_blocks": 1, "extent_offsets": [0, 4096], "extent_lengths": [4096, 4096],
     "extent_counts": [1, 1]},
], ids=["lengths-short", "counts-over", "blocks-missing", "blocks-extra"])
def test_packed_extents_that_do_not_describe_the_lease_are_refused(fields: dict[str, Any]
                                                                   ) -> None:
    with pytest.raises(ValueError, match="lease"):
        convert.lease_blocks_from(pb.LeaseResponse(lease_id=b"x", **fields))


def test_write_leases_round_trip() -> None:
    lease = WriteLease(b"w", [0, 2], BLOCKS[:2], expires_in_s=30.0)
    wire = pb.LeaseResponse.FromString(convert.write_lease_to(lease, b"s").SerializeToString())
    assert convert.blocks_from(wire.blocks) == BLOCKS[:2]
    assert (wire.lease_id, wire.num_blocks, list(wire.write_indices)) == (b"w", 2, [0, 2])
    assert (wire.expires_in_s, wire.slab_id, wire.num_cached) == (30.0, b"s", 0)


def test_lookups_round_trip() -> None:
    counts = {Tier.GPU: 1, Tier.HOST: 2, Tier.DISK: 3}
    wire = pb.LookupResponse.FromString(convert.lookup_to(counts, 4).SerializeToString())
    assert convert.lookup_from(wire) == LookupDetail(6, 1, 2, 3, 4)
    assert convert.lookup_from(pb.LookupResponse()) == LookupDetail(0, 0, 0, 0, 0)


def _store_stats(tiers: dict[Tier, TierStats]) -> StoreStats:
    moved = {(Tier.HOST, Tier.DISK): 2**40, (Tier.DISK, Tier.HOST): 5}
    return StoreStats(tiers, *range(100, 108), moved, *range(108, 111))


NAMESPACES = (
    NamespaceStats(Namespace("m", KVLayout(2, 4, 8), tenant="acme"), 3, 3 * 1024, 1),
    NamespaceStats(Namespace("n", KVLayout(1, 1, 8, 4, DType.BF16), 1, 2, tenant="b"), 0, 0, 2),
)


def test_stats_round_trip_and_their_fields_cover_both_sides() -> None:
    tier_fields = [f.name for f in dataclasses.fields(TierStats) if f.name != "tier"]
    store_fields = [f.name for f in dataclasses.fields(StoreStats)
                    if f.name not in ("tiers", "bytes_moved", "remote", "tenant")]
    assert list(convert.TIER_STATS_FIELDS) == tier_fields
    assert set(convert.TIER_STATS_FIELDS) == set(pb.TierStats.DESCRIPTOR.fields_by_name) - {"tier"}
    assert list(convert.STORE_STATS_FIELDS) == store_fields
    assert set(convert.STORE_STATS_FIELDS) == (
        set(pb.StatsResponse.DESCRIPTOR.fields_by_name)
        - {"tiers", "bytes_moved", "namespaces", "remote", "tenants", "tenant"})
    assert set(convert.TENANT_STATS_FIELDS) == (
        {f.name for f in dataclasses.fields(TenantTierStats)} - {"tenant", "tier"})
    assert set(convert.TENANT_STATS_FIELDS) == (
        set(pb.TenantTierStats.DESCRIPTOR.fields_by_name) - {"tenant", "tier"})
    assert list(convert.REMOTE_STATS_FIELDS) == [f.name for f in dataclasses.fields(RemoteStats)]
    assert set(convert.REMOTE_STATS_FIELDS) == set(pb.RemoteStats.DESCRIPTOR.fields_by_name)
    assert set(convert.NAMESPACE_STATS_FIELDS) == (
        {f.name for f in dataclasses.fields(NamespaceStats)} - {"namespace"})
    assert set(convert.NAMESPACE_STATS_FIELDS) == (
        set(pb.NamespaceStats.DESCRIPTOR.fields_by_name) - {"tenant", "namespace"})

    tiers = {tier: TierStats(tier, *range(10 * tier, 10 * tier + 8)) for tier in Tier}
    stats = dataclasses.replace(_store_stats(tiers), remote=RemoteStats(True, *range(200, 214)))
    tenants = (TenantTierStats("alice", Tier.HOST, 2**33, 2**34, 7, 3, *range(300, 307)),
               TenantTierStats("bob", Tier.DISK, 0, 1, 2, 0))
    wire = pb.StatsResponse.FromString(
        convert.stats_to(stats, NAMESPACES, tenants).SerializeToString())
    back = convert.stats_from(wire, TierStats, ServerStats, NamespaceStats, RemoteStats,
                              TenantTierStats)
    assert back == ServerStats(**{f.name: getattr(stats, f.name)
                                  for f in dataclasses.fields(StoreStats)}, namespaces=NAMESPACES,
                               tenants=tenants)
    assert back.as_dict()["tenants"][0]["tier"] == "host"
    assert isinstance(back, StoreStats) and list(back.tiers) == list(Tier)
    assert back.as_dict()["bytes_moved"] == {"disk->host": 5, "host->disk": 2**40}
    assert back.tenant is None
    own = dataclasses.replace(stats, tenant="alice")  # a tenant's own view says whose it is
    assert convert.stats_from(pb.StatsResponse.FromString(convert.stats_to(own).SerializeToString()),
                              TierStats, ServerStats, NamespaceStats, RemoteStats,
                              TenantTierStats).tenant == "alice"


def test_stats_of_an_older_server_read_with_zero_and_empty_new_fields() -> None:
    old = pb.StatsResponse(num_leases=3, puts=4)  # what a server before these fields sends
    back = convert.stats_from(old, TierStats, ServerStats, NamespaceStats, RemoteStats,
                              TenantTierStats)
    assert (back.num_leases, back.puts, back.leases_expired, back.num_sessions) == (3, 4, 0, 0)
    assert back.remote is None
    assert (back.bytes_moved, back.namespaces, back.tenants) == ({}, (), ())


def test_server_info_round_trips_and_covers_describe() -> None:
    names = [f.name for f in dataclasses.fields(ServerInfo)]
    assert set(names) == set(pb.DescribeResponse.DESCRIPTOR.fields_by_name)
    info = ServerInfo("0.1", "tierkv-1", 2**33, 4096, "boot", 65536, 2**20, "seed", "p", b"k",
                      b"slab", "/dev/shm/tierkv-lock-")
    wire = pb.DescribeResponse.FromString(convert.server_info_to(info).SerializeToString())
    assert convert.server_info_from(wire) == info


def test_sessions_round_trip_and_cover_the_message() -> None:
    names = [f.name for f in dataclasses.fields(SessionInfo)]
    assert list(convert.SESSION_INFO_FIELDS) == names
    assert set(names) == set(pb.SessionInfo.DESCRIPTOR.fields_by_name)
    sessions = [SessionInfo("chat-1", "model-a", 42, 1.5e9), SessionInfo("chat-2", "m", 0, 0.25)]
    wire = pb.ListSessionsResponse.FromString(convert.sessions_to(sessions).SerializeToString())
    assert convert.sessions_from(wire, SessionInfo) == sessions


def test_stats_of_a_newer_server_with_a_tier_this_client_does_not_know_still_read() -> None:
    wire = convert.stats_to(_store_stats({Tier.HOST: TierStats(Tier.HOST, *range(8))}))
    wire.tiers.add(tier="remote", capacity_bytes=1)
    wire.bytes_moved.add(source="disk", destination="remote", num_bytes=9)
    wire.namespaces.add(tenant="t", namespace=pb.Namespace(model_id="m", dtype="fp3"))
    back = convert.stats_from(wire, TierStats, ServerStats, NamespaceStats, RemoteStats,
                              TenantTierStats)
    assert list(back.tiers) == [Tier.HOST] and back.tiers[Tier.HOST].used_bytes == 1
    assert set(back.bytes_moved) == {(Tier.HOST, Tier.DISK), (Tier.DISK, Tier.HOST)}
    assert back.namespaces == ()


def test_clear_results_round_trip_and_cover_the_message() -> None:
    names = [f.name for f in dataclasses.fields(ClearResult)]
    assert list(convert.CLEAR_RESULT_FIELDS) == names
    assert set(names) == set(pb.ClearProgress.DESCRIPTOR.fields_by_name) - {
        "num_blocks_done", "num_blocks_total", "done"}
    result = ClearResult(2, 5, 5 * 512, 1, 3)
    wire = pb.ClearProgress.FromString(convert.clear_result_to(result, 8).SerializeToString())
    assert (wire.done, wire.num_blocks_done, wire.num_blocks_total) == (True, 8, 8)
    assert convert.clear_result_from(wire, ClearResult) == result
    assert not convert.clear_progress_to(3, 8).done
    namespace = Namespace("m", KVLayout(2, 4, 8), tenant="ignored")
    request = convert.clear_request_to("acme", None, namespace, False)
    assert (request.tenant, request.model_id, request.all) == ("acme", "", False)
    assert namespace_from(request.namespace, "acme") == namespace.with_tenant("acme")
    assert not convert.clear_request_to(None, None, None, True).HasField("namespace")
