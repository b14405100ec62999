"""Helpers of the test suite, not tests: the tiny layouts and blocks, fakes, harnesses of real
servers and of Redis, and the scripts tests start as child processes.

Tests import them by package path (``from tests.support.fake_clock import FakeClock``); pytest
puts the checkout on ``sys.path`` because ``tests`` is a package. A helper a test starts as a
process runs as a module, ``python -m tests.support.<name>`` (``helper_command``), with the
checkout first on the child's ``PYTHONPATH`` (``child_env``), wherever pytest was started from.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The checkout: the folder that holds ``tests/``, ``tierkv/``, ``deploy/`` and ``scripts/``."""


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the checkout first on PYTHONPATH, so
    that a child imports ``tests.support`` and this checkout's ``tierkv``."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), out.get("PYTHONPATH")]))
    return out


def helper_command(name: str, *args: str) -> list[str]:
    """The command line of the helper module ``tests.support.<name>`` run as a script (run it
    with ``env=child_env()``)."""
    return [sys.executable, "-m", f"tests.support.{name}", *args]
