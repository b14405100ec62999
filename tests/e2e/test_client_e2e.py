"""The client SDK end to end, with real processes: a ``tierkv serve`` subprocess and clients in
other processes or threads.

1. Two client processes share blocks through one server (shared-memory and stream paths).
2. The server is killed with SIGKILL (idle, and in the middle of a stream of write_through puts)
   and restarted on the same disk: every acknowledged write_through block and every saved
   session is still there.
3. Sixteen concurrent clients (shared memory and stream) hammer one server with small tier
   budgets: every hit is bit-exact, the budgets hold, nothing unexpected is raised. The
   duration is ``TIERKV_E2E_SECONDS`` (default 30).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import child_env, helper_command
from tests.support.client_worker import BLOCK_BYTES as WORKER_BLOCK_BYTES
from tests.support.client_worker import block_content as worker_block_content
from tests.support.harness import Sidecar, SidecarFactory, shm_client, stream_client
from tests.support.tiny_blocks import TINY_LAYOUT, block_for, key, same_bytes
from tierkv import CapacityError, Namespace, Priority, WritePolicy, block_hashes
from tierkv.errors import ServiceUnavailableError, TierKVError

E2E_SECONDS = float(os.environ.get("TIERKV_E2E_SECONDS", "30"))
NAMESPACE = Namespace("e2e-model", TINY_LAYOUT)
WRITE_THROUGH = WritePolicy.WRITE_THROUGH


# --- 1. two client processes share blocks ------------------------------------------------------


def run_workers(*commands: list[str], timeout_s: float = 180.0) -> list[dict[str, Any]]:
    """Run ``client_worker.py`` processes concurrently; their JSON lines, in order."""
    processes = [
        subprocess.Popen(helper_command("client_worker", *command), env=child_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for command in commands
    ]
    results = []
    for command, process in zip(commands, processes, strict=True):
        try:
            out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        assert process.returncode == 0, f"{command} failed:\n{err}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def mismatched_blocks(raw: bytes, count: int) -> list[int]:
    """The blocks of a worker's OUT_FILE that are not ``block_content(i)``."""
    bad = []
    for i in range(count):
        expected = worker_block_content(i).contiguous().view(torch.uint8).numpy().tobytes()
        if raw[i * WORKER_BLOCK_BYTES : (i + 1) * WORKER_BLOCK_BYTES] != expected:
            bad.append(i)
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("path", ["shm", "stream"])
def test_two_client_processes_share_blocks_through_one_server(
    sidecar_factory: SidecarFactory, tmp_path: Path, path: str
) -> None:
    sidecar = sidecar_factory("--host-bytes", "16MiB", "--page-bytes", "16KiB",
                              "--disk-bytes", "64MiB")
    targets = {"shm": sidecar.unix_target, "stream": sidecar.tcp_target}
    other = "stream" if path == "shm" else "shm"
    count, model = 96, f"shared-{path}"
    [put] = run_workers(["put", targets[path], path, model, str(count)])
    assert put == {"uses_shared_memory": path == "shm", "count": count}
    same_out, other_out = tmp_path / "same.bin", tmp_path / "other.bin"
    same, cross = run_workers(
        ["get", targets[path], path, model, str(count), str(same_out)],
        ["get", targets[other], other, model, str(count), str(other_out)],
    )
    assert same == {"uses_shared_memory": path == "shm", "count": count}
    assert cross == {"uses_shared_memory": other == "shm", "count": count}
    for out in (same_out, other_out):
        raw = out.read_bytes()
        assert len(raw) == count * WORKER_BLOCK_BYTES
        assert mismatched_blocks(raw, count) == [], f"{out.name}: blocks differ"
    with stream_client(sidecar) as client:
        assert client.stats().num_leases == 0


# --- 2. SIGKILL and restart on the same disk ---------------------------------------------------


def content(salt: str, index: int) -> torch.Tensor:
    """The tiny block stored under ``key(index, salt)`` (derived from that key)."""
    return block_for(int.from_bytes(key(index, salt)[:4], "little"))


def contents(salt: str, indices: range) -> torch.Tensor:
    return torch.stack([content(salt, i) for i in indices])


