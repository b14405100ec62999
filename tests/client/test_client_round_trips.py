"""The client SDK (``Client`` and ``AsyncClient``): round trips on both data paths.

Every test starts its own server: ``create_server`` on a background event loop, listening on a
Unix socket and ``127.0.0.1:0``, in front of a real ``TieredStore`` (shared-memory HOST slab,
LMDB disk tier in ``tmp_path``) with bearer tokens. Clients take one of two data paths:

* ``shm``: the Unix socket with ``use_shm`` left to the client (same host: the slab is mapped,
  bulk bytes go through leases: Allocate/Commit, Acquire/Release);
* ``stream``: TCP with ``use_shm=False`` (bulk bytes go through the Put and Get streams).

The server's servicer is a spy that records which RPCs each client id made, so a test can tell
which path a client really took, and that a call refused client side sent nothing. The
``AsyncClient`` runs the same test bodies through ``AsyncFacade`` (each call awaited on a
private event loop); a few tests drive it natively with ``async with`` and ``asyncio.gather``.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from tests.support.client_harness import (
    BIG_BLOCK_BYTES,
    BIG_LAYOUT,
    BIG_PAGE_BYTES,
    BIG_RECORD_BYTES,
    AnyClient,
    LiveServer,
    ServerFactory,
    SpyServicer,
    check_path,
    ns,
    patterned_blocks,
)
from tests.support.harness import ALICE_TOKEN, BOB_TOKEN, BackgroundServer
from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, keys, same_bytes
from tierkv import AsyncClient, Client
from tierkv.config import Tier
from tierkv.errors import ServiceUnavailableError, TierKVError
from tierkv.keys import Namespace
from tierkv.layout import KVLayout

# --- round trips -------------------------------------------------------------------------------


def test_put_get_and_get_into_round_trip_bit_exact(
    server: LiveServer, client: AnyClient, path: str
) -> None:
    namespace, hashes = ns(), keys(12, salt="round-trip")
    data = patterned_blocks(12, seed=1)
    assert client.put(namespace, hashes, data) == 12
    assert client.put(namespace, hashes, data) == 0  # idempotent: nothing new
    got = client.get(namespace, hashes)
    assert got.shape == (12, *TINY_LAYOUT.block_shape) and got.dtype == TINY_LAYOUT.torch_dtype
    assert same_bytes(got, data)
    out = torch.zeros((15, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype)
    assert client.get_into(namespace, hashes, out) == 12
    assert same_bytes(out[:12], data)
    for index in (0, 5, 11):  # any single block, any sub-chain
        assert same_bytes(client.get(namespace, hashes[index : index + 1]), data[index : index + 1])
    assert same_bytes(client.get(namespace, hashes[3:9]), data[3:9])
    check_path(server, client, path)


def test_a_put_from_one_path_is_read_exactly_from_the_other(
    server: LiveServer, open_client: Callable[..., AnyClient], kind: str
) -> None:
    shm = open_client(server, "shm", kind)
    stream = open_client(server, "stream", kind)
    namespace = ns()
    first, second = keys(6, salt="shm-put"), keys(6, salt="stream-put")
    data_a, data_b = patterned_blocks(6, seed=2), patterned_blocks(6, seed=3)
    assert shm.put(namespace, first, data_a) == 6
    assert stream.put(namespace, second, data_b) == 6
    assert same_bytes(stream.get(namespace, first), data_a)
    assert same_bytes(shm.get(namespace, second), data_b)
    check_path(server, shm, "shm")
    check_path(server, stream, "stream")


def test_blocks_split_across_runs_of_free_pages_round_trip_exactly(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    """A slab whose free pages are single pages between stored ones: every block of the next
    put (two pages) lies in two runs, so its lease names two extents a block (on the shm path,
    in the packed form's per-block counts), and reads come back exactly."""
    server = make_server(host_bytes=32 * BLOCK_BYTES, disk_bytes=0)
    client = open_client(server, path, kind)
    small = ns("one-page-model", KVLayout(1, 2, 8, 4))  # half a tiny block: one page
    filler = keys(64, salt="filler")
    assert client.put(small, filler, patterned_blocks(64, seed=12, layout=small.layout)) == 64
    assert client.delete(small, filler[::2]) == 32  # 32 free runs of one page each
    namespace, hashes = ns(), keys(8, salt="split")
    data = patterned_blocks(8, seed=13)
    assert client.put(namespace, hashes, data) == 8
    lease = server.store.sidecar.acquire(Namespace("test-model", TINY_LAYOUT, tenant="alice"), hashes)
    try:
        assert all(len(extents) == 2 for extents in lease.blocks)
    finally:
        server.store.sidecar.release(lease.lease_id)
    assert same_bytes(client.get(namespace, hashes), data)
    check_path(server, client, path)


class _Filler:
    """A ``put_with`` fill that writes rows of ``data`` and records each call's indices."""

    def __init__(self, data: torch.Tensor) -> None:
        self.rows = data.view(torch.uint8).reshape(data.shape[0], -1)
        self.calls: list[list[int]] = []
        self.targets: list[int] = []

    def __call__(self, indices: Sequence[int], out: torch.Tensor) -> None:
        assert out.dtype == torch.uint8 and tuple(out.shape) == (len(indices), self.rows.shape[1])
        self.calls.append(list(indices))
        self.targets.append(out.data_ptr())
        out.copy_(self.rows[list(indices)])


def test_put_with_writes_each_missing_block_once_and_round_trips_bit_exact(
    server: LiveServer, client: AnyClient, path: str
) -> None:
    namespace, hashes = ns(), keys(12, salt="put-with")
    data = patterned_blocks(12, seed=21)
    assert client.put(namespace, hashes[4:6], data[4:6]) == 2
    fill = _Filler(data)
    assert client.put_with(namespace, hashes, fill) == 10
    written = [index for call in fill.calls for index in call]
    if path == "shm":  # only what the server has not (4 and 5); a stream sends every block
        assert written == [i for i in range(12) if i not in (4, 5)]
    else:
        assert written == list(range(12))
    assert same_bytes(client.get(namespace, hashes), data)
    again = _Filler(data)
    assert client.put_with(namespace, hashes, again) == 0
    assert again.calls == ([] if path == "shm" else [list(range(12))])
    assert client.put_with(namespace, [], again) == 0
    check_path(server, client, path)


def test_put_with_fills_the_slab_in_place_on_the_same_host(server: LiveServer) -> None:
    """On the shm path the fill writes the mapped slab's pages (no copy after it)."""
    with Client(server.unix_target, token=ALICE_TOKEN) as client:
        namespace, hashes = ns(), keys(8, salt="in-place")
        data = patterned_blocks(8, seed=22)
        fill = _Filler(data)
        assert client.put_with(namespace, hashes, fill) == 8
        slab = client._slab
        assert slab is not None
        low, high = slab.array.ctypes.data, slab.array.ctypes.data + slab.array.size
        assert fill.targets and all(low <= target < high for target in fill.targets)
        assert same_bytes(client.get(namespace, hashes), data)


def test_put_with_of_blocks_split_across_runs_of_free_pages_round_trips_exactly(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    """Blocks whose two pages lie apart are filled one at a time and scattered to their pages;
    blocks back to back in the slab are filled in runs."""
    server = make_server(host_bytes=32 * BLOCK_BYTES, disk_bytes=0)
    client = open_client(server, path, kind)
    small = ns("one-page-model", KVLayout(1, 2, 8, 4))  # half a tiny block: one page
    filler = keys(64, salt="filler")
    assert client.put(small, filler, patterned_blocks(64, seed=12, layout=small.layout)) == 64
    assert client.delete(small, filler[::2]) == 32  # 32 free runs of one page each
    namespace, hashes = ns(), keys(8, salt="split-with")
    data = patterned_blocks(8, seed=23)
    fill = _Filler(data)
    assert client.put_with(namespace, hashes, fill) == 8
    if path == "shm":
        assert fill.calls == [[i] for i in range(8)]
    assert same_bytes(client.get(namespace, hashes), data)
    assert client.delete(small, filler[1::2]) == 32  # the slab is free again: one run
    more, more_data = keys(8, salt="one-run"), patterned_blocks(8, seed=24)
    fill = _Filler(more_data)
    assert client.put_with(namespace, more, fill) == 8
    assert fill.calls == [list(range(8))]
    assert same_bytes(client.get(namespace, more), more_data)


def test_a_fill_that_raises_aborts_the_put_and_stores_nothing(
    server: LiveServer, client: AnyClient, path: str
) -> None:
    namespace, hashes = ns(), keys(6, salt="fill-raises")

    def fail(indices: Sequence[int], out: torch.Tensor) -> None:
        out[:1].fill_(7)  # half written, then the writer fails
        raise RuntimeError("the engine's pages are gone")

    with pytest.raises(RuntimeError, match="pages are gone"):
        client.put_with(namespace, hashes, fail)
    assert client.lookup(namespace, hashes) == 0
    data = patterned_blocks(6, seed=25)
    assert client.put_with(namespace, hashes, _Filler(data)) == 6  # nothing left leased
    assert same_bytes(client.get(namespace, hashes), data)


class _Collector:
    """A ``get_with`` use that copies out what it is handed and records each call."""

    def __init__(self, num_blocks: int, block_bytes: int = BLOCK_BYTES) -> None:
        self.rows = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8)
        self.calls: list[list[int]] = []
        self.sources: list[int] = []

    def __call__(self, indices: Sequence[int], blocks: torch.Tensor) -> None:
        assert blocks.dtype == torch.uint8
        assert tuple(blocks.shape) == (len(indices), self.rows.shape[1])
        assert list(indices) == list(range(indices[0], indices[0] + len(indices)))
        self.calls.append(list(indices))
        self.sources.append(blocks.data_ptr())
        self.rows[list(indices)] = blocks

    def blocks(self, count: int, layout: KVLayout = TINY_LAYOUT) -> torch.Tensor:
        return self.rows[:count].view(layout.torch_dtype).reshape(count, *layout.block_shape)


def test_get_with_hands_over_the_leading_cached_blocks_bit_exact(
    server: LiveServer, client: AnyClient, path: str
) -> None:
    namespace, hashes = ns(), keys(12, salt="get-with")
    data = patterned_blocks(12, seed=26)
    assert client.put(namespace, hashes[:8], data[:8]) == 8
    assert client.put(namespace, hashes[9:], data[9:]) == 3  # block 8 missing: the run ends
    use = _Collector(12)
    assert client.get_with(namespace, hashes, use) == 8
    assert [index for call in use.calls for index in call] == list(range(8))
    assert same_bytes(use.blocks(8), data[:8])
    assert client.get_with(namespace, hashes[8:], _Collector(4)) == 0
    assert client.get_with(namespace, [], _Collector(1)) == 0
    tail = _Collector(3)
    assert client.get_with(namespace, hashes[9:], tail) == 3
    assert same_bytes(tail.blocks(3), data[9:])
    check_path(server, client, path)


def test_get_with_hands_over_the_slabs_own_pages_on_the_same_host(server: LiveServer) -> None:
    with Client(server.unix_target, token=ALICE_TOKEN) as client:
        namespace, hashes = ns(), keys(8, salt="read-in-place")
        data = patterned_blocks(8, seed=27)
        assert client.put(namespace, hashes, data) == 8
        use = _Collector(8)
        assert client.get_with(namespace, hashes, use) == 8
        slab = client._slab
        assert slab is not None
        low, high = slab.array.ctypes.data, slab.array.ctypes.data + slab.array.size
        assert use.calls == [list(range(8))] and low <= use.sources[0] < high
        assert same_bytes(use.blocks(8), data)
        methods = server.spy.methods_of(client.settings.client_id)
        assert methods["Acquire"] == 1 and methods["Get"] == 0


def test_get_with_of_blocks_split_across_runs_of_free_pages_round_trips_exactly(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    """Blocks whose two pages lie apart are handed over one at a time, from a buffer."""
    server = make_server(host_bytes=32 * BLOCK_BYTES, disk_bytes=0)
    client = open_client(server, path, kind)
    small = ns("one-page-model", KVLayout(1, 2, 8, 4))  # half a tiny block: one page
    filler = keys(64, salt="filler")
    assert client.put(small, filler, patterned_blocks(64, seed=12, layout=small.layout)) == 64
    assert client.delete(small, filler[::2]) == 32  # 32 free runs of one page each
    namespace, hashes = ns(), keys(8, salt="split-get-with")
    data = patterned_blocks(8, seed=28)
    assert client.put(namespace, hashes, data) == 8
    use = _Collector(8)
    assert client.get_with(namespace, hashes, use) == 8
    if path == "shm":
        assert use.calls == [[i] for i in range(8)]
    assert same_bytes(use.blocks(8), data)


def test_a_block_whose_pages_change_while_in_use_is_not_handed_over(
    server: LiveServer, open_client: Callable[..., AnyClient], kind: str
) -> None:
    """``use`` sees the slab's pages; one that changes while it copies (here: a stray write
    into block 3, which the copy saw) counts as never received, and the block is a miss
    from then on, never its changed bytes."""
    client = open_client(server, "shm", kind)
    namespace, hashes = ns(), keys(6, salt="changed-in-use")
    data = patterned_blocks(6, seed=29)
    assert client.put(namespace, hashes, data) == 6

    def scribble(indices: Sequence[int], blocks: torch.Tensor) -> None:
        blocks[3 - indices[0], 5] ^= 0x10  # a stray write the copy below sees
        use(indices, blocks)

    use = _Collector(6)
    assert client.get_with(namespace, hashes, scribble) == 3
    assert same_bytes(use.blocks(3), data[:3])
    assert client.stats().checksum_failures == 1
    assert client.lookup(namespace, hashes) == 3
    assert same_bytes(client.get(namespace, hashes), data[:3])


def test_a_use_that_raises_ends_the_get_and_leaves_nothing_leased(
    server: LiveServer, client: AnyClient, path: str
) -> None:
    namespace, hashes = ns(), keys(6, salt="use-raises")
    data = patterned_blocks(6, seed=30)
    assert client.put(namespace, hashes, data) == 6
    before = client.stats().tiers[Tier.HOST].hits

    def fail(indices: Sequence[int], blocks: torch.Tensor) -> None:
        raise RuntimeError("the engine's pages are gone")

    with pytest.raises(RuntimeError, match="pages are gone"):
        client.get_with(namespace, hashes, fail)
    stats = client.stats()
    assert stats.num_leases == 0
    if path == "shm":  # nothing was kept: no hit counted
        assert stats.tiers[Tier.HOST].hits == before
    use = _Collector(6)
    assert client.get_with(namespace, hashes, use) == 6
    assert same_bytes(use.blocks(6), data)


def test_get_of_a_partly_cached_chain_returns_the_leading_run(client: AnyClient) -> None:
    namespace, hashes = ns(), keys(6, salt="partial")
    data = patterned_blocks(6, seed=4)
    assert client.put(namespace, hashes[:3], data[:3]) == 3
    assert client.put(namespace, hashes[4:], data[4:]) == 2  # block 3 is missing
    assert client.lookup(namespace, hashes) == 3
    got = client.get(namespace, hashes)
    assert got.shape[0] == 3 and same_bytes(got, data[:3])
    out = torch.zeros((6, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype)
    assert client.get_into(namespace, hashes, out) == 3
    assert same_bytes(out[:3], data[:3])
    missing_head = client.get(namespace, hashes[3:])
    assert missing_head.shape == (0, *TINY_LAYOUT.block_shape)
    assert client.get(namespace, keys(4, salt="never-stored")).shape[0] == 0


def test_blocks_of_other_namespaces_and_tenants_are_misses(
    server: LiveServer, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    alice = open_client(server, path, kind)
    bob = open_client(server, path, kind, token=BOB_TOKEN)
    hashes, data = keys(4, salt="tenancy"), patterned_blocks(4, seed=5)
    assert alice.put(ns("model-a"), hashes, data) == 4
    assert alice.lookup(ns("model-b"), hashes) == 0
    assert alice.get(ns("model-b"), hashes).shape[0] == 0
    assert bob.lookup(ns("model-a"), hashes) == 0  # same model and keys, another tenant
    assert bob.get(ns("model-a"), hashes).shape[0] == 0
    assert same_bytes(alice.get(ns("model-a"), hashes), data)


def test_batches_bigger_than_a_stream_chunk_round_trip_in_one_call(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    server = make_server(host_bytes=16 << 20, page_bytes=BIG_PAGE_BYTES, disk_bytes=0)
    client = open_client(server, path, kind)
    namespace, hashes = ns("big-model", BIG_LAYOUT), keys(40, salt="big")
    data = patterned_blocks(40, seed=6, layout=BIG_LAYOUT)
    assert data.numel() * data.element_size() == 40 * BIG_BLOCK_BYTES == 5 << 20
    assert client.put(namespace, hashes, data) == 40
    assert same_bytes(client.get(namespace, hashes), data)
    check_path(server, client, path)
    methods = server.spy.methods_of(client.settings.client_id)
    assert methods["Put" if path == "stream" else "Allocate"] == 1  # one call, not a split
    assert methods["Get" if path == "stream" else "Acquire"] == 1


def test_get_of_a_chain_bigger_than_the_host_tier_round_trips_exactly(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    # 1 MiB of HOST holds 8 of the 40 blocks; the rest are demoted to disk. On the shm path the
    # client must acquire, copy and release HOST-sized parts of the chain in turn.
    server = make_server(host_bytes=1 << 20, page_bytes=BIG_PAGE_BYTES,
                         disk_bytes=64 * BIG_RECORD_BYTES)
    client = open_client(server, path, kind)
    namespace, hashes = ns("big-model", BIG_LAYOUT), keys(40, salt="bigger-than-host")
    data = patterned_blocks(40, seed=7, layout=BIG_LAYOUT)
    for start in range(0, 40, 4):
        assert client.put(namespace, hashes[start : start + 4], data[start : start + 4]) == 4
    detail = client.lookup_detail(namespace, hashes)
    assert detail.num_cached == 40 and detail.num_host <= 8 and detail.num_disk >= 32
    got = client.get(namespace, hashes)
    assert got.shape[0] == 40, f"got {got.shape[0]} of 40 cached blocks"
    assert same_bytes(got, data)
    assert client.stats().num_leases == 0
    check_path(server, client, path)


def test_get_acquires_the_rest_of_the_chain_after_releasing_the_first_part(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str, path: str
) -> None:
    # HOST holds 8 blocks: blocks 0-7 are there, 8-11 were demoted to disk. The first lease can
    # only cover 0-7 (they are being read, nothing can make room for 8-11); the second, after
    # the release, covers 8-11.
    server = make_server(host_bytes=8 * BLOCK_BYTES)
    client = open_client(server, path, kind)
    namespace, hashes = ns(), keys(12, salt="two-leases")
    data = patterned_blocks(12, seed=8)
    assert client.put(namespace, hashes[8:], data[8:]) == 4
    assert client.put(namespace, hashes[:8], data[:8]) == 8
    detail = client.lookup_detail(namespace, hashes)
    assert (detail.num_cached, detail.num_host, detail.num_disk) == (12, 8, 4)
    assert same_bytes(client.get(namespace, hashes), data)
    methods = server.spy.methods_of(client.settings.client_id)
    if path == "shm":  # the first lease's release rode on the second Acquire
        assert methods["Acquire"] == 2 and methods["Release"] == 0
    assert client.stats().num_leases == 0  # the second's went just before the Stats
    if path == "shm":
        assert server.spy.methods_of(client.settings.client_id)["Release"] == 1


# --- releases carried on the next call ------------------------------------------------------


def test_a_release_carried_on_a_later_call_keeps_the_pages_leased_until_then(
    make_server: ServerFactory, open_client: Callable[..., AnyClient], kind: str
) -> None:
    """A same-host get queues its release for the client's next call (one round trip a get).
    Until that call the leased blocks stay busy: another client's flood of puts, which evicts
    everything else in HOST, never takes their pages; once the release rode on the next call,
    the next flood may."""
    server = make_server(host_bytes=16 * BLOCK_BYTES, disk_bytes=0)
    reader = open_client(server, "shm", kind, release_delay_s=30.0)  # no send on its own here
    # Another client of the same tenant: another tenant's puts would recycle its own blocks
    # first (tenants' shares), and never reach the reader's whether leased or not.
    writer = open_client(server, "shm", kind)
    namespace, hashes = ns(), keys(8, salt="carried")
    data = patterned_blocks(8, seed=14)
    assert reader.put(namespace, hashes, data) == 8
    got = reader.get(namespace, hashes)
    assert same_bytes(got, data)
    in_store = Namespace("test-model", TINY_LAYOUT, tenant="alice")

    def flood(salt: str) -> None:
        for batch in range(4):  # 32 blocks through 16 of HOST: all that is not leased goes
            flood_hashes = keys(8, salt=f"{salt}-{batch}")
            assert writer.put(namespace, flood_hashes, patterned_blocks(8, seed=batch)) == 8

    assert server.store.sidecar.num_leases == 1
    flood("first")
    assert server.store.lookup(in_store, hashes) == 8  # still leased: never evicted
    assert same_bytes(server.store.get(in_store, hashes), data)
    assert server.spy.methods_of(reader.settings.client_id)["Release"] == 0
    stats = reader.stats()  # the release goes first, then the Stats that counts it
    assert stats.num_leases == 0 and server.store.sidecar.num_leases == 0
    flood("second")
    assert server.store.lookup(in_store, hashes) == 0  # released: its pages were reused
    assert same_bytes(got, data)  # what the reader copied is its own


def test_a_queued_release_is_sent_once_due_and_at_close(
    make_server: ServerFactory, open_client: Callable[..., AnyClient]
) -> None:
    """No call follows the get: the release goes on its own after release_delay_s (the
    client's sender thread), or at close, whichever comes first; its hits count then."""
    server = make_server()
    namespace, hashes = ns(), keys(4, salt="due")
    idle = open_client(server, "shm", "sync", release_delay_s=0.05)
    assert idle.put(namespace, hashes, patterned_blocks(4, seed=15)) == 4
    hits_before = server.store.stats().tiers[Tier.HOST].hits
    assert len(idle.get(namespace, hashes)) == 4
    deadline = time.monotonic() + 10.0
    while server.store.sidecar.num_leases and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.store.sidecar.num_leases == 0
    assert server.store.stats().tiers[Tier.HOST].hits == hits_before + 4
    closing = open_client(server, "shm", "sync", release_delay_s=30.0)
    assert len(closing.get(namespace, hashes)) == 4 and server.store.sidecar.num_leases == 1
    closing.close()
    assert server.store.sidecar.num_leases == 0


@pytest.mark.asyncio
async def test_an_async_clients_queued_release_is_sent_once_due(
    make_server: ServerFactory
) -> None:
    server = make_server()
    namespace, hashes = ns(), keys(4, salt="async-due")
    async with AsyncClient(server.unix_target, token=ALICE_TOKEN, release_delay_s=0.05) as client:
        assert await client.put(namespace, hashes, patterned_blocks(4, seed=16)) == 4
        assert len(await client.get(namespace, hashes)) == 4
        assert server.store.sidecar.num_leases == 1
        for _ in range(1000):
            if not server.store.sidecar.num_leases:
                break
            await asyncio.sleep(0.01)
        assert server.store.sidecar.num_leases == 0
        assert len(await client.get(namespace, hashes)) == 4
    assert server.store.sidecar.num_leases == 0  # the close sent the second get's release


def test_a_client_dropped_without_close_takes_its_release_sender_with_it(
    server: LiveServer,
) -> None:
    """The thread that sends a sync client's due releases holds the client weakly: a client
    dropped without ``close`` is collected, and its thread ends."""
    def senders() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "tierkv-client-releases"}

    before = senders()
    client = Client(server.unix_target, token=ALICE_TOKEN, release_delay_s=30.0)
    namespace, hashes = ns(), keys(2, salt="dropped")
    assert client.put(namespace, hashes, patterned_blocks(2, seed=17)) == 2
    assert len(client.get(namespace, hashes)) == 2
    (sender,) = senders() - before  # started by the queued release
    del client
    gc.collect()
    sender.join(timeout=5.0)
    assert not sender.is_alive()


class _ServerBeforeCarriedReleases(SpyServicer):
    """A server from before ``carries_releases``: Describe does not set it, and Acquire and
    Allocate never read the releases a request carries."""

    async def Describe(self, request: Any, context: Any) -> Any:
        response = await super().Describe(request, context)
        response.carries_releases = False
        return response

    async def Acquire(self, request: Any, context: Any) -> Any:
        del request.releases[:]
        return await super().Acquire(request, context)

    async def Allocate(self, request: Any, context: Any) -> Any:
        del request.releases[:]
        return await super().Allocate(request, context)


class _ServerOfLeasesPastTheSlab(SpyServicer):
    """A server whose read leases name bytes past the end of its slab."""

    async def Acquire(self, request: Any, context: Any) -> Any:
        response = await super().Acquire(request, context)
        if response.extent_offsets:
            response.extent_offsets[0] = 1 << 40
        return response


def test_a_server_that_does_not_carry_releases_gets_each_on_its_own(tmp_path: Path) -> None:
    """A client of a server from before carried releases (a rolling upgrade) sends each get's
    release at once: none waits on a call that would drop it."""
    server = BackgroundServer(tmp_path / "old", servicer=_ServerBeforeCarriedReleases)
    try:
        with Client(server.unix_target, token=ALICE_TOKEN) as client:
            namespace, hashes = ns(), keys(4, salt="old-server")
            assert client.put(namespace, hashes, patterned_blocks(4, seed=18)) == 4
            for _ in range(3):
                assert len(client.get(namespace, hashes)) == 4
                assert server.store.sidecar.num_leases == 0
            spy = server.served.server.servicer
            assert spy.methods_of(client.settings.client_id)["Release"] == 3
    finally:
        server.close()


class _ServerThatDropsTheSecondAcquire(SpyServicer):
    """The second Acquire fails before its handler reads anything (as one refused at
    authentication, or cut by its deadline, would)."""

    num_acquires = 0

    async def Acquire(self, request: Any, context: Any) -> Any:
        type(self).num_acquires += 1
        if type(self).num_acquires == 2:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "dropped before reading")
        return await super().Acquire(request, context)


def test_releases_a_failed_call_carried_are_sent_again(tmp_path: Path) -> None:
    """An Acquire that fails before the server reads it puts back the releases it carried:
    the next call sends them."""
    server = BackgroundServer(tmp_path / "drops", servicer=_ServerThatDropsTheSecondAcquire)
    try:
        with Client(server.unix_target, token=ALICE_TOKEN, release_delay_s=30.0) as client:
            namespace, hashes = ns(), keys(4, salt="failed-carrier")
            assert client.put(namespace, hashes, patterned_blocks(4, seed=19)) == 4
            assert len(client.get(namespace, hashes)) == 4 and server.store.sidecar.num_leases == 1
            with pytest.raises(TierKVError, match="dropped before reading"):
                client.get(namespace, hashes)
            assert server.store.sidecar.num_leases == 1  # the release it carried was not done
            assert client.stats().num_leases == 0  # put back, sent before the Stats
    finally:
        server.close()


class _ServerOfSlowReleases(SpyServicer):
    """A server that answers a Release only after a while (a busy loop, a long GC)."""

    async def Release(self, request: Any, context: Any) -> Any:
        await asyncio.sleep(0.5)
        return await super().Release(request, context)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_stats_counts_the_releases_being_sent_on_their_own(tmp_path: Path, kind: str) -> None:
    """The queued release of a get is due and on its way (the client's sender took it off the
    queue) when the caller asks for stats: the Stats waits for it, so it counts no lease the
    caller has let go of (it once raced the sender and counted the lease still held)."""
    server = BackgroundServer(tmp_path / "slow", servicer=_ServerOfSlowReleases)
    namespace, hashes = ns(), keys(4, salt="sending")

    async def in_async() -> tuple[int, int]:
        async with AsyncClient(server.unix_target, token=ALICE_TOKEN,
                               release_delay_s=0.01) as client:
            assert await client.put(namespace, hashes, patterned_blocks(4, seed=21)) == 4
            assert len(await client.get(namespace, hashes)) == 4
            await asyncio.sleep(0.2)  # due, taken and sent; the server is still on it
            held = server.store.sidecar.num_leases
            return held, (await client.stats()).num_leases

    try:
        if kind == "async":
            held, counted = asyncio.run(in_async())
        else:
            with Client(server.unix_target, token=ALICE_TOKEN, release_delay_s=0.01) as client:
                assert client.put(namespace, hashes, patterned_blocks(4, seed=21)) == 4
                assert len(client.get(namespace, hashes)) == 4
                time.sleep(0.2)
                held = server.store.sidecar.num_leases
                counted = client.stats().num_leases
        assert held == 1  # the release had not arrived when the stats was asked for
        assert counted == 0
    finally:
        server.close()


def test_a_lease_past_the_end_of_the_slab_is_refused_before_any_copy(tmp_path: Path) -> None:
    server = BackgroundServer(tmp_path / "bad", servicer=_ServerOfLeasesPastTheSlab)
    try:
        with Client(server.unix_target, token=ALICE_TOKEN) as client:
            namespace, hashes = ns(), keys(2, salt="past-the-slab")
            assert client.put(namespace, hashes, patterned_blocks(2, seed=20)) == 2
            with pytest.raises(ServiceUnavailableError, match="past its slab"):
                client.get(namespace, hashes)
            assert server.store.sidecar.num_leases == 0  # released at once, nothing copied
    finally:
        server.close()
