"""Structured logs: one line per event an operator acts on, as JSON or as text.
``log_event`` writes a named event with fields, ``setup_logging`` picks the format, and
``Throttle`` keeps hot-path events to one line per interval. Imports nothing of tierkv.
Design: docs/design/operations.md#logs
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

_RESERVED = frozenset({"ts", "level", "logger", "event", "message", "exception", "stack"})


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


_MAX_DEPTH = 8
"""How deep a field's containers are written; deeper ones (a cycle) are written with ``str``."""


def _safe_str(value: Any) -> str:
    try:
        return str(value)
    except Exception:  # a field's own __str__ failed: the line is still written
        return f"<{type(value).__name__} that cannot be written>"


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as what ``json.dumps`` writes as JSON, whatever it holds: a float that is not
    finite as text (json.dumps would write NaN, which is not JSON), a mapping with text keys,
    a tuple or set as a list, anything else as ``str`` (a cycle too, past ``_MAX_DEPTH``)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth < _MAX_DEPTH and isinstance(value, dict):
        return {key if isinstance(key, str) else _safe_str(key): _plain(item, depth + 1)
                for key, item in value.items()}
    if depth < _MAX_DEPTH and isinstance(value, list | tuple | set | frozenset):
        return [_plain(item, depth + 1) for item in value]
    return _safe_str(value)


def message_of(record: logging.LogRecord) -> str:
    """``record``'s message; for a call whose arguments do not fit its format (``log.info("%d",
    "x")``), the format and the arguments as they are, rather than a lost record and a
    traceback on stderr between the log lines."""
    try:
        return record.getMessage()
    except Exception as exc:  # the caller's format string, not ours: keep the record
        return f"{_safe_str(record.msg)} (arguments {_safe_str(record.args)}: {exc})"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (see the module docstring), whatever the record
    holds: fields that JSON cannot write are written as text, never lost."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "event": event_of(record),
            "message": message_of(record),
        }
        for key, value in fields_of(record).items():
            data[f"field_{key}" if key in _RESERVED else key] = _plain(value)
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            data["stack"] = self.formatStack(record.stack_info)
        return _one_line(json.dumps(data, ensure_ascii=False, allow_nan=False))


# Line breaks to str.splitlines and to JavaScript that JSON leaves raw inside its strings: a
# reader that splits on them would cut the record. (json.dumps escapes every C0 control.)
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_LINE_BREAK_TABLE = str.maketrans(_LINE_BREAKS)


def _one_line(text: str) -> str:
    return text.translate(_LINE_BREAK_TABLE)


def _printable(text: str) -> str:
    """``text`` with every character that is not printable (line breaks, terminal escapes,
    U+2028...) written as a Python escape: a text line stays one line, and a client's model id
    cannot move an operator's cursor."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _text_value(value: Any) -> str:
    if isinstance(value, str):
        plain = value and not any(c.isspace() or c in '"=' for c in value)
        return _printable(value if plain else json.dumps(value, ensure_ascii=False))
    if isinstance(value, bool | int | float) or value is None:
        return json.dumps(_plain(value))
    return _printable(json.dumps(_plain(value), ensure_ascii=False, separators=(",", ":")))


class TextFormatter(logging.Formatter):
    """``<ts> <LEVEL> <logger> <event>: <message> key=value ...`` on one line, whatever the
    message and values hold (unprintable characters are escaped); an exception's traceback
    follows on its own lines."""

    def format(self, record: logging.LogRecord) -> str:
        head = f"{_timestamp(record.created)} {record.levelname} {record.name}"
        event = event_of(record)
        message = _printable(message_of(record))
        line = f"{head} {event}: {message}" if event != PLAIN_EVENT else f"{head}: {message}"
        pairs = " ".join(f"{key}={_text_value(value)}" for key, value in fields_of(record).items())
        if pairs:
            line = f"{line} {pairs}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        if record.stack_info:
            line = f"{line}\n{self.formatStack(record.stack_info)}"
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
