"""A reader killed with SIGKILL while it held a snapshot of a live disk store (an inspection,
say) must not keep the store from reusing the pages it frees: the store reclaims dead readers'
slots while it runs, not only when it opens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tierkv import DiskTierConfig, HostTierConfig, KVLayout, Namespace, StoreConfig, TieredStore, WritePolicy

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=64)  # 64 KiB blocks
NUM_BLOCKS = 8
HOLD_A_SNAPSHOT = """
import sys, time
from tierkv.tiers.lmdb_readonly import ReadOnlyStore
store = ReadOnlyStore(sys.argv[1])
assert store.server_running
print("holding", flush=True)
time.sleep(600)
"""


def _kill_a_reader_holding_a_snapshot(path: Path) -> None:
    with subprocess.Popen([sys.executable, "-c", HOLD_A_SNAPSHOT, str(path)],
                          stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        finally:
            holder.kill()


def test_rewrites_after_a_dead_reader_reuse_the_freed_pages(tmp_path: Path) -> None:
    # A map of about 3 MiB: without the reclaim, the churn below (15 MiB of rewrites behind
    # the dead reader's snapshot) fills it and puts fail with DiskFullError.
    disk = DiskTierConfig(tmp_path / "disk", 2 * NUM_BLOCKS * LAYOUT.bytes_per_block,
                          map_slack_bytes=1024 * 1024)
    config = StoreConfig(host=HostTierConfig(2 * NUM_BLOCKS * LAYOUT.bytes_per_block, 64 * 1024),
                         disk=disk, write_policy=WritePolicy.WRITE_THROUGH)
    namespace = Namespace("dead-reader-model", LAYOUT)
    data = torch.randn(NUM_BLOCKS, *LAYOUT.block_shape).to(LAYOUT.dtype.torch_dtype)
    with TieredStore(config) as store:
        store.register(namespace)
        store.put(namespace, [bytes([255, i]) * 16 for i in range(NUM_BLOCKS)], data)
        _kill_a_reader_holding_a_snapshot(disk.path)
        for round_ in range(30):
            hashes = [bytes([round_, i]) * 16 for i in range(NUM_BLOCKS)]
            store.put(namespace, hashes, data)
            assert store.delete(namespace, hashes) == NUM_BLOCKS
        assert store.wait_for_background(timeout_s=60)
        kept = [bytes([255, i]) * 16 for i in range(NUM_BLOCKS)]
        assert store.lookup(namespace, kept) == NUM_BLOCKS
