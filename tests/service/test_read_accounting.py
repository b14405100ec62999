"""Every read path against every resource that can run out (issue 23), through a real server:
a read serves each stored block of its leading run, or reports a miss, and the server's hit
counters grow by exactly the blocks the reader received; never a wrong byte.

Paths: the SDK over shared memory (Acquire, with its stream fallback) and over the stream
(Get), and the store's own ``get_into`` and ``acquire``. Resources: HOST full of pinned blocks,
of blocks leased to another reader, of ``write_back`` blocks that the small disk budget
cannot take (``write_through`` puts fill it), and of blocks of other namespaces.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.harness import ALICE_TOKEN, BOB_TOKEN, BackgroundServer, free_port, tokens_saved
from tests.support.tiny_blocks import (
    BLOCK_BYTES,
    PAGE_BYTES,
    RECORD_BYTES,
    TINY_LAYOUT,
    block_for,
    key,
    same_bytes,
)
from tierkv import (
    CapacityError,
    Client,
    DiskTierConfig,
    HostTierConfig,
    Namespace,
    StoreConfig,
    StoreStats,
    Tier,
    TieredStore,
    WritePolicy,
)
from tierkv.errors import LeaseStateError
from tierkv.store import migrate

HOST_BLOCKS = 8
NUM_KEYS = 12
_models = itertools.count()

Op = tuple[str, int, int]
OPS = st.one_of(
    st.tuples(st.sampled_from(["put_back", "put_through"]), st.integers(0, NUM_KEYS - 1),
              st.integers(1, 6)),
    st.tuples(st.sampled_from(["pin_host", "lease_host", "release_all", "unpin_all"]),
              st.integers(1, HOST_BLOCKS), st.just(0)),
    st.tuples(st.sampled_from(["read_shm", "read_stream", "read_store", "acquire_store"]),
              st.integers(0, NUM_KEYS - 1), st.integers(1, 10)),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    root = tmp_path_factory.mktemp("read-accounting")
    # A put waits up to 5 s for HOST room that reads hold (migrate._RESERVE_WAIT_S) before it
    # is refused; here leases held for a whole example make every such put wait it out, which
    # is not what these tests count (a property run took 46-196 s by its draws): 0.2 s.
    waits = pytest.MonkeyPatch()
    waits.setattr(migrate, "_RESERVE_WAIT_S", 0.2)
    # 24 records of DISK budget: write_through puts fill it, HOST's demotions then evict them.
    served = BackgroundServer(root, host_blocks=HOST_BLOCKS, disk_blocks=24,
                              tokens={ALICE_TOKEN: "alice"})
    try:
        yield served
    finally:
        served.close()
        waits.undo()


_slabs: dict[str, np.ndarray] = {}


def slab_of(store: TieredStore) -> np.ndarray:
    """The store's HOST slab, mapped as a same-host client maps it (by name, under /dev/shm)."""
    name = store.sidecar.host_shm_name
    if name not in _slabs:
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            _slabs[name] = np.frombuffer(mmap.mmap(fd, 0), np.uint8)
        finally:
            os.close(fd)
    return _slabs[name]


def hits(stats: StoreStats) -> int:
    return sum(t.hits for t in stats.tiers.values())


