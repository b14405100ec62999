"""NVIDIA Dynamo's standalone KV indexer (``ai-dynamo-runtime`` 1.6.1, ``python -m dynamo.indexer``)
for the tests, which check tierkv's vLLM-format KV events against a real router. The indexer
itself is the package's ``tierkv.bench.dynamo_indexer.DynamoIndexer`` (re-exported here, with
``Match``, ``DynamoError`` and ``free_port``); this module adds what only tests need:

* ``dynamo_python()``: the python of a test-only venv holding ``ai-dynamo-runtime==1.6.1``, built
  once at test time by ``python -m venv`` and ``pip install`` (pip's own configuration and index)
  under ``platformdirs.user_cache_path("tierkv") / "dynamo-1.6.1"`` (``TIERKV_DYNAMO_VENV``
  overrides it), and reused while its marker file is there. Not the project's venv: the package
  pins pydantic <= 2.13.5, below what vLLM uses there. Linux only (PyPI has no other wheel). Where
  it cannot be built the test fails, with pip's last lines: never a silent skip.
* ``dynamo_indexer``: a module-scoped fixture yielding a started indexer of that venv; each test
  registers instance ids of its own (``next_instance_id()``).
* ``wait_for``: polling with ``AssertionError``, since events are applied asynchronously (a
  publisher flushes every 50 ms, Dynamo applies on its own tasks).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from platformdirs import user_cache_path

from tierkv.bench.dynamo_indexer import DynamoError, DynamoIndexer, Match, free_port

__all__ = ["DynamoError", "DynamoIndexer", "Match", "dynamo_indexer", "dynamo_python", "free_port",
           "venv_dir", "wait_for"]

VERSION = "1.6.1"
PACKAGE = f"ai-dynamo-runtime=={VERSION}"
MARKER = "tierkv-installed"  # written into the venv once pip succeeded; its text is PACKAGE
INSTALL_TIMEOUT_S = 900.0
# PyPI's wheels of 1.6.1: manylinux_2_28 x86_64 and aarch64 (cp310-abi3), nothing else.
WHEEL_MACHINES = ("x86_64", "aarch64")

T = TypeVar("T")


# --------------------------------------------------------------------------------------- the venv


def venv_dir() -> Path:
    return Path(os.environ.get("TIERKV_DYNAMO_VENV") or user_cache_path("tierkv") / f"dynamo-{VERSION}")


def dynamo_python() -> Path:
    """``bin/python`` of the venv holding ``ai-dynamo-runtime==1.6.1``, built if it is not there
    yet (about 75 MB from PyPI, 275 MB installed). Fails the calling test, with the reason,
    where it cannot be built.

    The venv is built under a temporary name and renamed, so its scripts' shebangs name the
    temporary path: run its python (``python -m pip``, ``python -m dynamo.indexer``), never
    ``bin/pip``."""
    if sys.platform != "linux" or platform.machine() not in WHEEL_MACHINES:
        pytest.fail(f"{PACKAGE} has no wheel for {sys.platform} {platform.machine()} (Linux "
                    f"{'/'.join(WHEEL_MACHINES)} only)", pytrace=False)
    root = venv_dir()
    python = root / "bin" / "python"
    if _installed(root):
        return python
    root.parent.mkdir(parents=True, exist_ok=True)
    with _locked(root.parent / f"{root.name}.lock"):
        if _installed(root):  # another process built it while this one waited
            return python
        _build(root)
    return python


def _installed(root: Path) -> bool:
    marker = root / MARKER
    return marker.is_file() and marker.read_text().strip() == PACKAGE


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _build(root: Path) -> None:
    partial = Path(tempfile.mkdtemp(prefix=f"{root.name}.partial-", dir=root.parent))
    partial.chmod(0o755)  # mkdtemp's 0700 would keep other users out of a shared cache
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        steps = (
            [sys.executable, "-m", "venv", str(partial)],
            [str(partial / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
             PACKAGE],
        )
        for command in steps:
            try:
                done = subprocess.run(command, capture_output=True, text=True, env=env, check=False,
                                      timeout=INSTALL_TIMEOUT_S)
            except subprocess.TimeoutExpired as timeout:
                _unavailable(f"{' '.join(command[1:4])} ran over {INSTALL_TIMEOUT_S:.0f} s",
                             str(timeout.stderr or ""))
            if done.returncode != 0:
                _unavailable(f"{' '.join(command[1:4])} exited {done.returncode}",
                             done.stderr or done.stdout)
        (partial / MARKER).write_text(PACKAGE + "\n")
        shutil.rmtree(root, ignore_errors=True)  # a folder left without its marker
        partial.rename(root)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _unavailable(what: str, output: str) -> None:
    tail = "\n".join(output.strip().splitlines()[-12:])
    pytest.fail(f"{PACKAGE} not installable ({what}):\n{tail}", pytrace=False)


# ------------------------------------------------------------------------------ the indexer's use


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, interval_s: float = 0.05,
             what: str | Callable[[], str] = "") -> T:
    """Call ``predicate`` until it returns something truthy, and return that; after
    ``timeout_s`` raise ``AssertionError`` with the last value and ``what`` (text, or a function
    giving it, such as an indexer's ``log_tail``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = what() if callable(what) else what
            raise AssertionError(f"not true within {timeout_s} s (last: {value!r}) {detail}".rstrip())
        time.sleep(interval_s)


@pytest.fixture(scope="module")
def dynamo_indexer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoIndexer]:
    """A started indexer (``--threads 1``) for the module; tests register their own instance
    ids (``next_instance_id()``), and model names, to keep out of each other's way."""
    with DynamoIndexer(dynamo_python(), tmp_path_factory.mktemp("dynamo")) as indexer:
        yield indexer
