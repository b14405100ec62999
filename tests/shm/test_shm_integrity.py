"""The shared-memory data path against stale, stalled and stray writers: never a wrong byte.

Every lease names its slab; a commit keeps the client's checksums (and, with ``verify_commit``,
refuses pages that differ from them); a block's HOST bytes are checked against them on every
way out (reads, leases, copies to the GPU and to disk), so a page changed after the client's
hash is a miss; the pages of an expired write lease stay out of the free pool while its client
is alive.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import secrets
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch

from tests.support.harness import Served, serving
from tests.support.service_fixtures import (
    ALICE,
    aiter_of,
    commit_request,
    get_blocks,
    mapped_slab,
    payload,
    put_chunks,
    wire_namespace,
    write_extents,
)
from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, StoreFactory, keys, same_bytes
from tierkv import AsyncClient, HostTierConfig, Namespace, StoreConfig, Tier, TieredStore
from tierkv.shm.liveness import ClientLock, ClientWatch, Liveness
from tierkv.wire import tierkv_pb2 as pb

Code = grpc.StatusCode
NS = wire_namespace()
NAMESPACE = Namespace("test-model", TINY_LAYOUT)


@pytest_asyncio.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    async with serving(tmp_path / "store") as handle:
        yield handle


def as_blocks(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(TINY_LAYOUT.torch_dtype) \
        .reshape(-1, *TINY_LAYOUT.block_shape)


async def code_of(call: object) -> Code:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return Code.OK


@pytest.mark.asyncio
async def test_a_commit_whose_pages_differ_from_the_clients_checksums_stores_nothing(
    tmp_path: Path,
) -> None:
    """With ``verify_commit`` the pages are hashed at the commit: a block that differs from
    the client's checksum, or a commit without checksums, stores nothing."""
    async with serving(tmp_path / "store", verify_commit=True) as served:
        stub = served.stub(unix=True)
        describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
        hashes, data = keys(4, salt="dl"), payload(4, seed=3)
        before = await stub.Stats(pb.StatsRequest(), metadata=ALICE)
        for wrong in (b"\x00" * BLOCK_BYTES, None):
            lease = await stub.Allocate(pb.AllocateRequest(
                namespace=NS, hashes=hashes, slab_id=describe.slab_id), metadata=ALICE)
            assert lease.slab_id == describe.slab_id
            with mapped_slab(describe.shm_name) as slab:
                for index, extents in zip(lease.write_indices, lease.blocks, strict=True):
                    block = data[index * BLOCK_BYTES : (index + 1) * BLOCK_BYTES]
                    write_extents(slab, extents, wrong if wrong and index == 2 else block)
            if wrong is None:  # right bytes, but no checksums: unverified, so refused
                request = pb.LeaseRequest(lease_id=lease.lease_id)
                assert await code_of(stub.Commit(request, metadata=ALICE)) == Code.INVALID_ARGUMENT
            else:
                request = commit_request(lease, data)
                assert await code_of(stub.Commit(request, metadata=ALICE)) == Code.DATA_LOSS
        after = await stub.Stats(pb.StatsRequest(), metadata=ALICE)
        assert after.num_leases == 0 and after.checksum_failures == before.checksum_failures + 1
        assert next(t for t in after.tiers if t.tier == "host").used_bytes == 0
        assert (await get_blocks(stub, NS, hashes))[0] == 0


READ_PATHS = ["leased", "leased-in-place", "streamed", "in-process", "copied-to-disk", "copied-to-gpu"]


