"""Tenants that cannot hurt each other, through ``tierkv serve`` and the SDK: with a 16 MiB HOST
and two tokens (equal shares by default), tenant B keeps every block it holds within its share
through any flood by tenant A: of HOST, of DISK (write-through), and with A holding pins and
leases. Before shares, A's flood left B 0 of 64."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.support.harness import ALICE_TOKEN, BOB_TOKEN, TOKENS, SidecarFactory
from tierkv import Client, KVLayout, Namespace, WritePolicy
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


def flood(client: Client, num_blocks: int, **put: object) -> None:
    namespace = Namespace(MODEL, LAYOUT)
    for batch in range(0, num_blocks, 16):
        client.put(namespace, chain(1000 + batch, 16), data(16, seed=batch), **put)  # type: ignore[arg-type]


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
