"""DISK reads of large batches copy and verify on every core (``tierkv.tiers.disk``, decision
10): the contract of ``read_into`` stays exact (CORRUPT exactly where a record fails a check,
MISSING where there is none, results in request order) whichever thread copied a block, under
concurrent reads and writes, and ``close`` neither hangs on nor unmaps under reads in flight."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import tierkv.tiers.disk_reads as disk_module
from tests.support.tiny_blocks import blocks, keys, same_bytes
from tierkv import DiskTierConfig, HostTierConfig, KVLayout, Namespace, StoreConfig, TieredStore
from tierkv.checksums import CopyParts
from tierkv.config import WritePolicy
from tierkv.errors import StoreClosedError
from tierkv.tiers.disk import DiskTier, DiskWrite
from tierkv.tiers.disk_reads import PARALLEL_READ_BYTES
from tierkv.tiers.records import RecordStatus, encode_record

PAYLOAD_BYTES = 256 * 1024
NUM_BLOCKS = 2 * PARALLEL_READ_BYTES // PAYLOAD_BYTES  # twice the parallel threshold
FINGERPRINT = "parallel-read-test"
JOIN_TIMEOUT_S = 30.0
OK, MISSING, CORRUPT = RecordStatus.OK, RecordStatus.MISSING, RecordStatus.CORRUPT


def raw_key(i: int, salt: str = "") -> bytes:
    return hashlib.sha256(f"raw-{salt}-{i}".encode()).digest() + bytes(16)


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAYLOAD_BYTES, dtype=np.uint8)


def put(tier: DiskTier, indices: range, salt: str = "", damage_at: int | None = None) -> None:
    """Write the records of ``indices``; ``damage_at``'s with one payload byte flipped (its
    header, checksum included, is the intact record's)."""
    puts = []
    for i in indices:
        record, _ = encode_record(raw_key(i, salt), FINGERPRINT, payload(i))
        if i == damage_at:
            record[-PAYLOAD_BYTES // 3] ^= 0x01
        puts.append((raw_key(i, salt), record))
    tier.submit(DiskWrite(block_puts=puts)).result(JOIN_TIMEOUT_S)


def read(tier: DiskTier, raw_keys: list[bytes]) -> tuple[list[tuple[RecordStatus, int]],
                                                           np.ndarray]:
    out = np.zeros((len(raw_keys), PAYLOAD_BYTES), np.uint8)
    results = tier.read_into(list(zip(raw_keys, out, strict=True)), FINGERPRINT, PAYLOAD_BYTES)
    assert len(results) == len(raw_keys)
    return results, out


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    opened = DiskTier(DiskTierConfig(tmp_path / "disk", 64 << 20, map_slack_bytes=64 << 20))
    yield opened
    opened.close()


@pytest.fixture
def copy_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The thread names that copied blocks; each copy on the caller's thread pauses a little,
    so that a helper surely starts within a large batch."""
    names: list[str] = []
    caller = threading.current_thread()
    real = disk_module.copy_with_checksum

    def recorded(parts: CopyParts, chunk_bytes: int) -> int:
        names.append(threading.current_thread().name)
        if threading.current_thread() is caller:
            time.sleep(0.002)
        return real(parts, chunk_bytes)

    monkeypatch.setattr(disk_module, "copy_with_checksum", recorded)
    return names


def test_a_large_batch_is_read_bit_exact_in_order_with_helpers(
    tier: DiskTier, copy_threads: list[str]
) -> None:
    put(tier, range(NUM_BLOCKS))
    order = list(range(NUM_BLOCKS))[::-1]  # not key order: results follow the requests
    results, out = read(tier, [raw_key(i) for i in order])
    assert [status for status, _ in results] == [OK] * NUM_BLOCKS
    for row, i in enumerate(order):
        assert np.array_equal(out[row], payload(i)), f"block {i} differs"
        assert results[row][1] == encode_record(raw_key(i), FINGERPRINT, payload(i))[1]
    assert len(copy_threads) == NUM_BLOCKS
    assert any(name.startswith("tierkv-disk-copy") for name in copy_threads), copy_threads


def test_a_small_batch_stays_on_the_callers_thread(tier: DiskTier, copy_threads: list[str]) -> None:
    count = PARALLEL_READ_BYTES // PAYLOAD_BYTES - 1
    put(tier, range(count))
    results, out = read(tier, [raw_key(i) for i in range(count)])
    assert [status for status, _ in results] == [OK] * count
    assert all(np.array_equal(out[i], payload(i)) for i in range(count))
    assert copy_threads == [threading.current_thread().name] * count


@pytest.mark.parametrize("damaged", [3, NUM_BLOCKS - 4], ids=["first-half", "second-half"])
def test_a_damaged_payload_is_corrupt_at_its_block_only(
    tier: DiskTier, copy_threads: list[str], damaged: int
) -> None:
    put(tier, range(NUM_BLOCKS), damage_at=damaged)
    results, out = read(tier, [raw_key(i) for i in range(NUM_BLOCKS)])
    for i, (status, checksum) in enumerate(results):
        if i == damaged:
            assert (status, checksum) == (CORRUPT, 0)
        else:
            assert status is OK, i
            assert np.array_equal(out[i], payload(i)), f"block {i} differs"


def test_a_record_under_another_key_or_size_is_corrupt(tier: DiskTier) -> None:
    put(tier, range(NUM_BLOCKS))
    moved, _ = encode_record(raw_key(0), FINGERPRINT, payload(0))  # its header names key 0
    tier.submit(DiskWrite(block_puts=[(raw_key(5), moved)])).result(JOIN_TIMEOUT_S)
    raw_keys = [raw_key(i) for i in range(NUM_BLOCKS)]
    results, _ = read(tier, raw_keys)
    assert [i for i, (status, _) in enumerate(results) if status is not OK] == [5]
    assert results[5] == (CORRUPT, 0)
    short = tier.read_into([(raw_key(i), np.zeros(PAYLOAD_BYTES, np.uint8)) for i in range(4)],
                           FINGERPRINT, PAYLOAD_BYTES // 2)  # another layout's size
    assert short == [(CORRUPT, 0)] * 4


def test_a_missing_key_in_the_middle_is_missing_and_the_rest_ok(tier: DiskTier) -> None:
    put(tier, range(NUM_BLOCKS))
    raw_keys = [raw_key(i) for i in range(NUM_BLOCKS)]
    middle = NUM_BLOCKS // 2
    raw_keys[middle] = raw_key(middle, salt="never-written")
    results, out = read(tier, raw_keys)
    assert results[middle] == (MISSING, 0)
    for i, (status, _) in enumerate(results):
        if i != middle:
            assert status is OK and np.array_equal(out[i], payload(i)), i


def test_an_lmdb_error_marks_the_rest_corrupt(tier: DiskTier) -> None:
    put(tier, range(NUM_BLOCKS))
    raw_keys = [raw_key(i) for i in range(NUM_BLOCKS)]
    bad = NUM_BLOCKS // 2
    raw_keys[bad] = b""  # LMDB refuses an empty key: the lookup raises lmdb.BadValsizeError
    results, out = read(tier, raw_keys)
    assert [status for status, _ in results] == [OK] * bad + [CORRUPT] * (NUM_BLOCKS - bad)
    assert all(np.array_equal(out[i], payload(i)) for i in range(bad))


def test_a_copy_error_in_a_helper_reaches_the_caller(tier: DiskTier) -> None:
    put(tier, range(NUM_BLOCKS))
    requests = [(raw_key(i), np.zeros(PAYLOAD_BYTES, np.uint8)) for i in range(NUM_BLOCKS)]
    requests[-1] = (raw_key(NUM_BLOCKS - 1), np.zeros(PAYLOAD_BYTES // 2, np.uint8))
    with pytest.raises(ValueError):
        tier.read_into(requests, FINGERPRINT, PAYLOAD_BYTES)
    results, _ = read(tier, [raw_key(i) for i in range(NUM_BLOCKS)])  # the tier goes on
    assert [status for status, _ in results] == [OK] * NUM_BLOCKS


def test_concurrent_large_reads_during_writes_are_exact(tier: DiskTier) -> None:
    put(tier, range(NUM_BLOCKS))
    stop = threading.Event()
    errors: list[str] = []
    num_reads = [0]

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                order = [int(i) for i in rng.permutation(NUM_BLOCKS)]
                results, out = read(tier, [raw_key(i) for i in order])
                for row, i in enumerate(order):
                    if results[row][0] is not OK or not np.array_equal(out[row], payload(i)):
                        errors.append(f"reader {seed}: block {i} {results[row][0]}")
                num_reads[0] += 1
        except Exception as exc:  # reported below
            errors.append(f"reader {seed}: {exc!r}")

    def writer() -> None:
        try:
            for round_ in range(40):
                if stop.is_set():
                    break
                salt = f"churn-{round_}"
                put(tier, range(8), salt=salt)  # other keys, and rewrites of the read ones
                put(tier, range(round_ % NUM_BLOCKS, round_ % NUM_BLOCKS + 1))
                tier.submit(DiskWrite(block_deletes=[raw_key(i, salt) for i in range(8)])).result(
                    JOIN_TIMEOUT_S)
        except Exception as exc:  # reported below
            errors.append(f"writer: {exc!r}")

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    threads.append(threading.Thread(target=writer))
    for thread in threads:
        thread.start()
    threads[-1].join(JOIN_TIMEOUT_S)
    time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors[:5]
    assert num_reads[0] >= 4


def test_close_during_reads_waits_for_them_and_does_not_hang(tmp_path: Path) -> None:
    tier = DiskTier(DiskTierConfig(tmp_path / "disk", 64 << 20, map_slack_bytes=64 << 20))
    put(tier, range(NUM_BLOCKS))
    started = threading.Barrier(5)
    outcomes: list[str] = []

    def reader() -> None:
        started.wait(JOIN_TIMEOUT_S)
        try:
            while True:
                results, out = read(tier, [raw_key(i) for i in range(NUM_BLOCKS)])
                exact = all(np.array_equal(out[i], payload(i)) for i in range(NUM_BLOCKS))
                if [s for s, _ in results] != [OK] * NUM_BLOCKS or not exact:
                    outcomes.append("a read in flight at close was not exact")
                    return
        except StoreClosedError:
            outcomes.append("closed")
        except Exception as exc:  # reported below
            outcomes.append(repr(exc))

    readers = [threading.Thread(target=reader, daemon=True) for _ in range(4)]
    for thread in readers:
        thread.start()
    started.wait(JOIN_TIMEOUT_S)
    time.sleep(0.05)
    closer = threading.Thread(target=tier.close, daemon=True)
    closer.start()
    closer.join(JOIN_TIMEOUT_S)
    assert not closer.is_alive(), "close() hung with reads in flight"
    for thread in readers:
        thread.join(JOIN_TIMEOUT_S)
    assert outcomes == ["closed"] * 4
    with pytest.raises(StoreClosedError):
        tier.read_into([(raw_key(0), np.zeros(PAYLOAD_BYTES, np.uint8))], FINGERPRINT,
                       PAYLOAD_BYTES)


def test_the_store_serves_a_large_disk_batch_exactly(tmp_path: Path) -> None:
    layout = KVLayout(8, 8, 64, block_size=32)  # 512 KiB a block
    count = 2 * PARALLEL_READ_BYTES // layout.bytes_per_block
    namespace = Namespace("parallel-read", layout)
    config = StoreConfig(
        host=HostTierConfig(2 * layout.bytes_per_block, 64 * 1024),
        disk=DiskTierConfig(tmp_path / "disk", 4 * count * (layout.bytes_per_block + 4096)),
        write_policy=WritePolicy.WRITE_THROUGH,
        promote_on_read=False,
    )
    data = blocks(count, seed=5, layout=layout)
    hashes = keys(count, salt="parallel")
    with TieredStore(config) as store:
        store.register(namespace)
        for start in range(0, count, 2):  # HOST holds two blocks: the rest come from DISK
            assert store.put(namespace, hashes[start:start + 2], data[start:start + 2]) == 2
        out = torch.empty_like(data)
        assert store.get_into(namespace, hashes, out) == count
        assert same_bytes(out, data)
        assert store.stats().checksum_failures == 0