@pytest.mark.asyncio
@pytest.mark.parametrize("path", [*READ_PATHS, "write-through"])
async def test_a_page_changed_between_the_copy_and_the_commit_is_a_miss_on_every_read_path(
    tmp_path: Path, path: str,
) -> None:
    """The default commit records the client's checksums without hashing the pages. A page
    that changed after the client hashed it (here block 2 of 4) is then a counted miss on
    every way out of HOST, never its bytes; a write-through commit, which copies the pages
    into records, refuses it."""
    async with serving(tmp_path / "store", gpu_bytes=16 * BLOCK_BYTES) as served:
        stub = served.stub(unix=True)
        describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
        hashes, data = keys(4, salt=f"late-{path}"), payload(4, seed=11)
        policy = pb.WRITE_POLICY_WRITE_THROUGH if path == "write-through" else None
        lease = await stub.Allocate(pb.AllocateRequest(
            namespace=NS, hashes=hashes, slab_id=describe.slab_id, write_policy=policy,
        ), metadata=ALICE)
        with mapped_slab(describe.shm_name) as slab:
            for index, extents in zip(lease.write_indices, lease.blocks, strict=True):
                write_extents(slab, extents, data[index * BLOCK_BYTES : (index + 1) * BLOCK_BYTES])
            slab[lease.blocks[2].extents[0].offset] ^= 0x40  # after the client's hash
        code = await code_of(stub.Commit(commit_request(lease, data), metadata=ALICE))
        store, namespace = served.store, Namespace("test-model", TINY_LAYOUT, tenant="alice")
        if path == "write-through":
            assert code == Code.DATA_LOSS
            assert store.lookup(namespace, hashes) == 0
            assert store.stats().checksum_failures == 1
            return
        assert code == Code.OK and store.lookup(namespace, hashes) == 4
        if path == "leased":
            async with AsyncClient(served.unix_target, token="t" * 32) as client:
                assert await client.uses_shared_memory()
                got = await client.get(NAMESPACE, hashes)
        elif path == "leased-in-place":  # get_with: handed over where it lies in the slab
            rows = torch.zeros((4, BLOCK_BYTES), dtype=torch.uint8)

            def use(indices: Sequence[int], blocks: torch.Tensor) -> None:
                rows[list(indices)] = blocks

            async with AsyncClient(served.unix_target, token="t" * 32) as client:
                assert await client.uses_shared_memory()
                count = await client.get_with(NAMESPACE, hashes, use)
            got = as_blocks(bytes(rows[:count].numpy()))
        elif path == "streamed":
            num_blocks, streamed, _ = await get_blocks(stub, NS, hashes)
            assert streamed == data[: num_blocks * BLOCK_BYTES]
            got = as_blocks(streamed)
        elif path == "in-process":
            got = await asyncio.to_thread(store.get, namespace, hashes)
        elif path == "copied-to-disk":
            await asyncio.to_thread(store.flush)
            disk = store.stats().tiers[Tier.DISK]
            assert disk.num_blocks == 3  # the damaged block was not written
            flood = keys(64, salt="flood")  # HOST's room: the flushed blocks leave HOST
            await asyncio.to_thread(store.put, namespace, flood, as_blocks(payload(64, seed=2)))
            assert store.sidecar.locate(namespace, hashes)[Tier.DISK] == 2
            got = await asyncio.to_thread(store.get, namespace, hashes)
        else:
            assert await asyncio.wrap_future(store.prefetch_async(namespace, hashes, Tier.GPU)) == 2
            got = await asyncio.to_thread(store.get, namespace, hashes)
        assert len(got) == 2 and same_bytes(got, as_blocks(data)[:2])
        assert store.stats().checksum_failures == 1
        assert store.lookup(namespace, hashes) == 2  # the damaged block is gone
        assert same_bytes(await asyncio.to_thread(store.get, namespace, hashes[3:]),
                          as_blocks(data)[3:])


@pytest.mark.asyncio
async def test_lease_calls_that_name_another_slab_are_aborted(served: Served) -> None:
    stub = served.stub(unix=True)
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    assert len(describe.slab_id) == 16
    hashes = keys(2, salt="stale")
    stale = secrets.token_bytes(16)
    for request in (pb.AllocateRequest(namespace=NS, hashes=hashes, slab_id=stale),
                    pb.AcquireRequest(namespace=NS, hashes=hashes, slab_id=stale)):
        call = getattr(stub, type(request).__name__.removesuffix("Request"))
        assert await code_of(call(request, metadata=ALICE)) == Code.ABORTED
    assert (await stub.Stats(pb.StatsRequest(), metadata=ALICE)).num_leases == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("watched", [True, False], ids=["client-alive", "client-unwatched"])
