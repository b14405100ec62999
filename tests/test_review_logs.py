"""Attacks on the structured logs (a review's tests): a JSON line must stay one valid line
whatever a record holds, a text line must not lose its record either, the throttle must count
every occurrence under threads, and the eviction-storm watch must neither flap nor take a gap
between samples for a storm.
"""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tierkv.cli.serve_cmd import EvictionStormWatch
from tierkv.config import Tier
from tierkv.logs import JsonFormatter, TextFormatter, Throttle, event_of, fields_of, log_event
from tierkv.store import StoreStats
from tierkv.types import TierStats

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


# --- eviction storms ------------------------------------------------------------------------


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
