"""Property tests of ``TieredStore``: random operation sequences against tiny tiers.

A hypothesis state machine drives one store per example (tiny emulated GPU, HOST and DISK
budgets, a fake clock for pin TTLs) with puts, gets, lookups, pins, unpins, deletes, prefetches
and clock steps over a universe of ten keys (the content of key ``i`` is always
``block_for(i)``), and checks after every step what must hold at every instant:

- no tier is ever over its budget, and its block count fits what it holds;
- a hit returns exactly the bytes put under its key, never other bytes;
- a failed put (``CapacityError``) makes none of its new keys visible;
- a deleted key is a miss until it is put again;
- a pinned block stays stored until its pin goes (unpin, TTL, delete);
- while the disk has room for every key ever put, a ``write_through`` block is never lost, and
  no block at all is lost unless a demotion failed.

``wait_for_background`` is a barrier behind every background promotion; the machine tracks
whether background work may be in flight (``quiet``) and checks the stronger "no background
work" properties only when it is not.
"""

from __future__ import annotations

import math
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from tests.support.fake_clock import FakeClock
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
    DiskTierConfig,
    GpuTierConfig,
    HostTierConfig,
    Namespace,
    Priority,
    StoreConfig,
    StoreStats,
    Tier,
    TieredStore,
    WritePolicy,
)
from tierkv.config import Eviction

NUM_KEYS = 10
KEYS = [key(i, "property") for i in range(NUM_KEYS)]
BLOCKS = [block_for(i) for i in range(NUM_KEYS)]
# No single call may take this long: the store waits only for blocks that are busy, and nothing
# in a single-threaded caller's sequence keeps a block busy for long.
STALL_S = 2.0


def chain_of(start: int, length: int) -> list[int]:
    """Key indices of a chain (distinct: ``length`` < ``NUM_KEYS``)."""
    return [(start + j) % NUM_KEYS for j in range(length)]


def stack(indices: list[int]) -> torch.Tensor:
    return torch.stack([BLOCKS[i] for i in indices])


def open_store(
    *,
    gpu_blocks: int,
    host_blocks: int,
    disk_blocks: int,
    disk_path: Path | None,
    write_policy: WritePolicy = WritePolicy.WRITE_BACK,
    promote_on_read: bool = True,
    clock: FakeClock | None = None,
    eviction: Eviction = Eviction.LRU,
) -> TieredStore:
    """A store with tiny tiers and ONE worker thread (so a worker task is a barrier)."""
    disk = None
    if disk_blocks:
        assert disk_path is not None
        disk = DiskTierConfig(disk_path, disk_blocks * RECORD_BYTES)
    config = StoreConfig(
        host=HostTierConfig(host_blocks * BLOCK_BYTES, PAGE_BYTES),
        gpu=GpuTierConfig(gpu_blocks * BLOCK_BYTES, PAGE_BYTES, "emulated"),
        disk=disk,
        write_policy=write_policy,
        promote_on_read=promote_on_read,
        num_workers=1,
        eviction=eviction,
    )
    return TieredStore(config, clock=clock) if clock is not None else TieredStore(config)


def check_budgets(stats: StoreStats) -> None:
    """What must hold at every instant, background copies in flight included."""
    for tier, tier_stats in stats.tiers.items():
        unit = RECORD_BYTES if tier is Tier.DISK else BLOCK_BYTES
        assert 0 <= tier_stats.used_bytes <= tier_stats.capacity_bytes, tier_stats
        assert tier_stats.num_blocks >= 0, tier_stats
        # Every block counted holds its bytes; reserved in-flight copies come on top.
        assert tier_stats.num_blocks * unit <= tier_stats.used_bytes, tier_stats


def check_settled(stats: StoreStats, num_found: int) -> None:
    """With no copy in flight, a tier holds exactly its blocks, and each block is one key."""
    for tier, tier_stats in stats.tiers.items():
        unit = RECORD_BYTES if tier is Tier.DISK else BLOCK_BYTES
        assert tier_stats.used_bytes == tier_stats.num_blocks * unit, tier_stats
        assert tier_stats.num_blocks <= num_found, (tier_stats, num_found)
    assert num_found <= sum(t.num_blocks for t in stats.tiers.values())



