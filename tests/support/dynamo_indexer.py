"""NVIDIA Dynamo's standalone KV indexer (``ai-dynamo-runtime`` 1.6.1, ``python -m dynamo.indexer``)
as a subprocess, so that tests can check tierkv's vLLM-format KV events against a real router.

* ``dynamo_python()``: the python of a test-only venv holding ``ai-dynamo-runtime==1.6.1``, built
  once at test time by ``python -m venv`` and ``pip install`` (pip's own configuration and index)
  under ``platformdirs.user_cache_path("tierkv") / "dynamo-1.6.1"`` (``TIERKV_DYNAMO_VENV``
  overrides it), and reused while its marker file is there. Not the project's venv: the package
  pins pydantic <= 2.13.5, below what vLLM uses there. Linux only (PyPI has no other wheel). If
  pip fails the test skips with pip's last lines, or fails where ``TIERKV_REQUIRE_DYNAMO=1`` (CI).
* ``DynamoIndexer``: one indexer on a free port (``DYN_LOG=info``, its log in a file), with
  ``register``/``unregister``/``query``/``workers`` over its HTTP API; ``query`` answers a
  ``Match`` per instance with the tokens matched in each tier.
* ``dynamo_indexer``: a module-scoped fixture yielding a started indexer; each test registers
  instance ids of its own (``next_instance_id()``).
* ``wait_for``: polling, since events are applied asynchronously (a publisher flushes every
  50 ms, Dynamo applies on its own tasks).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import pytest
from platformdirs import user_cache_path

VERSION = "1.6.1"
PACKAGE = f"ai-dynamo-runtime=={VERSION}"
MARKER = "tierkv-installed"  # written into the venv once pip succeeded; its text is PACKAGE
INSTALL_TIMEOUT_S = 900.0
START_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 10.0
# PyPI's wheels of 1.6.1: manylinux_2_28 x86_64 and aarch64 (cp310-abi3), nothing else.
WHEEL_MACHINES = ("x86_64", "aarch64")

T = TypeVar("T")


class DynamoError(RuntimeError):
    """The indexer answered something other than what the call expects, or did not start."""


# --------------------------------------------------------------------------------------- the venv


def venv_dir() -> Path:
    return Path(os.environ.get("TIERKV_DYNAMO_VENV") or user_cache_path("tierkv") / f"dynamo-{VERSION}")


def dynamo_python() -> Path:
    """``bin/python`` of the venv holding ``ai-dynamo-runtime==1.6.1``, built if it is not there
    yet (about 75 MB from PyPI, 275 MB installed). Skips (or, with ``TIERKV_REQUIRE_DYNAMO=1``,
    fails) the calling test where it cannot be built.

    The venv is built under a temporary name and renamed, so its scripts' shebangs name the
    temporary path: run its python (``python -m pip``, ``python -m dynamo.indexer``), never
    ``bin/pip``."""
    if sys.platform != "linux" or platform.machine() not in WHEEL_MACHINES:
        pytest.skip(f"{PACKAGE} has no wheel for {sys.platform} {platform.machine()} (Linux "
                    f"{'/'.join(WHEEL_MACHINES)} only)")
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
    reason = f"{PACKAGE} not installable ({what}):\n{tail}"
    if os.environ.get("TIERKV_REQUIRE_DYNAMO") == "1":
        pytest.fail(reason + "\n(TIERKV_REQUIRE_DYNAMO=1: no skipping)", pytrace=False)
    pytest.skip(reason)


# ------------------------------------------------------------------------------------ the indexer


@dataclass(frozen=True)
class Match:
    """One instance's answer to a query, in tokens: ``gpu``, ``cpu`` and ``disk`` are the
    tokens matched *in* that tier (Dynamo's answer is cumulative: its ``cpu`` is GPU + CPU, its
    ``disk`` GPU + CPU + disk; these are the differences). ``longest_matched`` is Dynamo's own
    figure, the whole prefix matched over every tier."""

    longest_matched: int
    gpu: int
    cpu: int
    disk: int


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class DynamoIndexer:
    """``python -m dynamo.indexer --port <free> --threads <threads>`` (``--threads 1``: the
    single-threaded ``KvIndexer``; more: its thread pool), started by the constructor and ready
    (``GET /health`` answered 200) when it returns. Its stdout and stderr go to
    ``workdir/dynamo-indexer.log``. ``close`` (or leaving ``with``) stops it."""

    def __init__(self, workdir: Path, python: Path | None = None, threads: int = 1,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.python = python or dynamo_python()
        self.workdir = workdir
        self.log_path = workdir / "dynamo-indexer.log"
        self._ids = itertools.count(1)
        self._proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "DYN_LOG": "info"}  # logs in colour (NO_COLOR is ignored): log_text strips it
        for _ in range(3):  # a free port can be taken between free_port() and the bind
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            with self.log_path.open("ab") as log:
                self._proc = subprocess.Popen(
                    [str(self.python), "-m", "dynamo.indexer", "--port", str(self.port),
                     "--threads", str(threads)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True)
            if self._wait_healthy(start_timeout_s):
                return
            if "in use" not in self.log_text():
                break
        self.close()
        raise DynamoError(f"the indexer did not answer /health within {start_timeout_s} s\n"
                          f"{self.log_tail()}")

    def _wait_healthy(self, timeout_s: float) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            with contextlib.suppress(OSError):
                status, _ = self._request("GET", "/health", timeout_s=1.0)
                if status == 200:
                    return True
            time.sleep(0.05)
        return False

    # ----------------------------------------------------------------------------------- HTTP

    def _request(self, method: str, path: str, body: object = None,
                 timeout_s: float = HTTP_TIMEOUT_S) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                status: int = response.status
                return status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def _call(self, method: str, path: str, body: object, expect: int) -> Any:
        status, answer = self._request(method, path, body)
        if status != expect:
            raise DynamoError(f"{method} {path} {json.dumps(body)[:300]}: {status} "
                              f"{answer.decode(errors='replace')[:500]} (expected {expect})")
        return json.loads(answer) if answer else None

    def next_instance_id(self) -> int:
        """An instance id no earlier call on this indexer returned (1, 2, ...)."""
        return next(self._ids)

    def register(self, instance_id: int, endpoint: str, model_name: str, block_size: int,
                 replay_endpoint: str | None = None, dp_rank: int | None = None,
                 routing_group: str | None = None) -> None:
        """``POST /register``: listen to ``endpoint`` (a vLLM-format PUB socket) as this
        (instance, dp_rank) of ``model_name``; gaps are replayed from ``replay_endpoint`` (a
        ROUTER). 201 or ``DynamoError`` (409: the pair has an endpoint, the instance another
        model, or the model another block size)."""
        body: dict[str, object] = {"instance_id": instance_id, "endpoint": endpoint,
                                   "model_name": model_name, "block_size": block_size}
        for key, value in (("replay_endpoint", replay_endpoint), ("dp_rank", dp_rank),
                           ("routing_group", routing_group)):
            if value is not None:
                body[key] = value
        self._call("POST", "/register", body, 201)

    def unregister(self, instance_id: int, model_name: str, dp_rank: int | None = None,
                   routing_group: str | None = None) -> None:
        """``POST /unregister``: the instance's listeners and its blocks in the index go. With
        ``dp_rank``, that rank only (1.6.1 honours ``dp_rank`` only with a routing group, so
        ``"default"`` is sent for it). 200 or ``DynamoError`` (404: not registered)."""
        body: dict[str, object] = {"instance_id": instance_id, "model_name": model_name}
        if dp_rank is not None:
            body["dp_rank"] = dp_rank
            body["routing_group"] = routing_group or "default"
        elif routing_group is not None:
            body["routing_group"] = routing_group
        self._call("POST", "/unregister", body, 200)

    def query(self, token_ids: Sequence[int], model_name: str, lora_name: str | None = None,
              cache_salt: str | None = None, routing_group: str | None = None) -> dict[int, Match]:
        """``POST /query``: the prefix of ``token_ids`` each instance holds, by instance id; an
        instance that matches nothing is absent. ``DynamoError`` where the model has no
        registered instance (404)."""
        body: dict[str, object] = {"token_ids": list(token_ids), "model_name": model_name}
        for key, value in (("lora_name", lora_name), ("cache_salt", cache_salt),
                           ("routing_group", routing_group)):
            if value is not None:
                body[key] = value
        answer = self._call("POST", "/query", body, 200)
        matches: dict[int, Match] = {}
        for instance, counts in answer["instances"].items():
            gpu, cpu, disk = counts["gpu"], counts["cpu"], counts["disk"]
            matches[int(instance)] = Match(counts["longest_matched"], gpu, cpu - gpu, disk - cpu)
        return matches

    def match(self, instance_id: int, token_ids: Sequence[int], model_name: str,
              lora_name: str | None = None) -> Match | None:
        """``query``'s answer for one instance (None: it matches nothing)."""
        return self.query(token_ids, model_name, lora_name).get(instance_id)

    def wait_matched(self, instance_id: int, token_ids: Sequence[int], model_name: str,
                     tokens: int, lora_name: str | None = None, timeout_s: float = 10.0) -> Match | None:
        """Poll until the instance's ``longest_matched`` for ``token_ids`` is ``tokens`` (0: no
        match), and return its match; ``AssertionError`` with the log's tail otherwise."""
        last: list[Match | None] = [None]

        def reached() -> bool:
            last[0] = self.match(instance_id, token_ids, model_name, lora_name)
            return (last[0].longest_matched if last[0] else 0) == tokens

        wait_for(reached, timeout_s, what=lambda: f"waiting for instance {instance_id} to match "
                 f"{tokens} tokens; it matched {last[0]}\n{self.log_tail()}")
        return last[0]

    def workers(self) -> list[dict[str, Any]]:
        """``GET /workers``: per instance its ``model_name``, ``block_size``, ``endpoints`` and
        ``listeners`` (by dp_rank: ``{"endpoint", "status"}``)."""
        workers: list[dict[str, Any]] = self._call("GET", "/workers", None, 200)
        return workers

    def wait_active(self, instance_id: int, dp_rank: int = 0, timeout_s: float = 10.0,
                    settle_s: float = 0.5) -> None:
        """Poll ``/workers`` until the instance's listener for ``dp_rank`` is ``active``, then
        sleep ``settle_s``: "active" means its SUB socket exists, not that a publisher has seen
        its subscription (ZMQ's slow joiner: a PUB drops what it sends before that)."""

        def active() -> bool:
            for worker in self.workers():
                if worker["instance_id"] == instance_id:
                    listener = worker.get("listeners", {}).get(str(dp_rank), {})
                    return bool(listener.get("status") == "active")
            return False

        wait_for(active, timeout_s, what=lambda: f"instance {instance_id} dp_rank {dp_rank}: "
                 f"{self.workers()}\n{self.log_tail()}")
        time.sleep(settle_s)

    # ------------------------------------------------------------------------------ the process

    def log_text(self) -> str:
        """The indexer's log so far (colour codes removed)."""
        try:
            return _ANSI.sub("", self.log_path.read_text(errors="replace"))
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def close(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)

    def __enter__(self) -> DynamoIndexer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@pytest.fixture(scope="module")
def dynamo_indexer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoIndexer]:
    """A started indexer (``--threads 1``) for the module; tests register their own instance
    ids (``next_instance_id()``), and model names, to keep out of each other's way."""
    with DynamoIndexer(tmp_path_factory.mktemp("dynamo")) as indexer:
        yield indexer
