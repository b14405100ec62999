"""Property: whatever well-typed request a client sends to any RPC, the server answers OK or one
of the contract's error codes (never UNKNOWN or INTERNAL), and it keeps answering.

Hypothesis builds random protobuf requests for every RPC of ``tierkv.v1.TierKV``: block hashes
of every length (mostly 32 bytes, many of them stored), namespaces with zeros, huge and bogus
fields, TTLs that are NaN, infinite, negative or huge, enum values the proto never named, lease
ids (random, or granted earlier, possibly to someone else), session ids and token ids, and Put
streams that are exact, short, long, headerless or with extra headers; under alice's, bob's, a
wrong or no token. They all go to one real server (module-scoped, on its own event loop) over
TCP; after every example a Describe must still work.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.harness import CHANNEL_OPTIONS, BackgroundServer
from tests.support.service_fixtures import (
    ALICE,
    ALL_RPCS,
    ALLOWED_ERRORS,
    BOB,
    bearer,
    payload,
    put_chunks,
    wire_namespace,
)
from tests.support.tiny_blocks import TINY_LAYOUT, keys
from tierkv import KVLayout
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

Code = grpc.StatusCode
TIMEOUT_S = 30.0
MAX_U32 = 2**32 - 1

# Namespaces the server accepts, with their layouts (so that exact Put streams can be built).
DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")
GOOD_LAYOUTS: dict[str, KVLayout] = {"test-model": TINY_LAYOUT} | {
    f"prop-{dtype}": KVLayout(1, 2, 8, 4, dtype) for dtype in DTYPES
}
GOOD_NAMESPACES = [wire_namespace(layout, model_id) for model_id, layout in GOOD_LAYOUTS.items()]
POOL = keys(16, salt="pool")  # stored (for alice, in test-model) before the examples run

GOOD_CREDENTIALS = [ALICE, BOB, (*ALICE, ("x-tierkv-client", "other-client"))]
BAD_CREDENTIALS = [(), bearer("w" * 32), (("authorization", "Bearer"),)]

# Lease ids the server granted in earlier examples (to alice, bob, or alice's other client).
GRANTED: list[bytes] = []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    background = BackgroundServer(tmp_path_factory.mktemp("property") / "store",
                                  host_blocks=64, disk_blocks=1024)
    try:
        yield background
    finally:
        background.close()


@pytest.fixture(scope="module")
def stub(server: BackgroundServer) -> Iterator[pb_grpc.TierKVStub]:
    channel = grpc.insecure_channel(server.target, options=CHANNEL_OPTIONS)
    tierkv = pb_grpc.TierKVStub(channel)
    chunks = put_chunks(wire_namespace(), POOL, payload(len(POOL), seed=1234))
    tierkv.Put(iter(chunks), metadata=ALICE, timeout=TIMEOUT_S)
    try:
        yield tierkv
    finally:
        channel.close()


@pytest.fixture(scope="module")
def shm_size(stub: pb_grpc.TierKVStub) -> int:
    return int(stub.Describe(pb.DescribeRequest(), metadata=ALICE).shm_size_bytes)


# --- strategies --------------------------------------------------------------------------------

u32 = st.one_of(
    st.integers(0, 8),
    st.sampled_from([16, 1024, 1025, 4096, 4097, 100_000, 2**31 - 1, 2**31, MAX_U32]),
    st.integers(0, MAX_U32),
)
utf8_text = st.text(st.characters(codec="utf-8"), max_size=24)

random_namespaces = st.builds(
    pb.Namespace,
    model_id=st.one_of(st.sampled_from(["test-model", "", "m" * 256, "m" * 257]), utf8_text),
    num_layers=u32,
    num_kv_heads=u32,
    head_dim=u32,
    block_size=u32,
    dtype=st.one_of(
        st.sampled_from([*DTYPES, "", "float16", "half", "bfloat16", "torch.float16", "INT4",
                         "fp12", "e4m3"]),
        st.text(st.characters(codec="utf-8"), max_size=12),
    ),
    tp_rank=u32,
    tp_size=u32,
)
namespaces = st.one_of(st.sampled_from(GOOD_NAMESPACES), random_namespaces)

hash32 = st.one_of(st.sampled_from(POOL), st.binary(min_size=32, max_size=32))
any_hash = st.one_of(hash32, hash32, hash32, st.binary(max_size=64))
short_hash_lists = st.one_of(st.lists(hash32, max_size=12), st.lists(any_hash, max_size=12))
# Over the inline-lookup bound, at and over max_hashes_per_call, over the 4 MiB message limit.
long_hash_lists = st.builds(lambda h, n: [h] * n, hash32,
                            st.sampled_from([65, 200, 65536, 65537, 140_000]))


@st.composite
def blocks_fields(draw: st.DrawFn) -> dict[str, Any]:
    """A namespace and hashes. Long hash lists go with the tiny layout only (a long list of a
    big-block namespace is test_service's subject, not this test's)."""
    if draw(st.integers(0, 19)) == 19:
        return {"namespace": wire_namespace(), "hashes": draw(long_hash_lists)}
    return {"namespace": draw(namespaces), "hashes": draw(short_hash_lists)}


ttls = st.one_of(
    st.sampled_from([0.0, -0.0, 0.05, 1.0, 30.0, 600.0, 601.0, 2_592_000.0, 2_592_001.0,
                     -1.0, 5e-324, 1e300, math.nan, math.inf, -math.inf]),
    st.floats(),
)
enums = st.one_of(st.integers(0, 4), st.integers(-(2**31), 2**31 - 1))


def _granted(index: int) -> bytes:
    return GRANTED[index % len(GRANTED)] if GRANTED else b""


lease_ids = st.one_of(
    st.builds(_granted, st.integers(0, 1000)),
    st.binary(max_size=40),
    st.binary(min_size=16, max_size=16),
)
session_ids = st.one_of(
    st.sampled_from(["s1", "s2", "chat", "x" * 256, "x" * 257, "a\x00b", "é" * 128]),
    st.text(st.characters(codec="utf-8"), max_size=300),
)
token_ids = st.lists(st.integers(0, MAX_U32), max_size=64)


@st.composite
def put_streams(draw: st.DrawFn) -> list[pb.PutChunk]:
    """The messages of one Put: exact (the right number of bytes), short or long by a little,
    random bytes, no header, a second header, or nothing at all."""
    fields = draw(blocks_fields())
    header = pb.PutHeader(
        **fields,
        write_policy=draw(st.one_of(st.integers(0, 2), enums)),
        priority=draw(st.one_of(st.integers(0, 4), enums)),
    )
    layout = GOOD_LAYOUTS.get(header.namespace.model_id)
    exact = 0
    if layout is not None and header.namespace in GOOD_NAMESPACES:
        exact = len(header.hashes) * layout.bytes_per_block
    if exact > 4 << 20:
        exact = 0
    mode = draw(st.sampled_from(["exact", "exact", "short", "long", "random", "no-header",
                                 "two-headers", "empty"]))
    size = {"exact": exact, "short": max(exact - 1, 0), "long": exact + 1}.get(
        mode, draw(st.integers(0, 4096))
    )
    data = random.Random(draw(st.integers(0, 2**32))).randbytes(size)
    sizes = draw(st.lists(st.sampled_from([1 << 20, 65536, 1000, 512, 7, 1]), min_size=1,
                          max_size=4))
    pieces: list[bytes] = []
    while data:  # at most 16 pieces: the last one takes the rest
        cut = sizes[len(pieces) % len(sizes)] if len(pieces) < 15 else len(data)
        pieces.append(data[:cut])
        data = data[cut:]
    if mode == "empty":
        return []
    chunks = [pb.PutChunk(data=piece) for piece in pieces] or [pb.PutChunk()]
    if mode != "no-header":
        chunks[0].header.CopyFrom(header)
    if mode == "two-headers":
        chunks.insert(draw(st.integers(1, len(chunks))), pb.PutChunk(header=header))
    return chunks


REQUESTS: dict[str, st.SearchStrategy[Any]] = {
    "Describe": st.just(pb.DescribeRequest()),
    "Lookup": st.builds(lambda f, p, t: pb.LookupRequest(**f, prefetch=p, pin_ttl_s=t),
                        blocks_fields(), st.booleans(), ttls),
    "Pin": st.builds(lambda f, t: pb.PinRequest(**f, ttl_s=t), blocks_fields(), ttls),
    "Unpin": st.builds(lambda f: pb.BlocksRequest(**f), blocks_fields()),
    "Delete": st.builds(lambda f: pb.BlocksRequest(**f), blocks_fields()),
    "Publish": st.builds(lambda f, t: pb.PublishRequest(**f, timeout_s=t), blocks_fields(),
                         st.one_of(st.sampled_from([0.0, 0.01, -1.0, 61.0]),
                                   st.floats(allow_nan=True))),
    "Put": put_streams(),
    "Get": st.builds(lambda f: pb.BlocksRequest(**f), blocks_fields()),
    "Acquire": st.builds(lambda f, t: pb.AcquireRequest(**f, lease_ttl_s=t), blocks_fields(),
                         ttls),
    "Release": st.builds(pb.LeaseRequest, lease_id=lease_ids),
    "Allocate": st.builds(
        lambda f, w, p, t: pb.AllocateRequest(**f, write_policy=w, priority=p, lease_ttl_s=t),
        blocks_fields(), st.one_of(st.integers(0, 2), enums), st.one_of(st.integers(0, 4), enums),
        ttls,
    ),
    "Commit": st.builds(pb.LeaseRequest, lease_id=lease_ids),
    "Abort": st.builds(pb.LeaseRequest, lease_id=lease_ids),
    "SaveSession": st.builds(pb.SaveSessionRequest, namespace=namespaces,
                             session_id=session_ids, token_ids=token_ids, ttl_s=ttls),
    "ResumeSession": st.builds(pb.SessionRequest, session_id=session_ids),
    "DeleteSession": st.builds(pb.SessionRequest, session_id=session_ids),
    "ListSessions": st.just(pb.ListSessionsRequest()),
    "Stats": st.builds(pb.StatsRequest, max_namespaces=u32),
    # Never test-model's namespaces nor a bare `all`: the POOL blocks stay for the other calls.
    "Clear": st.builds(
        pb.ClearRequest,
        tenant=st.one_of(st.sampled_from(["", "alice", "bob", "default"]), utf8_text),
        model_id=st.one_of(st.sampled_from(["", "prop-fp16", "m" * 257]), utf8_text),
        namespace=st.one_of(st.none(), st.sampled_from(GOOD_NAMESPACES[1:]), random_namespaces
                            .filter(lambda ns: ns.model_id != "test-model")),
        all=st.booleans(),
    ).filter(lambda r: not r.all or bool(r.tenant or r.model_id or r.HasField("namespace"))),
}
credentials = st.one_of(st.sampled_from(GOOD_CREDENTIALS), st.just(ALICE),
                        st.sampled_from(BAD_CREDENTIALS))


def test_every_rpc_has_a_strategy() -> None:
    assert set(REQUESTS) == set(ALL_RPCS)


# --- the property ------------------------------------------------------------------------------


def call(stub: pb_grpc.TierKVStub, rpc: str, request: Any, metadata: Any) -> Any:
    if rpc in ("Get", "Clear"):  # stream-out calls: every message
        return list(getattr(stub, rpc)(request, metadata=metadata, timeout=TIMEOUT_S))
    if rpc == "Put":
        return stub.Put(iter(request), metadata=metadata, timeout=TIMEOUT_S)
    return getattr(stub, rpc)(request, metadata=metadata, timeout=TIMEOUT_S)


def hashes_of(rpc: str, request: Any) -> list[bytes]:
    if rpc == "Put":
        return list(request[0].header.hashes) if request else []
    return list(getattr(request, "hashes", []))


def oversize(rpc: str, request: Any) -> bool:
    """Whether a message of the request is over the server's 4 MiB limit."""
    messages = request if rpc == "Put" else [request]
    return any(message.ByteSize() > 4 << 20 for message in messages)