async def test_a_writer_stalled_past_its_lease_ttl_changes_no_other_block(
    served: Served, watched: bool
) -> None:
    """The issue's run: a client allocates, stalls past its lease's TTL, then copies. With
    its lock file held (the SDK's case) its pages were never reused; without (a client the
    server cannot watch), the blocks it hits are misses, never its bytes, on every path out."""
    stub = served.stub(unix=True)
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    client_id = f"stalled{int(watched)}"
    metadata = (*ALICE, ("x-tierkv-client", client_id))
    lock = ClientLock(describe.client_lock_prefix, client_id) if watched else None
    stalled = await stub.Allocate(pb.AllocateRequest(
        namespace=NS, hashes=keys(32, salt="stalled"), lease_ttl_s=0.2, slab_id=describe.slab_id,
    ), metadata=metadata)
    await asyncio.sleep(0.3)  # the lease expires while its client stalls

    hashes, data = keys(32, salt="victim"), payload(32, seed=9)
    async with AsyncClient(served.unix_target, token="t" * 32) as other:
        assert await other.uses_shared_memory()
        assert await other.put(NAMESPACE, hashes, as_blocks(data)) == 32
        quarantined = served.store.sidecar.num_quarantined_pages
        assert (quarantined > 0) == watched
        with mapped_slab(describe.shm_name) as slab:  # the stalled client wakes up and copies
            for extents in stalled.blocks:
                write_extents(slab, extents, b"\xab" * BLOCK_BYTES)
        late = commit_request(stalled, b"\xab" * 32 * BLOCK_BYTES)
        assert await code_of(stub.Commit(late, metadata=metadata)) == Code.FAILED_PRECONDITION
        if not watched:
            await asyncio.to_thread(served.store.flush)  # HOST -> DISK checks the bytes too
        got = await other.get(NAMESPACE, hashes)
        num_blocks, streamed, _ = await get_blocks(stub, NS, hashes)
        stats = await other.stats()
    expected = as_blocks(data)
    assert same_bytes(got, expected[: len(got)])
    assert streamed == data[: num_blocks * BLOCK_BYTES]
    if watched:
        assert len(got) == num_blocks == 32 and stats.checksum_failures == 0
        assert lock is not None
        lock.close()  # the stalled client exits: its quarantined pages come back
        await asyncio.sleep(0.3)  # (a live client is probed again after 0.25 s)
        served.store.sidecar.expire_leases()
        assert served.store.sidecar.num_quarantined_pages == 0
    else:
        assert stats.checksum_failures > 0  # its late bytes were seen, and not served


@pytest.mark.asyncio
async def test_reads_through_shared_memory_count_as_gets(served: Served) -> None:
    hashes, data = keys(3, salt="gets"), payload(3, seed=4)
    async with AsyncClient(served.unix_target, token="t" * 32) as client:
        await client.put(NAMESPACE, hashes, as_blocks(data))
        before = (await client.stats()).gets
        assert same_bytes(await client.get(NAMESPACE, hashes), as_blocks(data))
        assert (await client.stats()).gets == before + 1


@pytest.mark.asyncio
async def test_host_bytes_changed_behind_the_stores_back_are_a_miss(served: Served) -> None:
    stub = served.stub(unix=True)
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    hashes, data = keys(4, salt="stray"), payload(4, seed=5)
    await stub.Put(aiter_of(put_chunks(NS, hashes, data)), metadata=ALICE)
    lease = await stub.Acquire(pb.AcquireRequest(namespace=NS, hashes=hashes), metadata=ALICE)
    assert len(lease.checksums) == 4
    await stub.Release(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE)
    with mapped_slab(describe.shm_name) as slab:  # a stray write into block 2
        extent = lease.blocks[2].extents[0]
        slab[extent.offset] ^= 0x01
    num_blocks, got, _ = await get_blocks(stub, NS, hashes)
    assert num_blocks == 2 and got == data[: 2 * BLOCK_BYTES]
    stats = await stub.Stats(pb.StatsRequest(), metadata=ALICE)
    assert stats.checksum_failures == 1
    lookup = await stub.Lookup(pb.LookupRequest(namespace=NS, hashes=hashes), metadata=ALICE)
    assert lookup.num_cached == 2  # the damaged block is gone


# --- segments left behind by servers that are gone ---------------------------------------------


