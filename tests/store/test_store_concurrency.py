"""Concurrency tests of ``TieredStore``: threads, futures, asyncio, reads racing deletes, pins.

Every block's content is derived from its key index (``block_for(i)``), so any reader can check
that a hit is bit-exact. Every wait has a timeout: a deadlock fails the test instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from tests.support.tiny_blocks import (
    BLOCK_BYTES,
    PAGE_BYTES,
    RECORD_BYTES,
    TINY_LAYOUT,
    StoreFactory,
    block_for,
    blocks,
    key,
    keys,
    same_bytes,
)
from tierkv import (
    CapacityError,
    DiskTierConfig,
    HostTierConfig,
    KVLayout,
    Namespace,
    Priority,
    StoreConfig,
    StoreStats,
    Tier,
    TieredStore,
    WritePolicy,
)

JOIN_TIMEOUT_S = 60.0  # far beyond any legitimate wait (the store waits at most 5 s for room)


def stack(indices: list[int]) -> torch.Tensor:
    return torch.stack([block_for(i) for i in indices])


def check_budgets(stats: StoreStats) -> None:
    """No tier over budget, ever; counted blocks fit in the bytes held."""
    for tier, tier_stats in stats.tiers.items():
        unit = RECORD_BYTES if tier is Tier.DISK else BLOCK_BYTES
        assert 0 <= tier_stats.used_bytes <= tier_stats.capacity_bytes, tier_stats
        assert 0 <= tier_stats.num_blocks * unit <= tier_stats.used_bytes, tier_stats


def run_threads(targets: list[Callable[[], None]], timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Run each target on its own thread; fail (rather than hang) if one does not finish."""
    threads = [threading.Thread(target=target, daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"threads {stuck} did not finish within {timeout_s} s: deadlock?"


def close_within(store: TieredStore, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """``close(flush=False)`` must return (no deadlock with background work), and not raise."""
    errors: list[BaseException] = []

    def close() -> None:
        try:
            store.close(flush=False)
        except BaseException as exc:
            errors.append(exc)

    run_threads([close], timeout_s)
    assert not errors, f"close raised {errors[0]!r}"


# --- 1. many threads, one store ----------------------------------------------------------------


def test_many_threads_hammer_one_store(
    make_store: StoreFactory, namespace: Namespace, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="tierkv")
    store = make_store(gpu_blocks=4, host_blocks=8, disk_blocks=32)
    store.register(namespace)
    num_keys = 40
    hashes = keys(num_keys, salt="hammer")
    stop = threading.Event()
    errors: list[str] = []
    num_ops: list[int] = []
    num_capacity_errors: list[int] = []
    num_blocks_read: list[int] = []

    def fail(message: str) -> None:
        errors.append(message)
        stop.set()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        pinned: list[list[bytes]] = []
        ops = capacity_errors = blocks_read = 0
        out = torch.empty((5, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype)
        try:
            while not stop.is_set():
                start, length = rng.randrange(num_keys), rng.randint(1, 4)
                chain = [(start + j) % num_keys for j in range(length)]
                chain_hashes = [hashes[i] for i in chain]
                op = rng.choice(["put", "put", "get", "get", "get_into", "lookup", "pin", "unpin",
                                 "delete", "prefetch"])
                ops += 1
                try:
                    if op == "put":
                        store.put(
                            namespace, chain_hashes, stack(chain),
                            priority=rng.choice(list(Priority)),
                            write_policy=rng.choice([None, *WritePolicy]),
                            tier=rng.choice([None, Tier.GPU, Tier.HOST, Tier.DISK]),
                        )
                    elif op in ("get", "get_into"):
                        if op == "get":
                            result = store.get(namespace, chain_hashes)
                        else:
                            result = out[: store.get_into(namespace, chain_hashes, out)]
                        if len(result) > length:
                            fail(f"{op} of {length} keys returned {len(result)} blocks")
                        for j in range(len(result)):
                            if not same_bytes(result[j], block_for(chain[j])):
                                fail(f"{op}: key {chain[j]} came back with other bytes")
                        blocks_read += len(result)
                    elif op == "lookup":
                        if not 0 <= store.lookup(namespace, chain_hashes) <= length:
                            fail("lookup out of range")
                    elif op == "pin":
                        if store.pin(namespace, chain_hashes, ttl_s=rng.choice([None, 0.05, 0.5])):
                            pinned.append(chain_hashes)
                        if len(pinned) > 2:
                            store.unpin(namespace, pinned.pop(0))
                    elif op == "unpin":
                        if pinned:
                            store.unpin(namespace, pinned.pop(rng.randrange(len(pinned))))
                    elif op == "delete":
                        store.delete(namespace, chain_hashes)
                    else:
                        tier = rng.choice([Tier.GPU, Tier.HOST])
                        num_ready = store.prefetch_async(namespace, chain_hashes, tier).result(timeout=30)
                        if not 0 <= num_ready <= length:
                            fail("prefetch out of range")
                except CapacityError:
                    capacity_errors += 1
            for chain_hashes in pinned:
                store.unpin(namespace, chain_hashes)
        except BaseException:
            fail(traceback.format_exc())
        finally:
            num_ops.append(ops)
            num_capacity_errors.append(capacity_errors)
            num_blocks_read.append(blocks_read)

    num_checks = [0]

    def checker() -> None:
        try:
            while not stop.is_set():
                check_budgets(store.stats())
                num_checks[0] += 1
        except BaseException:
            fail(traceback.format_exc())

    def timer() -> None:
        stop.wait(4.0)
        stop.set()

    workers = [lambda seed=seed: worker(seed) for seed in range(8)]
    run_threads([*workers, checker, timer])
    assert not errors, "\n".join(errors[:5])
    # Background work (promotions, demotions) has no caller to raise to: it logs. It must not fail.
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("tierkv")]
    assert not logged, "background work failed:\n" + "\n".join(
        caplog.handler.format(r) for r in logged[:3])
    assert sum(num_ops) > 200 and sum(num_blocks_read) > 0 and num_checks[0] > 10, (
        num_ops, num_blocks_read, num_checks)
    # Settled: every block the index holds is served exactly.
    assert store.wait_for_background(timeout_s=30)
    check_budgets(store.stats())
    for i in range(num_keys):
        result = store.get(namespace, [hashes[i]])
        assert len(result) <= 1
        if len(result):
            assert same_bytes(result[0], block_for(i))
    close_within(store)


# --- 2. asyncio --------------------------------------------------------------------------------

ASYNC_LAYOUT = KVLayout(8, 8, 64, block_size=16)  # 256 KiB a block
ASYNC_BATCH = 16  # 4 MiB a call
ASYNC_ROUNDS = 25


class Gated(torch.Tensor):
    """A tensor whose first copy waits until the event loop has run ``gate.set`` (scheduled
    right before the call): a call that ran on the loop's own thread would wait forever."""

    gate = threading.Event()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.copy_, torch.Tensor.contiguous):
            assert cls.gate.wait(10), "the call ran on the event loop's thread: it blocked it"
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.asyncio
async def test_async_calls_work_and_do_not_block_the_event_loop(tmp_path: Path) -> None:
    layout, batch = ASYNC_LAYOUT, ASYNC_BATCH
    block_bytes = layout.bytes_per_block
    config = StoreConfig(
        host=HostTierConfig(batch * block_bytes, 64 * 1024),  # one batch: older ones live on disk
        disk=DiskTierConfig(tmp_path / "disk", 4 * batch * (block_bytes + 4096)),
        write_policy=WritePolicy.WRITE_THROUGH,
    )
    namespace = Namespace("async-model", layout)
    base = blocks(batch, seed=11, layout=layout)
    data = [torch.roll(base, r, 0).contiguous() for r in range(ASYNC_ROUNDS)]

    def batch_hashes(r: int) -> list[bytes]:
        return [key(i, f"async-{r}") for i in range(batch)]

    store = TieredStore(config)
    loop = asyncio.get_running_loop()
    try:
        store.register(namespace)
        for r in range(ASYNC_ROUNDS):
            # aput and aget_into must leave the loop free while they work (deterministic: the
            # gate opens only if the loop gets to run while the call is under way).
            Gated.gate.clear()
            loop.call_soon(Gated.gate.set)
            assert await store.aput(namespace, batch_hashes(r), data[r].as_subclass(Gated)) == batch
            assert await store.alookup(namespace, batch_hashes(r)) == batch
            if r:  # the previous batch was pushed out of HOST: this reads the disk
                out = torch.empty((batch, *layout.block_shape), dtype=layout.torch_dtype)
                Gated.gate.clear()
                loop.call_soon(Gated.gate.set)
                count = await store.aget_into(namespace, batch_hashes(r - 1), out.as_subclass(Gated))
                assert count == batch and same_bytes(out, data[r - 1]), f"batch {r - 1} differs"
                assert same_bytes(await store.aget(namespace, batch_hashes(r - 1)), data[r - 1])
        # aprefetch brings a batch from disk up to HOST; aget_into then reads it exactly.
        previous = batch_hashes(ASYNC_ROUNDS - 3)
        assert await store.alookup(namespace, previous) == batch
        assert await store.aprefetch(namespace, previous, Tier.HOST) == batch
        out = torch.empty((batch, *layout.block_shape), dtype=layout.torch_dtype)
        assert await store.aget_into(namespace, previous, out) == batch
        assert same_bytes(out, data[ASYNC_ROUNDS - 3])
    finally:
        store.close(flush=False)


# --- 3. futures and concurrent puts of the same keys -------------------------------------------


def test_put_async_and_get_async_futures(make_store: StoreFactory, namespace: Namespace) -> None:
    store = make_store(host_blocks=16, disk_blocks=32)
    store.register(namespace)
    chains = [list(range(start, start + 4)) for start in range(0, 16, 4)]
    puts = [store.put_async(namespace, keys(4, start=c[0], salt="fut"), stack(c)) for c in chains]
    assert [future.result(timeout=30) for future in puts] == [4, 4, 4, 4]
    gets = [store.get_async(namespace, keys(4, start=c[0], salt="fut")) for c in chains]
    for chain, future in zip(chains, gets, strict=True):
        result = future.result(timeout=30)
        assert len(result) == 4
        assert all(same_bytes(result[j], block_for(i)) for j, i in enumerate(chain))


@pytest.mark.parametrize("write_policy", list(WritePolicy))
def test_concurrent_puts_of_the_same_keys_store_one_copy(
    make_store: StoreFactory, namespace: Namespace, write_policy: WritePolicy
) -> None:
    # Room for every racing copy: losing puts reserve pages too, until they find they lost.
    store = make_store(host_blocks=160, disk_blocks=160)
    store.register(namespace)
    num_keys, num_threads, num_rounds = 8, 6, 6
    reported: list[int] = []
    for round_index in range(num_rounds):
        hashes = keys(num_keys, salt=f"same-{round_index}")
        data = stack(list(range(num_keys)))
        barrier = threading.Barrier(num_threads)
        returned: list[int] = []

        def put(hashes: list[bytes] = hashes, data: torch.Tensor = data,
                barrier: threading.Barrier = barrier, returned: list[int] = returned) -> None:
            barrier.wait(timeout=30)
            returned.append(store.put(namespace, hashes, data, write_policy=write_policy))

        futures = [store.put_async(namespace, hashes, data, write_policy=write_policy)
                   for _ in range(num_threads)]
        run_threads([put] * num_threads)
        returned += [future.result(timeout=30) for future in futures]
        reported.append(sum(returned))
        stats = store.stats()
        host = stats.tiers[Tier.HOST]
        expected_blocks = num_keys * (round_index + 1)
        assert host.num_blocks == expected_blocks, "a key was stored more than once"
        assert host.used_bytes == expected_blocks * BLOCK_BYTES, "pages of a losing put leaked"
        disk = stats.tiers[Tier.DISK]
        if write_policy is WritePolicy.WRITE_THROUGH:
            assert disk.num_blocks == expected_blocks
            assert disk.used_bytes == expected_blocks * RECORD_BYTES, "disk bytes leaked"
        result = store.get(namespace, hashes)
        assert len(result) == num_keys
        assert all(same_bytes(result[i], block_for(i)) for i in range(num_keys))
    # ``put`` returns how many blocks it newly stored: between all the racing puts of a round,
    # exactly the round's keys.
    assert reported == [num_keys] * num_rounds, (
        f"racing puts of {num_keys} keys reported {reported} blocks newly stored per round"
    )


# --- 4. reads racing deletes -------------------------------------------------------------------


def test_get_racing_delete_returns_exact_blocks_or_fewer(
    make_store: StoreFactory, namespace: Namespace
) -> None:
    store = make_store(gpu_blocks=2, host_blocks=4, disk_blocks=16)
    store.register(namespace)
    chain = list(range(6))
    hashes = keys(len(chain), salt="race")
    data = stack(chain)
    stop = threading.Event()
    errors: list[str] = []
    reads = {"full": 0, "partial": 0}

    def reader() -> None:
        try:
            out = torch.empty((len(chain), *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype)
            use_into = False
            while not stop.is_set():
                use_into = not use_into
                if use_into:
                    result = out[: store.get_into(namespace, hashes, out)]
                else:
                    result = store.get(namespace, hashes)
                for j in range(len(result)):
                    if not same_bytes(result[j], data[j]):
                        errors.append(f"block {j} came back with other bytes")
                        stop.set()
                reads["full" if len(result) == len(chain) else "partial"] += 1
        except BaseException:
            errors.append(traceback.format_exc())
            stop.set()

    def deleter() -> None:
        try:
            rng = random.Random(4)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and not stop.is_set():
                start = rng.randrange(len(chain))
                store.delete(namespace, hashes[start:])
                with contextlib.suppress(CapacityError):  # a GPU of 2 blocks cannot take 6
                    store.put(namespace, hashes, data, write_policy=rng.choice(list(WritePolicy)),
                              tier=rng.choice([Tier.GPU, Tier.HOST, Tier.DISK]))
        except BaseException:
            errors.append(traceback.format_exc())
        finally:
            stop.set()

    run_threads([reader, reader, deleter])
    assert not errors, "\n".join(errors[:5])
    assert reads["full"] and reads["partial"], reads
    # Settled: whatever the index says is stored is served, exactly.
    assert store.wait_for_background(timeout_s=30)
    num_stored = store.lookup(namespace, hashes)
    result = store.get(namespace, hashes)
    assert len(result) == num_stored
    assert all(same_bytes(result[j], data[j]) for j in range(len(result)))


def test_eviction_never_frees_pages_under_a_read_that_started_during_it(tmp_path: Path) -> None:
    """A put evicts block E from a one-block HOST (demoting it to disk); a get of E that starts
    while the demotion is in flight reads E's HOST pages. The eviction must not free those pages
    under the read: the put would write its own block there and the get would serve it as E."""
    config = StoreConfig(
        host=HostTierConfig(BLOCK_BYTES, PAGE_BYTES),
        disk=DiskTierConfig(tmp_path / "disk", 128 * RECORD_BYTES),
        promote_on_read=False,
    )
    store = TieredStore(config)
    namespace = Namespace("evict-race", TINY_LAYOUT)
    out = torch.empty((1, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype)
    num_raced = 0
    try:
        store.register(namespace)
        for attempt in range(40):
            if num_raced >= 5:
                break
            evicted, newcomer = key(0, f"evicted-{attempt}"), key(1, f"newcomer-{attempt}")
            store.put(namespace, [evicted], stack([0]))
            disk_bytes = store.stats().tiers[Tier.DISK].used_bytes
            _GatedOut.entered, _GatedOut.gate = threading.Event(), threading.Event()
            put_errors: list[BaseException] = []

            def put_newcomer(newcomer: bytes = newcomer, put_errors: list[BaseException] = put_errors
                             ) -> None:
                try:
                    store.put(namespace, [newcomer], stack([1]))
                except CapacityError as exc:  # allowed: the room is being read
                    put_errors.append(exc)

            putter = threading.Thread(target=put_newcomer, daemon=True)
            putter.start()
            # The demotion reserves its disk record first: from then on E is being evicted.
            deadline = time.monotonic() + 10
            while store.stats().tiers[Tier.DISK].used_bytes == disk_bytes:
                assert time.monotonic() < deadline, "the put never started evicting"
            read: list[int] = []

            def read_evicted(evicted: bytes = evicted, read: list[int] = read) -> None:
                read.append(store.get_into(namespace, [evicted], out.as_subclass(_GatedOut)))

            reader = threading.Thread(target=read_evicted, daemon=True)
            reader.start()
            if _GatedOut.entered.wait(1.0):  # the read planned E in HOST and is copying
                num_raced += 1
                # Let the put finish its eviction and write its block (a correct store may
                # instead wait for the read: then this times out and the read goes first).
                putter.join(0.25)
            _GatedOut.gate.set()
            reader.join(JOIN_TIMEOUT_S)
            putter.join(JOIN_TIMEOUT_S)
            assert not reader.is_alive() and not putter.is_alive()
            assert read in ([0], [1])
            if read == [1]:
                assert same_bytes(out[0], block_for(0)), (
                    f"attempt {attempt}: a get of E served other bytes (the newcomer's?): the "
                    "eviction freed E's pages while the read was copying them"
                )
    finally:
        store.close(flush=False)


class _GatedOut(torch.Tensor):
    """An ``out`` buffer whose copies wait for ``gate``: it holds a read in flight on demand."""

    entered: ClassVar[threading.Event]
    gate: ClassVar[threading.Event]

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.Tensor.copy_:
            cls.entered.set()
            cls.gate.wait(30)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_delete_during_a_read_then_put_again_keeps_the_new_copy(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    """A key deleted while a read of it is in flight, then put again (``write_through``), keeps
    its new disk record: the old copy's deferred removal must not take the new record along."""
    disk_path = tmp_path / "reopen"
    store = make_store(host_blocks=4, disk_blocks=8, disk_path=disk_path)
    store.register(namespace)
    hashes = keys(1, salt="reput")
    through = WritePolicy.WRITE_THROUGH
    store.put(namespace, hashes, stack([0]), write_policy=through)

    _GatedOut.entered, _GatedOut.gate = threading.Event(), threading.Event()
    out = torch.empty((1, *TINY_LAYOUT.block_shape), dtype=TINY_LAYOUT.torch_dtype)
    gated = out.as_subclass(_GatedOut)
    read: list[int] = []
    reader = threading.Thread(target=lambda: read.append(store.get_into(namespace, hashes, gated)))
    reader.start()
    try:
        assert _GatedOut.entered.wait(10), "the read never started copying"
        assert store.delete(namespace, hashes) == 1
        assert store.lookup(namespace, hashes) == 0
        assert store.put(namespace, hashes, stack([0]), write_policy=through) == 1
    finally:
        _GatedOut.gate.set()
        reader.join(JOIN_TIMEOUT_S)
    assert not reader.is_alive() and read == [1]
    assert same_bytes(out[0], block_for(0))
    # Any later disk write carries queued record deletes; then restart from the disk.
    store.put(namespace, keys(1, salt="other"), stack([1]), write_policy=through)
    assert store.lookup(namespace, hashes) == 1
    store.close(flush=False)
    reopened = make_store(host_blocks=4, disk_blocks=8, disk_path=disk_path)
    reopened.register(namespace)
    assert reopened.lookup(namespace, keys(1, salt="other")) == 1
    assert reopened.lookup(namespace, hashes) == 1, (
        "the write_through block put after the delete did not survive a restart: the deferred "
        "delete of the old copy removed the new record"
    )
    result = reopened.get(namespace, hashes)
    assert len(result) == 1 and same_bytes(result[0], block_for(0))


# --- 5. eviction under pins --------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.mark.parametrize("disk_blocks", [0, 8])
@pytest.mark.parametrize("release", ["unpin", "ttl"])
def test_put_against_pinned_blocks_fails_fast_and_stores_nothing(
    make_store: StoreFactory, namespace: Namespace, disk_blocks: int, release: str
) -> None:
    clock = _Clock()
    store = make_store(host_blocks=4, disk_blocks=disk_blocks, clock=clock)
    store.register(namespace)
    held = keys(4, salt="held")
    store.put(namespace, held, stack([0, 1, 2, 3]))
    assert store.pin(namespace, held, ttl_s=10.0 if release == "ttl" else None) == 4
    before = store.stats()
    newcomer = keys(1, salt="new")
    policies = [WritePolicy.WRITE_BACK] + ([WritePolicy.WRITE_THROUGH] if disk_blocks else [])
    for policy in policies:
        started = time.monotonic()
        with pytest.raises(CapacityError):
            store.put(namespace, newcomer, stack([9]), write_policy=policy)
        elapsed_s = time.monotonic() - started
        assert elapsed_s < 1.0, f"CapacityError took {elapsed_s:.2f} s (nothing was busy)"
        assert store.lookup(namespace, newcomer) == 0
    after = store.stats()
    for tier in after.tiers:
        assert after.tiers[tier].num_blocks == before.tiers[tier].num_blocks
        assert after.tiers[tier].used_bytes == before.tiers[tier].used_bytes
    assert store.lookup(namespace, held) == 4

    if release == "unpin":
        assert store.unpin(namespace, held) == 4
    else:
        clock.now_s += 10.5
    assert store.put(namespace, newcomer, stack([9])) == 1
    result = store.get(namespace, newcomer)
    assert len(result) == 1 and same_bytes(result[0], block_for(9))
    check_budgets(store.stats())
