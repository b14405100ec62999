"""Structured logs: one line per event an operator acts on, as JSON or as text.

An *event* is a log record with a name (``start``, ``ready``, ``recovery``, ``shutdown``,
``stopped``, ``stats``, ``eviction_storm``, ``eviction_storm_end``, ``disk_error``,
``auth_failure``) and fields; ``log_event`` writes one. Records without a name (every other
``log.info``) are written too, with the event ``log``.

Formats (``setup_logging``):

* ``json``: one JSON object per line: ``ts`` (ISO 8601, UTC, milliseconds), ``level``,
  ``logger``, ``event``, ``message``, then the event's fields (a field named like one of those
  five is written as ``field_<name>``), and ``exception`` when there is one.
* ``text``: ``<ts> <LEVEL> <logger> <event>: <message> key=value ...``; a value with spaces,
  quotes or ``=`` is JSON-quoted.

Decisions:
1. No event is ever logged once per block or per call: what can repeat on a hot path (a bad
   token, a failing disk) goes through a ``Throttle``, which lets one line through per interval
   and counts the rest into the next line.
2. This module imports nothing of tierkv, so every layer (tiers, store, server, CLI) may use it.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
PLAIN_EVENT = "log"
"""The ``event`` of a record logged without one."""

_RESERVED = frozenset({"ts", "level", "logger", "event", "message", "exception"})


def log_event(logger: logging.Logger, level: int, event: str, message: str, /, **fields: Any) -> None:
    """Log ``message`` as the event ``event`` with ``fields`` (JSON-serialisable values; others
    are written with ``str``)."""
    logger.log(level, message, extra={"event": event, "fields": fields})


def event_of(record: logging.LogRecord) -> str:
    """The event name of ``record`` (``PLAIN_EVENT`` when it was logged without one)."""
    event = getattr(record, "event", None)
    return event if isinstance(event, str) else PLAIN_EVENT


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The fields of ``record``'s event (empty for a plain record)."""
    fields = getattr(record, "fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


def _timestamp(created: float) -> str:
    moment = datetime.fromtimestamp(created, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _plain(value: Any) -> Any:
    # json.dumps would write NaN/Infinity, which is not JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "event": event_of(record),
            "message": record.getMessage(),
        }
        for key, value in fields_of(record).items():
            data[f"field_{key}" if key in _RESERVED else key] = _plain(value)
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str, ensure_ascii=False)


def _text_value(value: Any) -> str:
    if isinstance(value, str):
        plain = value and not any(c.isspace() or c in '"=' for c in value)
        return value if plain else json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool | int | float) or value is None:
        return json.dumps(_plain(value))
    return json.dumps(value, default=str, ensure_ascii=False, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """``<ts> <LEVEL> <logger> <event>: <message> key=value ...`` on one line (an exception's
    traceback follows on its own lines)."""

    def format(self, record: logging.LogRecord) -> str:
        head = f"{_timestamp(record.created)} {record.levelname} {record.name}"
        event = event_of(record)
        line = f"{head} {event}: {record.getMessage()}" if event != PLAIN_EVENT else (
            f"{head}: {record.getMessage()}"
        )
        pairs = " ".join(f"{key}={_text_value(value)}" for key, value in fields_of(record).items())
        if pairs:
            line = f"{line} {pairs}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


class _TierKVHandler(logging.StreamHandler[TextIO]):
    """Marks the handler ``setup_logging`` installed, so that a second call replaces it."""


def setup_logging(level: str | int, log_format: str, stream: TextIO | None = None) -> None:
    """Send every record at ``level`` or above to ``stream`` (default: stderr) in ``log_format``
    (``"json"`` or ``"text"``), through one handler on the root logger. Calling it again replaces
    that handler (other handlers are left alone). ``ValueError`` on an unknown format or level."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    numeric = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _TierKVHandler)]:
        root.removeHandler(handler)
    handler = _TierKVHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(numeric)


class Throttle:
    """At most one log line per ``interval_s`` for something that may repeat on a hot path.

    ``admit()`` is called on every occurrence. It returns how many occurrences the line to log
    now stands for (this one and every one suppressed since the last line), or 0 when this one
    is to be counted, not logged. The first occurrence is always logged. Thread-safe; ``clock``
    is injectable for tests.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_s: float | None = None
        self._num_pending = 0

    def admit(self) -> int:
        """Count one occurrence; the number to report if a line is due now, else 0."""
        with self._lock:
            self._num_pending += 1
            now_s = self._clock()
            if self._last_s is not None and now_s - self._last_s < self.interval_s:
                return 0
            self._last_s = now_s
            num_occurrences, self._num_pending = self._num_pending, 0
            return num_occurrences
