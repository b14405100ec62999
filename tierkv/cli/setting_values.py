"""One value of a ``tierkv serve`` setting: its kind, and its conversions from a TOML file,
from the environment or a flag, and back to TOML (``--print-config``).

The schema itself (``SETTINGS``) and the resolution of the sources are in
``tierkv.cli.settings``. A conversion that fails raises ``BadValueError``, which says what is
wrong with the value only: the caller knows the setting and the source and names both.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from tierkv.errors import ConfigError
from tierkv.sizes import parse_size


class Kind(enum.Enum):
    """The type of a setting's value (after resolution)."""

    SIZE = "size"  # int bytes; written "8GiB", "1.5GB" or a number of bytes
    INT = "int"
    FLOAT = "float"
    BOOL = "bool"
    STR = "str"
    CHOICE = "choice"  # str, one of ``Setting.choices``
    LIST = "list"  # tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting. ``default`` is the resolved value's type (a size in bytes, a list as a
    tuple), or None when it is computed at start as ``computed`` says. A ``CHOICE`` is one of
    ``choices`` (in any case when ``fold_case``; it is then lower-cased). ``metavar`` names the
    flag's argument in ``--help`` (default: from the kind)."""

    name: str
    kind: Kind
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    computed: str = ""
    fold_case: bool = False
    metavar: str = ""

    @property
    def flag(self) -> str:
        """``--host-bytes`` for ``host_bytes``."""
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """``TIERKV_HOST_BYTES`` for ``host_bytes``."""
        return "TIERKV_" + self.name.upper()



class BadValueError(Exception):
    """What is wrong with one value; the caller adds the setting and the source."""


_TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "a table"}


def _toml_type(value: object) -> str:
    for kind, text in _TOML_TYPES.items():
        if type(value) is kind:
            return text
    return type(value).__name__


MAX_SIZE_BYTES = (1 << 63) - 1
"""The largest size a setting takes: larger ones overflowed deep in the tiers (a traceback, not
an error naming the setting)."""


def _size(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise BadValueError(f"a size is a string such as \"8GiB\" or an integer of bytes, "
                       f"not {_toml_type(value)}")
    try:
        num_bytes = parse_size(value)
    except ConfigError:
        raise BadValueError("not a size; use a number with an optional unit such as 512MiB, 8GiB "
                       "or 1.5GB") from None
    if num_bytes > MAX_SIZE_BYTES:
        raise BadValueError(f"too large: at most {MAX_SIZE_BYTES} bytes (8EiB)")
    return num_bytes


def check_text(value: str, setting: Setting) -> str:
    """``value`` as text of ``setting`` (a ``CHOICE`` checked, case folded if it says so)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes in the environment (surrogateescape)
        raise BadValueError("not valid UTF-8 text") from None
    if setting.kind is Kind.CHOICE:
        folded = value.lower() if setting.fold_case else value
        if folded not in setting.choices:
            choices = ", ".join(f'"{choice}"' for choice in setting.choices)
            raise BadValueError(f"must be one of {choices} (see {setting.flag} in tierkv serve --help)")
        return folded
    return value


def from_toml(setting: Setting, value: object) -> Any:
    """``value`` as read from a TOML file, as ``setting``'s type; ``BadValueError`` if it is not."""
    kind = setting.kind
    if kind is Kind.SIZE:
        return _size(value)
    expected: dict[Kind, tuple[type, ...]] = {
        Kind.INT: (int,), Kind.FLOAT: (int, float), Kind.BOOL: (bool,), Kind.STR: (str,),
        Kind.CHOICE: (str,), Kind.LIST: (list,),
    }
    # A TOML boolean is a Python int: only a BOOL setting takes one.
    if not isinstance(value, expected[kind]) or (kind is not Kind.BOOL and isinstance(value, bool)):
        name = {Kind.INT: "an integer", Kind.FLOAT: "a number", Kind.BOOL: "a boolean",
                Kind.LIST: "an array of strings"}.get(kind, "a string")
        raise BadValueError(f"{name} is expected, not {_toml_type(value)}")
    if isinstance(value, int | float) and kind is Kind.FLOAT:
        try:
            return _finite(float(value))
        except OverflowError:  # a TOML integer of more than 308 digits
            raise BadValueError("not a finite number") from None
    if isinstance(value, list):
        if not all(isinstance(item, str) for item in value):
            raise BadValueError("an array of strings is expected")
        return tuple(check_text(item, setting) for item in value)
    if isinstance(value, str):
        return check_text(value, setting)
    return value


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise BadValueError("not a finite number")
    return value


_TRUE = frozenset({"1", "true", "yes"})
_FALSE = frozenset({"0", "false", "no"})


def from_text(setting: Setting, text: str) -> Any:
    """``text`` from the environment or a flag as ``setting``'s type; ``BadValueError`` if it is not
    one (a list is comma-separated here)."""
    kind = setting.kind
    try:
        if kind is Kind.SIZE:
            return _size(text)
        if kind is Kind.INT:
            return int(text.strip())
        if kind is Kind.FLOAT:
            return _finite(float(text.strip()))
    except ValueError:
        raise BadValueError(f"not {'an integer' if kind is Kind.INT else 'a number'}") from None
    if kind is Kind.BOOL:
        folded = text.strip().lower()
        if folded not in _TRUE | _FALSE:
            raise BadValueError("a boolean is 1, 0, true, false, yes or no")
        return folded in _TRUE
    if kind is Kind.LIST:
        return tuple(check_text(item.strip(), setting) for item in text.split(",") if item.strip())
    return check_text(text, setting)


def toml_value(value: Any) -> str:
    """``value`` (a str, int, float, bool or a sequence of str) as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f'"{value}"'
    if isinstance(value, str):
        return toml_string(value)
    return "[" + ", ".join(toml_string(str(item)) for item in value) + "]"


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
            "\r": "\\r"}


def toml_string(text: str) -> str:
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def setting_value(setting: Setting, value: Any) -> str:
    """``value`` of ``setting`` as a TOML literal; a size of whole KiB/MiB/GiB/TiB is written
    with its unit (``"8GiB"``)."""
    if setting.kind is Kind.SIZE and isinstance(value, int) and value > 0:
        for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % factor == 0:
                return f'"{value // factor}{unit}"'
    return toml_value(value)