def test_a_new_store_removes_the_segments_of_servers_that_are_gone() -> None:
    shm = Path("/dev/shm")
    dead, live = f"tierkv-{secrets.token_hex(6)}", f"tierkv-{secrets.token_hex(6)}"
    leftovers = [dead, f"{dead}-presence", f"{dead}-client-0123", f"{live}-client-4567"]
    for name in [*leftovers, live]:
        (shm / name).write_bytes(b"\0" * 4096)
    holder = os.open(shm / live, os.O_RDONLY)  # a live server holds its slab's lock
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        store = TieredStore(StoreConfig(host=HostTierConfig(1 << 20, 1 << 16)))
        store.close()
        for name in leftovers:
            assert not (shm / name).exists(), name
        assert (shm / live).exists()
    finally:
        os.close(holder)
        (shm / live).unlink(missing_ok=True)


# --- lock files: only the one a live client locked counts --------------------------------------


@pytest.mark.asyncio
async def test_a_lock_path_that_is_not_a_regular_file_never_reaps_a_lease(served: Served) -> None:
    stub = served.stub(unix=True)
    describe = await stub.Describe(pb.DescribeRequest(), metadata=ALICE)
    path = Path("/dev/shm") / f"{describe.client_lock_prefix}dirclient"
    path.mkdir()  # a directory can be flocked too: it must not read as "the client is gone"
    try:
        metadata = (*ALICE, ("x-tierkv-client", "dirclient"))
        await stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=keys(2, salt="dir"),
                                               slab_id=describe.slab_id), metadata=metadata)
        served.store.sidecar.expire_leases()
        assert served.store.sidecar.num_leases == 1
    finally:
        path.rmdir()


def test_a_client_closed_in_the_middle_of_a_lease_reads_as_gone_not_unknown() -> None:
    prefix = f"tierkv-test-{secrets.token_hex(4)}-client-"
    watch = ClientWatch(prefix)
    lock = ClientLock(prefix, "closer")
    assert watch.state("closer") is Liveness.ALIVE
    lock.close(unlink=False)  # what the SDK does when a put or get is still running
    watch.forget_all()
    assert watch.state("closer") is Liveness.GONE  # and the server removed the file
    assert not (Path("/dev/shm") / f"{prefix}closer").exists()
    replaced = ClientLock(prefix, "swapped")
    assert watch.state("swapped") is Liveness.ALIVE
    (Path("/dev/shm") / f"{prefix}swapped").unlink()  # another process swaps the file
    (Path("/dev/shm") / f"{prefix}swapped").write_bytes(b"")
    watch.forget_all()
    assert watch.state("swapped") is Liveness.UNKNOWN  # not the file the client locked
    replaced.close()
    (Path("/dev/shm") / f"{prefix}swapped").unlink(missing_ok=True)


# --- damaged blocks brought up a tier ----------------------------------------------------------


@pytest.mark.parametrize("num_damaged", [1, 3])
def test_a_damaged_host_block_promoted_to_the_gpu_is_counted_once_and_never_copied(
        make_store: StoreFactory, num_damaged: int) -> None:
    # A batch copy that rejects a damaged block must not try it again on its own: one failure,
    # one count, one log line, and no GPU pages for it.
    store = make_store(host_blocks=8, gpu_blocks=4, promote_on_read=False)
    store.register(NAMESPACE)
    hashes = keys(3, salt="promote")
    store.put(NAMESPACE, hashes, as_blocks(payload(3, seed=9)), tier=Tier.HOST)
    lease = store.sidecar.acquire(NAMESPACE, hashes, ttl_s=10.0)
    store.sidecar.release(lease.lease_id)
    with mapped_slab(store.sidecar.host_shm_name) as slab:  # a stray write into the damaged blocks
        for index in range(3 - num_damaged, 3):
            slab[lease.blocks[index][0][0]] ^= 0x01
    assert store.prefetch_async(NAMESPACE, hashes, Tier.GPU).result() == 3 - num_damaged
    stats = store.stats()
    assert stats.checksum_failures == num_damaged
    assert stats.tiers[Tier.GPU].num_blocks == 3 - num_damaged
    assert store.lookup(NAMESPACE, hashes) == 3 - num_damaged
