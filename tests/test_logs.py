"""Structured logs: the JSON and text formats, the throttle that keeps hot paths to one line per
interval, and the events a real ``tierkv serve`` writes: start, recovery, ready, auth_failure,
shutdown, stopped; disk_error from the disk tier; eviction_storm from the serve loop's watch."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import lmdb
import pytest

from tests.support.fake_clock import FakeClock
from tests.support.harness import SidecarFactory
from tests.support.tiny_blocks import StoreFactory, blocks, keys
from tierkv import Namespace
from tierkv.cli.serve_cmd import EvictionStormWatch, show_progress
from tierkv.config import DiskTierConfig, MiB
from tierkv.errors import DiskFullError
from tierkv.logs import Throttle, event_of, fields_of, log_event, setup_logging
from tierkv.service.auth import AUTH_FAILURE_LOG_INTERVAL_S, Authenticator
from tierkv.tiers.disk import DiskTier, DiskWrite
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

GOOD_TOKEN = "g" * 32


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    """What ``setup_logging`` writes, in a buffer; the root logger is restored afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()
    yield stream
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def events(records: list[logging.LogRecord], name: str) -> list[dict[str, Any]]:
    """The fields of every record of the event ``name``."""
    return [fields_of(record) for record in records if event_of(record) == name]


# --- formats -------------------------------------------------------------------------------------


def test_json_logs_are_one_object_a_line_with_the_event_fields(log_stream: io.StringIO) -> None:
    setup_logging("info", "json", log_stream)
    log = logging.getLogger("tierkv.test")
    log_event(log, logging.INFO, "ready", "serving\non two lines", port=50051, tiers={"host": 1},
              listen=["a", "b"], level="not the level", ratio=float("nan"))
    log.debug("not logged at info")
    log.warning("plain %s", "record")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = log_stream.getvalue().splitlines()
    assert len(lines) == 3
    ready, plain, failed = (json.loads(line) for line in lines)
    assert ready["event"] == "ready" and ready["level"] == "INFO" and ready["logger"] == "tierkv.test"
    assert ready["message"] == "serving\non two lines"
    assert (ready["port"], ready["tiers"], ready["listen"]) == (50051, {"host": 1}, ["a", "b"])
    assert ready["field_level"] == "not the level" and ready["ratio"] == "nan"
    assert ready["ts"].endswith("Z")
    assert datetime.fromisoformat(ready["ts"].replace("Z", "+00:00")).utcoffset().total_seconds() == 0
    assert plain["event"] == "log" and plain["message"] == "plain record"
    assert failed["level"] == "ERROR" and "ValueError: boom" in failed["exception"]


def test_text_logs_are_one_readable_line_with_key_value_fields(log_stream: io.StringIO) -> None:
    setup_logging("DEBUG", "text", log_stream)
    log = logging.getLogger("tierkv.test")
    log_event(log, logging.WARNING, "auth_failure", "call refused", reason="no bearer token",
              num_failures=3, ok=True, path="/tmp/x")
    log.debug("plain")
    first, second = log_stream.getvalue().splitlines()
    assert " WARNING tierkv.test auth_failure: call refused " in first
    assert first.endswith('reason="no bearer token" num_failures=3 ok=true path=/tmp/x')
    assert second.endswith(" DEBUG tierkv.test: plain")


def test_setup_logging_replaces_its_own_handler_and_refuses_unknown_formats(
    log_stream: io.StringIO,
) -> None:
    setup_logging("info", "text", io.StringIO())
    setup_logging("info", "json", log_stream)
    logging.getLogger("tierkv.test").info("once")
    assert len(log_stream.getvalue().splitlines()) == 1
    with pytest.raises(ValueError, match="log format"):
        setup_logging("info", "yaml", log_stream)
    with pytest.raises(ValueError, match="level"):
        setup_logging("loud", "json", log_stream)


