"""The DISK tier against a bad disk, through the public API: an unreadable store (moved aside,
or refused), damaged session and namespace records, a second process on the same directory,
and a full filesystem (a real 8 MiB tmpfs).

The only direct LMDB access is to damage records the way a bad disk (or a bug) would.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import lmdb
import msgpack
import pytest

from tests.support import child_env
from tests.support import disk_fault_worker as worker
from tests.support.harness import ALICE_TOKEN, BackgroundServer
from tests.support.tiny_blocks import TINY_LAYOUT, blocks, keys, same_bytes
from tierkv import (
    CapacityError,
    Client,
    DiskFullError,
    DiskTierConfig,
    HostTierConfig,
    KVLayout,
    Namespace,
    StoreConfig,
    TieredStore,
    WritePolicy,
)
from tierkv.cli.main import build_parser, main
from tierkv.cli.serve_cmd import build_config
from tierkv.config import DiskCorruptAction
from tierkv.errors import ConfigError, DiskIOError, SessionNotFoundError
from tierkv.service.errors import status_of

WRITE_THROUGH = WritePolicy.WRITE_THROUGH
# 64 KiB blocks: a few of them fill the 8 MiB filesystem quickly.
BIG_LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, block_size=8)
BIG = Namespace("big-model", BIG_LAYOUT)


def store_config(path: Path, on_corrupt: str = "move_aside", disk_bytes: int = 1 << 20
                 ) -> StoreConfig:
    disk = DiskTierConfig(path, disk_bytes, map_slack_bytes=1 << 20, on_corrupt=on_corrupt)
    return StoreConfig(host=HostTierConfig(4 << 20, 4096, prefault=False), disk=disk,
                       presence_slots=0)


def truncate_mid_page(data_file: Path) -> int:
    """Cut ``data.mdb`` in the middle of a page its last commit uses; the new size."""
    size = worker.used_bytes(data_file) // 2 + 123
    with data_file.open("r+b") as f:
        f.truncate(size)
    return size


# --- unreadable stores -------------------------------------------------------------------------


def test_a_truncated_store_is_moved_aside_and_a_fresh_one_serves(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    worker.build(disk)
    size = truncate_mid_page(disk / "data.mdb")
    # In a subprocess: on the old code this was a SIGBUS.
    (result,) = worker.run_in_subprocess("check", str(disk))
    assert result["moved_aside"] and result["usable"] and result["error"] is None
    assert result["hits"] == result["sessions"] == result["wrong_blocks"] == 0
    (kept,) = disk.glob("corrupt-*/data.mdb")
    assert kept.stat().st_size == size  # kept as it was found, for inspection


def test_refuse_leaves_an_unreadable_store_untouched(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    worker.build(disk)
    truncate_mid_page(disk / "data.mdb")
    before = (disk / "data.mdb").read_bytes()
    with pytest.raises(ConfigError, match="unreadable") as raised:
        TieredStore(store_config(disk, on_corrupt="refuse"))
    assert str(disk) in str(raised.value) and "--disk-on-corrupt" in str(raised.value)
    assert (disk / "data.mdb").read_bytes() == before
    assert not list(disk.glob("corrupt-*"))
    TieredStore(store_config(disk)).close()  # the refusal released the directory


def test_the_on_corrupt_setting_is_validated_and_set_by_flag_or_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match="--disk-on-corrupt"):
        DiskTierConfig(tmp_path, 1 << 20, on_corrupt="ignore")  # type: ignore[arg-type]
    flags = ["serve", "--gpu-bytes", "0", "--disk-path", str(tmp_path), "--disk-bytes", "1MiB"]

    def on_corrupt(*extra: str) -> DiskCorruptAction:
        config = build_config(build_parser().parse_args([*flags, *extra]))
        assert config.disk is not None
        return config.disk.on_corrupt

    assert on_corrupt() is DiskCorruptAction.MOVE_ASIDE
    assert on_corrupt("--disk-on-corrupt", "refuse") is DiskCorruptAction.REFUSE
    monkeypatch.setenv("TIERKV_DISK_ON_CORRUPT", "refuse")
    assert on_corrupt() is DiskCorruptAction.REFUSE
    monkeypatch.setenv("TIERKV_DISK_ON_CORRUPT", "shrug")
    assert main([*flags, "--listen", "127.0.0.1:0"]) == 2
    assert "--disk-on-corrupt" in capsys.readouterr().err


# --- sealed session and namespace records ------------------------------------------------------


def damage(disk: Path, db_name: bytes, key: bytes, new_key: bytes | None = None,
           flip_at: int | None = None, value: bytes | None = None) -> None:
    """Rewrite one record of ``db_name`` (the store is closed): flip a bit of its value, move
    it under ``new_key``, or replace its value."""
    env = lmdb.open(str(disk), max_dbs=4, map_size=1 << 30)
    try:
        db = env.open_db(db_name)
        with env.begin(write=True, db=db) as txn:
            data = bytearray(txn.get(key))
            if flip_at is not None:
                data[flip_at % len(data)] ^= 0x10
            if value is not None:
                data = bytearray(value)
            if new_key is not None:
                txn.delete(key)
            txn.put(new_key or key, bytes(data))
    finally:
        env.close()


def test_a_damaged_session_record_is_absent_and_counted_never_resumed_wrong(
    tmp_path: Path,
) -> None:
    disk, namespace = tmp_path / "disk", Namespace("chat-model", TINY_LAYOUT)
    token_ids = list(range(5000, 5064))
    key = b"default\x00chat"
    for flip_at in (0, 5, 12, 40, -3, -1):  # magic, checksum, body, ..., last token byte
        with TieredStore(store_config(disk)) as store:
            store.register(namespace)
            store.save_session(namespace, "chat", token_ids)
        damage(disk, b"sessions", key, flip_at=flip_at)
        with TieredStore(store_config(disk)) as store:
            with pytest.raises(SessionNotFoundError):
                store.resume_session("chat")
            assert store.stats().checksum_failures == 1, flip_at
    # A bit flipped in the key: the checksum is bound to it.
    damage(disk, b"sessions", key, new_key=b"default\x00chau")
    with TieredStore(store_config(disk)) as store:
        with pytest.raises(SessionNotFoundError):
            store.resume_session("chau")
        assert store.stats().checksum_failures == 1
        store.save_session(namespace, "chat", token_ids)  # and it can be saved again
    with TieredStore(store_config(disk)) as store:
        assert list(store.resume_session("chat").token_ids) == token_ids


def test_a_session_record_of_the_unsealed_layout_is_absent_and_counted(tmp_path: Path) -> None:
    disk, namespace = tmp_path / "disk", Namespace("chat-model", TINY_LAYOUT)
    with TieredStore(store_config(disk)) as store:
        store.register(namespace)
        store.save_session(namespace, "old", [1, 2, 3])
    old_layout = msgpack.packb({"v": 1, "namespace": b"", "tokens": b"\x01\x00\x00\x00",
                                "last_use": 0.0, "ttl": None})
    damage(disk, b"sessions", b"default\x00old", value=old_layout)
    with TieredStore(store_config(disk)) as store:
        with pytest.raises(SessionNotFoundError):
            store.resume_session("old")
        assert store.stats().checksum_failures == 1


def test_a_lost_namespace_descriptor_drops_its_blocks_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = tmp_path / "disk"
    lost, kept = Namespace("lost-model", TINY_LAYOUT), Namespace("kept", TINY_LAYOUT)
    with TieredStore(store_config(disk)) as store:
        for namespace in (lost, kept):
            store.register(namespace)
            store.put(namespace, keys(6, salt=namespace.model_id), blocks(6, 3),
                      write_policy=WRITE_THROUGH)
    damage(disk, b"namespaces", bytes(lost.id), flip_at=30)
    with caplog.at_level(logging.ERROR), TieredStore(store_config(disk)) as store:
        assert store.stats().checksum_failures == 1 + 6  # the descriptor and its blocks
        assert "descriptor is lost" in caplog.text
        store.register(lost)
        assert store.lookup(lost, keys(6, salt=lost.model_id)) == 0
        got = store.get(kept, keys(6, salt=kept.model_id))
        assert len(got) == 6 and all(same_bytes(a, b) for a, b in zip(got, blocks(6, 3),
                                                                       strict=True))


# --- one process per directory -----------------------------------------------------------------


def test_a_second_store_on_the_same_disk_path_is_refused_until_the_first_closes(
    tmp_path: Path,
) -> None:
    disk = tmp_path / "disk"
    first = TieredStore(store_config(disk))
    with pytest.raises(ConfigError, match="another tierkv process holds it") as raised:
        TieredStore(store_config(disk))
    assert str(disk) in str(raised.value)
    first.close()
    for _ in range(3):  # closing releases it, every time
        TieredStore(store_config(disk)).close()


def test_a_sigkilled_holder_does_not_block_a_restart(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom tests.support import disk_fault_worker as w\n"
         "from tierkv import TieredStore\n"
         "store = TieredStore(w.store_config(w.Path(sys.argv[1])))\n"
         "print('ready', flush=True)\n"
         "time.sleep(120)\n", str(disk)],
        stdout=subprocess.PIPE, text=True,
        env=child_env(),
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(ConfigError, match="another tierkv process holds it"):
            TieredStore(worker.store_config(disk))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    TieredStore(worker.store_config(disk)).close()


def test_a_second_tierkv_serve_on_the_same_disk_path_is_refused(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    first = worker.start_serve(disk, tmp_path / "a.sock")
    try:
        assert first.stdout is not None and '"ready": true' in first.stdout.readline()
        second = worker.start_serve(disk, tmp_path / "b.sock")
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2
        assert "another tierkv process holds it" in err and str(disk) in err
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0


# --- a full filesystem -------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmpfs: Callable[[int], Path]) -> Path:
    """An 8 MiB tmpfs mounted for the test."""
    return tmpfs(8)


def test_write_through_on_a_full_filesystem_raises_disk_full_and_the_store_goes_on(
    small_tmpfs: Path,
) -> None:
    disk = small_tmpfs / "disk"
    config = store_config(disk, disk_bytes=64 << 20)  # the filesystem fills, not the budget
    hashes, data = keys(200, salt="full"), blocks(200, 5, BIG_LAYOUT)
    with TieredStore(config) as store:
        store.register(BIG)
        num_stored = 0
        with pytest.raises(DiskFullError):
            for num_stored in range(len(hashes)):
                one = slice(num_stored, num_stored + 1)
                store.put(BIG, hashes[one], data[one], write_policy=WRITE_THROUGH)
        assert 0 < num_stored < 128  # 8 MiB holds at most 128 blocks of 64 KiB
        assert store.lookup(BIG, hashes[num_stored : num_stored + 1]) == 0  # nothing half-stored
        got = store.get(BIG, hashes[:num_stored])
        assert len(got) == num_stored and all(
            same_bytes(a, b) for a, b in zip(got, data[:num_stored], strict=True))
    with TieredStore(config) as store:  # what was acknowledged is on disk, exact
        got = store.get(BIG, hashes[:num_stored])
        assert len(got) == num_stored and all(
            same_bytes(a, b) for a, b in zip(got, data[:num_stored], strict=True))


def test_a_client_put_on_a_full_filesystem_is_resource_exhausted_and_not_retried(
    small_tmpfs: Path,
) -> None:
    background = BackgroundServer(small_tmpfs, disk_bytes=64 << 20, host_bytes=4 << 20)
    hashes, data = keys(200, salt="client"), blocks(200, 6, BIG_LAYOUT)
    try:
        # With a retry the failing put would wait 2 + 4 + 8 s.
        with Client(background.target, token=ALICE_TOKEN, retries=3, backoff_s=2.0) as client:
            with pytest.raises(CapacityError) as raised:
                for index in range(len(hashes)):
                    started = time.monotonic()
                    client.put(BIG, hashes[index : index + 1], data[index : index + 1],
                               write_policy=WRITE_THROUGH)
            assert time.monotonic() - started < 2.0
            assert "RESOURCE_EXHAUSTED" in str(raised.value) and "full" in str(raised.value)
            got = client.get(BIG, hashes[:index])
            assert len(got) == index and all(
                same_bytes(a, b) for a, b in zip(got, data[:index], strict=True))
    finally:
        background.close()


def test_disk_errors_map_to_codes_the_sdk_does_not_retry() -> None:
    assert status_of(DiskFullError("disk: full"))[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(DiskIOError("disk: I/O error"))[0] is grpc.StatusCode.DATA_LOSS
