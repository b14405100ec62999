"""The shared-memory presence table: same-host lookups without a call, always in step with the
store's index, keyed per tenant."""

from __future__ import annotations

import random
import secrets
from pathlib import Path

import pytest

from tests.support.harness import ALICE_TOKEN, BOB_TOKEN, BackgroundServer
from tests.support.tiny_blocks import StoreFactory, blocks, keys
from tierkv import Client, Namespace, ServiceUnavailableError
from tierkv.shm.presence import PresenceTable, PresenceView, fingerprint


@pytest.fixture
def table() -> PresenceTable:
    created = PresenceTable(16, f"tkv-test-{secrets.token_hex(4)}")
    yield created  # type: ignore[misc]
    created.close()


def test_add_remove_and_probe_through_collisions(table: PresenceTable) -> None:
    view = PresenceView(table.name, b"")
    mask = table.num_slots - 1
    # Values that share home slots, runs that wrap around the end of the table.
    values = [(i << 8) | home | 1 for i in range(1, 4) for home in (mask - 1, mask, 0)]
    present: set[int] = set()
    rng = random.Random(3)
    for _ in range(2000):
        value = rng.choice(values)
        if value in present:
            table.remove(value)
            present.discard(value)
        else:
            assert table.add(value)
            present.add(value)
        for candidate in values:  # every present value is found, no other
            assert view.count_leading_values([candidate]) == (candidate in present)
    view.close()


def test_a_full_table_turns_itself_off(table: PresenceTable) -> None:
    for value in range(3, 3 + 2 * 8, 2):  # 8 values fill half of 16 slots
        assert table.add(value)
    assert not table.add(99)
    assert not table.enabled
    view = PresenceView(table.name, b"")
    assert view.count_leading(b"\x00" * 16, [b"\x00" * 32]) is None  # "ask over RPC"
    view.close()


def test_the_store_keeps_the_table_in_step(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=4, disk_blocks=8)
    store.register(namespace)
    name, key = store.sidecar.presence_info(namespace.tenant)
    view = PresenceView(name, key)
    core_id = bytes(namespace.with_tenant("").id)
    chain = keys(10)
    for i in range(0, 10, 2):  # evictions demote to disk: still present
        store.put(namespace, chain[i : i + 2], blocks(2, seed=i))
    assert view.count_leading(core_id, chain) == store.lookup(namespace, chain) == 10
    store.delete(namespace, chain[3:4])
    assert view.count_leading(core_id, chain) == store.lookup(namespace, chain) == 3
    store.put(namespace, chain[3:4], blocks(1))
    assert view.count_leading(core_id, chain) == 10
    # Another tenant's key finds nothing of this tenant's.
    _, other_key = store.sidecar.presence_info("someone-else")
    other = PresenceView(name, other_key)
    assert other_key != key and other.count_leading(core_id, chain) == 0
    view.close()
    other.close()


def test_a_store_without_a_table_says_so(make_store: StoreFactory) -> None:
    store = make_store(presence_slots=0)
    assert store.sidecar.presence_info("default") == ("", b"")


def test_fingerprints_never_read_as_empty() -> None:
    for _ in range(100):
        assert fingerprint(secrets.token_bytes(16), secrets.token_bytes(16),
                           secrets.token_bytes(32)) & 1


def test_clients_look_up_short_chains_without_a_call(tmp_path: Path, namespace: Namespace) -> None:
    served = BackgroundServer(tmp_path)
    alice = Client(served.served.unix_target, token=ALICE_TOKEN, retries=0)
    bob = Client(served.served.unix_target, token=BOB_TOKEN, retries=0)
    try:
        chain = keys(6)
        alice.put(namespace, chain[:4], blocks(4))
        assert alice.uses_shared_memory and bob.uses_shared_memory
        assert alice.lookup(namespace, chain) == 4  # from the table
        assert alice.lookup_detail(namespace, chain).num_cached == 4  # over RPC: the same
        alice.delete(namespace, chain[1:2])
        assert alice.lookup(namespace, chain) == 1
        assert bob.lookup(namespace, chain) == 0  # the same hashes are not bob's blocks
        assert alice.lookup(namespace, keys(65)) == 1  # a long chain goes over RPC
        # With the listeners gone, short lookups still answer: they made no call.
        served.call(served.served.server.grpc_server.stop(None))
        assert alice.lookup(namespace, chain) == 1
        with pytest.raises(ServiceUnavailableError):
            alice.lookup(namespace, keys(65))
    finally:
        alice.close()
        bob.close()
        served.close()