@dataclass
class PinModel:
    """What is known of one key's pins: its count lies in ``[low, high]``; while ``low >= 1``,
    the store's deadline for the key is at least ``deadline_s``. A key's pins share one
    deadline, the latest of the pins added since its count was last zero: an unpin keeps it,
    but a pin after the count reached zero (unpinned, or expired) starts afresh, so the
    deadline of a pin that has gone says nothing of the pins left. The store drops expired
    pins lazily, so after expiry the count is only known to be at most ``high``."""

    low: int
    high: int
    deadline_s: float


class StoreMachine(RuleBasedStateMachine):
    """One tiny store per example, driven by random operations."""

    def __init__(self) -> None:
        super().__init__()
        self.store: TieredStore | None = None
        self.tmp: tempfile.TemporaryDirectory[str] | None = None
        self.stuck = False

    # --- set-up and tear-down -----------------------------------------------------------------

    @initialize(
        gpu_blocks=st.integers(0, 3),
        host_blocks=st.integers(2, 6),
        disk_blocks=st.sampled_from([0, 3, 4, 5, 6, 7, 8, 9, 10]),
        write_through=st.booleans(),
        promote_on_read=st.booleans(),
        eviction=st.sampled_from(list(Eviction)),
    )
    def open(
        self, gpu_blocks: int, host_blocks: int, disk_blocks: int, write_through: bool,
        promote_on_read: bool, eviction: Eviction,
    ) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="tierkv-prop-", ignore_cleanup_errors=True)
        self.clock = FakeClock()
        self.gpu_blocks, self.host_blocks, self.disk_blocks = gpu_blocks, host_blocks, disk_blocks
        self.default_policy = (
            WritePolicy.WRITE_THROUGH if write_through and disk_blocks else WritePolicy.WRITE_BACK
        )
        self.promote_on_read = promote_on_read
        self.store = open_store(
            gpu_blocks=gpu_blocks, host_blocks=host_blocks, disk_blocks=disk_blocks,
            disk_path=Path(self.tmp.name) / "disk", write_policy=self.default_policy,
            promote_on_read=promote_on_read, clock=self.clock, eviction=eviction,
        )
        self.ns = Namespace("property-model", TINY_LAYOUT)
        self.store.register(self.ns)
        self.tiers = [t for t, n in ((Tier.GPU, gpu_blocks), (Tier.HOST, host_blocks),
                                     (Tier.DISK, disk_blocks)) if n]
        self.capacity_blocks = {Tier.GPU: gpu_blocks, Tier.HOST: host_blocks, Tier.DISK: disk_blocks}
        self.ever_put: set[int] = set()  # keys ever stored (bounds what the disk must hold)
        self.live: set[int] = set()  # stored, not deleted since
        self.durable: set[int] = set()  # stored on disk by a put, not deleted since
        self.deleted: set[int] = set()  # deleted, not stored since
        self.pins: dict[int, PinModel] = {}
        self.quiet = True  # no background work can be in flight

    def teardown(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            if self.stuck:
                # A background task is stuck in the store; do not hang the suite on it.
                threading.Thread(target=store.close, kwargs={"flush": False}, daemon=True).start()
            else:
                store.close(flush=False)
        if self.tmp is not None:
            self.tmp.cleanup()
            self.tmp = None

    # --- helpers ------------------------------------------------------------------------------

    @property
    def s(self) -> TieredStore:
        assert self.store is not None
        return self.store

    def hashes(self, indices: list[int]) -> list[bytes]:
        return [KEYS[i] for i in indices]

    def found(self, i: int) -> bool:
        return self.s.lookup(self.ns, [KEYS[i]]) == 1

    def definitely_pinned(self) -> set[int]:
        now = self.clock.now_s
        return {i for i, pin in self.pins.items() if pin.low >= 1 and pin.deadline_s > now}

    def settle(self) -> None:
        """Wait for every background task."""
        started = time.monotonic()
        if not self.s.wait_for_background(timeout_s=STALL_S):
            self.stuck = True
            raise AssertionError(
                f"background work did not finish within {STALL_S} s (a promotion waits on itself?)"
            )
        self.quiet = True
        assert time.monotonic() - started < STALL_S

    def timed(self, started: float, what: str) -> None:
        elapsed = time.monotonic() - started
        assert elapsed < STALL_S, f"{what} took {elapsed:.2f} s"

    # --- rules --------------------------------------------------------------------------------

    @rule(
        start=st.integers(0, NUM_KEYS - 1),
        length=st.integers(1, 4),
        priority=st.sampled_from(Priority),
        tier_pick=st.integers(0, 2),
        policy_pick=st.sampled_from(["default", "write_back", "write_through"]),
    )
    def put(self, start: int, length: int, priority: Priority, tier_pick: int, policy_pick: str) -> None:
        chain = chain_of(start, length)
        target = self.tiers[tier_pick % len(self.tiers)]
        policy: WritePolicy | None = None
        if policy_pick == "write_back":
            policy = WritePolicy.WRITE_BACK
        elif policy_pick == "write_through" and self.disk_blocks:
            policy = WritePolicy.WRITE_THROUGH
        effective = policy or self.default_policy
        before = {i: self.found(i) for i in chain}
        started = time.monotonic()
        try:
            stored = self.s.put(self.ns, self.hashes(chain), stack(chain), priority=priority,
                                write_policy=policy, tier=target)
        except CapacityError:
            event("put: CapacityError")
            self.timed(started, "a failed put")
            for i in chain:
                if not before[i]:
                    assert not self.found(i), f"a failed put made key {i} visible"
            if self.quiet and not self.pins:
                # With nothing pinned or busy, only a chain larger than a tier cannot fit.
                needs_disk = target is Tier.DISK or effective is WritePolicy.WRITE_THROUGH
                too_big = length > self.capacity_blocks[target] or (
                    needs_disk and length > self.disk_blocks)
                assert too_big, (
                    f"put of {length} blocks into {target.name} (policy {effective.value}) "
                    "raised CapacityError with nothing pinned or busy"
                )
            return
        self.timed(started, "a put")
        event(f"put: stored into {target.name}")
        assert 0 <= stored <= length
        assert stored >= sum(not found for found in before.values())
        for i in chain:
            self.deleted.discard(i)
            self.ever_put.add(i)
            self.live.add(i)
        if target is Tier.DISK or effective is WritePolicy.WRITE_THROUGH:
            self.durable.update(chain)
        if self.quiet:
            # Acknowledged means stored: the whole chain is a hit right after the put.
            assert self.s.lookup(self.ns, self.hashes(chain)) == length, (
                f"put of chain {chain} into {target.name} returned {stored}, but only "
                f"{self.s.lookup(self.ns, self.hashes(chain))} leading blocks are stored: the put "
                "evicted part of its own chain"
            )

    @rule(start=st.integers(0, NUM_KEYS - 1), length=st.integers(1, 4), into=st.booleans())
    def get(self, start: int, length: int, into: bool) -> None:
        chain = chain_of(start, length)
        hashes = self.hashes(chain)
        expected = self.s.lookup(self.ns, hashes) if self.quiet else None
        started = time.monotonic()
        if into:
            out = torch.randint(0, 256, (length + 1, BLOCK_BYTES), dtype=torch.uint8)
            out = out.view(TINY_LAYOUT.torch_dtype).reshape(length + 1, *TINY_LAYOUT.block_shape)
            num_read = self.s.get_into(self.ns, hashes, out)
            result = out[:num_read]
        else:
            result = self.s.get(self.ns, hashes)
            num_read = len(result)
        self.timed(started, "a get")
        assert 0 <= num_read <= length
        for j in range(num_read):
            assert chain[j] not in self.deleted, f"deleted key {chain[j]} was served"
            assert same_bytes(result[j], BLOCKS[chain[j]]), f"key {chain[j]} came back with other bytes"
        event(f"get: {num_read} of {length} blocks")
        if expected is not None:
            assert num_read == expected, f"lookup said {expected} blocks, get served {num_read}"
        if self.promote_on_read:
            self.quiet = False

    @rule(start=st.integers(0, NUM_KEYS - 1), length=st.integers(1, 4))
    def lookup(self, start: int, length: int) -> None:
        chain = chain_of(start, length)
        num_found = self.s.lookup(self.ns, self.hashes(chain))
        assert 0 <= num_found <= length
        for i in chain[:num_found]:
            assert i not in self.deleted

    @rule(
        start=st.integers(0, NUM_KEYS - 1),
        length=st.integers(1, 4),
        ttl_s=st.one_of(st.none(), st.sampled_from([0.5, 1.0, 2.0, 5.0])),
    )
    def pin(self, start: int, length: int, ttl_s: float | None) -> None:
        chain = chain_of(start, length)
        expected = self.s.lookup(self.ns, self.hashes(chain)) if self.quiet else None
        num_pinned = self.s.pin(self.ns, self.hashes(chain), ttl_s=ttl_s)
        assert 0 <= num_pinned <= length
        if expected is not None:
            assert num_pinned == expected
        now = self.clock.now_s
        deadline = math.inf if ttl_s is None else now + ttl_s
        for i in chain[:num_pinned]:
            pin = self.pins.get(i)
            if pin is None:
                self.pins[i] = PinModel(1, 1, deadline)
            elif pin.low >= 1 and pin.deadline_s > now:  # still pinned: one more pin
                pin.low, pin.high = pin.low + 1, pin.high + 1
                pin.deadline_s = max(pin.deadline_s, deadline)
            else:  # unpinned or expired: the store may or may not hold old pins still
                self.pins[i] = PinModel(1, pin.high + 1, deadline)

    @rule(start=st.integers(0, NUM_KEYS - 1), length=st.integers(1, 4))
    def unpin(self, start: int, length: int) -> None:
        chain = chain_of(start, length)
        definite = self.definitely_pinned()
        sure = sum(1 for i in chain if i in definite)
        maybe = sum(1 for i in chain if i in self.pins and i not in definite)
        num_unpinned = self.s.unpin(self.ns, self.hashes(chain))
        assert sure <= num_unpinned <= sure + maybe, (chain, self.pins, num_unpinned)
        for i in chain:
            pin = self.pins.get(i)
            if pin is None:
                continue
            pin.low, pin.high = max(pin.low - 1, 0), pin.high - 1
            if pin.high <= 0:
                del self.pins[i]

    @rule(start=st.integers(0, NUM_KEYS - 1), length=st.integers(1, 4))
    def delete(self, start: int, length: int) -> None:
        chain = chain_of(start, length)
        expected = sum(self.found(i) for i in chain) if self.quiet else None
        started = time.monotonic()
        num_deleted = self.s.delete(self.ns, self.hashes(chain))
        self.timed(started, "a delete")
        assert 0 <= num_deleted <= length
        if expected is not None:
            assert num_deleted == expected
        for i in chain:
            self.deleted.add(i)
            self.live.discard(i)
            self.durable.discard(i)
            self.pins.pop(i, None)
            assert not self.found(i), f"key {i} is still a hit after delete"
        assert len(self.s.get(self.ns, self.hashes(chain))) == 0

    @rule(step_s=st.sampled_from([0.25, 1.0, 3.0]))
    def advance_clock(self, step_s: float) -> None:
        self.clock.now_s += step_s

    @rule(start=st.integers(0, NUM_KEYS - 1), length=st.integers(1, 4), tier_pick=st.integers(0, 1))
    def prefetch(self, start: int, length: int, tier_pick: int) -> None:
        chain = chain_of(start, length)
        paged = [t for t in self.tiers if t is not Tier.DISK]
        tier = paged[tier_pick % len(paged)]
        started = time.monotonic()
        future = self.s.prefetch_async(self.ns, self.hashes(chain), tier)
        try:
            num_ready = future.result(timeout=STALL_S)
        except TimeoutError:
            self.stuck = True
            raise AssertionError(f"prefetch did not finish within {STALL_S} s") from None
        self.timed(started, "a prefetch")
        self.settle()
        assert 0 <= num_ready <= self.s.lookup(self.ns, self.hashes(chain))

    @rule()
    def wait_for_background_work(self) -> None:
        self.settle()

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def books_hold(self) -> None:
        # Background copies may be running: sample the budgets a few times.
        for _ in range(3):
            check_budgets(self.s.stats())
        found = {i: self.found(i) for i in range(NUM_KEYS)}
        for i in self.deleted:
            assert not found[i], f"deleted key {i} is a hit again without a put"
        for i in self.definitely_pinned():
            assert found[i], f"pinned key {i} was evicted from every tier"
        for i in [i for i in self.pins if not found[i]]:
            del self.pins[i]  # (it was not definitely pinned) its entry, and pins, are gone
        disk_has_room = self.disk_blocks > 0 and len(self.ever_put) <= self.disk_blocks
        stats = self.s.stats()
        if disk_has_room:
            event("invariant: checked that nothing is lost (the disk has room)")
            lost = sorted(i for i in self.durable if not found[i])
            assert not lost, f"write-through keys {lost} were lost although the disk had room"
            if stats.failed_demotions == 0:
                lost = sorted(i for i in self.live if not found[i])
                assert not lost, f"keys {lost} were lost although the disk had room"
        num_pinned_low = len(self.definitely_pinned())
        assert num_pinned_low <= stats.num_pinned <= len(self.pins), (stats.num_pinned, self.pins)
        if self.quiet:
            event("invariant: checked the settled books")
            check_settled(stats, sum(found.values()))


# No shrink phase: a failure that stalls the store (a promotion waiting on itself) costs seconds
# per replay, and shrinking would run for minutes. The regression tests below are the minimal
# cases of what this machine found.
StoreMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    puts=st.lists(
        st.tuples(st.integers(0, NUM_KEYS - 1), st.integers(1, 5)), min_size=1, max_size=20
    )
)
def test_random_puts_into_a_three_block_host_stay_in_budget(puts: list[tuple[int, int]]) -> None:
    """HOST of 3 blocks, no other tier: a chain of up to 3 blocks is stored whole; a longer one
    raises ``CapacityError`` and stores nothing; the budget holds and every hit is exact."""
    store = open_store(gpu_blocks=0, host_blocks=3, disk_blocks=0, disk_path=None)
    ns = Namespace("property-model", TINY_LAYOUT)
    try:
        store.register(ns)
        for start, length in puts:
            chain = chain_of(start, length)
            hashes = [KEYS[i] for i in chain]
            before = {i: store.lookup(ns, [KEYS[i]]) for i in chain}
            if length > 3:
                try:
                    store.put(ns, hashes, stack(chain))
                except CapacityError:
                    pass
                else:
                    raise AssertionError(f"{length} blocks were accepted by a 3-block tier")
                for i in chain:
                    assert store.lookup(ns, [KEYS[i]]) <= before[i]
            else:
                store.put(ns, hashes, stack(chain))
                assert store.lookup(ns, hashes) == length, (
                    f"chain {chain} is not stored whole right after its put"
                )
            stats = store.stats()
            check_budgets(stats)
            check_settled(stats, sum(store.lookup(ns, [k]) for k in KEYS))
            for probe in (chain, list(range(NUM_KEYS))):
                result = store.get(ns, [KEYS[i] for i in probe])
                for j in range(len(result)):
                    assert same_bytes(result[j], BLOCKS[probe[j]])
    finally:
        store.close(flush=False)