def check_response(rpc: str, request: Any, response: Any, shm_size: int) -> None:
    """What an OK answer must look like."""
    hashes = hashes_of(rpc, request)

    def within_slab(blocks: Any) -> bool:
        return all(e.offset + e.length <= shm_size and e.length > 0
                   for block in blocks for e in block.extents)

    if rpc == "Lookup":
        assert response.num_cached <= len(hashes)
        assert response.num_gpu + response.num_host + response.num_disk == response.num_cached
        assert response.num_pinned <= len(hashes)
    elif rpc in ("Put", "Pin", "Unpin", "Delete", "Publish"):
        assert response.count <= len(hashes)
    elif rpc == "Get":
        num_blocks = response[0].num_blocks
        assert num_blocks <= len(hashes)
        assert all(chunk.num_blocks == 0 for chunk in response[1:])
        assert all(len(chunk.data) <= 1 << 20 for chunk in response)
        layout = GOOD_LAYOUTS.get(request.namespace.model_id)
        if layout is not None and request.namespace in GOOD_NAMESPACES:
            assert sum(len(c.data) for c in response) == num_blocks * layout.bytes_per_block
    elif rpc == "Acquire":
        assert response.num_blocks == len(response.blocks) <= len(hashes)
        assert within_slab(response.blocks)
        GRANTED.append(response.lease_id)
    elif rpc == "Allocate":
        indices = list(response.write_indices)
        assert response.num_blocks == len(response.blocks) == len(indices)
        assert indices == sorted(set(indices)) and all(i < len(hashes) for i in indices)
        assert within_slab(response.blocks)
        GRANTED.append(response.lease_id)
    elif rpc == "SaveSession":
        assert response.num_tokens == len(request.token_ids)
    elif rpc == "Clear":
        assert response and response[-1].done and not any(m.done for m in response[:-1])
        assert all(m.num_blocks_done <= m.num_blocks_total for m in response)
    del GRANTED[:-64]


