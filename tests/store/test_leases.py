"""Leases on HOST pages: a same-host client reads and writes blocks in the shared-memory slab."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.support.fake_clock import FakeClock
from tests.support.tiny_blocks import BLOCK_BYTES, StoreFactory, blocks, keys, same_bytes
from tierkv import (
    CapacityError,
    InvalidArgumentError,
    LeaseNotFoundError,
    LeaseStateError,
    Namespace,
    Tier,
    TieredStore,
    WritePolicy,
)
from tierkv.checksums import block_checksums


@pytest.fixture
def slab_of() -> Iterator[object]:
    """Map a store's HOST slab the way a client process does (by name, under /dev/shm)."""
    maps: list[mmap.mmap] = []

    def open_slab(store: TieredStore) -> np.ndarray:
        fd = os.open(f"/dev/shm/{store.sidecar.host_shm_name}", os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        maps.append(mapping)
        return np.frombuffer(mapping, np.uint8)

    yield open_slab
    for mapping in maps:
        with contextlib.suppress(BufferError):
            mapping.close()


def read_block(slab: np.ndarray, extents: list[tuple[int, int]]) -> bytes:
    return b"".join(slab[offset : offset + length].tobytes() for offset, length in extents)


def checksums_of(data: torch.Tensor, indices: list[int]) -> list[int]:
    """What a client sends with Commit: the checksum of each block it wrote."""
    flat = data.contiguous().view(torch.uint8).reshape(-1)
    return block_checksums(flat, flat.numel() // data.shape[0], indices)


def write_block(slab: np.ndarray, extents: list[tuple[int, int]], data: torch.Tensor) -> None:
    raw = data.contiguous().view(torch.uint8).reshape(-1).numpy()
    done = 0
    for offset, length in extents:
        slab[offset : offset + length] = raw[done : done + length]
        done += length


def test_acquire_gives_the_bytes_in_place_and_pins_them(
    make_store: StoreFactory, namespace: Namespace, slab_of: object
) -> None:
    store = make_store(host_blocks=4)
    store.register(namespace)
    data = blocks(3, seed=1)
    store.put(namespace, keys(3), data)
    lease = store.sidecar.acquire(namespace, keys(5), owner="a")
    assert lease.num_cached == 3 and len(lease.blocks) == 3
    slab = slab_of(store)  # type: ignore[operator]
    for i, extents in enumerate(lease.blocks):
        assert sum(length for _, length in extents) == BLOCK_BYTES
        assert read_block(slab, extents) == data[i].contiguous().view(torch.uint8).numpy().tobytes()
    # Leased blocks are being read: a put that needs their room cannot take it.
    with pytest.raises(CapacityError):
        store.put(namespace, keys(4, start=10), blocks(4, seed=2))
    store.sidecar.release(lease.lease_id, owner="a")
    store.put(namespace, keys(4, start=10), blocks(4, seed=2))
    assert store.sidecar.num_leases == 0


def test_acquire_brings_disk_blocks_into_host(
    make_store: StoreFactory, namespace: Namespace, slab_of: object
) -> None:
    store = make_store(host_blocks=4, disk_blocks=8, promote_on_read=False)
    store.register(namespace)
    data = blocks(2, seed=3)
    store.put(namespace, keys(2), data, tier=Tier.DISK)
    lease = store.sidecar.acquire(namespace, keys(2))
    slab = slab_of(store)  # type: ignore[operator]
    assert [read_block(slab, e) for e in lease.blocks] == [
        data[i].contiguous().view(torch.uint8).numpy().tobytes() for i in range(2)
    ]
    store.sidecar.release(lease.lease_id)


def test_allocate_write_commit_makes_the_blocks_visible_at_once(
    make_store: StoreFactory, namespace: Namespace, slab_of: object
) -> None:
    store = make_store(host_blocks=8, disk_blocks=8)
    store.register(namespace)
    data = blocks(4, seed=4)
    store.put(namespace, keys(1), data[:1])  # block 0 is stored already
    lease = store.sidecar.allocate(namespace, keys(4), owner="w", write_policy=WritePolicy.WRITE_THROUGH)
    assert lease.write_indices == [0, 1, 2, 3]  # 0 too: it has no disk record yet
    slab = slab_of(store)  # type: ignore[operator]
    for index, extents in zip(lease.write_indices, lease.blocks, strict=True):
        write_block(slab, extents, data[index])
    assert store.lookup(namespace, keys(4)) == 1  # nothing new is visible before the commit
    sums = checksums_of(data, lease.write_indices)
    assert store.sidecar.commit(lease.lease_id, owner="w", checksums=sums) == 3
    assert same_bytes(store.get(namespace, keys(4)), data)
    assert store.stats().tiers[Tier.DISK].num_blocks == 4
    with pytest.raises(LeaseStateError, match="already committed"):
        store.sidecar.commit(lease.lease_id, owner="w", checksums=sums)


def test_abort_stores_nothing_and_gives_the_pages_back(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store(host_blocks=4)
    store.register(namespace)
    lease = store.sidecar.allocate(namespace, keys(4))
    assert store.stats().tiers[Tier.HOST].used_bytes == 4 * BLOCK_BYTES
    store.sidecar.abort(lease.lease_id)
    assert store.lookup(namespace, keys(4)) == 0
    assert store.stats().tiers[Tier.HOST].used_bytes == 0
    with pytest.raises(LeaseStateError, match="aborted"):
        store.sidecar.commit(lease.lease_id)


def test_a_lease_belongs_to_its_owner(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store()
    store.register(namespace)
    lease = store.sidecar.allocate(namespace, keys(1), owner="tenant-a/client-1")
    with pytest.raises(LeaseNotFoundError):
        store.sidecar.commit(lease.lease_id, owner="tenant-b/client-9")
    with pytest.raises(LeaseNotFoundError):
        store.sidecar.release(lease.lease_id, owner="tenant-a/client-1")  # a write lease, not a read one
    with pytest.raises(LeaseNotFoundError):
        store.sidecar.commit(b"\x00" * 16, owner="tenant-a/client-1")
    store.sidecar.abort(lease.lease_id, owner="tenant-a/client-1")


def test_leases_expire_and_give_their_pages_back(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    clock = FakeClock(100.0)
    store = make_store(host_blocks=4, clock=clock)
    store.register(namespace)
    write = store.sidecar.allocate(namespace, keys(2), ttl_s=5)
    store.put(namespace, keys(2, start=5), blocks(2))
    read = store.sidecar.acquire(namespace, keys(2, start=5), ttl_s=5)
    clock.now_s += 6
    assert store.sidecar.expire_leases() == 2
    assert store.sidecar.num_leases == 0
    with pytest.raises(LeaseStateError, match="expired"):
        store.sidecar.commit(write.lease_id)
    with pytest.raises(LeaseStateError, match="expired"):
        store.sidecar.release(read.lease_id)
    assert store.lookup(namespace, keys(2)) == 0
    assert store.stats().tiers[Tier.HOST].used_bytes == 2 * BLOCK_BYTES  # only the put's pages


def test_a_deleted_leased_block_keeps_its_bytes_until_release(
    make_store: StoreFactory, namespace: Namespace, slab_of: object
) -> None:
    store = make_store(host_blocks=2)
    store.register(namespace)
    data = blocks(1, seed=5)
    store.put(namespace, keys(1), data)
    lease = store.sidecar.acquire(namespace, keys(1))
    assert store.delete(namespace, keys(1)) == 1
    store.put(namespace, keys(1, start=9), blocks(1, seed=6))  # takes the other free block
    slab = slab_of(store)  # type: ignore[operator]
    assert read_block(slab, lease.blocks[0]) == data[0].contiguous().view(torch.uint8).numpy().tobytes()
    store.sidecar.release(lease.lease_id)
    assert store.stats().tiers[Tier.HOST].used_bytes == BLOCK_BYTES


@pytest.mark.parametrize("ttl_s", [-1, float("nan"), 1e9, 1e-300, 0.05])
def test_bad_lease_ttl_is_rejected(
    make_store: StoreFactory, namespace: Namespace, ttl_s: float
) -> None:
    store = make_store()
    store.register(namespace)
    with pytest.raises(InvalidArgumentError, match="lease_ttl_s"):
        store.sidecar.allocate(namespace, keys(1), ttl_s=ttl_s)
    assert store.sidecar.num_leases == 0 and store.stats().tiers[Tier.HOST].used_bytes == 0
