"""Tenants that cannot hurt each other, through ``tierkv serve`` and the SDK: with a 16 MiB HOST
and two tokens (equal shares by default), tenant B keeps every block it holds within its share
through any flood by tenant A: of HOST, of DISK (write-through), and with A holding pins and
leases. Before shares, A's flood left B 0 of 64."""
from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.harness import ALICE_TOKEN, BOB_TOKEN, TOKENS, SidecarFactory
from tierkv import Client, KVLayout, Namespace, Tier, WritePolicy
from tierkv.errors import AuthenticationError
from tierkv.hashing import block_hashes

LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_size=16, dtype="fp16")
BLOCK_BYTES = LAYOUT.bytes_per_block  # 128 KiB: HOST of 16 MiB holds 128
MODEL = "tenant-model"


def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("".join(f"{token} {tenant}\n" for token, tenant in TOKENS.items()))
    return path


def chain(salt: int, num_blocks: int) -> list[bytes]:
    tokens = [salt * 100_003 + i for i in range(num_blocks * LAYOUT.block_size)]
    return [bytes(h) for h in block_hashes(tokens, LAYOUT.block_size)]


def data(num_blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *LAYOUT.block_shape), generator=generator).to(torch.float16)


def flood(client: Client, num_blocks: int, salt: int = 0, **put: object) -> None:
    namespace = Namespace(MODEL, LAYOUT)
    for batch in range(0, num_blocks, 16):
        client.put(namespace, chain(1000 + salt * 10_000 + batch, 16), data(16, seed=batch),
                   **put)  # type: ignore[arg-type]


def test_a_tenant_keeps_its_share_of_host_through_another_tenants_flood(
    sidecar_factory: SidecarFactory, tmp_path: Path,
) -> None:
    assert BLOCK_BYTES == 128 * 1024
    sidecar = sidecar_factory("--host-bytes", "16MiB", "--no-disk",
                              "--tokens-file", str(tokens_file(tmp_path)))
    namespace = Namespace(MODEL, LAYOUT)
    bob_keys, bob_data = chain(7, 64), data(64, seed=7)
    with Client(sidecar.unix_target, token=BOB_TOKEN) as bob, \
            Client(sidecar.unix_target, token=ALICE_TOKEN) as alice:
        assert bob.put(namespace, bob_keys, bob_data) == 64
        assert bob.lookup(namespace, bob_keys) == 64
        flood(alice, 256)  # twice HOST
        assert bob.lookup(namespace, bob_keys) == 64
        assert torch.equal(bob.get(namespace, bob_keys).view(torch.int16),
                           bob_data.view(torch.int16))
        # A borrowed nothing it kept: its own blocks made its room.
        assert alice.lookup(namespace, chain(1000 + 240, 16)) == 16


def test_a_tenant_keeps_its_share_of_disk_and_host_through_pins_and_leases_of_another(
    sidecar_factory: SidecarFactory, tmp_path: Path,
) -> None:
    """B's write-through blocks stay on DISK through A's write-through flood of twice DISK;
    A pinning half its HOST share and reading takes nothing of B's (A's flood recycles the
    other half; were it all pinned, A's puts would be refused, never served from B's room)."""
    sidecar = sidecar_factory("--host-bytes", "16MiB", "--disk-bytes", "32MiB",
                              "--disk-path", str(tmp_path / "disk"),
                              "--tokens-file", str(tokens_file(tmp_path)))
    namespace = Namespace(MODEL, LAYOUT)
    bob_keys, bob_data = chain(8, 64), data(64, seed=8)
    with Client(sidecar.unix_target, token=BOB_TOKEN) as bob, \
            Client(sidecar.unix_target, token=ALICE_TOKEN) as alice:
        assert bob.put(namespace, bob_keys, bob_data, write_policy=WritePolicy.WRITE_THROUGH) == 64
        pinned = chain(9, 32)
        assert alice.put(namespace, pinned, data(32, seed=9)) == 32
        assert alice.pin(namespace, pinned) == 32
        assert len(alice.get(namespace, pinned[:8])) == 8
        flood(alice, 512, write_policy=WritePolicy.WRITE_THROUGH)  # twice DISK, 4x HOST
        assert bob.lookup(namespace, bob_keys) == 64
        assert torch.equal(bob.get(namespace, bob_keys).view(torch.int16),
                           bob_data.view(torch.int16))
        assert alice.lookup(namespace, pinned) == 32  # its pins held, in its own share


CAROL_TOKEN = "c" * 32


def wait_for_event(log_path: Path, event: str, after: int) -> dict[str, Any]:
    """The first JSON log line of ``event`` past the first ``after`` lines of the log."""
    deadline_s = time.monotonic() + 30
    while time.monotonic() < deadline_s:
        lines = log_path.read_text().splitlines()[after:]
        for line in lines:
            if line.startswith("{") and json.loads(line)["event"] == event:
                return dict(json.loads(line))
        time.sleep(0.05)
    raise AssertionError(f"no {event} event in {log_path}:\n{log_path.read_text()}")


def num_log_lines(log_path: Path) -> int:
    return len(log_path.read_text().splitlines())


