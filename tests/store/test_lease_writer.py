"""A byte stream copied straight into a write lease's HOST pages by the store
(``TieredStore.sidecar.allocate_in_process`` and ``lease_writer``: the server's stream Put).

Real stores with two pages a block, fragmented on purpose so that leased blocks lie on scattered
pages; chunk sizes that cut pages, blocks and spans anywhere; blocks stored already (whose bytes
the stream carries but the lease does not want). What commits must read back bit-exact.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.service_fixtures import split
from tests.support.tiny_blocks import BLOCK_BYTES, StoreFactory, blocks, keys, same_bytes
from tierkv import InvalidArgumentError, LeaseStateError, Namespace, Tier, TieredStore

NUM_BLOCKS = 6


def fragment(store: TieredStore, namespace: Namespace) -> None:
    """Leave HOST with every other block's pages free: new blocks get scattered pages."""
    filler = keys(8, salt="frag")
    store.put(namespace, filler, blocks(8, seed=5))
    store.delete(namespace, filler[::2])


def stream(store: TieredStore, namespace: Namespace, hashes: list[bytes], data: torch.Tensor,
           chunk_sizes: list[int]) -> int:
    """Allocate, feed ``data`` in chunks of ``chunk_sizes`` (cycled), commit."""
    raw = data.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    lease = store.sidecar.allocate_in_process(namespace, hashes)
    with store.sidecar.lease_writer(lease) as filler:
        assert filler.total_bytes == len(raw)
        for piece in split(raw, chunk_sizes):
            filler.write(memoryview(piece))
        assert filler.complete
    return store.sidecar.commit(lease.lease_id)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chunk_sizes=st.lists(st.integers(1, 3 * BLOCK_BYTES), min_size=1, max_size=5),
    stored=st.sets(st.integers(0, NUM_BLOCKS - 1)),
)
def test_chunks_of_any_size_land_bit_exact(
    make_store: StoreFactory, namespace: Namespace, chunk_sizes: list[int], stored: set[int]
) -> None:
    store = make_store(host_blocks=16)
    store.register(namespace)
    fragment(store, namespace)
    hashes = keys(NUM_BLOCKS, salt="stream")
    data = blocks(NUM_BLOCKS, seed=11)
    for index in sorted(stored):  # stored already: the stream carries them, the lease skips them
        store.put(namespace, [hashes[index]], data[index : index + 1])

    assert stream(store, namespace, hashes, data, chunk_sizes) == NUM_BLOCKS - len(stored)
    assert same_bytes(store.get(namespace, hashes), data)
    assert store.sidecar.num_leases == 0


def test_more_bytes_than_the_blocks_hold_are_refused(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store()
    store.register(namespace)
    hashes = keys(2)
    lease = store.sidecar.allocate_in_process(namespace, hashes)
    raw = memoryview(bytes(3 * BLOCK_BYTES))
    with store.sidecar.lease_writer(lease) as filler:
        assert filler.total_bytes == 2 * BLOCK_BYTES
        filler.write(raw[: BLOCK_BYTES + 1])
        assert not filler.complete
        with pytest.raises(InvalidArgumentError, match="more than"):
            filler.write(raw[: BLOCK_BYTES])
    store.sidecar.abort(lease.lease_id)
    assert store.lookup(namespace, hashes) == 0
    assert store.stats().tiers[Tier.HOST].used_bytes == 0


def test_a_lease_that_does_not_expire_outlives_every_ttl(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    """What the stream writes into can never be reaped (and reused) under it."""
    now = [100.0]
    store = make_store(clock=lambda: now[0])
    store.register(namespace)
    lease = store.sidecar.allocate_in_process(namespace, keys(2))
    assert math.isinf(lease.expires_in_s)
    now[0] += 10**9
    assert store.sidecar.expire_leases() == 0
    assert store.sidecar.num_leases == 1
    store.sidecar.abort(lease.lease_id)
    assert store.sidecar.num_leases == 0
    assert store.stats().tiers[Tier.HOST].used_bytes == 0


def test_only_an_in_process_lease_is_written_by_the_store(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    """A client's lease is written by that client alone (and checked against its checksums)."""
    store = make_store()
    store.register(namespace)
    lease = store.sidecar.allocate(namespace, keys(2))
    with pytest.raises(LeaseStateError, match="allocate_in_process"):
        store.sidecar.lease_writer(lease)
    store.sidecar.abort(lease.lease_id)
