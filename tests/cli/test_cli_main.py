"""The ``tierkv`` entry point: ``tierkv health`` (a container's health check, every few seconds)
and ``import tierkv`` import neither torch nor the client (each command imports its own module
only, and the package's names load on first use); Ctrl-C is one line and exit 130."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tierkv
from tests.support.harness import INTERRUPTIBLE


def _modules_after(code: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return set(done.stdout.split())


def test_tierkv_health_imports_neither_torch_nor_the_client() -> None:
    loaded = _modules_after(
        "from tierkv.cli.main import main\n"
        "assert main(['health', '--target', 'unix:///nonexistent/t.sock', '--timeout-s', '0.1',"
        " '--quiet']) == 1"
    )
    assert "tierkv.cli.health_cmd" in loaded
    assert "torch" not in loaded and "tierkv.client" not in loaded


def test_importing_the_package_loads_its_names_on_first_use() -> None:
    loaded = _modules_after("import tierkv")
    assert "torch" not in loaded
    loaded = _modules_after("import tierkv\ntierkv.Client")
    assert "torch" in loaded and "tierkv.client" in loaded
    assert set(tierkv.__all__) <= set(dir(tierkv))
    for name in tierkv.__all__:
        assert getattr(tierkv, name) is not None


def test_every_command_is_listed_and_reachable() -> None:
    from tierkv.cli.main import COMMANDS, build_parser

    everything = build_parser().format_help()
    for command in COMMANDS:
        assert command in everything
        assert f"{{{command}}}" in build_parser(command).format_help()


def test_ctrl_c_during_a_command_is_one_line_and_exit_130(tmp_path: Path) -> None:
    # A big store being inspected, interrupted: no traceback.
    code = INTERRUPTIBLE + (
        "import signal, threading\n"
        "from tierkv.cli.main import main\n"
        "from tierkv.cli import inspect_cmd\n"
        "def slow(*args, **kwargs):\n"
        "    signal.raise_signal(signal.SIGINT)\n"
        "inspect_cmd.inspect_disk = slow\n"
        f"raise SystemExit(main(['inspect', '--disk-path', {str(tmp_path)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 130
    assert done.stderr.strip() == "tierkv inspect: interrupted"
