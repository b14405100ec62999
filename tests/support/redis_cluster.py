"""The harness for real Redis servers: a cluster, a single server, and a listener that never answers.

All bind 127.0.0.1 only, and a ``with`` block stops them, also when it raises. Nothing is persisted."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.crc import key_slot
from redis.retry import Retry

from tests.support import REPO
from tierkv.bench.servers import free_cluster_ports
from tierkv.config import RemoteTierConfig
from tierkv.store import TieredStore

_SCRIPTS = REPO / "scripts"
_CLUSTER_SCRIPT = _SCRIPTS / "redis-cluster"
_SERVER_SCRIPT = _SCRIPTS / "redis-server"
_START_TIMEOUT_S = 60.0  # the first start may install redis-server with apt-get
_PING_TIMEOUT_S = 15.0
_BUS_OFFSET = 10000  # a cluster node also listens on port + 10000 (the cluster bus)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now, each with port + 10000 free as well (a cluster
    node's bus): the bench's own search. Free now only: another process may take one before it
    is used."""
    return free_cluster_ports(n)


def _options(password: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Client options: bytes replies, a 5 s socket timeout, the password; ``kwargs`` win."""
    return {"password": password, "decode_responses": False, "socket_timeout": 5.0, **kwargs}


def _probe() -> dict[str, Any]:
    """Options of the harness's own clients: no retries (redis-py retries 10 times, with backoff)."""
    return {"retry": Retry(NoBackoff(), 0), "socket_timeout": 2.0, "socket_connect_timeout": 2.0}


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a redis-server that runs or may still hold its ports. Nothing need reap a
    daemon, so a zombie counts as gone, but only once its last thread is: the leader turns zombie first."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return status.startswith("Name:\tredis-server\n") and (
        "\nState:\tZ" not in status or "\nThreads:\t1\n" not in status)


