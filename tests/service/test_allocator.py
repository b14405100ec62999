"""The server's malloc tuning (``tierkv.service.allocator``)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_both_thresholds_apply_on_glibc() -> None:
    # In a child process: the settings are process-wide and must not leak into the test run.
    code = "from tierkv.service.allocator import tune_for_bulk_messages as t; print(t())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"