def test_the_throttle_lets_one_line_through_an_interval_and_counts_the_rest() -> None:
    clock = FakeClock()
    throttle = Throttle(10.0, clock)
    assert throttle.admit() == 1
    assert [throttle.admit() for _ in range(5)] == [0] * 5
    clock.now_s += 9.9
    assert throttle.admit() == 0
    clock.now_s += 0.1
    assert throttle.admit() == 7  # this one and the six counted since the last line
    clock.now_s += 60
    assert throttle.admit() == 1


# --- auth failures -------------------------------------------------------------------------------


def test_a_burst_of_bad_tokens_is_one_auth_failure_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    auth = Authenticator({GOOD_TOKEN: "alice"}, clock)
    caplog.set_level(logging.INFO)
    for _ in range(50):
        assert auth.tenant_of((("authorization", "Bearer " + "w" * 32),)) is None
    assert auth.tenant_of((("authorization", "Bearer " + GOOD_TOKEN),)) == "alice"
    assert events(caplog.records, "auth_failure") == [
        {"reason": "unknown bearer token", "num_failures": 1,
         "interval_s": AUTH_FAILURE_LOG_INTERVAL_S}]
    assert caplog.records[0].levelno == logging.WARNING
    clock.now_s += AUTH_FAILURE_LOG_INTERVAL_S
    assert auth.tenant_of(()) is None
    assert [(f["reason"], f["num_failures"]) for f in events(caplog.records, "auth_failure")] == [
        ("unknown bearer token", 1), ("no bearer token", 50)]


# --- disk errors ---------------------------------------------------------------------------------


def test_disk_write_failures_are_one_disk_error_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    config = DiskTierConfig(tmp_path / "disk", 1 * MiB, map_slack_bytes=0)
    tier = DiskTier(config)
    caplog.set_level(logging.INFO)
    try:
        for number in range(5):  # each one larger than the whole map
            job = DiskWrite(block_puts=[(b"key-%d" % number, bytes(4 * MiB))])
            with pytest.raises(DiskFullError):
                tier.submit(job).result(timeout=60)
    finally:
        tier.close()
    (line,) = events(caplog.records, "disk_error")
    assert (line["op"], line["kind"], line["num_errors"]) == ("write", "full", 1)
    assert line["path"] == str(config.path) and "no room" in line["error"]


