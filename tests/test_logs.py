"""Structured logs: the JSON and text formats, the throttle that keeps hot paths to one line per
interval, and the events a real ``tierkv serve`` writes: start, recovery, ready, auth_failure,
shutdown, stopped; disk_error from the disk tier; eviction_storm from the serve loop's watch.

A JSON line stays one valid line whatever a record holds, a text line does not lose its record
either, the throttle counts every occurrence under threads, and the eviction-storm watch neither
flaps nor takes a gap between samples for a storm.
"""

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
from tierkv.config import DiskTierConfig, MiB, Tier
from tierkv.errors import DiskFullError
from tierkv.logs import JsonFormatter, TextFormatter, Throttle, event_of, fields_of, log_event, setup_logging
from tierkv.service.auth import AUTH_FAILURE_LOG_INTERVAL_S, Authenticator
from tierkv.store import StoreStats
from tierkv.tiers.disk import DiskTier, DiskWrite
from tierkv.types import TierStats
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


# --- formats -----------------------------------------------------------------------------------


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


# --- auth failures -----------------------------------------------------------------------------


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


# --- disk errors -------------------------------------------------------------------------------


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


# --- eviction storms ---------------------------------------------------------------------------


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


# --- a real `tierkv serve` ---------------------------------------------------------------------


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


# --- hostile records, threads, and the storm watch at its edges --------------------------------


# A logger of its own, outside logging's tree: pytest's capture handlers, which raise where
# logging would not, never see its records.
log = logging.Logger("tierkv.review", logging.DEBUG)


@pytest.fixture
def logged(capsys: pytest.CaptureFixture[str]) -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """(json stream, text stream): every record of ``log`` goes to both formatters."""
    as_json, as_text = io.StringIO(), io.StringIO()
    handlers = [logging.StreamHandler(as_json), logging.StreamHandler(as_text)]
    handlers[0].setFormatter(JsonFormatter())
    handlers[1].setFormatter(TextFormatter())
    for handler in handlers:
        log.addHandler(handler)
    yield as_json, as_text
    for handler in handlers:
        log.removeHandler(handler)
    assert "Logging error" not in capsys.readouterr().err  # no record failed to format


def strict_json(line: str) -> dict[str, Any]:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} is not JSON")

    value = json.loads(line, parse_constant=refuse)
    assert isinstance(value, dict)
    return value


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for this one")

    __repr__ = __str__


def _cycle() -> list[Any]:
    items: list[Any] = []
    items.append(items)
    return items


HOSTILE_FIELDS: dict[str, Any] = {
    "tuple_keys": {(1, 2): 3, None: "none"},
    "nested_nan": [float("nan"), {"x": float("-inf")}],
    "cycle": _cycle(),
    "unprintable": Unprintable(),
    "raw": b"\xff\x00\n",
    "a_set": {1},
    "text": 'line one\nline "two"\r\n\x00\u2028',
}


@pytest.mark.parametrize("name", sorted(HOSTILE_FIELDS))
def test_any_field_is_one_valid_json_line_and_never_loses_the_record(
    logged: tuple[io.StringIO, io.StringIO], name: str,
) -> None:
    """Non-text keys, cycles and a failing __str__ made json.dumps raise: the record was
    lost and logging wrote a traceback on stderr; a NaN in a list was written as NaN."""
    as_json, as_text = logged
    log_event(log, logging.WARNING, "odd", "odd\nfield",
              **{name: HOSTILE_FIELDS[name]}, ts="a field named like a key")
    (line,) = as_json.getvalue().splitlines()
    record = strict_json(line)
    assert record["event"] == "odd" and record["message"] == "odd\nfield"
    assert name in record and record["field_ts"] == "a field named like a key"
    assert f" {name}=" in as_text.getvalue()


