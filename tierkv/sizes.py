"""Human byte sizes: ``"8GiB"`` <-> 8589934592."""

from __future__ import annotations

import re
from decimal import Decimal

from tierkv.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, setting: str = "size") -> int:
    """Return the number of bytes in ``text`` (``"512MiB"``, ``"8GiB"``, ``"1.5GB"``, ``"4096"``).

    Decimal units (KB, MB, GB) are powers of 1000, binary units (KiB, MiB, GiB) powers of 1024.
    ``setting`` names the option in the error message.
    """
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{setting}: a size cannot be negative, got {text}")
        return text
    match = _SIZE_RE.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{setting}: cannot read {text!r} as a size; use a number with an optional unit "
            "such as 512MiB, 8GiB or 1.5GB"
        )
    # Decimal, not float: "9007199254740993" must stay exact.
    return int(Decimal(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(num_bytes: float) -> str:
    """Format ``num_bytes`` with a binary unit, e.g. ``1.0 GiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