# --- regression cases: minimal forms of what the machine found ---------------------------------


def test_put_does_not_evict_its_own_chain() -> None:
    """HOST of 3 holds [A] (least recent) and [B, C]; a put of the chain [A, D] needs one block of
    room and must not take it from A: right after the put the whole chain is a hit."""
    store = open_store(gpu_blocks=0, host_blocks=3, disk_blocks=0, disk_path=None)
    ns = Namespace("property-model", TINY_LAYOUT)
    try:
        store.register(ns)
        store.put(ns, [KEYS[0]], stack([0]))
        store.put(ns, [KEYS[1], KEYS[2]], stack([1, 2]))
        assert store.put(ns, [KEYS[0], KEYS[3]], stack([0, 3])) == 1
        assert store.lookup(ns, [KEYS[0], KEYS[3]]) == 2, "the put evicted the head of its own chain"
    finally:
        store.close(flush=False)


def test_promotion_does_not_wait_on_itself_nor_drop_blocks() -> None:
    """GPU of 2 holds [A0, A1]; HOST of 2 holds [B0, B1]. A get of [B0, B1] promotes both to GPU
    in the background: making room there demotes A0, A1 to HOST, whose only blocks are the
    B's being promoted. That must neither stall (it waited 5 s on its own reads) nor drop A0, A1
    (after the wait their demotion failed and they were dropped from every tier)."""
    store = open_store(gpu_blocks=2, host_blocks=2, disk_blocks=0, disk_path=None)
    ns = Namespace("property-model", TINY_LAYOUT)
    try:
        store.register(ns)
        store.put(ns, KEYS[0:2], stack([0, 1]), tier=Tier.GPU)
        store.put(ns, KEYS[2:4], stack([2, 3]), tier=Tier.HOST)
        result = store.get(ns, KEYS[2:4])
        assert len(result) == 2 and all(same_bytes(result[j], BLOCKS[2 + j]) for j in range(2))
        started = time.monotonic()
        store.prefetch_async(ns, [], Tier.HOST).result(timeout=30)  # one worker: waits for the promotion
        waited_s = time.monotonic() - started
        assert waited_s < 1.0, f"the background promotion took {waited_s:.1f} s (waiting on itself)"
        assert [store.lookup(ns, [k]) for k in KEYS[0:4]] == [1, 1, 1, 1], (
            f"blocks were lost by a promotion ({store.stats().failed_demotions} failed demotions)"
        )
    finally:
        store.close(flush=False)
