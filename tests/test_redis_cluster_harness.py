"""The Redis harness (``redis_cluster``, ``scripts/redis-cluster``) against real redis-server
processes: clusters form whole, keys land where ``node_of_key`` says, a killed node fails only its
own keys and comes back on restart, and nothing keeps running after a ``with`` block."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from tests.support.redis_cluster import RedisCluster, RedisServer, StallingListener, free_ports

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "redis-cluster"
_KEYS = [f"block-{i}".encode() for i in range(48)]
# redis-py retries 10 times with backoff by default, which stretches an error (a timeout, a refused
# password) to seconds: these checks want the first answer.
_NO_RETRY = Retry(NoBackoff(), 0)


def _servers_under(path: Path) -> list[int]:
    """The pids of running redis-servers whose folder is under ``path`` (a zombie has none)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().strip() == "redis-server" \
                    and Path(os.readlink(proc / "cwd")).is_relative_to(path):
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile, or a zombie
            continue
    return pids


@pytest.fixture(autouse=True)
def _no_server_survives(tmp_path: Path) -> Iterator[None]:
    """Every test leaves no redis-server running from its tmp_path (those found are killed)."""
    yield
    leaked = _servers_under(tmp_path)
    for pid in leaked:
        os.kill(pid, signal.SIGKILL)
    assert leaked == [], "redis-server processes survived the test"


def _assert_nothing_listens(ports: list[int]) -> None:
    """Every port refuses connections: the servers on them are gone."""
    for port in ports:
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass


def _slot_owner_port(client: redis.Redis, slot: int) -> int:
    """The port of the master serving ``slot``, by that node's ``CLUSTER SLOTS``."""
    for first, last, owner, *_ in client.execute_command("CLUSTER SLOTS"):
        if first <= slot <= last:
            return int(owner[1])
    raise AssertionError(f"slot {slot} unassigned")


def test_free_ports_are_distinct_and_leave_room_for_the_bus() -> None:
    ports = free_ports(20)
    assert len(set(ports)) == 20
    assert all(1024 <= port < 55535 for port in ports)


def test_cluster_forms_with_every_slot_on_every_node(tmp_path: Path) -> None:
    with RedisCluster(tmp_path) as cluster:
        assert cluster.url == "redis://" + ",".join(f"127.0.0.1:{port}" for port in cluster.ports)
        for index in range(3):
            with cluster.node_client(index) as node:
                info = node.execute_command("CLUSTER INFO")
            assert info["cluster_state"] == "ok"
            assert info["cluster_slots_assigned"] == "16384"
            assert info["cluster_known_nodes"] == "3"
            assert info["cluster_size"] == "3"  # masters serving slots
    _assert_nothing_listens(cluster.ports)


def test_keys_spread_over_the_nodes_that_node_of_key_names(tmp_path: Path) -> None:
    with RedisCluster(tmp_path) as cluster, cluster.client() as client:
        for key in _KEYS:
            client.set(key, b"value of " + key)
        owners = {key: cluster.node_of_key(key) for key in _KEYS}
        assert set(owners.values()) == {0, 1, 2}
        with cluster.node_client(0) as node:
            for key, index in owners.items():
                slot = node.execute_command("CLUSTER KEYSLOT", key)
                assert slot == key_slot(key)
                assert _slot_owner_port(node, slot) == cluster.ports[index]
        for key, index in owners.items():  # each key is stored on that node itself
            with cluster.node_client(index) as owner:
                assert owner.get(key) == b"value of " + key


def test_a_killed_node_fails_its_keys_only_until_restarted(tmp_path: Path) -> None:
    with RedisCluster(tmp_path) as cluster, cluster.client() as client:
        for key in _KEYS:
            client.set(key, b"v")
        owners = {key: cluster.node_of_key(key) for key in _KEYS}
        dead_key = _KEYS[0]
        dead = owners[dead_key]
        cluster.kill_node(dead)
        _assert_nothing_listens([cluster.ports[dead]])

        # The port refuses at once, so even the client's retries end fast (~25 ms measured).
        started = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            client.get(dead_key)
        assert time.monotonic() - started < 5
        for key, index in owners.items():
            if index != dead:
                with cluster.node_client(index) as node:
                    assert node.get(key) == b"v"
        assert cluster.node_of_key(dead_key) == dead  # the others still map its slots to it

        cluster.restart_node(dead)
        assert client.get(dead_key) is None  # back, and empty: nothing is persisted
        client.set(dead_key, b"again")
        assert client.get(dead_key) == b"again"
        with cluster.node_client(dead) as node:
            assert node.execute_command("CLUSTER INFO")["cluster_state"] == "ok"
    _assert_nothing_listens(cluster.ports)


def test_a_one_node_cluster_with_a_password(tmp_path: Path) -> None:
    with RedisCluster(tmp_path, 1, ["--requirepass", "s3cret", "--maxmemory", "64mb"]) as cluster:
        assert cluster.url == f"redis://127.0.0.1:{cluster.ports[0]}"
        with cluster.client() as client:
            client.set(b"a", b"1")
            client.set(b"b", b"2")  # another slot, same node
            assert client.mget([b"a"]) == [b"1"]
        with cluster.node_client(0) as node:
            assert node.execute_command("CLUSTER INFO")["cluster_slots_assigned"] == "16384"
            assert node.config_get("maxmemory")["maxmemory"] == str(64 << 20)
            assert node.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        with pytest.raises(redis.AuthenticationError), \
                cluster.node_client(0, password=None, retry=_NO_RETRY) as anonymous:
            anonymous.get(b"a")
    _assert_nothing_listens(cluster.ports)


def test_the_script_fails_on_a_taken_port_and_leaves_nothing_running(tmp_path: Path) -> None:
    ports = free_ports(3)
    with socket.create_server(("127.0.0.1", ports[1])):
        result = subprocess.run([str(_SCRIPT), str(tmp_path), *map(str, ports)], capture_output=True,
                                text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert result.stdout == ""
    assert "Address already in use" in result.stderr  # the log's tail
    _assert_nothing_listens([ports[0], ports[2]])
    stop = subprocess.run([str(_SCRIPT), "--stop", str(tmp_path / "nothing")], timeout=10, check=False)
    assert stop.returncode == 0


def test_a_stalling_listener_makes_reads_time_out() -> None:
    with StallingListener() as listener:
        client = redis.Redis(port=listener.port, socket_timeout=0.3, retry=_NO_RETRY)
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            client.ping()
        assert time.monotonic() - started < 1.0
        assert listener.num_accepted == 1
        assert listener.url == f"redis://127.0.0.1:{listener.port}"
        client.close()


def test_a_single_server_with_a_password(tmp_path: Path) -> None:
    with RedisServer(tmp_path, ["--requirepass", "s3cret"]) as server:
        assert server.url == f"redis://127.0.0.1:{server.port}"
        with server.client() as client:
            assert client.set(b"k", b"v")
            assert client.get(b"k") == b"v"
            assert client.info("server")["redis_mode"] == "standalone"
        with pytest.raises(redis.AuthenticationError), \
                server.client(password=None, retry=_NO_RETRY) as anonymous:
            anonymous.ping()
        with redis.Redis.from_url(server.url, password="s3cret") as by_url:
            assert by_url.get(b"k") == b"v"
    _assert_nothing_listens([server.port])
