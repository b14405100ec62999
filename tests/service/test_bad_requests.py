"""Every kind of bad request to the gRPC service is refused with its status code and changes
nothing.

Every test talks to a real ``create_server`` (Unix socket and ``127.0.0.1:0``) in front of a real
``TieredStore`` (shared-memory HOST slab, LMDB disk tier in ``tmp_path``) with ``grpc.aio``
channels. The tenant is always decided by the bearer token: alice and bob share nothing.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.harness import Served, serving
from tests.support.rpc_calls import (
    INVALID,
    NS,
    Bench,
    Code,
    drain,
    expect,
    expect_code,
    lookup,
    put,
    stats,
    unchanged,
)
from tests.support.service_fixtures import (
    ALICE,
    ALL_RPCS,
    BOB,
    HASH_RPCS,
    LEASE_RPCS,
    NAMESPACE_RPCS,
    aiter_of,
    code_of,
    invoke,
    mapped_slab,
    payload,
    put_chunks,
    request_for,
    wire_namespace,
    write_extents,
)
from tests.support.tiny_blocks import BLOCK_BYTES, keys
from tierkv.config import MiB
from tierkv.wire import tierkv_pb2 as pb

# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [0, 1, 31, 33, 64])
@pytest.mark.parametrize("rpc", HASH_RPCS)
async def test_a_hash_of_the_wrong_length_is_invalid(bench: Bench, rpc: str, size: int) -> None:
    hashes = [*bench.fresh[:2], b"\x01" * size, bench.fresh[3]]
    await expect_code(bench, INVALID, rpc, request_for(rpc, NS, hashes))
    hashes = [b"\x02" * size]  # alone (Lookup's inline path too)
    await expect_code(bench, INVALID, rpc, request_for(rpc, NS, hashes))


@pytest.mark.asyncio
@pytest.mark.parametrize("rpc", HASH_RPCS)
async def test_a_million_hashes_exceed_the_message_limit(bench: Bench, rpc: str) -> None:
    request = request_for(rpc, NS, [bench.fresh[0]] * 10**6, block_bytes=0)
    await expect_code(bench, {Code.RESOURCE_EXHAUSTED}, rpc, request)


@pytest.mark.asyncio
@pytest.mark.parametrize("rpc", HASH_RPCS)
async def test_more_hashes_than_max_hashes_per_call_are_invalid(bench: Bench, rpc: str) -> None:
    # 70000 hashes are 2.4 MB: under the message limit, over max_hashes_per_call (65536).
    request = request_for(rpc, NS, [bench.fresh[0]] * 70000, block_bytes=0)
    await expect_code(bench, INVALID, rpc, request)


BAD_TTLS = [-1.0, -1e-9, math.nan, math.inf, -math.inf, 1e300]


@pytest.mark.asyncio
async def test_a_lower_max_hashes_per_call_holds_for_every_lookup(tmp_path: Path) -> None:
    """Short lookups are answered on the event loop; the limit holds there too."""
    async with serving(tmp_path / "store", max_hashes_per_call=16) as served:
        stub = served.stub()
        hashes = keys(17, salt="limit")
        await put(stub, hashes[:4], payload(4, seed=97))  # the namespace is known from here on
        assert (await lookup(stub, hashes[:16])).num_cached == 4
        await expect(Code.INVALID_ARGUMENT, lookup(stub, hashes))


@pytest.mark.asyncio
@pytest.mark.parametrize("ttl", BAD_TTLS, ids=str)
async def test_bad_ttls_are_invalid(bench: Bench, ttl: float) -> None:
    cases = [
        ("Lookup", {"pin_ttl_s": ttl}, bench.stored),
        ("Pin", {"ttl_s": ttl}, bench.stored),
        ("Acquire", {"lease_ttl_s": ttl}, bench.stored),
        ("Allocate", {"lease_ttl_s": ttl}, bench.fresh),
        ("SaveSession", {"ttl_s": ttl}, []),
    ]
    for rpc, fields, hashes in cases:
        await expect_code(bench, INVALID, rpc, request_for(rpc, NS, hashes, **fields))
    assert (await stats(bench.stub)).num_pinned == 0


@pytest.mark.asyncio
async def test_ttls_over_their_limits_are_invalid(bench: Bench) -> None:
    month = 30 * 24 * 3600.0
    cases = [
        ("Lookup", {"pin_ttl_s": month + 1}, bench.stored),
        ("Pin", {"ttl_s": month + 1}, bench.stored),
        ("Acquire", {"lease_ttl_s": 601.0}, bench.stored),
        ("Allocate", {"lease_ttl_s": 601.0}, bench.fresh),
        ("SaveSession", {"ttl_s": month + 1}, []),
    ]
    for rpc, fields, hashes in cases:
        await expect_code(bench, INVALID, rpc, request_for(rpc, NS, hashes, **fields))


@pytest.mark.asyncio
async def test_a_refused_lookup_moves_nothing(small: Served) -> None:
    """Lookup(prefetch, bad pin_ttl_s) is refused, so it must not prefetch either: bad input
    changes nothing (the store's rule), and the blocks stay where they were."""
    stub = small.stub()
    on_disk = keys(4, salt="cold")
    await put(stub, on_disk, payload(4, 81))
    await put(stub, keys(8, salt="hot"), payload(8, 82))
    assert (await lookup(stub, on_disk)).num_disk == 4
    before = await stats(stub)
    await expect(Code.INVALID_ARGUMENT, lookup(stub, on_disk, prefetch=True, pin_ttl_s=-1.0))
    where = await lookup(stub, on_disk)
    assert (where.num_host, where.num_disk) == (0, 4), "a refused Lookup prefetched its blocks"
    assert await stats(stub) == before


@pytest.mark.asyncio
async def test_unknown_sessions_are_not_found(bench: Bench) -> None:
    for rpc in ("ResumeSession",):
        await expect_code(bench, {Code.NOT_FOUND}, rpc, pb.SessionRequest(session_id="nope"))
    response = await bench.stub.DeleteSession(pb.SessionRequest(session_id="nope"), metadata=ALICE)
    assert not response.deleted


@pytest.mark.asyncio
@pytest.mark.parametrize("session_id", ["", "x" * 257, "é" * 129, "a\x00b"],
                         ids=["empty", "257-bytes", "258-utf8-bytes", "nul"])
async def test_bad_session_ids_are_invalid(bench: Bench, session_id: str) -> None:
    for rpc in ("SaveSession", "ResumeSession", "DeleteSession"):
        await expect_code(bench, INVALID, rpc, request_for(rpc, NS, session_id=session_id))


@pytest.mark.asyncio
async def test_random_lease_ids_are_not_found(bench: Bench) -> None:
    for lease_id in (b"", bytes(16), os.urandom(16), os.urandom(40)):
        for rpc in LEASE_RPCS:
            await expect_code(bench, {Code.NOT_FOUND}, rpc, pb.LeaseRequest(lease_id=lease_id))


@pytest.mark.asyncio
async def test_a_lease_of_the_other_kind_is_not_found(bench: Bench) -> None:
    stub = bench.stub
    async with unchanged(bench):
        read = await stub.Acquire(pb.AcquireRequest(namespace=NS, hashes=bench.stored),
                                  metadata=ALICE)
        write = await stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=bench.fresh),
                                    metadata=ALICE)
        for rpc in ("Commit", "Abort"):
            await expect(Code.NOT_FOUND, invoke(stub, rpc, pb.LeaseRequest(lease_id=read.lease_id)))
        await expect(Code.NOT_FOUND,
                     stub.Release(pb.LeaseRequest(lease_id=write.lease_id), metadata=ALICE))
        await stub.Release(pb.LeaseRequest(lease_id=read.lease_id), metadata=ALICE)
        await stub.Abort(pb.LeaseRequest(lease_id=write.lease_id), metadata=ALICE)