def check_call(stub: pb_grpc.TierKVStub, rpc: str, request: Any, metadata: Any,
               shm_size: int) -> Code:
    code = _check_call(stub, rpc, request, metadata, shm_size)
    event(f"{rpc}: {code.name}")  # --hypothesis-show-statistics shows how often each happened
    return code


def _check_call(stub: pb_grpc.TierKVStub, rpc: str, request: Any, metadata: Any,
                shm_size: int) -> Code:
    try:
        response = call(stub, rpc, request, metadata)
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in ALLOWED_ERRORS, f"{rpc} answered {code}: {exc.details()}"
        if metadata in BAD_CREDENTIALS and not oversize(rpc, request):
            # (A message over the limit is refused before any handler sees its credentials.)
            assert code == Code.UNAUTHENTICATED, (rpc, code, exc.details())
        return code
    assert metadata not in BAD_CREDENTIALS, f"{rpc} succeeded without valid credentials"
    check_response(rpc, request, response, shm_size)
    return Code.OK


def still_up(stub: pb_grpc.TierKVStub) -> None:
    describe = stub.Describe(pb.DescribeRequest(), metadata=ALICE, timeout=TIMEOUT_S)
    assert describe.shm_name


@pytest.mark.parametrize("rpc", ALL_RPCS)
def test_random_requests_get_allowed_codes(
    stub: pb_grpc.TierKVStub, shm_size: int, rpc: str
) -> None:
    @settings(max_examples=100, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=REQUESTS[rpc], metadata=credentials)
    def property_(request: Any, metadata: Any) -> None:
        check_call(stub, rpc, request, metadata, shm_size)
        still_up(stub)

    property_()


calls = st.one_of(*(st.tuples(st.just(rpc), REQUESTS[rpc], credentials) for rpc in ALL_RPCS))


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(sequence=st.lists(calls, min_size=1, max_size=12))
def test_random_call_sequences_get_allowed_codes(
    stub: pb_grpc.TierKVStub, shm_size: int, sequence: list[tuple[str, Any, Any]]
) -> None:
    """Calls that build on each other (a lease granted, then committed by someone; blocks put,
    then pinned and deleted) keep to the same rules."""
    for rpc, request, metadata in sequence:
        check_call(stub, rpc, request, metadata, shm_size)
    still_up(stub)


def test_the_server_is_healthy_after_all_that(server: BackgroundServer,
                                              stub: pb_grpc.TierKVStub) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(server.target)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
    assert Path(f"/dev/shm/{stub.Describe(pb.DescribeRequest(), metadata=ALICE).shm_name}").exists()