def _wait_ping(client: redis.Redis, what: str, alive: Callable[[], bool], timeout_s: float) -> None:
    """Wait until ``client`` answers PING; RuntimeError once ``alive()`` is false, or on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
            if client.ping():
                return
        if not alive():
            raise RuntimeError(f"{what} exited before it answered PING")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer PING in {timeout_s:.0f} s")
        time.sleep(0.05)


class _Server:
    """``with`` starts it and stops it at the end, also when the body raises."""

    start: Callable[[], None]
    stop: Callable[[], None]

    def __init__(self, work_dir: Path, extra_args: Sequence[str]) -> None:
        self.work_dir = Path(work_dir)
        self.extra_args = args = list(extra_args)
        # The value after the last --requirepass: every client here authenticates with it.
        passwords = [args[i + 1] for i in range(len(args) - 1) if args[i] == "--requirepass"]
        self.password = passwords[-1] if passwords else None
        self.url = ""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class RedisCluster(_Server):
    """A Redis Cluster of ``num_masters`` masters, no replicas, on free loopback ports; each node runs
    daemonized from ``work_dir/<port>/`` with ``extra_args`` (``--requirepass PASS`` makes every client
    here authenticate). Full slot coverage is not required and reads are served while the cluster is
    down, so with a node dead the others keep serving their slots.

    ``ports`` are chosen at construction; ``url`` (``redis://127.0.0.1:P1,127.0.0.1:P2,...``) is set by
    ``start()``. A node's index is its position in ``ports``."""

    def __init__(self, work_dir: Path, num_masters: int = 3, extra_args: Sequence[str] = ()) -> None:
        super().__init__(work_dir, extra_args)
        self.ports: list[int] = free_ports(num_masters)

    def start(self) -> None:
        """Start every node and form the cluster; returns once every node sees all 16384 slots assigned
        and ``cluster_state:ok``, else RuntimeError with the script's stderr (the script stopped its
        nodes). Ports taken meanwhile are chosen afresh, twice at most."""
        for attempt in range(3):
            command = [str(_CLUSTER_SCRIPT), str(self.work_dir), *map(str, self.ports), "--",
                       *self.extra_args]
            try:
                result = subprocess.run(command, capture_output=True, text=True, check=False,
                                        timeout=_START_TIMEOUT_S, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired as error:
                self.stop()  # the nodes are daemons: the script's end does not end them
                raise RuntimeError(f"scripts/redis-cluster timed out:\n{error.stderr!r}") from None
            if result.returncode == 0:
                self.url = result.stdout.strip().splitlines()[-1]
                return
            if "Address already in use" not in result.stderr or attempt == 2:
                raise RuntimeError(f"scripts/redis-cluster failed ({result.returncode}):\n{result.stderr}")
            self.ports = free_ports(len(self.ports))

    def stop(self) -> None:
        """Stop every node (SIGTERM, SIGKILL after 5 s); returns once none runs. Idempotent."""
        subprocess.run([str(_CLUSTER_SCRIPT), "--stop", str(self.work_dir)], timeout=60, check=True)

    def pid(self, index: int) -> int:
        """The pid in node ``index``'s pidfile (a killed node leaves its pidfile behind)."""
        return int((self.work_dir / str(self.ports[index]) / "redis.pid").read_text())

    def kill_node(self, index: int) -> None:
        """SIGKILL node ``index``; returns once the process is gone (its ports are then free)."""
        pid = self.pid(index)
        if _pid_alive(pid):  # else it is gone already, and the pid may be another program's now
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _pid_alive(pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server {pid} survived SIGKILL for 10 s")
            time.sleep(0.01)

    def restart_node(self, index: int) -> None:
        """Start node ``index`` again with the arguments the script used (its ``redis.argv``): it
        rejoins from its kept ``nodes.conf`` with the slots it had, and no keys. Returns once it
        answers PING and its own ``cluster info`` says ok (a master just started says fail ~2 s)."""
        node_dir = self.work_dir / str(self.ports[index])
        argv = (node_dir / "redis.argv").read_text().split("\0")[:-1]
        (node_dir / "redis.pid").unlink(missing_ok=True)  # so pid() never names the killed process
        subprocess.run([str(_SERVER_SCRIPT), *argv], check=True, timeout=_START_TIMEOUT_S)
        with contextlib.closing(self.node_client(index, **_probe())) as client:
            # A node that dies at once (its port taken meanwhile) shows as the timeout.
            _wait_ping(client, f"cluster node {self.ports[index]}", lambda: True, _PING_TIMEOUT_S)
            deadline = time.monotonic() + 30
            while client.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"node {self.ports[index]} not cluster_state:ok in 30 s")
                time.sleep(0.05)

    def client(self, **kwargs: Any) -> redis.RedisCluster:
        """A cluster client seeded with every node (bytes replies; ``kwargs`` go to the client)."""
        nodes = [ClusterNode("127.0.0.1", port) for port in self.ports]
        return redis.RedisCluster(startup_nodes=nodes, **_options(self.password, kwargs))

    def node_client(self, index: int, **kwargs: Any) -> redis.Redis:
        """A plain client of node ``index`` alone: it follows no redirects."""
        return redis.Redis(host="127.0.0.1", port=self.ports[index], **_options(self.password, kwargs))

    def node_of_key(self, key: bytes) -> int:
        """The index of the node serving ``key``'s slot, by ``CLUSTER SLOTS`` of the first node
        that answers (every node knows the whole map, also that of a dead node)."""
        slot = key_slot(key)
        for index in range(len(self.ports)):
            client = self.node_client(index, **_probe())
            try:
                ranges = client.execute_command("CLUSTER SLOTS")
            except (redis.ConnectionError, redis.TimeoutError):
                continue
            finally:
                client.close()
            for first, last, owner, *_replicas in ranges:
                if first <= slot <= last:
                    return self.ports.index(int(owner[1]))
            raise LookupError(f"slot {slot} is not assigned")
        raise RuntimeError("no cluster node answered CLUSTER SLOTS")


class RedisServer(_Server):
    """One non-cluster ``redis-server`` on a free loopback port, a child process of this one, with
    ``extra_args`` after the defaults; log in ``work_dir/redis.log``. ``url`` is set by ``start()``."""

    def __init__(self, work_dir: Path, extra_args: Sequence[str] = ()) -> None:
        super().__init__(work_dir, extra_args)
        self.port = free_ports(1)[0]
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server; returns once it answers PING, else RuntimeError with the log's tail."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.work_dir / "redis.log"
        command = [str(_SERVER_SCRIPT), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--protected-mode", "no", "--dir", str(self.work_dir),
                   *self.extra_args]
        with log_path.open("ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
        self._process = process
        try:
            with contextlib.closing(self.client(**_probe())) as client:
                # The whole start timeout: the script may first install redis-server.
                _wait_ping(client, f"redis-server on port {self.port}", lambda: process.poll() is None,
                           _START_TIMEOUT_S)
        except RuntimeError as error:
            self.stop()
            raise RuntimeError(f"{error}:\n{log_path.read_text(errors='replace')[-4000:]}") from None
        self.url = f"redis://127.0.0.1:{self.port}"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A client of this server (bytes replies; ``kwargs`` go to the client)."""
        return redis.Redis(host="127.0.0.1", port=self.port, **_options(self.password, kwargs))

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 5 s) and reap it. Idempotent."""
        process, self._process = self._process, None
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class StallingListener:
    """A TCP listener on 127.0.0.1 that accepts every connection and then never reads nor writes,
    keeping the sockets open until ``close()``: a remote that never answers."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}"
        self._accepted: list[socket.socket] = []  # appended by the thread alone (atomic under the GIL)
        self._thread = threading.Thread(target=self._accept_loop, name="stalling-listener", daemon=True)
        self._thread.start()

    @property
    def num_accepted(self) -> int:
        """How many connections were accepted so far."""
        return len(self._accepted)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # close() shut the listener down
                return
            self._accepted.append(conn)

    def close(self) -> None:
        """Stop accepting and close every socket. Idempotent."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (Linux)
        self._thread.join()
        self._listener.close()
        for conn in self._accepted:  # the thread has ended
            conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --- stores on a REMOTE tier -------------------------------------------------------------------

TIMEOUT_S = 5.0  # healthy Redis on a busy 2-core machine is never a miss


def remote_config(url: str, **options: object) -> RemoteTierConfig:
    """A REMOTE tier config of ``url`` with the tests' generous ``timeout_s`` by default."""
    options.setdefault("timeout_s", TIMEOUT_S)
    return RemoteTierConfig.from_url(url, **options)


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


def connected(store: TieredStore) -> TieredStore:
    """``store`` once its REMOTE tier knows the slot map: it connects in the background, and
    until then every key is a miss and every queued record is skipped."""
    def is_connected() -> bool:
        stats = store.stats().remote
        return stats is not None and stats.connected

    wait_until(is_connected, 10, "the store connects to Redis")
    return store