@pytest.mark.slow
def test_write_through_blocks_and_sessions_survive_sigkill_while_idle(
    sidecar_factory: SidecarFactory, tmp_path: Path
) -> None:
    flags = ("--host-bytes", "1MiB", "--page-bytes", "256", "--disk-bytes", "64MiB",
             "--hash-seed", "e2e-seed")
    sidecar = sidecar_factory(*flags)
    token_ids = list(range(7000, 7066))  # 16 full blocks of 4 tokens, 2 tokens more
    hashes = [bytes(h) for h in block_hashes(token_ids, TINY_LAYOUT.block_size, "e2e-seed")]
    session_blocks = torch.stack([block_for(100 + i) for i in range(16)])
    other = [key(i, salt="idle-stream") for i in range(12)]
    with shm_client(sidecar) as shm, stream_client(sidecar) as stream:
        # The session's first 10 blocks write_through (half on each path), the rest write_back.
        assert shm.put(NAMESPACE, hashes[:5], session_blocks[:5], priority=Priority.SESSION,
                       write_policy=WRITE_THROUGH) == 5
        assert stream.put(NAMESPACE, hashes[5:10], session_blocks[5:10],
                          priority=Priority.SESSION, write_policy=WRITE_THROUGH) == 5
        assert shm.put(NAMESPACE, hashes[10:], session_blocks[10:]) == 6
        assert stream.put(NAMESPACE, other, contents("idle-stream", range(12)),
                          write_policy=WRITE_THROUGH) == 12
        assert shm.save_session(NAMESPACE, "chat-kill", token_ids) == 66
        assert stream.save_session(NAMESPACE, "chat-short", token_ids[:9], ttl_s=3600) == 9
        assert shm.resume_session("chat-kill").num_cached_tokens == 64
    sidecar.kill()

    restarted = sidecar_factory(*flags, disk_path=sidecar.disk_path, socket_dir=sidecar.socket_dir)
    assert restarted.ready["recovered_blocks"] >= 22
    with shm_client(restarted) as shm, stream_client(restarted) as stream:
        resumed = shm.resume_session("chat-kill")
        resumed_ns, num_cached = resumed.namespace, resumed.num_cached_tokens
        assert (resumed_ns.model_id, resumed_ns.layout) == (NAMESPACE.model_id, TINY_LAYOUT)
        assert list(resumed.token_ids) == token_ids
        assert 40 <= num_cached <= 64 and num_cached % 4 == 0  # write_back blocks may be lost
        short = stream.resume_session("chat-short")
        assert (list(short.token_ids), short.num_cached_tokens) == (token_ids[:9], 8)
        assert {s.session_id for s in stream.list_sessions()} == {"chat-kill", "chat-short"}
        for client in (shm, stream):
            got = client.get(NAMESPACE, hashes)
            assert got.shape[0] * 4 == num_cached
            assert same_bytes(got, session_blocks[: got.shape[0]])
            assert same_bytes(client.get(NAMESPACE, other), contents("idle-stream", range(12)))


@dataclass
class Writer:
    """A client thread putting write_through batches of 1-4 blocks until its first error."""

    sidecar: Sidecar
    path: str
    acked: list[tuple[int, int]] = field(default_factory=list)  # (start, count) acknowledged
    in_flight: tuple[int, int] | None = None
    error: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def salt(self) -> str:
        return f"crash-{self.path}"

    def run(self) -> None:
        client = shm_client(self.sidecar) if self.path == "shm" else stream_client(self.sidecar)
        with client:
            index = 0
            while not self.stop.is_set():
                count = 1 + len(self.acked) % 4
                self.in_flight = (index, count)
                indices = range(index, index + count)
                try:
                    client.put(NAMESPACE, [key(i, salt=self.salt) for i in indices],
                               contents(self.salt, indices), write_policy=WRITE_THROUGH)
                except BaseException as exc:
                    self.error = exc
                    return
                self.acked.append((index, count))
                index += count

    def start(self) -> Writer:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self


@pytest.mark.slow
def test_every_acknowledged_write_through_put_survives_sigkill_mid_stream(
    sidecar_factory: SidecarFactory,
) -> None:
    flags = ("--host-bytes", "64KiB", "--page-bytes", "256", "--disk-bytes", "256MiB")
    sidecar = sidecar_factory(*flags)
    writers = [Writer(sidecar, "shm").start(), Writer(sidecar, "stream").start()]
    deadline = time.monotonic() + 120
    while any(len(w.acked) < 60 for w in writers) and time.monotonic() < deadline:
        assert all(w.error is None for w in writers), [w.error for w in writers]
        time.sleep(0.01)
    assert all(len(w.acked) >= 60 for w in writers)
    assert all(w.thread is not None and w.thread.is_alive() for w in writers)  # still writing
    sidecar.kill()
    for writer in writers:
        assert writer.thread is not None
        writer.stop.set()
        writer.thread.join(60)
        assert not writer.thread.is_alive()
        assert isinstance(writer.error, ServiceUnavailableError), repr(writer.error)

    restarted = sidecar_factory(*flags, disk_path=sidecar.disk_path, socket_dir=sidecar.socket_dir)
    num_acked = sum(count for w in writers for _, count in w.acked)
    assert restarted.ready["recovered_blocks"] >= num_acked
    with stream_client(restarted) as client:
        for writer in writers:
            end = writer.acked[-1][0] + writer.acked[-1][1]
            hashes = [key(i, salt=writer.salt) for i in range(end)]
            got = client.get(NAMESPACE, hashes)
            assert got.shape[0] == end, (
                f"{writer.path}: block {got.shape[0]} of {end} acknowledged blocks is missing"
            )
            assert same_bytes(got, contents(writer.salt, range(end)))
            # The put in flight at the kill: each of its blocks is there exactly, or missing.
            assert writer.in_flight is not None and writer.in_flight[0] == end
            start, count = writer.in_flight
            for i in range(start, start + count):
                block = client.get(NAMESPACE, [key(i, salt=writer.salt)])
                assert block.shape[0] == 0 or same_bytes(block[0], content(writer.salt, i))