def misses_in_every_tier(before: StoreStats, after: StoreStats) -> int:
    """Misses counted in the slowest tier: one per block asked for and not served."""
    return after.tiers[Tier.DISK].misses - before.tiers[Tier.DISK].misses


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=4, max_size=24))
def test_reads_serve_what_is_stored_and_count_what_they_served(
    server: BackgroundServer, ops: list[Op]
) -> None:
    model = f"accounting-{next(_models)}"
    namespace = Namespace(model, TINY_LAYOUT)
    own = Namespace(model, TINY_LAYOUT, tenant="alice")  # as the server names the caller's
    other = Namespace(model + "-other", TINY_LAYOUT)
    store = server.store
    store.register(other)
    store.register(own)
    hashes = [key(i, model) for i in range(NUM_KEYS)]
    held_leases: list[bytes] = []
    pinned: list[bytes] = []
    filler = 0
    out = torch.empty((10, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype)
    with Client(server.unix_target, token=ALICE_TOKEN) as shm, \
            Client(server.unix_target, token=ALICE_TOKEN, use_shm=False) as stream:
        try:
            for name, first, count in ops:
                chain = hashes[first : first + count]
                if name in ("put_back", "put_through"):
                    policy = (WritePolicy.WRITE_BACK if name == "put_back"
                              else WritePolicy.WRITE_THROUGH)
                    data = torch.stack([block_for(first + i) for i in range(len(chain))])
                    # HOST pinned or leased full, or no disk room: refused, which is fine
                    with contextlib.suppress(CapacityError):
                        shm.put(namespace, chain, data, write_policy=policy)
                elif name == "pin_host":  # blocks of another namespace, pinned in HOST
                    keys_ = [key(filler + i, model + "-pin") for i in range(first)]
                    filler += first
                    try:
                        store.put(other, keys_, torch.stack([block_for(0)] * first))
                    except CapacityError:
                        continue
                    store.pin(other, keys_)
                    pinned.extend(keys_)
                elif name == "lease_host":  # another reader holds leases on HOST pages
                    keys_ = [key(filler + i, model + "-lease") for i in range(first)]
                    filler += first
                    try:
                        store.put(other, keys_, torch.stack([block_for(0)] * first))
                    except CapacityError:
                        continue
                    held_leases.append(store.sidecar.acquire(other, keys_, 60, owner="holder").lease_id)
                elif name == "release_all":
                    for lease_id in held_leases:
                        store.sidecar.release(lease_id, owner="holder")
                    held_leases.clear()
                elif name == "unpin_all":
                    store.unpin(other, pinned)
                    pinned.clear()
                else:
                    check_read(name, shm, stream, store, namespace, own, chain, first, out)
        finally:
            for lease_id in held_leases:
                store.sidecar.release(lease_id, owner="holder")
            store.unpin(other, pinned)
            store.delete(other, pinned)


def check_read(name: str, shm: Client, stream: Client, store: TieredStore, namespace: Namespace,
               own: Namespace, chain: list[bytes], first: int, out: torch.Tensor) -> None:
    """One read by ``name``'s path; its bytes, hits and misses checked."""
    slab = slab_of(store)
    store.wait_for_background(10.0)  # no promotion of an earlier read moves blocks meanwhile
    num_stored = store.lookup(own, chain)
    before = store.stats()
    if name == "read_shm":
        num_got = shm.get_into(namespace, chain, out[: len(chain)])
        shm.stats()  # its release rides on the next call (client.md, 5): this one sends it
    elif name == "read_stream":
        num_got = stream.get_into(namespace, chain, out[: len(chain)])
    elif name == "read_store":
        num_got = store.get_into(own, chain, out[: len(chain)])
    else:  # an embedded same-host read: lease, copy out of the mapped slab, release
        lease = store.sidecar.acquire(own, chain, 30, owner="reader")
        try:
            num_got = len(lease.blocks)
            for i, extents in enumerate(lease.blocks):
                raw = b"".join(slab[offset : offset + length].tobytes()
                               for offset, length in extents)
                assert len(raw) == BLOCK_BYTES
                out[i].view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw),
                                                                         dtype=torch.uint8))
        finally:
            store.sidecar.release(lease.lease_id, owner="reader")
    after = store.stats()
    for i in range(num_got):
        assert same_bytes(out[i], block_for(first + i)), f"{name}: block {i} has wrong bytes"
    counted = hits(after) - hits(before)
    assert counted == num_got, f"{name}: {num_got} blocks received, {counted} hits counted"
    if name != "acquire_store":  # a lease is one try: the caller reads the rest again
        assert num_got == num_stored, f"{name}: {num_stored} stored, {num_got} served"
        missed = misses_in_every_tier(before, after)
        assert missed == (num_got < len(chain)), f"{name}: {missed} misses for {num_got}/{len(chain)}"


