"""Authentication and tenants in the gRPC service: every call needs a valid token, and tenants
share nothing.

Every test talks to a real ``create_server`` (Unix socket and ``127.0.0.1:0``) in front of a real
``TieredStore`` (shared-memory HOST slab, LMDB disk tier in ``tmp_path``) with ``grpc.aio``
channels. The tenant is always decided by the bearer token: alice and bob share nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.harness import ALICE_TOKEN, Served
from tests.support.rpc_calls import (
    NS,
    Code,
    expect,
    lookup,
    put,
    stats,
)
from tests.support.service_fixtures import (
    ALICE,
    ALL_RPCS,
    BOB,
    LEASE_RPCS,
    bearer,
    code_of,
    commit_request,
    get_blocks,
    invoke,
    mapped_slab,
    payload,
    request_for,
    write_extents,
)
from tests.support.tiny_blocks import BLOCK_BYTES, keys
from tierkv.wire import tierkv_pb2 as pb

# --- authentication and tenants ----------------------------------------------------------------

BAD_CREDENTIALS = {
    "none": (),
    "wrong-token": bearer("w" * 32),
    "empty-token": bearer(""),
    "prefix-of-token": bearer(ALICE_TOKEN[:-1]),
    "no-bearer-prefix": (("authorization", ALICE_TOKEN),),
    "basic-scheme": (("authorization", f"Basic {ALICE_TOKEN}"),),
    "token-in-other-key": (("x-token", f"Bearer {ALICE_TOKEN}"),),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("credentials", BAD_CREDENTIALS.values(), ids=BAD_CREDENTIALS.keys())
async def test_every_call_without_a_valid_token_is_unauthenticated(
    served: Served, credentials: Any
) -> None:
    stub = served.stub()
    hashes = keys(2, salt="auth")
    await put(stub, hashes, payload(2))
    before = await stats(stub)
    for rpc in ALL_RPCS:
        request = request_for(rpc, NS, hashes)
        assert await code_of(stub, rpc, request, credentials) == Code.UNAUTHENTICATED, rpc
    after = await stats(stub)
    assert after == before
    assert (await lookup(stub, hashes)).num_cached == 2
    assert not (await stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE)).sessions


@pytest.mark.asyncio
async def test_tenants_do_not_see_each_others_blocks(served: Served) -> None:
    stub = served.stub()
    hashes = keys(4, salt="shared")
    alice_data, bob_data = payload(4, seed=41), payload(4, seed=42)
    assert await put(stub, hashes, alice_data, metadata=ALICE) == 4

    assert (await lookup(stub, hashes, metadata=BOB)).num_cached == 0
    assert (await get_blocks(stub, NS, hashes, BOB))[0] == 0
    assert (await stub.Pin(pb.PinRequest(namespace=NS, hashes=hashes), metadata=BOB)).count == 0
    assert (await stub.Delete(pb.BlocksRequest(namespace=NS, hashes=hashes),
                              metadata=BOB)).count == 0
    acquired = await stub.Acquire(pb.AcquireRequest(namespace=NS, hashes=hashes), metadata=BOB)
    assert acquired.num_blocks == 0
    await stub.Release(pb.LeaseRequest(lease_id=acquired.lease_id), metadata=BOB)

    # Bob stores his own bytes under the same namespace and hashes; each reads his own.
    assert await put(stub, hashes, bob_data, metadata=BOB) == 4
    assert (await get_blocks(stub, NS, hashes, ALICE))[1] == alice_data
    assert (await get_blocks(stub, NS, hashes, BOB))[1] == bob_data
    assert (await stub.Delete(pb.BlocksRequest(namespace=NS, hashes=hashes),
                              metadata=BOB)).count == 4
    assert (await get_blocks(stub, NS, hashes, ALICE)) == (4, alice_data, [len(alice_data)])


@pytest.mark.asyncio
async def test_another_tenants_lease_id_is_not_found(served: Served) -> None:
    stub = served.stub(unix=True)
    hashes = keys(3, salt="alice-lease")
    write = await stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=hashes), metadata=ALICE)
    for rpc in LEASE_RPCS:
        await expect(Code.NOT_FOUND, invoke(stub, rpc, pb.LeaseRequest(lease_id=write.lease_id),
                                            BOB))
    assert (await lookup(stub, hashes, metadata=ALICE)).num_cached == 0
    # Alice's lease is untouched by bob's attempts.
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    data = payload(3, seed=51)
    with mapped_slab(describe.shm_name) as slab:
        for index, extents in zip(write.write_indices, write.blocks, strict=True):
            write_extents(slab, extents, data[index * BLOCK_BYTES : (index + 1) * BLOCK_BYTES])
    assert (await stub.Commit(commit_request(write, data), metadata=ALICE)).count == 3

    read = await stub.Acquire(pb.AcquireRequest(namespace=NS, hashes=hashes), metadata=ALICE)
    assert read.num_blocks == 3
    await expect(Code.NOT_FOUND,
                 stub.Release(pb.LeaseRequest(lease_id=read.lease_id), metadata=BOB))
    await stub.Release(pb.LeaseRequest(lease_id=read.lease_id), metadata=ALICE)
    # Once finished, the id is still nobody else's: NOT_FOUND for bob, not FAILED_PRECONDITION.
    await expect(Code.NOT_FOUND,
                 stub.Commit(pb.LeaseRequest(lease_id=write.lease_id), metadata=BOB))