def test_a_reload_under_load_moves_who_is_evicted_next_and_loses_no_write_through_block(
    sidecar_factory: SidecarFactory, tmp_path: Path,
) -> None:
    """SIGHUP with a new tokens file and new weights while A floods: B's HOST share halves, so
    A's flood now takes B's blocks past it (counted as evicted by others), yet every block B
    wrote through stays a hit with its bytes; a new tenant's token works at once. A broken
    tokens file is then refused in one line that names it, and the server serves on with
    what it had."""
    tokens = tokens_file(tmp_path)
    config = tmp_path / "tierkv.toml"
    config.write_text('tenant_weights = ["alice=1", "bob=1"]\n')
    sidecar = sidecar_factory("--host-bytes", "16MiB", "--disk-bytes", "64MiB",
                              "--disk-path", str(tmp_path / "disk"), "--log-format", "json",
                              "--tokens-file", str(tokens), "--config", str(config))
    assert sidecar.process is not None
    namespace = Namespace(MODEL, LAYOUT)
    bob_keys, bob_data = chain(7, 64), data(64, seed=7)
    with Client(sidecar.unix_target, token=BOB_TOKEN) as bob, \
            Client(sidecar.unix_target, token=ALICE_TOKEN) as alice:
        assert bob.put(namespace, bob_keys, bob_data, write_policy=WritePolicy.WRITE_THROUGH) == 64
        flood(alice, 256)
        assert bob.stats().tiers[Tier.HOST].num_blocks == 64  # all of it: its share is 64
        with Client(sidecar.unix_target, token=CAROL_TOKEN) as carol, \
                pytest.raises(AuthenticationError):
            carol.lookup(namespace, bob_keys)

        stop = threading.Event()
        failures: list[BaseException] = []

        def keep_flooding() -> None:
            with Client(sidecar.unix_target, token=ALICE_TOKEN) as flooder:
                round_ = 0
                while not stop.is_set():
                    try:
                        flood(flooder, 128, salt=round_)
                    except BaseException as exc:  # reported below
                        failures.append(exc)
                        return
                    round_ += 1

        flooder = threading.Thread(target=keep_flooding)
        flooder.start()
        try:
            tokens.write_text(tokens.read_text() + f"{CAROL_TOKEN} carol\n")
            config.write_text('tenant_weights = ["alice=3", "bob=1"]\n')
            mark = num_log_lines(sidecar.log_path)
            sidecar.process.send_signal(signal.SIGHUP)
            reloaded = wait_for_event(sidecar.log_path, "reload", mark)
            assert reloaded["weights"] == {"alice": 3.0, "bob": 1.0}
            assert reloaded["tenants"] == ["alice", "bob", "carol"]
            time.sleep(2)  # A's flood goes on under the new shares
        finally:
            stop.set()
            flooder.join()
        assert not failures, failures
        flood(alice, 256)
        host = {t.tier: t for t in bob.stats().tenants}[Tier.HOST]
        assert host.share_bytes == 4 * 1024 * 1024
        assert host.used_bytes == host.share_bytes  # down to its new share, no further
        assert host.evicted_by_others == 32
        assert bob.lookup(namespace, bob_keys) == 64  # every block it wrote through
        assert torch.equal(bob.get(namespace, bob_keys).view(torch.int16),
                           bob_data.view(torch.int16))
        with Client(sidecar.unix_target, token=CAROL_TOKEN) as carol:
            assert carol.lookup(namespace, bob_keys) == 0  # in, and sees none of bob's

            # Shares the store cannot hold (20 MiB of a 16 MiB HOST): refused, naming them.
            config.write_text('tenant_weights = ["alice=3", "bob=1"]\n'
                              'tenant_bytes = ["alice:host=12MiB", "bob:host=8MiB"]\n')
            mark = num_log_lines(sidecar.log_path)
            sidecar.process.send_signal(signal.SIGHUP)
            refused = wait_for_event(sidecar.log_path, "reload_failed", mark)
            assert "the host shares (alice 12582912 B, bob 8388608 B) sum to" in \
                refused["message"]
            assert {t.tier: t for t in bob.stats().tenants}[Tier.HOST].share_bytes == 4 * 2**20

            tokens.write_text(f"{ALICE_TOKEN} alice\nnot-a-token\n")
            mark = num_log_lines(sidecar.log_path)
            sidecar.process.send_signal(signal.SIGHUP)
            refused = wait_for_event(sidecar.log_path, "reload_failed", mark)
            assert f"{tokens}:2" in refused["message"] and "\n" not in refused["message"]
            assert carol.lookup(namespace, bob_keys) == 0  # the tokens in force stay
        assert bob.lookup(namespace, bob_keys) == 64

        # A token removed by a reload: its next call is refused; the others go on.
        tokens.write_text(f"{ALICE_TOKEN} alice\n{CAROL_TOKEN} carol\n")
        config.write_text('tenant_weights = ["alice=1", "carol=1"]\n')
        mark = num_log_lines(sidecar.log_path)
        sidecar.process.send_signal(signal.SIGHUP)
        assert wait_for_event(sidecar.log_path, "reload", mark)["tenants"] == ["alice", "carol"]
        with pytest.raises(AuthenticationError):
            bob.get(namespace, bob_keys)
        with pytest.raises(AuthenticationError):
            bob.put(namespace, chain(9, 1), data(1, seed=9))
        assert alice.lookup(namespace, bob_keys) == 0
        assert sidecar.alive