@pytest.mark.asyncio
async def test_commit_after_expiry_fails_and_stores_nothing(bench: Bench) -> None:
    stub = bench.stub
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    async with unchanged(bench):
        lease = await stub.Allocate(
            pb.AllocateRequest(namespace=NS, hashes=bench.fresh, lease_ttl_s=0.3), metadata=ALICE)
        assert 0 < lease.expires_in_s <= 0.3
        with mapped_slab(describe.shm_name) as slab:
            for index, extents in zip(lease.write_indices, lease.blocks, strict=True):
                data = payload(4, seed=5)[index * BLOCK_BYTES : (index + 1) * BLOCK_BYTES]
                write_extents(slab, extents, data)
        await asyncio.sleep(0.6)
        for rpc in ("Commit", "Abort"):
            await expect(Code.FAILED_PRECONDITION,
                         invoke(stub, rpc, pb.LeaseRequest(lease_id=lease.lease_id)))
        # Another client still gets NOT_FOUND for it.
        await expect(Code.NOT_FOUND,
                     stub.Commit(pb.LeaseRequest(lease_id=lease.lease_id), metadata=BOB))

        read = await stub.Acquire(
            pb.AcquireRequest(namespace=NS, hashes=bench.stored, lease_ttl_s=0.3), metadata=ALICE)
        await asyncio.sleep(0.6)
        await expect(Code.FAILED_PRECONDITION,
                     stub.Release(pb.LeaseRequest(lease_id=read.lease_id), metadata=ALICE))


