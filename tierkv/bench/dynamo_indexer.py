"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer`` of ``ai-dynamo-runtime``)
as a subprocess, driven over its HTTP API: ``tierkv bench route`` routes by it, the tests check
tierkv's vLLM-format KV events against it.

* ``DynamoIndexer(python, workdir)``: the indexer of ``python``'s venv on a free port, answering
  ``GET /health`` when the constructor returns, its log in ``workdir``; ``ConfigError`` if
  ``python`` is no file, ``ServiceUnavailableError`` (with the log's tail) if it does not start.
  ``close`` (or leaving ``with``) stops it.
* ``register``/``unregister``/``query``/``match``/``workers``: its API; ``query`` answers a
  ``Match`` per instance, in tokens per tier. ``DynamoError``: an answer other than the call's.
* ``wait_matched``/``wait_active``: polling (events are applied asynchronously);
  ``DeadlineExceededError`` with the log's tail when the wait runs out.
* ``free_port``: ``tierkv.bench.servers``'s, re-exported for the indexer's users.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from tierkv.bench.servers import free_port
from tierkv.errors import (
    ConfigError,
    DeadlineExceededError,
    ServiceUnavailableError,
    TierKVError,
)

__all__ = ["DynamoError", "DynamoIndexer", "Match", "free_port"]

START_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.05

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class DynamoError(TierKVError):
    """The indexer answered a call with another status than the call expects (a 409 on
    ``register``, a 404 on ``query``...). Not a ``ServiceUnavailableError``: the indexer is up
    and said no, so retrying the same call will not help."""


@dataclass(frozen=True, slots=True)
class Match:
    """One instance's answer to a query, in tokens: ``gpu``, ``cpu`` and ``disk`` are the
    tokens matched *in* that tier (Dynamo's answer is cumulative: its ``cpu`` is GPU + CPU, its
    ``disk`` GPU + CPU + disk; these are the differences). ``longest_matched`` is Dynamo's own
    figure, the whole prefix matched over every tier."""

    longest_matched: int
    gpu: int
    cpu: int
    disk: int


class DynamoIndexer:
    """``python -m dynamo.indexer --port <free> --threads <threads>`` (``--threads 1``: the
    single-threaded ``KvIndexer``; more: its thread pool) with ``DYN_LOG=<log_level>``, started
    by the constructor and ready (``GET /health`` answered 200) when it returns. Its stdout and
    stderr go to ``workdir/dynamo-indexer.log``."""

    def __init__(self, python: Path, workdir: Path, threads: int = 1,
                 start_timeout_s: float = START_TIMEOUT_S, log_level: str = "info") -> None:
        if not python.is_file():
            raise ConfigError(f"Dynamo's indexer: {python}: no such file (the python of a venv "
                              "with ai-dynamo-runtime installed)")
        self.python = python
        self.workdir = workdir
        self.log_path = workdir / "dynamo-indexer.log"
        self._ids = itertools.count(1)
        self._proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "DYN_LOG": log_level}  # in colour (NO_COLOR is ignored): log_text strips it
        for _ in range(3):  # a free port can be taken between free_port() and the bind
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            with self.log_path.open("ab") as log:
                self._proc = subprocess.Popen(
                    [str(python), "-m", "dynamo.indexer", "--port", str(self.port),
                     "--threads", str(threads)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True)
            if self._wait_healthy(self._proc, start_timeout_s):
                return
            if "in use" not in self.log_text():
                break
        self.close()
        raise ServiceUnavailableError(f"Dynamo's indexer did not answer /health within "
                                      f"{start_timeout_s} s\n{self.log_tail()}")

    def _wait_healthy(self, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            with contextlib.suppress(OSError):
                status, _ = self._request("GET", "/health", timeout_s=1.0)
                if status == 200:
                    return True
            time.sleep(POLL_INTERVAL_S)
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
            raise DynamoError(f"Dynamo's indexer: {method} {path} {json.dumps(body)[:300]}: "
                              f"{status} {answer.decode(errors='replace')[:500]} "
                              f"(expected {expect})")
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
            gpu, cpu, disk = int(counts["gpu"]), int(counts["cpu"]), int(counts["disk"])
            matches[int(instance)] = Match(int(counts["longest_matched"]), gpu, cpu - gpu,
                                           disk - cpu)
        return matches

    def match(self, instance_id: int, token_ids: Sequence[int], model_name: str,
              lora_name: str | None = None) -> Match | None:
        """``query``'s answer for one instance (None: it matches nothing)."""
        return self.query(token_ids, model_name, lora_name).get(instance_id)

    def workers(self) -> list[dict[str, Any]]:
        """``GET /workers``: per instance its ``model_name``, ``block_size``, ``endpoints`` and
        ``listeners`` (by dp_rank: ``{"endpoint", "status"}``)."""
        workers: list[dict[str, Any]] = self._call("GET", "/workers", None, 200)
        return workers

    # -------------------------------------------------------------------------------- polling

    def _poll(self, reached: Callable[[], bool], timeout_s: float, interval_s: float,
              what: Callable[[], str]) -> None:
        """Call ``reached`` until it is true; ``DeadlineExceededError`` after ``timeout_s``,
        with ``what()`` and the log's tail."""
        deadline = time.monotonic() + timeout_s
        while not reached():
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(f"not within {timeout_s} s: {what()}\n"
                                            f"{self.log_tail()}")
            time.sleep(interval_s)

    def wait_matched(self, instance_id: int, token_ids: Sequence[int], model_name: str,
                     tokens: int, lora_name: str | None = None, timeout_s: float = 10.0,
                     interval_s: float = POLL_INTERVAL_S) -> Match | None:
        """Poll until the instance's ``longest_matched`` for ``token_ids`` is ``tokens`` (0: no
        match), and return its match (None for 0)."""
        last: list[Match | None] = [None]

        def reached() -> bool:
            last[0] = self.match(instance_id, token_ids, model_name, lora_name)
            return (last[0].longest_matched if last[0] else 0) == tokens

        self._poll(reached, timeout_s, interval_s, lambda: (
            f"instance {instance_id} matching {tokens} tokens; it matched {last[0]}"))
        return last[0]

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

        self._poll(active, timeout_s, POLL_INTERVAL_S, lambda: (
            f"instance {instance_id} dp_rank {dp_rank} active: {self.workers()}"))
        time.sleep(settle_s)

    # ------------------------------------------------------------------------------ the process

    def log_text(self) -> str:
        """The indexer's log so far (colour codes removed)."""
        try:
            return _ANSI.sub("", self.log_path.read_text(errors="replace"))
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        """The log's last ``lines`` lines."""
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