# --- what a Release says the client kept -------------------------------------------------------


def stored_chain(server: BackgroundServer, name: str, num_blocks: int, num_keys: int | None = None
                 ) -> tuple[TieredStore, Namespace, list[bytes]]:
    """A fresh namespace of alice's (as the server names it) holding ``num_blocks`` blocks of
    a chain of ``num_keys`` (default: as many) keys."""
    store = server.store
    own = Namespace(f"{name}-{next(_models)}", TINY_LAYOUT, tenant="alice")
    store.register(own)
    chain = [key(i, own.model_id) for i in range(num_keys or num_blocks)]
    store.put(own, chain[:num_blocks], torch.stack([block_for(i) for i in range(num_blocks)]))
    return store, own, chain


def test_a_release_takes_back_the_hits_of_the_blocks_the_client_did_not_keep(
    server: BackgroundServer,
) -> None:
    store, own, chain = stored_chain(server, "release", 4)
    for corrupt, num_copied, kept, missed in (((), None, 4, 0), ((), 0, 0, 0), ((2,), None, 2, 1),
                                              ((), 3, 3, 0), ((1,), 3, 1, 1)):
        before = store.stats()
        lease = store.sidecar.acquire(own, chain, 30, owner="reader")
        assert len(lease.blocks) == 4
        store.sidecar.release(lease.lease_id, owner="reader", corrupt_indices=corrupt,
                      num_copied=num_copied)
        after = store.stats()
        assert hits(after) - hits(before) == kept, (corrupt, num_copied)
        assert misses_in_every_tier(before, after) == missed, (corrupt, num_copied)
        assert store.lookup(own, chain) == 4  # intact pages: the client's word deletes nothing


def test_prefill_tokens_of_a_lease_count_the_blocks_its_release_says_were_kept(
    tmp_path: Path,
) -> None:
    import grpc

    from tierkv.wire import tierkv_pb2 as pb
    from tierkv.wire import tierkv_pb2_grpc as pb_grpc
    from tierkv.wire.namespaces import namespace_to

    served = BackgroundServer(tmp_path, host_blocks=HOST_BLOCKS, disk_blocks=0,
                              metrics_port=free_port())
    try:
        namespace = Namespace("tokens-model", TINY_LAYOUT)
        chain = [key(i, "tokens") for i in range(4)]
        alice = (("authorization", f"Bearer {ALICE_TOKEN}"),)
        bob = (("authorization", f"Bearer {BOB_TOKEN}"),)
        with Client(served.unix_target, token=ALICE_TOKEN) as client:
            client.put(namespace, chain, torch.stack([block_for(i) for i in range(4)]))
        port = served.served.server.metrics_port
        with grpc.insecure_channel(served.tcp_target) as channel:
            stub = pb_grpc.TierKVStub(channel)
            slab_id = stub.Describe(pb.DescribeRequest(), metadata=alice).slab_id

            def acquire() -> bytes:
                lease = stub.Acquire(pb.AcquireRequest(
                    namespace=namespace_to(namespace), hashes=chain, slab_id=slab_id),
                    metadata=alice)
                assert lease.num_blocks == 4
                return bytes(lease.lease_id)

            expected = 0.0
            for release, kept in ((pb.LeaseRequest(), 4), (pb.LeaseRequest(num_copied=0), 0),
                                  (pb.LeaseRequest(corrupt_indices=[1]), 1),
                                  (pb.LeaseRequest(num_copied=3, corrupt_indices=[3]), 3)):
                lease_id = acquire()
                assert tokens_saved(port, namespace.model_id) == expected  # not before Release
                release.lease_id = lease_id
                stub.Release(release, metadata=alice)
                expected += kept * TINY_LAYOUT.block_size
                assert tokens_saved(port, namespace.model_id) == expected, release
            # Another tenant's Release of alice's lease counts nothing (and is refused).
            lease_id = acquire()
            with pytest.raises(grpc.RpcError):
                stub.Release(pb.LeaseRequest(lease_id=lease_id), metadata=bob)
            assert tokens_saved(port, namespace.model_id) == expected
            stub.Release(pb.LeaseRequest(lease_id=lease_id), metadata=alice)
            assert tokens_saved(port, namespace.model_id) == expected + 4 * TINY_LAYOUT.block_size
    finally:
        served.close()