# --- 3. sixteen concurrent clients -------------------------------------------------------------

NUM_KEYS = 600
MAX_CHAIN = 8


@dataclass
class Tally:
    """What the client threads saw (appended to under the GIL)."""

    failures: list[str] = field(default_factory=list)
    ops: dict[str, int] = field(default_factory=dict)

    def count(self, what: str, n: int = 1) -> None:
        self.ops[what] = self.ops.get(what, 0) + n


@pytest.mark.slow
def test_sixteen_concurrent_clients_see_only_exact_blocks_and_tier_budgets_hold(
    sidecar_factory: SidecarFactory,
) -> None:
    sidecar = sidecar_factory("--host-bytes", "32KiB", "--page-bytes", "256",
                              "--disk-bytes", "256KiB")
    hashes = [key(i, salt="stress") for i in range(NUM_KEYS)]
    data = torch.stack([block_for(i) for i in range(NUM_KEYS)])
    tally = Tally()
    deadline = time.monotonic() + E2E_SECONDS
    done = threading.Event()

    def client_loop(number: int) -> None:
        path = "shm" if number % 2 == 0 else "stream"
        rng = random.Random(number)
        try:
            client = shm_client(sidecar) if path == "shm" else stream_client(sidecar)
        except BaseException as exc:
            tally.failures.append(f"client {number} ({path}): connect: {exc!r}")
            return
        with client:
            while time.monotonic() < deadline:
                start, length = rng.randrange(NUM_KEYS - MAX_CHAIN), rng.randint(1, MAX_CHAIN)
                chain = hashes[start : start + length]
                roll = rng.random()
                op = "put" if roll < 0.4 else "get" if roll < 0.8 else "lookup"
                try:
                    if op == "put":
                        client.put(NAMESPACE, chain, data[start : start + length])
                    elif op == "get":
                        got = client.get(NAMESPACE, chain)
                        if not got.shape[0] <= length:
                            tally.failures.append(f"{path} get: {got.shape[0]} > {length} blocks")
                        for j in range(got.shape[0]):
                            if not same_bytes(got[j], data[start + j]):
                                tally.failures.append(f"{path} get: block {start + j} differs")
                        tally.count("hit blocks", got.shape[0])
                    else:
                        found = client.lookup(NAMESPACE, chain)
                        if not 0 <= found <= length:
                            tally.failures.append(f"{path} lookup: {found} of {length}")
                    tally.count(f"{path} {op}")
                except CapacityError:
                    tally.count("capacity errors")
                except Exception as exc:  # anything else is a failure
                    tally.failures.append(f"client {number} ({path}) {op}: {exc!r}")
                    return

    def sample_stats() -> None:
        with stream_client(sidecar) as client:
            while not done.is_set():
                try:
                    stats = client.stats()
                except TierKVError as exc:
                    tally.failures.append(f"stats: {exc!r}")
                    return
                for tier in stats.tiers.values():
                    if tier.used_bytes > tier.capacity_bytes:
                        tally.failures.append(
                            f"{tier.tier.label}: {tier.used_bytes} B used of {tier.capacity_bytes} B"
                        )
                tally.count("stats samples")
                time.sleep(0.02)

    sampler = threading.Thread(target=sample_stats, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client_loop, args=(n,), daemon=True) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(E2E_SECONDS + 120)
    done.set()
    sampler.join(30)
    assert not any(t.is_alive() for t in (*threads, sampler)), "a client thread hung"
    assert tally.failures == [], tally.failures[:20]
    assert sidecar.alive

    ops = tally.ops
    for path in ("shm", "stream"):
        for op in ("put", "get", "lookup"):
            assert ops.get(f"{path} {op}", 0) > 0, ops
    assert ops.get("hit blocks", 0) > 0, ops
    assert ops.get("stats samples", 0) >= min(10, E2E_SECONDS * 5), ops
    with stream_client(sidecar) as client:
        stats = client.stats()
    tiers = {tier.label: t for tier, t in stats.tiers.items()}
    assert set(tiers) == {"host", "disk"}
    assert all(t.used_bytes <= t.capacity_bytes for t in tiers.values())
    # The budgets were exercised: HOST demoted to disk, and disk evicted.
    assert tiers["host"].evictions > 0 and stats.demotions > 0 and tiers["disk"].evictions > 0, stats
    assert stats.num_leases == 0  # every shared-memory client released what it acquired
    print(f"\n16 clients, {E2E_SECONDS:.0f} s: {ops}")
