"""Fault injection: random SIGKILL / SIGTERM restarts of ``tierkv serve`` under live clients.

Four clients (shared memory and stream, sync and async) put and get blocks without pause while
the server is restarted at random moments, on the same disk and socket. Every block's content is
derived from its key, so every read is checked: a read may miss or fail with a clear error while
the server is down, never return a wrong byte; every client carries on by itself after each
restart; every acknowledged write_through block is exact at the end.

``TIERKV_SOAK_RESTARTS`` (default 8) restarts, seeded by ``TIERKV_SOAK_SEED`` (default 2026);
the figures go to RELIABILITY.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.support.harness import Sidecar, SidecarFactory
from tests.support.tiny_blocks import TINY_LAYOUT, block_for, key, same_bytes
from tierkv import AsyncClient, Client, Namespace, WritePolicy
from tierkv.errors import (
    CapacityError,
    DeadlineExceededError,
    LeaseStateError,
    NotFoundError,
    ServiceUnavailableError,
)

NAMESPACE = Namespace("soak-model", TINY_LAYOUT)
FLAGS = ("--host-bytes", "2MiB", "--page-bytes", "512", "--disk-bytes", "64MiB")
NUM_RESTARTS = int(os.environ.get("TIERKV_SOAK_RESTARTS", "8"))
SEED = int(os.environ.get("TIERKV_SOAK_SEED", "2026"))
BATCH = 16
# What a call may fail with while the server is down or has just restarted: a clear error.
CLEAR_ERRORS = (ServiceUnavailableError, DeadlineExceededError, NotFoundError, LeaseStateError,
                CapacityError)


def content(salt: str, index: int) -> torch.Tensor:
    return block_for(int.from_bytes(key(index, salt)[:4], "little"))


def batch_of(salt: str) -> tuple[list[bytes], torch.Tensor]:
    return [key(i, salt) for i in range(BATCH)], torch.stack([content(salt, i) for i in range(BATCH)])


@dataclass
class Tally:
    """What one client saw."""

    name: str
    ops: int = 0
    blocks_read: int = 0
    wrong_blocks: int = 0
    clear_errors: int = 0
    ops_by_epoch: dict[int, int] = field(default_factory=dict)
    durable: list[str] = field(default_factory=list)  # acknowledged write_through batches

    def check(self, salt: str, got: torch.Tensor) -> None:
        expected = batch_of(salt)[1][: len(got)]
        self.blocks_read += len(got)
        if not same_bytes(got, expected):
            self.wrong_blocks += sum(
                1 for a, b in zip(got, expected, strict=True) if not same_bytes(a, b)
            )


class Epoch:
    """Which server incarnation is up (a client's op counts toward the one it finished in)."""

    def __init__(self) -> None:
        self.value = 0
        self.stop = threading.Event()


def one_op(client: Client, tally: Tally, rng: random.Random, epoch: Epoch) -> None:
    salt = f"{tally.name}-{rng.randrange(1 << 30)}"
    hashes, data = batch_of(salt)
    policy = rng.choice([WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK])
    client.put(NAMESPACE, hashes, data, write_policy=policy)
    if policy is WritePolicy.WRITE_THROUGH:
        tally.durable.append(salt)
    tally.check(salt, client.get(NAMESPACE, hashes))
    if tally.durable:  # an older batch, maybe from an earlier server
        old = rng.choice(tally.durable)
        tally.check(old, client.get(NAMESPACE, batch_of(old)[0]))


def run_sync(target: str, use_shm: bool, tally: Tally, epoch: Epoch, seed: int) -> None:
    rng = random.Random(seed)
    with Client(target, use_shm=use_shm, timeout_s=10, retries=4) as client:
        while not epoch.stop.is_set():
            try:
                one_op(client, tally, rng, epoch)
                tally.ops += 1
                tally.ops_by_epoch[epoch.value] = tally.ops_by_epoch.get(epoch.value, 0) + 1
            except CLEAR_ERRORS:
                tally.clear_errors += 1
                time.sleep(0.05)


def run_async(target: str, use_shm: bool, tally: Tally, epoch: Epoch, seed: int) -> None:
    async def main() -> None:
        rng = random.Random(seed)
        async with AsyncClient(target, use_shm=use_shm, timeout_s=10, retries=4) as client:
            while not epoch.stop.is_set():
                salt = f"{tally.name}-{rng.randrange(1 << 30)}"
                hashes, data = batch_of(salt)
                try:
                    await client.put(NAMESPACE, hashes, data,
                                     write_policy=WritePolicy.WRITE_THROUGH)
                    tally.durable.append(salt)
                    tally.check(salt, await client.get(NAMESPACE, hashes))
                    tally.ops += 1
                    tally.ops_by_epoch[epoch.value] = tally.ops_by_epoch.get(epoch.value, 0) + 1
                except CLEAR_ERRORS:
                    tally.clear_errors += 1
                    await asyncio.sleep(0.05)

    asyncio.run(main())


@pytest.mark.slow
def test_random_restarts_under_live_clients_never_serve_a_wrong_byte(
    sidecar_factory: SidecarFactory,
) -> None:
    rng = random.Random(SEED)
    server: Sidecar = sidecar_factory(*FLAGS)
    epoch = Epoch()
    kinds: list[tuple[str, Any, bool]] = [
        ("sync-shm", run_sync, True), ("sync-stream", run_sync, False),
        ("async-shm", run_async, True), ("async-stream", run_async, False),
    ]
    tallies = [Tally(name) for name, _, _ in kinds]
    threads = [
        threading.Thread(target=run, args=(server.unix_target, shm, tally, epoch, seed),
                         daemon=True)
        for seed, ((_, run, shm), tally) in enumerate(zip(kinds, tallies, strict=True))
    ]
    for thread in threads:
        thread.start()
    kills = 0
    for _ in range(NUM_RESTARTS):
        time.sleep(rng.uniform(0.5, 2.0))
        if rng.random() < 0.5:
            server.kill()
            kills += 1
        else:
            server.terminate()
        time.sleep(rng.uniform(0.0, 0.5))  # clients run into a server that is down
        server = sidecar_factory(*FLAGS, disk_path=server.disk_path, socket_dir=server.socket_dir)
        epoch.value += 1
    time.sleep(3.0)  # every client carries on with the last server
    epoch.stop.set()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()

    # Every acknowledged write_through batch is exact on the last server, through a new client.
    num_durable = 0
    with Client(server.unix_target) as reader:
        for tally in tallies:
            for salt in tally.durable:
                hashes, data = batch_of(salt)
                got = reader.get(NAMESPACE, hashes)
                assert same_bytes(got, data), f"{tally.name}: {salt} lost or wrong"
                num_durable += 1
        stats = reader.stats()
    figures = {
        "restarts": NUM_RESTARTS, "sigkills": kills, "durable_batches_checked": num_durable,
        "checksum_failures_last_server": stats.checksum_failures,
        **{t.name: {"ops": t.ops, "blocks_read": t.blocks_read, "wrong_blocks": t.wrong_blocks,
                    "clear_errors": t.clear_errors} for t in tallies},
    }
    print(json.dumps(figures))
    for tally in tallies:
        assert tally.wrong_blocks == 0, figures
        assert tally.ops_by_epoch.get(NUM_RESTARTS, 0) > 0, f"{tally.name} did not carry on"
