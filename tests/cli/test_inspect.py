"""``tierkv inspect``: a disk store's namespaces, blocks, bytes and sessions, read offline
without changing a byte (or an mtime) of it; bad records counted and listed, never a crash;
a path that is no store is a clear error; a store a server is running on reads too.

A store a busy server is writing reads as one snapshot (never good blocks reported bad, never
a healthy store reported damaged); flipped bits at the bytes LMDB and the parsers trust, and
paths that are no store, give a report or a clear error: never a crash, a changed byte or wrong
numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import pytest

from tests.support.disk_records import RawDisk
from tests.support.harness import SidecarFactory, stream_client
from tests.support.tiny_blocks import BLOCK_BYTES, PAGE_BYTES, TINY_LAYOUT, blocks, keys
from tierkv import DiskTierConfig, HostTierConfig, KVLayout, Namespace, StoreConfig, TieredStore
from tierkv import WritePolicy as Policy
from tierkv.cli.main import main
from tierkv.errors import ConfigError
from tierkv.store import inspect_disk
from tierkv.tiers.lmdb_readonly import NotAStoreError, ReadOnlyStore

ALICE = Namespace("model-a", TINY_LAYOUT, tenant="alice")
BOB = Namespace("model-b", KVLayout(2, 2, 8, 8), tenant="bob")  # blocks of 1 KiB


def make_store(path: Path) -> Path:
    """A closed disk store at ``path``: 4 blocks of ALICE, 2 of BOB, a session each."""
    config = StoreConfig(host=HostTierConfig(64 * BLOCK_BYTES, PAGE_BYTES),
                         disk=DiskTierConfig(path, 1 << 20))
    with TieredStore(config) as store:
        for ns, count in ((ALICE, 4), (BOB, 2)):
            store.register(ns)
            store.put(ns, keys(count), blocks(count, layout=ns.layout),
                      write_policy=Policy.WRITE_THROUGH)
            store.save_session(ns, f"chat-{ns.tenant}", [1, 2, 3])
    return path


def fingerprint(path: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under ``path``: its SHA-256, size and mtime (ns)."""
    return {str(p.relative_to(path)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                       p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


def inspect_json(path: Path, capsys: pytest.CaptureFixture[str], code: int = 0) -> dict[str, object]:
    assert main(["inspect", "--disk-path", str(path), "--json"]) == code
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


def test_inspect_reports_every_namespace_and_changes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = make_store(tmp_path / "disk")
    before = fingerprint(path)
    data = inspect_json(path, capsys)
    assert fingerprint(path) == before  # no byte, size or mtime changed, nothing created
    assert (data["num_namespaces"], data["num_blocks"], data["num_sessions"]) == (2, 6, 2)
    assert data["stored_bytes"] == 4 * BLOCK_BYTES + 2 * 1024
    assert (data["num_bad_records"], data["server_running"]) == (0, False)
    assert data["namespaces"] == [  # largest first; ties by tenant
        {"tenant": "alice", "model_id": "model-a", "layout": "2x2x8/4/fp16", "tp_rank": 0,
         "tp_size": 1, "num_blocks": 4, "stored_bytes": 2048, "num_sessions": 1},
        {"tenant": "bob", "model_id": "model-b", "layout": "2x2x8/8/fp16", "tp_rank": 0,
         "tp_size": 1, "num_blocks": 2, "stored_bytes": 2048, "num_sessions": 1},
    ]
    assert main(["inspect", "--disk-path", str(path)]) == 0
    text = capsys.readouterr().out
    assert "2 namespaces, 6 blocks (4.0 KiB), 2 sessions, 0 bad records" in text
    assert fingerprint(path) == before


def test_a_store_written_before_records_were_split_is_read_whole(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Records stored whole, with no heads DB (as stores written before the split hold them),
    are verified as before: nothing is bad."""
    path = make_store(tmp_path / "disk")
    with RawDisk(path) as raw, raw.env.begin(write=True) as txn:
        records = [(bytes(key), raw.get(txn, bytes(key)))
                   for key, _ in txn.cursor(db=raw.blocks)]
        for key, record in records:
            raw.put_whole(txn, key, record or b"")
        txn.drop(raw.heads, delete=True)
    data = inspect_json(path, capsys)
    assert (data["num_blocks"], data["num_bad_records"]) == (6, 0)
    assert data["stored_bytes"] == 4 * BLOCK_BYTES + 2 * 1024


def damage(path: Path) -> None:
    """Flip, truncate and forge records with LMDB directly (as a failing disk or a foreign
    writer would)."""
    with RawDisk(path) as raw, raw.env.begin(write=True) as txn:
        namespaces_db, sessions_db = (raw.env.open_db(name, txn=txn) for name in
                                      (b"namespaces", b"sessions"))
        a0, a1, a2 = (bytes(ALICE.id) + k for k in keys(3))
        flipped = bytearray(raw.get(txn, a0) or b"")
        flipped[-1] ^= 0x40  # a payload bit: the checksum fails
        raw.put(txn, a0, bytes(flipped))
        raw.put(txn, a1, (raw.get(txn, a1) or b"")[:100])  # torn
        header = bytearray(raw.get(txn, a2) or b"")
        header[0] ^= 0xFF  # the magic
        raw.put(txn, a2, bytes(header))
        raw.put_whole(txn, b"not a block key", b"foreign")
        raw.put_whole(txn, bytes(16) + keys(1)[0], b"x" * 600)  # a namespace never stored
        # A head whose body is lost.
        txn.put(bytes(ALICE.id) + keys(9)[8], txn.get(a0, db=raw.heads), db=raw.heads)
        descriptor = bytearray(txn.get(bytes(BOB.id), db=namespaces_db))
        descriptor[-2] ^= 0x01  # bob's descriptor: his blocks have no namespace now
        txn.put(bytes(BOB.id), bytes(descriptor), db=namespaces_db)
        session_key = b"alice\x00chat-alice"
        session = bytearray(txn.get(session_key, db=sessions_db))
        session[12] ^= 0x01
        txn.put(session_key, bytes(session), db=sessions_db)


def test_bad_records_are_counted_and_listed_never_a_crash(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = make_store(tmp_path / "disk")
    damage(path)
    before = fingerprint(path)
    data = inspect_json(path, capsys, code=3)
    assert fingerprint(path) == before
    bad = {(b["db"], b["reason"].split(":")[0]) for b in data["bad_records"]}  # type: ignore[union-attr, index]
    assert bad == {
        ("blocks", "its payload fails its checksum"),
        ("blocks", "its header does not match (torn, foreign or another layout)"),
        ("blocks", "a key of 15 bytes, not 48"),
        ("blocks", "its namespace's descriptor is lost or unreadable"),
        ("blocks", "its record's head is there but its body is lost"),
        ("namespaces", "failed its checksum"),
        ("sessions", "failed its checksum"),
    }
    # 3 of alice's blocks, the foreign key, the unknown namespace, bob's 2 blocks, his
    # descriptor, alice's session and the lost body.
    assert data["num_bad_records"] == 10
    namespaces = data["namespaces"]
    assert isinstance(namespaces, list)
    assert [(n["tenant"], n["num_blocks"], n["num_sessions"]) for n in namespaces] == [
        ("alice", 1, 0), ("bob", 0, 1)]  # bob's session still names his namespace
    assert main(["inspect", "--disk-path", str(path)]) == 3
    text = capsys.readouterr().out
    assert "10 bad records" in text and "its payload fails its checksum" in text


def test_a_path_that_is_no_store_is_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    assert main(["inspect", "--disk-path", str(missing)]) == 1
    assert "no LMDB data file" in capsys.readouterr().err and not missing.exists()
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "data.mdb").write_bytes(b"not lmdb at all" * 1000)
    assert main(["inspect", "--disk-path", str(garbage)]) == 1
    assert "not an LMDB store" in capsys.readouterr().err
    other = tmp_path / "other"
    env = lmdb.open(str(other), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"things")) as txn:
        txn.put(b"k", b"v")
    env.close()
    assert main(["inspect", "--disk-path", str(other)]) == 1
    assert "not a tierkv disk store" in capsys.readouterr().err
    truncated = make_store(tmp_path / "truncated")
    with (truncated / "data.mdb").open("r+b") as f:
        f.truncate(3 * 4096)
    assert main(["inspect", "--disk-path", str(truncated)]) == 1
    assert "truncated" in capsys.readouterr().err


def test_inspect_reads_a_store_while_a_server_runs_on_it(
        sidecar_factory: SidecarFactory, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    sidecar = sidecar_factory()
    with stream_client(sidecar) as client:
        client.put(ALICE.with_tenant("default"), keys(3), blocks(3),
                   write_policy=Policy.WRITE_THROUGH)
        data = inspect_json(sidecar.disk_path, capsys)
        assert (data["server_running"], data["num_blocks"], data["num_bad_records"]) == (
            True, 3, 0)
        client.put(ALICE.with_tenant("default"), keys(2, start=3), blocks(2),
                   write_policy=Policy.WRITE_THROUGH)  # the server still writes
        assert client.lookup(ALICE.with_tenant("default"), keys(5)) == 5
        assert inspect_json(sidecar.disk_path, capsys)["num_blocks"] == 5
    assert sidecar.alive


# --- a busy store, flipped bits, paths that are no store ---------------------------------------


BUSY_FLAGS = ("--disk-bytes", str(256 << 20), "--max-namespaces-per-tenant", "4096")


def test_a_store_is_read_from_one_snapshot_while_a_server_writes(
        sidecar_factory: SidecarFactory) -> None:
    """Every DB of an inspection comes from the snapshot of its start: a namespace and blocks
    stored after it began appear in none of them (they were read one transaction per DB, so
    blocks of a namespace stored in between had no namespace: good blocks listed as bad)."""
    sidecar = sidecar_factory(*BUSY_FLAGS)
    first, later = (Namespace(model, TINY_LAYOUT) for model in ("first", "later"))
    with stream_client(sidecar) as client:
        client.put(first, keys(2), blocks(2), write_policy=Policy.WRITE_THROUGH)
        with ReadOnlyStore(sidecar.disk_path) as store:
            assert store.server_running
            client.put(later, keys(3), blocks(3), write_policy=Policy.WRITE_THROUGH)
            client.put(first, keys(2, start=2), blocks(2), write_policy=Policy.WRITE_THROUGH)
            namespace_ids = [key for key, _ in store.records(1)]
            block_keys = [key for key, _ in store.records(0)]
        assert namespace_ids == [bytes(first.id)]
        assert sorted(block_keys) == sorted(bytes(first.id) + k for k in keys(2))
        report = inspect_disk(sidecar.disk_path)
        assert (report.num_blocks, report.num_bad_records, len(report.namespaces)) == (7, 0, 2)


def test_inspecting_a_busy_server_never_reports_good_blocks_bad_or_the_store_damaged(
        sidecar_factory: SidecarFactory) -> None:
    """Writers store new namespaces and blocks (write-through: one commit each) as fast as
    they can while the store is inspected again and again: every inspection is clean and counts
    at least the blocks acknowledged before it began and at most those sent by its end. (Before
    the one-snapshot read, most inspections listed blocks of new namespaces as bad, and some
    called the store damaged: the check walked pages the server's commits had recycled.)"""
    sidecar = sidecar_factory(*BUSY_FLAGS)
    stop = threading.Event()
    lock = threading.Lock()
    counts = {"sent": 0, "acked": 0}
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        try:
            with stream_client(sidecar) as client:
                round_ = 0
                while not stop.is_set() and round_ < 900:  # 4 x 900 namespaces: under 4096
                    namespace = Namespace(f"w{index}-{round_}", TINY_LAYOUT)
                    with lock:
                        counts["sent"] += 2
                    client.put(namespace, keys(2, salt=f"{index}-{round_}"), blocks(2, seed=round_),
                               write_policy=Policy.WRITE_THROUGH)
                    with lock:
                        counts["acked"] += 2
                    round_ += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    try:
        while counts["acked"] < 200 and not errors:
            stop.wait(0.05)
        for _ in range(25):
            with lock:
                acked_before = counts["acked"]
            report = inspect_disk(sidecar.disk_path)
            with lock:
                sent_after = counts["sent"]
            assert report.server_running and report.bad_records == []
            assert acked_before <= report.num_blocks <= sent_after
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
    assert sidecar.alive


def small_store(path: Path) -> Path:
    """A closed store of 3 namespaces (3 tenants), 20 blocks and a session each."""
    config = StoreConfig(host=HostTierConfig(64 * BLOCK_BYTES, PAGE_BYTES),
                         disk=DiskTierConfig(path, 1 << 20))
    with TieredStore(config) as store:
        for index in range(3):
            ns = Namespace(f"m{index}", TINY_LAYOUT, tenant=f"t{index}")
            store.register(ns)
            store.put(ns, keys(20, salt=str(index)), blocks(20, seed=index),
                      write_policy=Policy.WRITE_THROUGH)
            store.save_session(ns, f"s{index}", list(range(50)))
    return path


def test_flipped_bits_give_the_same_figures_a_bad_record_or_a_clear_error(
        tmp_path: Path) -> None:
    """A bit flipped in a page header, a node or anywhere in the used pages (a sample): the
    report is the store's own figures (the flip was in dead space), lists bad records, or the
    store is refused as damaged; never a crash (LMDB aborts on pages it trusts), never other
    figures without a bad record."""
    source = small_store(tmp_path / "source")
    flipped = tmp_path / "flipped"
    flipped.mkdir()
    baseline = inspect_disk(source).as_dict()
    baseline.pop("path")
    assert (baseline["num_blocks"], baseline["num_sessions"]) == (60, 3)
    env = lmdb.open(str(source), readonly=True, lock=False, max_dbs=4)
    page_bytes, used_pages = int(env.stat()["psize"]), int(env.info()["last_pgno"]) + 1
    env.close()
    used_bytes = used_pages * page_bytes  # the file is sparse past them (the map size)
    data = (source / "data.mdb").read_bytes()[:used_bytes]
    (flipped / "data.mdb").write_bytes(data)
    rng = random.Random(7)
    offsets = {page * page_bytes + rng.randrange(48) for page in range(used_pages)}
    offsets |= set(rng.sample(range(used_bytes), 120))
    outcomes = {"same": 0, "bad": 0, "refused": 0}
    fd = os.open(flipped / "data.mdb", os.O_RDWR)
    try:
        for offset in sorted(offsets):
            os.pwrite(fd, bytes([data[offset] ^ (1 << rng.randrange(8))]), offset)
            try:
                report = inspect_disk(flipped)
            except NotAStoreError:  # anything else fails the test
                outcomes["refused"] += 1
            else:
                figures = report.as_dict()
                figures.pop("path")
                if report.num_bad_records:
                    outcomes["bad"] += 1
                else:
                    assert figures == baseline, f"offset {offset}"
                    outcomes["same"] += 1
            os.pwrite(fd, data[offset : offset + 1], offset)
    finally:
        os.close(fd)
    assert all(outcomes.values()), outcomes  # each outcome was reached


@pytest.mark.parametrize("kind", ["empty", "a file", "a folder", "a fifo", "zeros", "random"])
def test_a_data_file_that_is_no_store_is_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    path = tmp_path / "store"
    path.mkdir()
    data_file = path / "data.mdb"
    if kind == "empty":
        data_file.touch()
    elif kind == "a file":
        shutil.rmtree(path)
        path.write_text("not a folder")
    elif kind == "a folder":
        data_file.mkdir()
    elif kind == "a fifo":
        os.mkfifo(data_file)
    else:
        data_file.write_bytes(bytes(16384) if kind == "zeros" else random.Random(1).randbytes(9000))
    assert main(["inspect", "--disk-path", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tierkv inspect: ") and "Traceback" not in err
    if kind == "empty":
        assert "empty (0 B)" in err


def test_a_store_without_its_lmdb_lock_file_is_read_and_none_is_created(tmp_path: Path) -> None:
    path = small_store(tmp_path / "store")
    (path / "lock.mdb").unlink(missing_ok=True)
    (path / "tierkv.lock").unlink(missing_ok=True)
    before = sorted(p.name for p in path.iterdir())
    report = inspect_disk(path)
    assert (report.num_blocks, report.num_sessions, report.num_bad_records) == (60, 3, 0)
    assert sorted(p.name for p in path.iterdir()) == before


def test_a_server_cannot_start_on_a_store_an_offline_inspection_is_reading(
        tmp_path: Path) -> None:
    """An offline inspection is no LMDB reader a server can see: a server that started on the
    store halfway through and rewrote its blocks recycled the pages being read, and LMDB
    aborted the inspecting process (``mdb_cursor_sibling`` assertion). Now the inspection
    holds the directory lock shared, so the server is refused until it ends, and the figures
    are the store's."""
    path = small_store(tmp_path / "store")
    config = StoreConfig(host=HostTierConfig(64 * BLOCK_BYTES, PAGE_BYTES),
                         disk=DiskTierConfig(path, 1 << 20))
    refusals: list[str] = []

    def start_a_server(num_bytes: int) -> None:
        if not refusals:
            with pytest.raises(ConfigError, match="another tierkv process holds it") as refused:
                TieredStore(config).close()
            refusals.append(str(refused.value))

    report = inspect_disk(path, progress=start_a_server)
    assert refusals and not report.server_running
    assert (report.num_blocks, report.num_sessions, report.num_bad_records) == (60, 3, 0)
    with TieredStore(config) as store:  # the lock went with the inspection
        assert store.num_recovered_blocks == 60


HOLD_A_SNAPSHOT = """
import sys, time
from tierkv.tiers.lmdb_readonly import ReadOnlyStore
store = ReadOnlyStore(sys.argv[1])
assert store.server_running
print("holding", flush=True)
time.sleep(600)
"""


def test_an_inspection_killed_on_a_live_store_does_not_pin_its_pages_for_good(
        sidecar_factory: SidecarFactory) -> None:
    """An inspection killed with SIGKILL left its LMDB reader slot (and snapshot) behind; the
    server clears dead readers only when it opens the store, so it could reuse no page freed
    since: measured, its file grew by every rewrite until the map was full and puts were
    refused. The next inspection clears the dead slot."""
    sidecar = sidecar_factory(*BUSY_FLAGS)
    with stream_client(sidecar) as client:
        client.put(Namespace("m", TINY_LAYOUT), keys(2), blocks(2),
                   write_policy=Policy.WRITE_THROUGH)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_A_SNAPSHOT, str(sidecar.disk_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()

    def reader_pids() -> str:
        env = lmdb.open(str(sidecar.disk_path), readonly=True, lock=True, max_dbs=4)
        try:
            return str(env.readers())
        finally:
            env.close()

    assert f" {holder.pid} " in reader_pids()  # the dead process still holds a slot
    assert inspect_disk(sidecar.disk_path).num_blocks == 2
    assert f" {holder.pid} " not in reader_pids()
    assert sidecar.alive