def test_a_text_line_stays_one_line_and_carries_no_terminal_escape(
    logged: tuple[io.StringIO, io.StringIO],
) -> None:
    """A client's model id (any 256 characters) reaches log messages and fields: the text
    format wrote it raw, so a newline forged a second line and an escape moved the cursor."""
    _, as_text = logged
    hostile = "m\x1b[2J\nforged line\u2028\x85\x7f"
    log_event(log, logging.WARNING, "odd", f"model {hostile}", model=hostile, plain=hostile[:1])
    (line,) = as_text.getvalue().splitlines()
    assert line.isprintable()
    assert "\\x1b[2J" in line and "\\n" in line and "plain=m" in line


def test_a_format_that_does_not_fit_its_arguments_is_still_one_line(
    logged: tuple[io.StringIO, io.StringIO],
) -> None:
    as_json, as_text = logged
    log.error("%d blocks", "many")
    (line,) = as_json.getvalue().splitlines()
    message = strict_json(line)["message"]
    assert message.startswith("%d blocks") and "many" in message
    assert "%d blocks" in as_text.getvalue()


def test_tracebacks_and_stacks_stay_inside_the_json_line(
    logged: tuple[io.StringIO, io.StringIO],
) -> None:
    as_json, _ = logged
    try:
        raise ValueError("first line\nsecond line")
    except ValueError:
        log.exception("failed\nbadly", extra={"event": "boom", "fields": {"n": 1}})
    log.warning("where", stack_info=True)
    failed, where = (strict_json(line) for line in as_json.getvalue().splitlines())
    assert failed["event"] == "boom" and failed["n"] == 1
    assert "ValueError: first line\nsecond line" in failed["exception"]
    assert "test_tracebacks_and_stacks_stay_inside_the_json_line" in where["stack"]


def test_every_occurrence_is_counted_once_by_the_throttle_under_threads() -> None:
    throttle = Throttle(3600.0)
    reported: list[int] = []
    lock = threading.Lock()

    def hammer() -> None:
        for _ in range(2000):
            count = throttle.admit()
            if count:
                with lock:
                    reported.append(count)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert reported == [1]  # the first line only, within the interval
    clock = iter([0.0, 1.0, 2.0, 10.0, 10.5, 25.0])
    timed = Throttle(10.0, lambda: next(clock))
    assert [timed.admit() for _ in range(6)] == [1, 0, 0, 3, 0, 2]


# --- eviction storms ---------------------------------------------------------------------------


def _stats(evictions: int, num_blocks: int = 8) -> StoreStats:
    host = TierStats(Tier.HOST, 8 * 4096, num_blocks * 4096, num_blocks, 0, 0, evictions, 0, 0)
    return StoreStats({Tier.HOST: host}, 1, 0, 0, 0, 0, 0, 0, 0, {}, 0, 0, 0)


def _storm_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, dict[str, Any]]]:
    return [(event_of(r), fields_of(r)) for r in caplog.records
            if event_of(r).startswith("eviction_storm")]


def test_a_storm_that_flickers_for_an_hour_is_two_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    watch = EvictionStormWatch(window_s=10.0, quiet_s=60.0, min_evictions=100)
    evictions = 0
    for second in range(3600):
        if (second // 20) % 2 == 0:  # 20 s hot, 20 s calm, for an hour
            evictions += 50
        watch.observe(float(second), _stats(evictions))
    for second in range(3600, 3700):  # then calm for good
        watch.observe(float(second), _stats(evictions))
    lines = _storm_lines(caplog)
    assert [event for event, _ in lines] == ["eviction_storm", "eviction_storm_end"]
    assert evictions - 100 <= lines[1][1]["num_evictions"] <= evictions


def test_a_gap_between_samples_is_not_taken_for_a_storm(caplog: pytest.LogCaptureFixture) -> None:
    """1,000 evictions over 300 s (3.3 a second, under the 10 a second of 100 in 10 s) were
    compared against a window of 10 s when the next sample came 300 s late."""
    caplog.set_level(logging.INFO)
    watch = EvictionStormWatch(window_s=10.0, quiet_s=60.0, min_evictions=100)
    watch.observe(0.0, _stats(0))
    watch.observe(300.0, _stats(1000))
    assert _storm_lines(caplog) == []
    watch.observe(301.0, _stats(1200))  # 200 in one second: that is a storm
    assert [event for event, _ in _storm_lines(caplog)] == ["eviction_storm"]
