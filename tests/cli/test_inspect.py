"""``tierkv inspect``: a disk store's namespaces, blocks, bytes and sessions, read offline
without changing a byte (or an mtime) of it; bad records counted and listed, never a crash;
a path that is no store is a clear error; a store a server is running on reads too."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import lmdb
import pytest

from tests.support.disk_records import RawDisk
from tests.support.harness import SidecarFactory, stream_client
from tests.support.tiny_blocks import BLOCK_BYTES, PAGE_BYTES, TINY_LAYOUT, blocks, keys
from tierkv import DiskTierConfig, HostTierConfig, KVLayout, Namespace, StoreConfig, TieredStore
from tierkv import WritePolicy as Policy
from tierkv.cli.main import main

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
