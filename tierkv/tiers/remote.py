"""The REMOTE tier: block records in a Redis Cluster (or one Redis server) shared by every node.
It only moves bytes (the disk tier's records, whole); whether one is intact is the store's
business. Every node is asked at once under one deadline, a failing node's keys are misses behind
its breaker, and nothing here raises to the caller.
Design: docs/design/remote.md#the-tier
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tierkv.config import RemoteEndpoint, RemoteTierConfig
from tierkv.logs import Throttle, log_event
from tierkv.tiers.remote_keys import (
    BULK_BYTES,
    BULK_HEAD,
    KEY_PREFIX,
    NUM_SLOTS,
    block_keys,
    raw_block_keys,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

ERROR_LOG_INTERVAL_S = 10.0
_EXISTS_SCRIPT = b"""#!lua flags=no-writes,allow-cross-slot-keys
local out = {}
for i = 1, #ARGV do
  if redis.call('EXISTS', ARGV[i]) == 1 then out[i] = '1' else out[i] = '0' end
end
return table.concat(out)
"""
# Redis errors that mean "this node cannot be used now" (others are answers: counted, logged).
_NODE_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
# Answers that mean the slot map is stale or the cluster is changing: re-read it.
_STALE_MAP = (redis.exceptions.MovedError, redis.exceptions.AskError,
              redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError)


def _names_another_node(exc: Exception) -> bool:
    """A script's reply that a key is not this node's: the slot map is stale."""
    return isinstance(exc, redis.ResponseError) and "non local key" in str(exc)


def _cannot_script(exc: redis.ResponseError) -> bool:
    """Whether ``exc`` says the node will never run the lookup script for us: the ACL forbids
    it, or scripting is unknown or off (any other error reply may pass)."""
    text = str(exc).lower()
    return isinstance(exc, redis.exceptions.NoPermissionError) or "unknown command" in text \
        or "noperm" in text or "disabled" in text


@dataclass(slots=True)
class RemoteCounters:
    """What the tier did since start (owned here; the store's stats copy them)."""

    num_errors: int = 0
    """Node calls that failed or timed out (each opens that node's breaker)."""
    num_skipped: int = 0
    """Keys answered as missing without a call because their node's breaker was open."""
    bytes_read: int = 0
    bytes_written: int = 0


class _Node:
    """One Redis server: its client and its breaker (decision 3)."""

    def __init__(self, endpoint: RemoteEndpoint, client: redis.Redis) -> None:
        self.endpoint = endpoint
        self.client = client
        self.open_until_s = 0.0
        self.exists_by_script = True

    @property
    def is_open(self) -> bool:
        return time.monotonic() < self.open_until_s


class RemoteTier:
    """Records in Redis under ``remote_key``; every method answers within about ``timeout_s``
    and never raises for a Redis that is down, slow or partly down (misses instead)."""

    def __init__(self, config: RemoteTierConfig) -> None:
        self.config = config
        self.counters = RemoteCounters()
        self._lock = threading.Lock()
        self._nodes: dict[RemoteEndpoint, _Node] = {}
        # The slot map: node index per slot (-1: no owner), into ``_owners``.
        self._owners: list[_Node] = []
        self._slot_owner = np.full(NUM_SLOTS, -1, np.int32)
        self._connected = threading.Event()
        self._closed = threading.Event()
        self._refresh = threading.Event()
        self._wake = threading.Event()  # set to make the watcher run now (and at close)
        self._errors = Throttle(ERROR_LOG_INTERVAL_S)
        self._calls = ThreadPoolExecutor(32, "tierkv-remote")
        self._script_sha = hashlib.sha1(_EXISTS_SCRIPT).hexdigest()
        # Connecting can stall (a listener that never answers): never in the caller's thread.
        self._watcher = threading.Thread(target=self._watch, name="tierkv-remote-watch", daemon=True)
        self._watcher.start()

    # --- topology -------------------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        """Whether the slot map (or the single server) is known."""
        return self._connected.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait until the first connection is made (tests and benches); False on timeout."""
        return self._connected.wait(timeout_s)

    def _client(self, endpoint: RemoteEndpoint) -> redis.Redis:
        config = self.config
        options: dict[str, object] = {}
        if config.tls:
            options = {"ssl": True, "ssl_ca_certs": _text(config.tls_ca_path),
                       "ssl_certfile": _text(config.tls_cert_path),
                       "ssl_keyfile": _text(config.tls_key_path)}
        return redis.Redis(
            host=endpoint.host, port=endpoint.port, username=config.username,
            password=config.password, socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s, retry=Retry(NoBackoff(), 0),
            health_check_interval=0, **options,  # type: ignore[arg-type]
        )

    def _node(self, endpoint: RemoteEndpoint) -> _Node:
        with self._lock:
            node = self._nodes.get(endpoint)
            if node is None:
                node = self._nodes[endpoint] = _Node(endpoint, self._client(endpoint))
            return node

    def _discover(self) -> bool:
        """Read the slot map from any reachable seed or known node; True when it is known."""
        candidates = list(self.config.endpoints) + [e for e in list(self._nodes)
                                                    if e not in self.config.endpoints]
        for endpoint in candidates:
            if self._closed.is_set():
                return False
            node = self._node(endpoint)
            try:
                info = node.client.info("cluster")
                if not info.get("cluster_enabled"):  # one server holds every slot
                    with self._lock:
                        self._owners = [node]
                        self._slot_owner = np.zeros(NUM_SLOTS, np.int32)
                    node.open_until_s = 0.0
                    return True
                slots = node.client.execute_command("CLUSTER SLOTS")  # type: ignore[no-untyped-call]
            except Exception as exc:  # anything: this thread must live (a close mid-connect
                # raises ValueError from the closed socket)
                if self._closed.is_set():
                    return False
                self._note_error(node, "discover", exc)
                continue
            owners: list[_Node] = []
            table = np.full(NUM_SLOTS, -1, np.int32)
            for entry in slots:
                start, end, primary = int(entry[0]), int(entry[1]), entry[2]
                host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
                owner = self._node(RemoteEndpoint(host or endpoint.host, int(primary[1])))
                if owner not in owners:
                    owners.append(owner)
                table[start : end + 1] = owners.index(owner)
            with self._lock:
                self._owners, self._slot_owner = owners, table
            return True
        return False

    def _watch(self) -> None:
        """Connect, then probe open breakers and re-read the slot map when asked (decision 3)."""
        interval_s = min(self.config.breaker_cooldown_s, 1.0)
        while not self._closed.is_set():
            try:
                if not self._connected.is_set() or self._refresh.is_set():
                    self._refresh.clear()
                    if self._discover():
                        self._connected.set()
                for node in list(self._nodes.values()):
                    # A shunned node keeps its whole cooldown: one that answers PING at once
                    # but a call slowly would otherwise be let back within a second, and each
                    # late call holds a pool thread until its socket times out.
                    if node.open_until_s and not node.is_open:
                        self._probe(node)
            except Exception:  # a bug must not end the probes: the breakers would stay open
                log.exception("the remote tier's watcher failed; retrying")
            self._wake.wait(interval_s)
            self._wake.clear()

    def _probe(self, node: _Node) -> None:
        try:
            node.client.ping()
        except Exception:  # down, stalled, or closed under us
            node.open_until_s = time.monotonic() + self.config.breaker_cooldown_s
            return
        if node.open_until_s:
            log_event(log, logging.INFO, "remote_node_back",
                      f"remote node {node.endpoint.label} answers again", node=node.endpoint.label)
        node.open_until_s = 0.0
        self._refresh.set()  # it may have come back with other slots

    def _note_error(self, node: _Node, op: str, exc: BaseException, shun: bool = True) -> None:
        """Count and log (throttled) a failed call; ``shun``: open the node's breaker (it is
        down or slow; an error reply, such as NOPERM or OOM, says the node works)."""
        if shun:
            node.open_until_s = time.monotonic() + self.config.breaker_cooldown_s
        with self._lock:
            self.counters.num_errors += 1
        num_errors = self._errors.admit()
        if num_errors:
            outcome = (f"its keys are misses for {self.config.breaker_cooldown_s:.1f} s" if shun
                       else "the node is still used")
            log_event(log, logging.WARNING, "remote_error",
                      f"remote {op} on {node.endpoint.label} failed ({num_errors} errors since the "
                      f"last line): {exc}; {outcome}",
                      node=node.endpoint.label, count=num_errors)

    def _failed(self, node: _Node, op: str, exc: Exception) -> None:
        if isinstance(exc, _STALE_MAP) or _names_another_node(exc):
            # The node answers, but the slot map changed (a reshard, a failover): read it
            # again; its keys are misses until then, the node is not shunned.
            with self._lock:
                self.counters.num_errors += 1
            self._refresh.set()
            self._wake.set()
            return
        # An error reply is an answer: the node is up (only its calls' keys are misses).
        self._note_error(node, op, exc, shun=not isinstance(exc, redis.ResponseError))

    def _group(self, slots: np.ndarray) -> dict[_Node, np.ndarray]:
        """Indices of keys (by their ``slots``) by the node serving them; keys of open breakers
        and of slots without an owner are left out (and counted as skipped)."""
        with self._lock:
            owners, slot_owner = self._owners, self._slot_owner
        if not len(slots) or not owners:
            self._count_skipped(len(slots))
            return {}
        by_key = slot_owner[slots]
        groups: dict[_Node, np.ndarray] = {}
        now = time.monotonic()
        num_skipped = int(np.count_nonzero(by_key < 0))
        for number, node in enumerate(owners):
            indices = np.flatnonzero(by_key == number)
            if not len(indices):
                continue
            if node.open_until_s > now:
                num_skipped += len(indices)
            else:
                groups[node] = indices
        self._count_skipped(num_skipped)
        return groups

    def _count_skipped(self, count: int) -> None:
        if count:
            with self._lock:
                self.counters.num_skipped += count

    def _run(self, groups: dict[_Node, np.ndarray], op: str,
             call: Callable[[_Node, np.ndarray], T], bounded: bool = True) -> dict[_Node, T]:
        """``call`` for each node's indices at once, under one deadline (``bounded``; else
        each call is bounded by its socket timeouts only); the results of the nodes that
        answered in time (the others' breakers are opened)."""
        if not groups:
            return {}
        # Even one node's call runs on the pool: a node that answers slowly but steadily
        # never trips a socket timeout, and only the deadline below bounds the caller's wait.
        try:
            futures = {self._calls.submit(call, node, indices): node
                       for node, indices in groups.items()}
        except RuntimeError:  # closed: a miss, as for a node that is down
            return {}
        # A transfer's own time on top of the stall budget: a full fetch at ~1 GB/s.
        budget_s = self.config.timeout_s + self.config.max_fetch_bytes / 1e9
        done, late = wait(futures, timeout=budget_s if bounded else None)
        results: dict[_Node, T] = {}
        for future in done:
            node = futures[future]
            try:
                results[node] = future.result()
            except Exception as exc:  # nothing here raises to the caller (decision 3)
                self._failed(node, op, exc)
        for future in late:
            self._note_error(futures[future], op, TimeoutError("no answer in time"))
        return results

    # --- the tier's operations ------------------------------------------------------------

    def get(self, raw_keys: Sequence[bytes]) -> list[bytes | None]:
        """The value under each block key, or None (missing, node down or slow)."""
        keys, slots = raw_block_keys(raw_keys)
        groups = self._group(slots)

        def fetch(node: _Node, indices: np.ndarray) -> list[object]:
            pipe = node.client.pipeline(transaction=False)
            for i in indices:
                pipe.get(keys[i].tobytes())
            return list(pipe.execute())

        values: list[bytes | None] = [None] * len(raw_keys)
        num_bytes = 0
        for node, fetched in self._run(groups, "get", fetch).items():
            for i, value in zip(groups[node].tolist(), fetched, strict=True):
                if isinstance(value, bytes):
                    values[i] = value
                    num_bytes += len(value)
        with self._lock:
            self.counters.bytes_read += num_bytes
        return values

    def put(self, items: Sequence[tuple[bytes, bytes | bytearray]],
            ttls_s: Sequence[int] | None = None) -> np.ndarray:
        """Store each ``(raw key, record)`` with its TTL in ``ttls_s`` (0: none; not given:
        the configured TTL for all); whether each was stored, as a bool array."""
        keys, slots = raw_block_keys([raw for raw, _ in items])
        groups = self._group(slots)
        expiries = [self.config.ttl_s or None] * len(items) if ttls_s is None else [
            ttl_s or None for ttl_s in ttls_s]

        def store(node: _Node, indices: np.ndarray) -> list[bool]:
            pipe = node.client.pipeline(transaction=False)
            for i in indices:
                pipe.set(keys[i].tobytes(), items[i][1], ex=expiries[i])
            return [bool(answer) for answer in pipe.execute()]

        stored = np.zeros(len(items), bool)
        for node, answers in self._run(groups, "set", store).items():
            stored[groups[node]] = answers
        num_bytes = sum(len(items[i][1]) for i in np.flatnonzero(stored).tolist())
        with self._lock:
            self.counters.bytes_written += num_bytes
        return stored

    def exists(self, raw_keys: Sequence[bytes]) -> np.ndarray:
        """Whether each block key is held, as a bool array (False also for a node that is down
        or slow)."""
        return self._exists_keys(*raw_block_keys(raw_keys))

    def exists_in(self, namespace_id: bytes, hashes: Sequence[bytes]) -> np.ndarray:
        """``exists`` of one namespace's block hashes (without joining id and hash first)."""
        return self._exists_keys(*block_keys(namespace_id, hashes))

    def _exists_keys(self, keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        found = np.zeros(len(keys), bool)
        groups = self._group(slots)
        if not groups:
            return found
        # Every key as a RESP bulk string, so that a node's part of a call is one gather.
        bulk = np.empty((len(keys), BULK_BYTES), np.uint8)
        bulk[:, : len(BULK_HEAD)] = np.frombuffer(BULK_HEAD, np.uint8)
        bulk[:, len(BULK_HEAD) : -2] = keys
        bulk[:, -2:] = np.frombuffer(b"\r\n", np.uint8)
        answers = self._run(groups, "exists", lambda node, idx: self._exists(node, bulk, idx))
        for node, answer in answers.items():
            found[groups[node]] = answer
        return found

    def _exists(self, node: _Node, bulk: np.ndarray, indices: np.ndarray) -> np.ndarray:
        if node.exists_by_script:
            try:
                try:
                    bits = self._evalsha_exists(node, bulk, indices)
                except redis.exceptions.NoScriptError:  # each node caches scripts on its own
                    node.client.script_load(_EXISTS_SCRIPT)
                    bits = self._evalsha_exists(node, bulk, indices)
                held: np.ndarray = np.frombuffer(bits, np.uint8) == ord("1")
                return held
            except _STALE_MAP:
                raise
            except redis.ResponseError as exc:
                if not _cannot_script(exc):
                    raise  # e.g. a key another node serves now (a reshard): counted, retried
                node.exists_by_script = False
                log.info("remote node %s cannot run the lookup script (%s); using EXISTS",
                         node.endpoint.label, exc)
        pipe = node.client.pipeline(transaction=False)
        for i in indices:
            pipe.exists(bulk[i, len(BULK_HEAD) : -2].tobytes())
        return np.array([bool(answer) for answer in pipe.execute()], bool)

    def _evalsha_exists(self, node: _Node, bulk: np.ndarray, indices: np.ndarray) -> bytes:
        """The lookup script's answer for the keys of ``bulk`` at ``indices``, the command packed
        by one gather: redis-py packs an argument at a time in Python (~0.5 us each)."""
        head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n0\r\n" % (
            len(indices) + 3, self._script_sha.encode())
        pool = node.client.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_packed_command([head, bulk[indices].tobytes()])  # type: ignore[no-untyped-call]
            answer = connection.read_response()
        except _NODE_ERRORS:
            connection.disconnect()  # type: ignore[no-untyped-call]
            raise
        finally:
            pool.release(connection)
        if isinstance(answer, redis.ResponseError):
            raise answer
        if not isinstance(answer, bytes) or len(answer) != len(indices):
            raise redis.ResponseError(f"unexpected lookup script answer {answer!r:.80}")
        return answer

    def delete(self, raw_keys: Sequence[bytes]) -> int:
        """Delete block keys; how many existed."""
        keys, slots = raw_block_keys(raw_keys)
        groups = self._group(slots)

        def remove(node: _Node, indices: np.ndarray) -> int:
            pipe = node.client.pipeline(transaction=False)
            for i in indices:
                pipe.unlink(keys[i].tobytes())
            return sum(int(answer) for answer in pipe.execute())

        return sum(self._run(groups, "del", remove).values())

    def delete_namespace(self, namespace_id: bytes) -> list[bytes]:
        """Delete every key of ``namespace_id`` on every master (``SCAN`` + ``UNLINK``: an
        operator's clear, O(keys) on each node); the block hashes deleted. Nodes that fail are
        skipped (counted as errors)."""

        def unlink(node: _Node, keys: list[bytes]) -> list[bytes]:
            # One key a command: a cluster refuses a multi-key UNLINK across slots.
            pipe = node.client.pipeline(transaction=False)
            for key in keys:
                pipe.unlink(key)
            return [_hash_of(key) for key, answer in zip(keys, pipe.execute(), strict=True)
                    if int(answer)]

        return self._scan_namespace(namespace_id, "clear", unlink)

    def hashes_in(self, namespace_id: bytes) -> list[bytes]:
        """The block hashes held under ``namespace_id`` on every master now (``SCAN``: O(keys)
        on each node; a key may be named twice; nodes that fail are skipped, counted)."""
        return self._scan_namespace(namespace_id, "scan",
                                    lambda _, keys: [_hash_of(key) for key in keys])

    def _scan_namespace(self, namespace_id: bytes, op: str,
                        handle: Callable[[_Node, list[bytes]], list[bytes]]) -> list[bytes]:
        with self._lock:
            owners = list(self._owners)
        pattern = b"%s{*}:%s:*" % (KEY_PREFIX, namespace_id.hex().encode())

        def scan(node: _Node, _: np.ndarray) -> list[bytes]:
            found: list[bytes] = []
            batch: list[bytes] = []
            for key in node.client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    found += handle(node, batch)
                    batch = []
            return found + (handle(node, batch) if batch else [])

        now = time.monotonic()
        groups = {node: np.empty(0, np.int64) for node in owners if node.open_until_s <= now}
        return [block_hash for hashes in self._run(groups, op, scan, bounded=False).values()
                for block_hash in hashes]

    def counters_snapshot(self) -> RemoteCounters:
        """A copy of the counters."""
        with self._lock:
            c = self.counters
            return RemoteCounters(c.num_errors, c.num_skipped, c.bytes_read, c.bytes_written)

    def close(self) -> None:
        """Stop the watcher and close every connection (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        self._calls.shutdown(wait=False, cancel_futures=True)
        for node in list(self._nodes.values()):
            node.client.close()


def _hash_of(key: bytes) -> bytes:
    """The block hash a REMOTE key names (see ``remote_keys``)."""
    return bytes.fromhex(key[-2 * 32:].decode())


def _text(path: object) -> str | None:
    return None if path is None else str(path)