@pytest.mark.asyncio
async def test_another_tenants_lease_changes_nothing(bench: Bench) -> None:
    stub = bench.stub
    async with unchanged(bench):
        lease = await stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=bench.fresh),
                                    metadata=ALICE)
        for rpc in LEASE_RPCS:
            await expect(Code.NOT_FOUND, invoke(stub, rpc, pb.LeaseRequest(lease_id=lease.lease_id),
                                                BOB))
        await stub.Abort(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE)


@pytest.mark.asyncio
async def test_wrong_payload_sizes_are_invalid(bench: Bench) -> None:
    data = payload(4, seed=91)
    cases = {
        "one byte short": data[:-1],
        "one block short": data[:-BLOCK_BYTES],
        "one byte over": data + b"\x00",
        "one block over": data + data[:BLOCK_BYTES],
        "nothing": b"",
    }
    for what, body in cases.items():
        for sizes in ([MiB], [7, 100]):
            chunks = put_chunks(NS, bench.fresh, body, sizes=sizes)
            async with unchanged(bench, what):
                await expect(Code.INVALID_ARGUMENT, bench.stub.Put(aiter_of(chunks), metadata=ALICE))


@pytest.mark.asyncio
async def test_put_streams_with_bad_headers_are_invalid(bench: Bench) -> None:
    data = payload(4, seed=92)
    good = put_chunks(NS, bench.fresh, data, sizes=[1000])
    header = good[0].header
    cases = {
        "empty stream": [],
        "no header at all": [pb.PutChunk(data=data)],
        "header in the second message": [pb.PutChunk(data=data[:10]),
                                         pb.PutChunk(header=header, data=data[10:])],
        "a second header": [*good[:2], pb.PutChunk(header=header), *good[2:]],
        "a second header, empty": [*good[:2], pb.PutChunk(header=pb.PutHeader()), *good[2:]],
        "a header repeated at the end": [*good, pb.PutChunk(header=header)],
    }
    for what, chunks in cases.items():
        async with unchanged(bench, what):
            await expect(Code.INVALID_ARGUMENT, bench.stub.Put(aiter_of(chunks), metadata=ALICE))