def test_prefill_tokens_count_the_releases_that_ride_on_later_calls(tmp_path: Path) -> None:
    """A same-host get's release rides on the client's next Acquire or Allocate: the tokens
    of its lease count then, once, as for a Release of its own."""
    served = BackgroundServer(tmp_path, host_blocks=HOST_BLOCKS, disk_blocks=0,
                              metrics_port=free_port())
    try:
        namespace = Namespace("carried-model", TINY_LAYOUT)
        chain = [key(i, "carried") for i in range(4)]
        port = served.served.server.metrics_port
        per_get = 4 * TINY_LAYOUT.block_size
        with Client(served.unix_target, token=ALICE_TOKEN, release_delay_s=30.0) as client:
            client.put(namespace, chain, torch.stack([block_for(i) for i in range(4)]))
            assert len(client.get(namespace, chain)) == 4
            assert tokens_saved(port, namespace.model_id) == 0  # queued, not released yet
            assert len(client.get(namespace, chain)) == 4  # its Acquire carries the first
            assert tokens_saved(port, namespace.model_id) == per_get
            client.put(namespace, [key(9, "carried")], block_for(9)[None])  # Allocate carries
            assert tokens_saved(port, namespace.model_id) == 2 * per_get
            client.stats()
            assert tokens_saved(port, namespace.model_id) == 2 * per_get
    finally:
        served.close()


def test_an_expired_lease_is_counted_by_its_late_release_and_once_only(
    server: BackgroundServer,
) -> None:
    store, own, chain = stored_chain(server, "expired", 3)
    for num_copied, kept in ((None, 3), (0, 0)):
        before = store.stats()
        lease = store.sidecar.acquire(own, [*chain, key(99, own.model_id)], 0.1, owner="late")
        assert hits(store.stats()) == hits(before)  # nothing is counted before the release
        time.sleep(0.2)
        with pytest.raises(LeaseStateError):
            store.sidecar.release(lease.lease_id, owner="late", num_copied=num_copied)
        with pytest.raises(LeaseStateError):  # a second release counts nothing more
            store.sidecar.release(lease.lease_id, owner="late")
        after = store.stats()
        assert hits(after) - hits(before) == kept
        # The lease reached the end of the run: the block after it is one miss, if kept.
        assert misses_in_every_tier(before, after) == (kept == 3)


def test_one_short_read_is_one_miss_whatever_ends_it(server: BackgroundServer) -> None:
    store, own, chain = stored_chain(server, "one-miss", 3, 4)
    # The lease reaches the end of the stored run (3 of 4) and the client finds block 1
    # damaged: one short read, one miss.
    before = store.stats()
    lease = store.sidecar.acquire(own, chain, 30, owner="reader")
    store.sidecar.release(lease.lease_id, owner="reader", corrupt_indices=[1])
    after = store.stats()
    assert (hits(after) - hits(before), misses_in_every_tier(before, after)) == (1, 1)


