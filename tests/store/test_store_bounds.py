"""What the store keeps for pins and namespaces stays bounded by what is live (issue 7, 10-11).

Pins with a TTL used to be dropped only under eviction pressure: their deadline heap grew by
one item per pinned block per call (3,000 pinned lookups grew a server by 400 MiB), and expired
pins stayed counted. Namespaces were stored for good.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fake_clock import FakeClock
from tests.support.tiny_blocks import StoreFactory, blocks, keys
from tierkv import Namespace, TieredStore
from tierkv.config import HostTierConfig, Priority, StoreConfig
from tierkv.errors import ConfigError
from tierkv.store.index import Entry
from tierkv.store.namespaces import namespace_state
from tierkv.store.pins import PinTable


def entries(namespace: Namespace, n: int) -> list[Entry]:
    state = namespace_state(namespace)
    return [Entry(key, state, Priority.NORMAL) for key in keys(n)]


# --- pins --------------------------------------------------------------------------------------


def test_re_pinning_the_same_blocks_keeps_the_heap_bounded(namespace: Namespace) -> None:
    clock = FakeClock()
    pins = PinTable(clock)
    pinned = entries(namespace, 16)
    for _ in range(5_000):
        clock.now_s += 0.001  # every pin moves the deadline later: each one is a new item
        for entry in pinned:
            pins.pin(entry, 60.0)
        assert pins.num_heap_items <= 2 * len(pins) + 64
    assert len(pins) == 16


def test_re_pinning_with_an_earlier_deadline_pushes_nothing(namespace: Namespace) -> None:
    pins = PinTable(FakeClock())
    entry = entries(namespace, 1)[0]
    assert pins.pin(entry, 60.0)
    for _ in range(100):
        assert not pins.pin(entry, 30.0)
    assert pins.num_heap_items == 1


def test_a_pin_ends_at_its_latest_deadline(namespace: Namespace) -> None:
    clock = FakeClock()
    pins = PinTable(clock)
    entry = entries(namespace, 1)[0]
    pins.pin(entry, 10.0)
    pins.pin(entry, 60.0)
    pins.pin(entry, 5.0)
    clock.now_s += 30
    assert pins.pop_expired() == [] and entry in pins
    clock.now_s += 31
    assert pins.pop_expired() == [entry] and entry not in pins
    assert pins.num_heap_items == 0


def test_unpinned_entries_leave_no_heap_behind(namespace: Namespace) -> None:
    clock = FakeClock()
    pins = PinTable(clock)
    for entry in entries(namespace, 1_000):
        pins.pin(entry, 60.0)
        pins.unpin(entry)
    assert len(pins) == 0
    assert pins.num_heap_items <= 64
    clock.now_s += 61
    assert pins.pop_expired() == []


def test_expired_pins_are_not_counted_without_eviction_pressure(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    clock = FakeClock()
    store = make_store(host_blocks=64, clock=clock)
    store.register(namespace)
    store.put(namespace, keys(8), blocks(8))
    assert store.pin(namespace, keys(8), ttl_s=10) == 8
    assert store.stats().num_pinned == 8
    clock.now_s += 11
    assert store.stats().num_pinned == 0  # no put, no eviction: reading the stats expires them
    assert store.unpin(namespace, keys(8)) == 0
    assert store.lookup(namespace, keys(8)) == 8  # expiry unpins, it does not delete


def test_expired_pins_give_their_blocks_back_to_eviction(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    clock = FakeClock()
    store = make_store(host_blocks=2, disk_blocks=0, clock=clock)
    store.register(namespace)
    store.put(namespace, keys(2), blocks(2))
    store.pin(namespace, keys(2), ttl_s=10)
    clock.now_s += 11
    store.pin(namespace, keys(1, start=7), ttl_s=10)  # a pin call expires the old pins
    store.put(namespace, keys(2, start=2), blocks(2, seed=1))  # evicts the two, once pinned
    assert store.lookup(namespace, keys(2, start=2)) == 2
    assert store.lookup(namespace, keys(2)) == 0


# --- namespaces --------------------------------------------------------------------------------


def other(namespace: Namespace, model_id: str, tenant: str = "default") -> Namespace:
    return Namespace(model_id, namespace.layout, tenant=tenant)


def test_only_empty_namespaces_of_the_tenant_are_pruned(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store()
    full, empty = other(namespace, "full"), other(namespace, "empty")
    theirs = other(namespace, "empty", tenant="someone-else")
    for each in (full, empty, theirs):
        store.register(each)
    store.put(full, keys(1), blocks(1))
    assert store.num_namespaces() == 3 and store.num_namespaces("default") == 2
    assert store.prune_namespaces("default") == [empty]
    assert not store.is_registered(empty)
    assert store.is_registered(full) and store.is_registered(theirs)
    assert store.prune_namespaces() == [theirs]
    assert store.num_namespaces() == 1


def test_a_namespace_with_a_session_is_kept(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store()
    store.register(namespace)
    store.save_session(namespace, "chat", [1, 2, 3, 4])
    assert store.prune_namespaces() == []
    assert store.is_registered(namespace)


def test_a_pruned_namespace_is_gone_after_a_restart(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store(disk_blocks=16)
    kept, pruned = other(namespace, "kept"), other(namespace, "pruned")
    store.register(kept)
    store.register(pruned)
    store.put(kept, keys(1), blocks(1))
    assert store.prune_namespaces() == [pruned]
    store.close()
    reopened = TieredStore(store.config)
    try:
        assert reopened.is_registered(kept) and not reopened.is_registered(pruned)
    finally:
        reopened.close()


def test_a_write_lease_outlives_the_pruning_of_its_namespace(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store()
    store.register(namespace)
    lease = store.sidecar.allocate_in_process(namespace, keys(2))
    assert store.prune_namespaces() == [namespace]  # no block yet: it goes
    store.register(namespace)  # takes back the state the lease holds, not a second one
    assert store.sidecar.commit(lease.lease_id) == 2
    assert store.lookup(namespace, keys(2)) == 2


def test_a_host_tier_larger_than_dev_shm_is_one_config_error(tmp_path: Path) -> None:
    # Refused before the segment exists: a pre-fault past /dev/shm's room would be a SIGBUS,
    # and Python's SharedMemory answers a failed ftruncate with a resource-tracker traceback.
    free_bytes = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    config = StoreConfig(host=HostTierConfig(free_bytes + 1024 * 1024 * 1024, 256 * 1024))
    with pytest.raises(ConfigError, match="free in /dev/shm"):
        TieredStore(config)
    done = subprocess.run(
        [sys.executable, "-m", "tierkv", "serve", "--host-bytes", "1000TiB", "--no-disk",
         "--listen", f"unix://{tmp_path}/s.sock"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 2
    assert "free in /dev/shm" in done.stderr and "Traceback" not in done.stderr