BAD_NAMESPACES = {
    "empty model_id": wire_namespace(model_id=""),
    "257-char model_id": wire_namespace(model_id="m" * 257),
    "0 layers": wire_namespace(num_layers=0),
    "0 heads": wire_namespace(num_kv_heads=0),
    "0 head_dim": wire_namespace(head_dim=0),
    "100000 heads": wire_namespace(num_kv_heads=100000),
    "2**32-1 layers": wire_namespace(num_layers=2**32 - 1),
    "huge head_dim": wire_namespace(head_dim=10**9),
    "huge block_size": wire_namespace(block_size=2**31),
    "unknown dtype": wire_namespace(dtype="fp12"),
    "dtype with spaces": wire_namespace(dtype=" fp16 "),
    "int4 with odd head_dim": wire_namespace(head_dim=7, dtype="int4"),
    "tp_rank == tp_size": wire_namespace(tp_rank=2, tp_size=2),
    "tp_rank > tp_size": wire_namespace(tp_rank=5, tp_size=2),
    "tp_rank with tp_size 0": wire_namespace(tp_rank=1, tp_size=0),
    "max tp_rank": wire_namespace(tp_rank=2**32 - 1, tp_size=2**32 - 1),
    "no namespace": pb.Namespace(),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("rpc", NAMESPACE_RPCS)
async def test_bad_namespaces_are_invalid(bench: Bench, rpc: str) -> None:
    for what, namespace in BAD_NAMESPACES.items():
        request = request_for(rpc, namespace, bench.fresh[:2])
        async with unchanged(bench, what):
            code = await code_of(bench.stub, rpc, request)
        assert code == Code.INVALID_ARGUMENT, (what, code)
    # A good namespace in the same call shape works (the cases above fail for their namespace).
    assert await code_of(bench.stub, rpc, request_for(rpc, NS, [])) == Code.OK


HUGE_GEOMETRIES = {
    # Every field within its bound; a block of 2**47 bytes.
    "petabyte block": wire_namespace(num_layers=1024, num_kv_heads=1024, head_dim=4096,
                                     block_size=4096, dtype="fp32"),
    # One block of 64 KiB, twice the whole 32 KiB HOST budget.
    "block over HOST": wire_namespace(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("rpc", ("Put", "Acquire", "Allocate", "SaveSession"))
@pytest.mark.parametrize("geometry", HUGE_GEOMETRIES.values(), ids=HUGE_GEOMETRIES.keys())
async def test_a_block_that_does_not_fit_host_is_refused(
    bench: Bench, rpc: str, geometry: pb.Namespace
) -> None:
    request = request_for(rpc, geometry, bench.fresh[:2], block_bytes=0)
    await expect_code(bench, {Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED}, rpc, request)


@pytest.mark.asyncio
@pytest.mark.parametrize("rpc", ("Lookup", "Pin", "Unpin", "Delete", "Get"))
@pytest.mark.parametrize("geometry", HUGE_GEOMETRIES.values(), ids=HUGE_GEOMETRIES.keys())
async def test_reads_of_a_namespace_that_cannot_hold_blocks_are_misses(
    bench: Bench, rpc: str, geometry: pb.Namespace
) -> None:
    # Read-only calls never register a namespace: one nobody stored into holds nothing.
    request = request_for(rpc, geometry, bench.fresh[:2], block_bytes=0)
    await expect_code(bench, {Code.OK}, rpc, request)


@pytest.mark.asyncio
@pytest.mark.parametrize("value", [5, 7, -1, 2**31 - 1, -(2**31)])
async def test_unknown_enum_values_are_invalid(bench: Bench, value: int) -> None:
    data = payload(4, seed=95)
    for field in ("write_policy", "priority"):
        chunks = put_chunks(NS, bench.fresh, data, **{field: value})
        async with unchanged(bench, f"Put {field}={value}"):
            await expect(Code.INVALID_ARGUMENT, bench.stub.Put(aiter_of(chunks), metadata=ALICE))
        request = pb.AllocateRequest(namespace=NS, hashes=bench.fresh, **{field: value})
        await expect_code(bench, INVALID, "Allocate", request)


@pytest.mark.asyncio
async def test_every_known_enum_value_is_accepted(served: Served) -> None:
    stub = served.stub()
    for policy in (0, 1, 2):
        for priority in (0, 1, 2, 3, 4):
            hashes = keys(1, salt=f"enum-{policy}-{priority}")
            assert await put(stub, hashes, payload(1), write_policy=policy, priority=priority) == 1
            hashes = keys(1, salt=f"enum-lease-{policy}-{priority}")
            lease = await stub.Allocate(pb.AllocateRequest(
                namespace=NS, hashes=hashes, write_policy=policy, priority=priority),
                metadata=ALICE)
            await stub.Abort(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE)


@pytest.mark.asyncio
async def test_no_room_is_resource_exhausted_and_stores_nothing(bench: Bench) -> None:
    stub = bench.stub
    # 64 blocks of HOST: 4 stored and pinned, so 61 new ones cannot all fit.
    await stub.Pin(pb.PinRequest(namespace=NS, hashes=bench.stored), metadata=ALICE)
    try:
        hashes = keys(61, salt="full")
        async with unchanged(bench):
            await expect(Code.RESOURCE_EXHAUSTED, put(stub, hashes, payload(61)))
            await expect(Code.RESOURCE_EXHAUSTED,
                         stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=hashes),
                                       metadata=ALICE))
            assert (await lookup(stub, hashes)).num_cached == 0
    finally:
        await stub.Unpin(pb.BlocksRequest(namespace=NS, hashes=bench.stored), metadata=ALICE)


@pytest.mark.asyncio
async def test_long_values_in_bad_requests_keep_their_status(bench: Bench) -> None:
    """A bad value the client made long (a 100 KB lease id, a 100 KB dtype) must still get its
    own code, NOT_FOUND / INVALID_ARGUMENT: the server must not echo it whole into the status
    message, which the client's transport refuses as oversize metadata (then RESOURCE_EXHAUSTED
    "received metadata size exceeds hard limit"; between 8 and 16 KiB at random)."""
    stub = bench.stub
    for rpc in LEASE_RPCS:
        error = await expect({Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED},
                             invoke(stub, rpc, pb.LeaseRequest(lease_id=b"\x07" * 100_000)))
        assert error.code() == Code.NOT_FOUND, (rpc, error.details())
    error = await expect({Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED},
                         lookup(stub, bench.fresh, wire_namespace(dtype="q" * 100_000)))
    assert error.code() == Code.INVALID_ARGUMENT, error.details()


@pytest.mark.asyncio
async def test_undecodable_requests_are_invalid_argument(bench: Bench) -> None:
    """Bytes that are not the request message (corrupt wire format; a string field that is not
    UTF-8, which a C++ or Go client can send) are malformed input: INVALID_ARGUMENT, never
    UNKNOWN."""
    channel = bench.served.channel()
    bad_utf8 = pb.LookupRequest(namespace=wire_namespace(model_id="ABCD"),
                                hashes=bench.fresh).SerializeToString().replace(b"ABCD", b"\xff\xfe\xfd\xfc")
    bad_session = pb.SessionRequest(session_id="ABCD").SerializeToString().replace(
        b"ABCD", b"\xc3\x28\xa0\xa1")
    cases = [("Lookup", bad_utf8), ("ResumeSession", bad_session)]
    cases += [(rpc, b"\xff\xff\xff\xff") for rpc in ALL_RPCS if rpc not in ("Put", "Get")]
    header = pb.PutChunk(header=pb.PutHeader(namespace=NS, hashes=bench.fresh[:1]))
    put_cases = {  # Put: a corrupt first message, or a corrupt one after a good header
        "Put:corrupt-first": [b"\xff\xff\xff\xff"],
        "Put:corrupt-second": [header.SerializeToString(), b"\xff\xff\xff\xff"],
    }
    codes: dict[str, str] = {}

    async def code(label: str, start: Callable[[], Awaitable[Any]]) -> None:
        # An aio call starts when it is made: make it inside, after the "before" stats.
        async with unchanged(bench, label):
            try:
                await start()
                codes[label] = "OK"
            except grpc.aio.AioRpcError as exc:
                codes[label] = exc.code().name

    for index, (rpc, raw) in enumerate(cases):
        label = f"{rpc}:{'bad-utf8' if index < 2 else 'corrupt'}"
        unary_call = channel.unary_unary(f"/tierkv.v1.TierKV/{rpc}")
        await code(label, functools.partial(unary_call, raw, metadata=ALICE))
    for label, messages in put_cases.items():
        put_call = channel.stream_unary("/tierkv.v1.TierKV/Put")
        await code(label, functools.partial(put_call, aiter_of(messages), metadata=ALICE))
    get_call = channel.unary_stream("/tierkv.v1.TierKV/Get")
    await code("Get:corrupt", lambda: drain(get_call(b"\xff\xff\xff\xff", metadata=ALICE)))
    wrong = {label: code for label, code in codes.items() if code != "INVALID_ARGUMENT"}
    assert not wrong, f"undecodable requests answered {wrong}"
