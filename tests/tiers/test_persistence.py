"""Persistence of the DISK tier: crashes, corruption, layouts, reopening, budgets, a full map.

Everything goes through ``TieredStore``'s public API on real LMDB files in ``tmp_path``; the
only direct LMDB access is to damage records the way a bad disk (or a bug) would.
The first rule under test: a hit returns exactly the bytes stored under that key, or is a miss.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support import child_env, crash_writer, helper_command
from tests.support.disk_records import RawDisk
from tests.support.tiny_blocks import (
    BLOCK_BYTES,
    PAGE_BYTES,
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
    DiskFullError,
    DiskTierConfig,
    HostTierConfig,
    KVLayout,
    Namespace,
    StoreConfig,
    Tier,
    TieredStore,
    TierKVError,
    WritePolicy,
)
from tierkv.tiers.records import encode_record

WRITE_THROUGH = WritePolicy.WRITE_THROUGH


# --- helpers -----------------------------------------------------------------------------------


def raw_key(namespace: Namespace, block_hash: bytes) -> bytes:
    """The 48-byte LMDB key of a block (namespace id + block hash, as in DESIGN.md)."""
    return bytes(namespace.id) + block_hash


def flip_payload_in_file(disk_path: Path, payload: bytes, at: int) -> int:
    """Flip byte ``at`` of every copy of ``payload`` found in ``data.mdb`` (LMDB's copy-on-write
    may have left stale copies in free pages; the live one is among them). Returns the count."""
    data_file = disk_path / "data.mdb"
    content = data_file.read_bytes()
    offsets = []
    start = content.find(payload)
    while start != -1:
        offsets.append(start)
        start = content.find(payload, start + 1)
    with data_file.open("r+b") as f:
        for offset in offsets:
            f.seek(offset + at)
            f.write(bytes([content[offset + at] ^ 0xFF]))
    return len(offsets)


def payload_bytes(block: torch.Tensor) -> bytes:
    """The raw bytes a block is stored as."""
    return block.contiguous().view(torch.uint8).numpy().tobytes()


def read_back(store: TieredStore, namespace: Namespace, hashes: Sequence[bytes]) -> torch.Tensor:
    """``get`` of ``hashes``; fails unless every one of them is a hit."""
    got = store.get(namespace, hashes)
    assert len(got) == len(hashes), f"only {len(got)} of {len(hashes)} blocks came back"
    return got


def disk_stats(store: TieredStore) -> tuple[int, int, int]:
    """(used_bytes, capacity_bytes, num_blocks) of the DISK tier."""
    tier = store.stats().tiers[Tier.DISK]
    return tier.used_bytes, tier.capacity_bytes, tier.num_blocks


# --- 1. SIGKILL during write-through puts ------------------------------------------------------


@pytest.mark.slow
def test_write_through_survives_sigkill(tmp_path: Path) -> None:
    """Every acknowledged write_through block survives a SIGKILL of its writer, bit-exact, in
    every later reopen; blocks in flight at the kill are a miss or exact, never anything else."""
    cycles = 20
    rng = random.Random(20240531)
    disk_path = tmp_path / "disk"
    ns = crash_writer.NAMESPACE
    durable: list[tuple[int, int]] = []  # acknowledged (or seen durable) blocks: (cycle, index)
    startup_s: list[float] = []
    killed_inside_put = 0
    started = time.monotonic()

    for cycle in range(cycles):
        num_acks_wanted = rng.randint(3, 30)
        # The writer's stderr (and that of its resource tracker, which reports the HOST
        # segment it unlinks for the killed writer) goes to a file, shown if the writer fails.
        stderr_path = tmp_path / f"writer-{cycle}.stderr"
        t0 = time.monotonic()
        with stderr_path.open("w") as stderr:
            proc = subprocess.Popen(
                helper_command("crash_writer", str(disk_path), str(cycle)),
                stdout=subprocess.PIPE, stderr=stderr, text=True, env=child_env(),
            )
        assert proc.stdout is not None
        lines: list[str] = []
        try:
            first = proc.stdout.readline()
            assert first == "ready\n", (
                f"cycle {cycle}: writer said {first!r}:\n{stderr_path.read_text()[-3000:]}"
            )
            startup_s.append(time.monotonic() - t0)
            num_acks = 0
            while num_acks < num_acks_wanted:
                line = proc.stdout.readline()
                assert line, (
                    f"cycle {cycle}: writer exited early (rc {proc.poll()}):\n"
                    f"{stderr_path.read_text()[-3000:]}"
                )
                lines.append(line)
                num_acks += line.startswith("ack ")
            # It writes continuously; a random delay spreads the kill over the put cycle.
            time.sleep(rng.random() * 0.004)
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
            lines += proc.stdout.read().splitlines(keepends=True)  # what it wrote before dying
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()

        assert "idle\n" not in lines, "the writer finished before the kill: raise its cap"
        begun: dict[int, int] = {}
        acked: list[int] = []
        for line in lines:
            verb, start, count = line.split()
            indices = range(int(start), int(start) + int(count))
            if verb == "begin":
                begun.update(dict.fromkeys(indices, cycle))
            else:
                assert verb == "ack", line
                acked.extend(indices)
        assert len(acked) >= num_acks_wanted
        in_flight = sorted(set(begun) - set(acked))
        killed_inside_put += bool(in_flight)
        durable += [(cycle, i) for i in acked]

        store = TieredStore(crash_writer.store_config(disk_path))
        try:
            store.register(ns)
            hashes = [crash_writer.block_hash(c, i) for c, i in durable]
            lost = [(c, i) for (c, i), h in zip(durable, hashes, strict=True)
                    if store.lookup(ns, [h]) != 1]
            assert not lost, f"cycle {cycle}: acknowledged blocks lost after SIGKILL: {lost[:10]}"
            got = read_back(store, ns, hashes)
            expected = torch.stack([crash_writer.block_content(c, i) for c, i in durable])
            wrong = [durable[j] for j in range(len(durable)) if not same_bytes(got[j], expected[j])]
            assert not wrong, f"cycle {cycle}: acknowledged blocks changed: {wrong[:10]}"
            # A put that was in flight at the kill: all or nothing, never other bytes.
            for i in in_flight:
                one = store.get(ns, [crash_writer.block_hash(cycle, i)])
                assert len(one) in (0, 1)
                if len(one):
                    assert same_bytes(one[0], crash_writer.block_content(cycle, i)), (cycle, i)
                    durable.append((cycle, i))  # once seen, it must stay
            # Blocks the writer never started are not there.
            next_index = max(begun) + 1
            never = [crash_writer.block_hash(cycle, i) for i in range(next_index, next_index + 8)]
            assert all(store.lookup(ns, [h]) == 0 for h in never)
            # LMDB commits are atomic: a kill never leaves a torn record to fail its checksum.
            assert store.stats().checksum_failures == 0
            used, capacity, num_blocks = disk_stats(store)
            assert used <= capacity
            assert num_blocks >= len(durable)
        finally:
            store.close(flush=False)

    elapsed = time.monotonic() - started
    print(
        f"\nsigkill: {cycles} cycles in {elapsed:.1f} s; writer start-up (python + torch import + "
        f"store open) mean {sum(startup_s) / len(startup_s):.2f} s, max {max(startup_s):.2f} s; "
        f"{killed_inside_put} kills landed inside a put; {len(durable)} durable blocks checked"
    )


# --- 2. corrupted records ----------------------------------------------------------------------


def test_corrupt_records_are_dropped_counted_and_never_served(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    store = make_store(host_blocks=32, disk_blocks=64, disk_path=disk)
    store.register(namespace)
    hashes = keys(20, salt="corrupt")
    data = blocks(20, seed=7)
    assert store.put(namespace, hashes, data, write_policy=WRITE_THROUGH) == 20
    chain = keys(6, salt="chain")
    chain_data = blocks(6, seed=8)
    assert store.put(namespace, chain, chain_data, tier=Tier.DISK) == 6
    store.close(flush=False)

    payload_flipped = [0, 1, 2, 3, 4]
    truncated = [5, 6, 7]
    header_flipped = {8: 0, 9: 20, 10: -BLOCK_BYTES - 3}  # magic, inside the key, checksum
    untouched = [i for i in range(20) if i not in payload_flipped + truncated
                 and i not in header_flipped]

    # Rewrite values through LMDB first; flip bytes in the file last, so that no later
    # copy-on-write can bring an intact copy of a flipped page back.
    with RawDisk(disk) as raw, raw.env.begin(write=True) as txn:
        for i in truncated:
            value = raw.get(txn, raw_key(namespace, hashes[i]))
            assert value is not None and len(value) > BLOCK_BYTES
            raw.put(txn, raw_key(namespace, hashes[i]), value[:-7])
        for i, at in header_flipped.items():
            value = bytearray(raw.get(txn, raw_key(namespace, hashes[i])) or b"")
            assert value[:4] == b"TKV1"
            value[at] ^= 0xFF
            raw.put(txn, raw_key(namespace, hashes[i]), bytes(value))
    for i in payload_flipped:
        assert flip_payload_in_file(disk, payload_bytes(data[i]), at=37 + 50 * i) >= 1
    assert flip_payload_in_file(disk, payload_bytes(chain_data[3]), at=BLOCK_BYTES - 1) >= 1

    store = make_store(host_blocks=32, disk_blocks=64, disk_path=disk)
    store.register(namespace)
    # Untouched blocks are exact.
    assert same_bytes(read_back(store, namespace, [hashes[i] for i in untouched]),
                      data[untouched])
    # Each damaged block is a miss, and no longer counted by lookup once it was read.
    for i in payload_flipped + truncated + list(header_flipped):
        assert len(store.get(namespace, [hashes[i]])) == 0, f"damaged block {i} was served"
        assert store.lookup(namespace, [hashes[i]]) == 0, f"damaged block {i} still indexed"
    # A damaged block ends the run of a get: it never comes back as data.
    assert store.lookup(namespace, chain) in (3, 6)  # may not be verified before it is read
    got = store.get(namespace, chain)
    assert len(got) == 3
    assert same_bytes(got, chain_data[:3])
    assert store.lookup(namespace, chain) == 3
    assert same_bytes(read_back(store, namespace, chain[4:]), chain_data[4:])
    # Every record that failed its checks is counted, once: truncated ones (the wrong size) when
    # the store opened, the others when they were read.
    assert store.stats().checksum_failures == (
        len(payload_flipped) + len(header_flipped) + 1 + len(truncated)
    )
    used, capacity, num_blocks = disk_stats(store)
    assert num_blocks == 20 + 6 - len(payload_flipped) - len(truncated) - len(header_flipped) - 1
    assert used <= capacity
    store.close(flush=False)

    # The bad records were deleted from the disk, not just hidden.
    damaged = payload_flipped + truncated + list(header_flipped)
    with RawDisk(disk) as raw, raw.env.begin() as txn:
        left = [i for i in damaged if raw.get(txn, raw_key(namespace, hashes[i])) is not None]
        assert raw.get(txn, raw_key(namespace, chain[3])) is None
        assert raw.get(txn, raw_key(namespace, chain[4])) is not None
        assert not any(txn.get(raw_key(namespace, hashes[i]), db=raw.heads) for i in damaged)
    assert not left, f"damaged records left on disk: {left}"

    # The store keeps working: the damaged keys can be stored again, new ones too.
    store = make_store(host_blocks=32, disk_blocks=64, disk_path=disk)
    store.register(namespace)
    assert store.stats().checksum_failures == 0
    redo = [hashes[i] for i in damaged] + [chain[3]]
    redo_data = torch.cat([data[damaged], chain_data[3:4]])
    assert store.put(namespace, redo, redo_data, write_policy=WRITE_THROUGH) == len(redo)
    fresh = keys(5, salt="fresh")
    assert store.put(namespace, fresh, blocks(5, seed=9), tier=Tier.DISK) == 5
    assert same_bytes(read_back(store, namespace, redo), redo_data)
    assert same_bytes(read_back(store, namespace, chain), chain_data)
    store.close(flush=False)

    store = make_store(host_blocks=32, disk_blocks=64, disk_path=disk)
    assert same_bytes(read_back(store, namespace, hashes), data)
    assert same_bytes(read_back(store, namespace, chain), chain_data)
    assert same_bytes(read_back(store, namespace, fresh), blocks(5, seed=9))
    assert store.stats().checksum_failures == 0


# --- 3. a record is never served under another layout or namespace -----------------------------


def test_record_is_never_served_under_another_layout_or_namespace(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    # Same byte size as TINY_LAYOUT (512 B a block), so the record sizes match too.
    other_shape = KVLayout(num_layers=4, num_kv_heads=1, head_dim=8, block_size=4)
    other_dtype = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bf16")
    assert other_shape.bytes_per_block == other_dtype.bytes_per_block == BLOCK_BYTES
    ns_shape = Namespace("test-model", other_shape)
    ns_dtype = Namespace("test-model", other_dtype)
    ns_tenant = namespace.with_tenant("other-tenant")
    disk = tmp_path / "disk"

    store = make_store(disk_blocks=32, disk_path=disk)
    for ns in (namespace, ns_shape, ns_dtype, ns_tenant):
        store.register(ns)
    hashes = keys(4, salt="layout")
    data = blocks(4, seed=11)
    assert store.put(namespace, hashes, data, write_policy=WRITE_THROUGH) == 4
    store.close(flush=False)

    with RawDisk(disk) as raw, raw.env.begin(write=True) as txn:
        record = raw.get(txn, raw_key(namespace, hashes[0]))
        assert record is not None
        # Verbatim copies: the header still names the original key and layout.
        raw.put(txn, raw_key(ns_shape, hashes[0]), record)
        raw.put(txn, raw_key(ns_dtype, hashes[0]), record)
        raw.put(txn, raw_key(ns_tenant, hashes[0]), record)
        # Forged records whose key is right and checksum valid, but whose layout is not.
        payload = data[1].contiguous().view(torch.uint8).reshape(-1).numpy()
        for ns in (ns_shape, ns_dtype):
            forged, _ = encode_record(raw_key(ns, hashes[1]), TINY_LAYOUT.fingerprint, payload)
            assert len(forged) == len(record)
            raw.put(txn, raw_key(ns, hashes[1]), bytes(forged))

    store = make_store(disk_blocks=32, disk_path=disk)
    served = []
    for ns, i in ((ns_shape, 0), (ns_dtype, 0), (ns_tenant, 0), (ns_shape, 1), (ns_dtype, 1)):
        got = store.get(ns, [hashes[i]])
        if len(got):
            served.append((ns.layout, ns.tenant, i))
        assert store.lookup(ns, [hashes[i]]) == 0
    assert not served, f"records served under a foreign namespace: {served}"
    assert store.stats().checksum_failures == 5
    # The owner's records are untouched.
    assert same_bytes(read_back(store, namespace, hashes), data)
    # And a record written properly under the other layout reads back under it.
    other_data = blocks(1, seed=12, layout=other_shape)
    assert store.put(ns_shape, hashes[:1], other_data, write_policy=WRITE_THROUGH) == 1
    store.close(flush=False)
    store = make_store(disk_blocks=32, disk_path=disk)
    assert same_bytes(read_back(store, ns_shape, hashes[:1]), other_data)
    assert same_bytes(read_back(store, namespace, hashes), data)
    assert store.stats().checksum_failures == 0


# --- 4. reopening after a clean close ----------------------------------------------------------


def test_reopen_serves_write_through_blocks_and_flushed_write_back_blocks(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    store = make_store(host_blocks=32, disk_blocks=64, disk_path=disk)
    store.register(namespace)
    through = keys(8, salt="through")
    through_data = blocks(8, seed=21)
    back = keys(6, salt="back")
    back_data = blocks(6, seed=22)
    assert store.put(namespace, through, through_data, write_policy=WRITE_THROUGH) == 8
    assert store.put(namespace, back, back_data) == 6  # write_back: HOST only
    assert disk_stats(store)[2] == 8
    store.close()  # flush=True by default: HOST-only blocks go to disk

    store = make_store(host_blocks=32, disk_blocks=64, disk_path=disk)
    assert store.num_recovered_blocks == 14
    assert disk_stats(store)[2] == 14
    # The namespace is known from its stored descriptor, without register().
    assert store.lookup(namespace, through) == 8
    assert store.lookup(namespace, back) == 6
    assert same_bytes(read_back(store, namespace, through), through_data)
    assert same_bytes(read_back(store, namespace, back), back_data)
    store.register(namespace)  # idempotent
    lost = keys(5, salt="lost")
    assert store.put(namespace, lost, blocks(5, seed=23)) == 5  # write_back
    assert store.lookup(namespace, lost) == 5
    store.close(flush=False)  # HOST-only blocks are dropped

    store = make_store(host_blocks=32, disk_blocks=64, disk_path=disk)
    assert store.num_recovered_blocks == 14
    assert store.lookup(namespace, lost) == 0
    assert len(store.get(namespace, lost)) == 0
    assert same_bytes(read_back(store, namespace, through + back),
                      torch.cat([through_data, back_data]))


# --- 5. reopening with a smaller disk budget ---------------------------------------------------


def test_reopen_with_smaller_budget_drops_surplus_and_stays_within_it(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    n = 40
    hashes = keys(n, salt="budget")
    data = blocks(n, seed=31)
    store = make_store(disk_blocks=n, disk_path=disk)
    store.register(namespace)
    for start in range(0, n, 8):
        assert store.put(namespace, hashes[start : start + 8], data[start : start + 8],
                         tier=Tier.DISK) == 8
    used, capacity, num_blocks = disk_stats(store)
    assert num_blocks == n and used <= capacity
    record_bytes = used // n
    store.close(flush=False)

    # promote_on_read off: lookups then see the disk tier alone.
    store = make_store(disk_blocks=15, disk_path=disk, promote_on_read=False)
    used, capacity, num_blocks = disk_stats(store)
    assert used <= capacity
    assert num_blocks == store.num_recovered_blocks == capacity // record_bytes
    kept = [i for i in range(n) if store.lookup(namespace, [hashes[i]]) == 1]
    assert len(kept) == num_blocks
    assert same_bytes(read_back(store, namespace, [hashes[i] for i in kept]), data[kept])
    assert store.stats().checksum_failures == 0
    # New writes evict within the smaller budget.
    new = keys(10, salt="budget-new")
    new_data = blocks(10, seed=32)
    for start in range(0, 10, 5):
        store.put(namespace, new[start : start + 5], new_data[start : start + 5], tier=Tier.DISK)
        used, capacity, _ = disk_stats(store)
        assert used <= capacity
    assert same_bytes(read_back(store, namespace, new), new_data)
    final = {h for h in hashes + new if store.lookup(namespace, [h]) == 1}
    assert len(final) == disk_stats(store)[2]
    store.close(flush=False)

    # The surplus was deleted from the disk, not just left out of the index.
    store = make_store(disk_blocks=n + 10, disk_path=disk)
    assert store.num_recovered_blocks == len(final)
    assert {h for h in hashes + new if store.lookup(namespace, [h]) == 1} == final
    everything = dict(zip(hashes + new, torch.cat([data, new_data]), strict=True))
    for h in final:
        assert same_bytes(read_back(store, namespace, [h])[0], everything[h])


# --- 6. LMDB's map fills up before the byte budget ---------------------------------------------


def _tiny_map_store(disk: Path) -> TieredStore:
    return TieredStore(StoreConfig(
        host=HostTierConfig(16 * BLOCK_BYTES, PAGE_BYTES),
        # The budget is far larger than what a map of 1 MiB (+ 16 KiB) can hold in records.
        disk=DiskTierConfig(disk, capacity_bytes=1 << 20, map_overhead_factor=1.0,
                            map_slack_bytes=16 << 10),
        promote_on_read=False,
    ))


def test_full_lmdb_map_raises_disk_full_and_stores_nothing_half(
    namespace: Namespace, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    store = _tiny_map_store(disk)
    try:
        store.register(namespace)
        stored: list[int] = []
        failure: BaseException | None = None
        failed: list[int] = []
        batch = 8
        for start in range(0, 4000, batch):
            indices = list(range(start, start + batch))
            try:
                store.put(namespace, [key(i, "full") for i in indices],
                          torch.stack([block_for(i) for i in indices]),
                          write_policy=WRITE_THROUGH)
            except Exception as exc:
                failure, failed = exc, indices
                break
            stored += indices
        assert failure is not None, "the map never filled: the test is miscalibrated"
        assert isinstance(failure, DiskFullError), repr(failure)
        assert isinstance(failure, CapacityError) and not isinstance(failure, ValueError)
        used, capacity, num_blocks = disk_stats(store)
        assert used < capacity, "the byte budget filled first: the test is miscalibrated"
        assert num_blocks == len(stored)
        assert len(stored) > 0
        # Nothing of the failed batch is visible, in any tier.
        assert all(store.lookup(namespace, [key(i, "full")]) == 0 for i in failed)
        # Straight to DISK fails the same way (a smaller batch may still squeeze in first),
        # and leaves nothing behind either.
        more: list[int] = []
        for start in range(10_000, 10_400, 4):
            indices = list(range(start, start + 4))
            try:
                store.put(namespace, [key(i, "full") for i in indices],
                          torch.stack([block_for(i) for i in indices]), tier=Tier.DISK)
            except DiskFullError:
                more = indices
                break
            stored += indices
        assert more, "putting straight to DISK never hit the full map"
        assert all(store.lookup(namespace, [key(i, "full")]) == 0 for i in more)
        used, capacity, num_blocks = disk_stats(store)
        assert num_blocks == len(stored) and used <= capacity
        # Earlier blocks read back exactly; HOST-only puts still work.
        assert same_bytes(read_back(store, namespace, [key(i, "full") for i in stored]),
                          torch.stack([block_for(i) for i in stored]))
        host_only = keys(4, salt="host-only")
        assert store.put(namespace, host_only, blocks(4, seed=41)) == 4
        assert same_bytes(read_back(store, namespace, host_only), blocks(4, seed=41))
        assert store.stats().checksum_failures == 0
    finally:
        store.close(flush=False)

    # After a restart: every acknowledged block, exact; nothing of the failed puts.
    store = _tiny_map_store(disk)
    try:
        assert store.num_recovered_blocks == len(stored)
        assert same_bytes(read_back(store, namespace, [key(i, "full") for i in stored]),
                          torch.stack([block_for(i) for i in stored]))
        assert all(store.lookup(namespace, [key(i, "full")]) == 0 for i in failed + more)
    finally:
        store.close(flush=False)


def test_delete_after_full_map_is_durable(namespace: Namespace, tmp_path: Path) -> None:
    """``delete`` promises disk deletes are durable on return, a full map included."""
    disk = tmp_path / "disk"
    store = _tiny_map_store(disk)
    stored: list[bytes] = []
    try:
        store.register(namespace)
        for start in range(0, 4000):
            h = key(start, "del")
            try:
                store.put(namespace, [h], block_for(start)[None], write_policy=WRITE_THROUGH)
            except TierKVError as exc:
                assert isinstance(exc, DiskFullError), repr(exc)
                break
            stored.append(h)
        else:
            pytest.fail("the map never filled: the test is miscalibrated")
        gone = stored[::2]
        assert store.delete(namespace, gone) == len(gone)
        assert all(store.lookup(namespace, [h]) == 0 for h in gone)
    finally:
        store.close(flush=False)

    store = _tiny_map_store(disk)
    try:
        back = [h for h in gone if store.lookup(namespace, [h]) != 0]
        assert len(back) == 0, f"{len(back)} of {len(gone)} deleted blocks came back after a restart"
        assert store.num_recovered_blocks == len(stored) - len(gone)
        kept = stored[1::2]
        assert same_bytes(read_back(store, namespace, kept),
                          torch.stack([block_for(stored.index(h)) for h in kept]))
        # With the room freed, writes succeed again.
        again = keys(4, salt="del-again")
        assert store.put(namespace, again, blocks(4, seed=42), write_policy=WRITE_THROUGH) == 4
        assert same_bytes(read_back(store, namespace, again), blocks(4, seed=42))
    finally:
        store.close(flush=False)


def test_lmdb_record_layout_matches_design(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    """The raw record: b"TKV1", u32 header length, msgpack header, then the payload verbatim
    (what the corruption tests above rely on to find and damage payloads)."""
    disk = tmp_path / "disk"
    store = make_store(disk_blocks=4, disk_path=disk)
    store.register(namespace)
    data = blocks(1, seed=51)
    store.put(namespace, [key(0, "fmt")], data, tier=Tier.DISK)
    store.close(flush=False)
    with RawDisk(disk) as raw, raw.env.begin() as txn:
        value = raw.get(txn, raw_key(namespace, key(0, "fmt")))
    assert value is not None and value[:4] == b"TKV1"
    header_len = int(np.frombuffer(value[4:8], "<u4")[0])
    assert len(value) == 8 + header_len + BLOCK_BYTES
    assert value[8 + header_len :] == payload_bytes(data[0])
