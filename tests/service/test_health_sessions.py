"""Health, reflection and chat sessions in the gRPC service.

Every test talks to a real ``create_server`` (Unix socket and ``127.0.0.1:0``) in front of a real
``TieredStore`` (shared-memory HOST slab, LMDB disk tier in ``tmp_path``) with ``grpc.aio``
channels. The tenant is always decided by the bearer token: alice and bob share nothing.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.harness import TOKENS, Served, short_socket_dir, store_config
from tests.support.rpc_calls import (
    NS,
    Code,
    expect,
    put,
)
from tests.support.service_fixtures import (
    ALICE,
    ALL_RPCS,
    BOB,
    aiter_of,
    code_of,
    get_blocks,
    payload,
    request_for,
)
from tests.support.tiny_blocks import TINY_LAYOUT, keys
from tierkv import StoreClosedError, TieredStore, block_hashes
from tierkv.service.config import ServiceConfig
from tierkv.service.server import TierKVServer
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

# --- health and reflection ---------------------------------------------------------------------


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
    return int(response.status)


@pytest.mark.asyncio
async def test_health_is_serving_with_a_store(served: Served) -> None:
    channel = served.channel()
    assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    assert await health_status(channel, "tierkv.v1.TierKV") == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.asyncio
async def test_a_server_without_a_store_is_not_serving_until_attached(tmp_path: Path) -> None:
    socket_dir = short_socket_dir()
    config = ServiceConfig(listen=(f"unix://{socket_dir}/s.sock", "127.0.0.1:0"),
                           tokens=dict(TOKENS))
    server = TierKVServer(config)
    port = server.bind()
    await server.start()
    store: TieredStore | None = None
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert await health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await health_status(channel, "tierkv.v1.TierKV") == (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )
        stub = pb_grpc.TierKVStub(channel)
        for rpc in ALL_RPCS:
            request = request_for(rpc, NS, keys(2))
            assert await code_of(stub, rpc, request, ALICE) == Code.UNAVAILABLE, rpc
            # Credentials are still checked first.
            assert await code_of(stub, rpc, request, ()) == Code.UNAUTHENTICATED, rpc

        (tmp_path / "store").mkdir()
        store = TieredStore(store_config(tmp_path / "store"))
        await server.attach(store)
        assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        assert await put(stub, keys(2), payload(2)) == 2
        assert (await get_blocks(stub, NS, keys(2)))[1] == payload(2)
        describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
        assert describe.shm_name == store.sidecar.host_shm_name
    finally:
        await channel.close()
        await server.stop()
        if store is not None:
            with pytest.raises(StoreClosedError):  # stop() closed it
                store.stats()
        shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.mark.asyncio
async def test_reflection_lists_the_service(served: Served) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(served.channel())
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = [r async for r in stub.ServerReflectionInfo(aiter_of([request]))]
    names = {s.name for s in responses[0].list_services_response.service}
    assert "tierkv.v1.TierKV" in names
    assert "grpc.health.v1.Health" in names
    # And the file describing it is served too (a stock client can then call it).
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="tierkv.v1.TierKV")
    responses = [r async for r in stub.ServerReflectionInfo(aiter_of([request]))]
    assert responses[0].file_descriptor_response.file_descriptor_proto


# --- sessions ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_session_save_resume_list_delete(served: Served) -> None:
    stub = served.stub()
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    tokens = list(range(1000, 1042))  # 10 whole blocks of 4 tokens, and 2 more
    hashes = block_hashes(tokens, TINY_LAYOUT.block_size, describe.hash_seed)
    assert len(hashes) == 10
    await put(stub, list(hashes[:6]), payload(6, seed=61),
              write_policy=pb.WRITE_POLICY_WRITE_THROUGH, priority=pb.PRIORITY_SESSION)

    saved = await stub.SaveSession(
        pb.SaveSessionRequest(namespace=NS, session_id="chat-1", token_ids=tokens),
        metadata=ALICE)
    assert saved.num_tokens == 42
    started = time.time()

    resumed = await stub.ResumeSession(pb.SessionRequest(session_id="chat-1"), metadata=ALICE)
    assert list(resumed.token_ids) == tokens
    assert resumed.num_cached_tokens == 24
    assert resumed.namespace == NS

    listed = await stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE)
    assert [(s.session_id, s.model_id, s.num_tokens) for s in listed.sessions] == [
        ("chat-1", "test-model", 42)
    ]
    assert abs(listed.sessions[0].last_use_unix_s - started) < 60

    # Saving again replaces the session.
    await stub.SaveSession(pb.SaveSessionRequest(namespace=NS, session_id="chat-1",
                                                 token_ids=tokens[:8]), metadata=ALICE)
    resumed = await stub.ResumeSession(pb.SessionRequest(session_id="chat-1"), metadata=ALICE)
    assert (list(resumed.token_ids), resumed.num_cached_tokens) == (tokens[:8], 8)

    # Bob sees none of it.
    assert not (await stub.ListSessions(pb.ListSessionsRequest(), metadata=BOB)).sessions
    await expect(Code.NOT_FOUND,
                 stub.ResumeSession(pb.SessionRequest(session_id="chat-1"), metadata=BOB))
    assert not (await stub.DeleteSession(pb.SessionRequest(session_id="chat-1"),
                                         metadata=BOB)).deleted

    assert (await stub.DeleteSession(pb.SessionRequest(session_id="chat-1"),
                                     metadata=ALICE)).deleted
    assert not (await stub.DeleteSession(pb.SessionRequest(session_id="chat-1"),
                                         metadata=ALICE)).deleted
    await expect(Code.NOT_FOUND,
                 stub.ResumeSession(pb.SessionRequest(session_id="chat-1"), metadata=ALICE))
    assert not (await stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE)).sessions


@pytest.mark.asyncio
async def test_a_session_with_a_ttl_expires(served: Served) -> None:
    stub = served.stub()
    await stub.SaveSession(pb.SaveSessionRequest(namespace=NS, session_id="brief",
                                                 token_ids=[1, 2, 3], ttl_s=0.2), metadata=ALICE)
    assert len((await stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE)).sessions) == 1
    await asyncio.sleep(0.5)
    await expect(Code.NOT_FOUND,
                 stub.ResumeSession(pb.SessionRequest(session_id="brief"), metadata=ALICE))
    assert not (await stub.ListSessions(pb.ListSessionsRequest(), metadata=ALICE)).sessions