def test_a_failing_disk_under_write_back_logs_a_few_lines_not_one_per_batch(
    make_store: StoreFactory, namespace: Namespace, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every commit fails, as on a dying device: each put evicts to disk and each demotion
    # batch fails. Measured before: 400 puts, 491 lines.
    def failing_commit(self: DiskTier, batch: list[DiskWrite]) -> None:
        raise lmdb.Error("injected: the device is gone")

    store = make_store(host_blocks=4, disk_blocks=64)
    store.register(namespace)
    monkeypatch.setattr(DiskTier, "_commit", failing_commit)
    caplog.set_level(logging.INFO)
    for number in range(200):
        store.put(namespace, keys(2, start=2 * number), blocks(2))
    store.wait_for_background(timeout_s=60)
    assert len(caplog.records) <= 4, [record.getMessage() for record in caplog.records]
    assert len(events(caplog.records, "disk_error")) == 1


# --- eviction storms -----------------------------------------------------------------------------


def test_an_eviction_storm_is_logged_once_when_it_starts_and_once_when_it_ends(
    make_store: StoreFactory, namespace: Namespace, caplog: pytest.LogCaptureFixture,
) -> None:
    store = make_store(host_blocks=8)
    store.register(namespace)
    watch = EvictionStormWatch(window_s=10.0, quiet_s=60.0, min_evictions=100)
    caplog.set_level(logging.INFO)

    def put(num_blocks: int, salt: str) -> None:
        for start in range(0, num_blocks, 4):
            store.put(namespace, keys(4, start, salt), blocks(4, start))

    watch.observe(0.0, store.stats())
    put(40, "calm")  # 32 evictions: fewer than min_evictions
    watch.observe(1.0, store.stats())
    assert not caplog.records
    put(400, "storm")
    watch.observe(2.0, store.stats())
    put(400, "still")
    watch.observe(3.0, store.stats())
    (storm,) = events(caplog.records, "eviction_storm")
    assert storm["tier"] == "host" and storm["num_evictions"] >= 400 and storm["num_blocks"] <= 8
    watch.observe(30.0, store.stats())  # quiet, but not for quiet_s yet
    assert not events(caplog.records, "eviction_storm_end")
    watch.observe(63.0, store.stats())
    (end,) = events(caplog.records, "eviction_storm_end")
    assert end["tier"] == "host" and end["num_evictions"] >= 800 and end["duration_s"] == 1.0
    assert len(events(caplog.records, "eviction_storm")) == 1


# --- a real `tierkv serve` -----------------------------------------------------------------------


def test_serve_logs_its_life_as_json_lines(
    tmp_path: Path, sidecar_factory: SidecarFactory,
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{GOOD_TOKEN} alice\n")
    sidecar = sidecar_factory("--log-format", "json", "--host-bytes", "64MiB", "--disk-bytes",
                              "256MiB", "--tokens-file", str(tokens))
    with grpc.insecure_channel(sidecar.tcp_target) as channel:
        stub = pb_grpc.TierKVStub(channel)
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as raised:
                stub.Describe(pb.DescribeRequest(), metadata=(("authorization", "Bearer nope"),),
                              timeout=30)
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.Describe(pb.DescribeRequest(), metadata=(("authorization", f"Bearer {GOOD_TOKEN}"),),
                      timeout=30)
    sidecar.terminate()
    lines = [json.loads(line) for line in sidecar.log_path.read_text().splitlines()]
    by_event: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        by_event.setdefault(line["event"], []).append(line)
    order = [line["event"] for line in lines if line["event"] != "log"]
    assert order == ["start", "recovery", "ready", "auth_failure", "shutdown", "stopped"]
    (start,) = by_event["start"]
    assert start["pid"] == sidecar.process.pid if sidecar.process else False
    assert start["host_bytes"] == 64 * MiB and start["tokens"] is True
    (recovery,) = by_event["recovery"]
    assert recovery["num_recovered_blocks"] == 0 and recovery["duration_s"] >= 0
    (ready,) = by_event["ready"]
    assert ready["port"] == sidecar.ready["port"] and ready["metrics_port"] == 0
    assert sidecar.ready["metrics_port"] == 0
    (failure,) = by_event["auth_failure"]
    assert failure["level"] == "WARNING" and failure["num_failures"] == 1
    assert by_event["shutdown"][0]["reason"] == "SIGTERM"
    assert by_event["stopped"][0]["num_flushed_blocks"] == 0


def serve_command(tmp_path: Path, name: str) -> list[str]:
    # 512 MiB: the HOST slab's pre-faulting is long enough to draw a bar (tierkv.tiers.host).
    return [sys.executable, "-m", "tierkv", "serve", "--host-bytes", "512MiB", "--gpu-bytes", "0",
            "--no-disk", "--stats-interval-s", "0", "--listen", "127.0.0.1:0",
            "--listen", f"unix://{tmp_path / name}.sock"]


def stop(process: subprocess.Popen[str]) -> None:
    assert process.stdout is not None
    ready = json.loads(process.stdout.readline())
    assert ready["ready"] is True
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


def test_start_up_progress_bars_show_on_a_terminal_only(tmp_path: Path) -> None:
    assert not show_progress(io.StringIO())
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TIERKV_", "TQDM_"))}
    piped = subprocess.Popen(serve_command(tmp_path, "piped"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    stop(piped)
    assert piped.stderr is not None
    assert "pre-faulting" not in piped.stderr.read()
    master, replica = pty.openpty()
    # A terminal of 0 columns (a fresh pty's size) gets no bar from tqdm at all.
    fcntl.ioctl(replica, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    seen: list[bytes] = []

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the process closed its end
                return
            if not chunk:
                return
            seen.append(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    on_terminal = subprocess.Popen(serve_command(tmp_path, "tty"), stdout=subprocess.PIPE,
                                   stderr=replica, text=True, env=env)
    os.close(replica)
    try:
        stop(on_terminal)
        reader.join(timeout=60)
    finally:
        os.close(master)
    assert b"pre-faulting host slab" in b"".join(seen)