def test_a_stream_cut_at_max_put_bytes_is_read_to_the_end_of_the_run(tmp_path: Path) -> None:
    served = BackgroundServer(tmp_path, host_blocks=8, disk_blocks=64,
                              tokens={ALICE_TOKEN: "alice"}, max_put_bytes=2 * BLOCK_BYTES)
    try:
        store = served.store
        namespace = Namespace("cut-model", TINY_LAYOUT)
        chain = [key(i, "cut") for i in range(8)]
        out = torch.empty((8, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype)
        with Client(served.unix_target, token=ALICE_TOKEN) as shm, \
                Client(served.unix_target, token=ALICE_TOKEN, use_shm=False) as stream:
            for start in range(0, 6, 2):
                stream.put(namespace, chain[start : start + 2],
                           torch.stack([block_for(start + i) for i in range(2)]),
                           write_policy=WritePolicy.WRITE_THROUGH)
            # HOST full of pins: the same-host client reads over the stream too.
            other = Namespace("cut-other", TINY_LAYOUT)
            store.register(other)
            walls = [key(i, "cut-wall") for i in range(8)]
            store.put(other, walls, torch.stack([block_for(0)] * 8))
            store.pin(other, walls)
            for reader in (stream, shm):
                store.wait_for_background(10.0)
                before = store.stats()
                assert reader.get_into(namespace, chain, out) == 6  # three answers of two
                after = store.stats()
                assert all(same_bytes(out[i], block_for(i)) for i in range(6))
                assert hits(after) - hits(before) == 6
                assert misses_in_every_tier(before, after) == 1
    finally:
        served.close()


def test_a_block_whose_demotion_failed_is_passed_over_only_until_it_has_a_disk_copy(
    tmp_path: Path,
) -> None:
    """The disk budget is full of pinned records: HOST's write_back blocks cannot be demoted.
    A read's promotion passes them over (each fails once, counted once) and the read is not
    leased; once they have a DISK copy (put again write_through after some pins went),
    promotions evict them again and the read is leased."""
    config = StoreConfig(host=HostTierConfig(4 * BLOCK_BYTES, PAGE_BYTES, prefault=False),
                         disk=DiskTierConfig(tmp_path / "disk", 8 * RECORD_BYTES,
                                             map_slack_bytes=16 << 20), presence_slots=0)
    namespace = Namespace("mark-model", TINY_LAYOUT)

    def chain(name: str) -> tuple[list[bytes], torch.Tensor]:
        offset = {"D": 0, "X": 10, "W": 20}[name]
        return ([key(i, name) for i in range(4)],
                torch.stack([block_for(offset + i) for i in range(4)]))

    (d_keys, d_data), (x_keys, x_data), (w_keys, w_data) = chain("D"), chain("X"), chain("W")
    with TieredStore(config) as store:
        store.register(namespace)
        store.put(namespace, d_keys, d_data, write_policy=WritePolicy.WRITE_THROUGH)
        store.put(namespace, x_keys, x_data, write_policy=WritePolicy.WRITE_THROUGH)
        store.put(namespace, w_keys, w_data)  # write_back: HOST is W, DISK is D and X
        store.pin(namespace, d_keys)
        store.pin(namespace, x_keys)
        for _ in range(3):
            lease = store.sidecar.acquire(namespace, d_keys[:1], owner="r")
            store.sidecar.release(lease.lease_id, owner="r")
            assert lease.blocks == [] and lease.num_cached == 1
        assert 1 <= store.stats().failed_demotions <= 4  # once per block, not once per read
        got = store.get(namespace, d_keys)  # served from DISK all the same
        assert len(got) == 4 and same_bytes(got, d_data)
        store.unpin(namespace, x_keys)
        store.put(namespace, w_keys, w_data, write_policy=WritePolicy.WRITE_THROUGH)
        lease = store.sidecar.acquire(namespace, d_keys[:1], owner="r")
        store.sidecar.release(lease.lease_id, owner="r")
        assert len(lease.blocks) == 1
        got = store.get(namespace, w_keys)
        assert len(got) == 4 and same_bytes(got, w_data)
