"""Helper process for ``test_persistence.test_write_through_survives_sigkill``.

Usage: ``crash_writer.py DISK_PATH CYCLE``.

Opens a ``TieredStore`` on ``DISK_PATH``, prints ``ready``, then writes blocks with
``write_through`` until it is killed: before each put ``begin START COUNT``, after the put
returns ``ack START COUNT`` (block indices ``START .. START + COUNT - 1`` of this cycle), each
line flushed. It never exits on its own while writing; after ``MAX_BLOCKS_PER_CYCLE`` blocks it
prints ``idle`` and sleeps (the test then knows its kill did not land mid-write).

Block ``i`` of cycle ``c`` has hash ``block_hash(c, i)`` and content ``block_content(c, i)``;
the test imports both to recompute what every acknowledged put stored.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import torch

from tierkv import (
    DiskTierConfig,
    HostTierConfig,
    KVLayout,
    Namespace,
    StoreConfig,
    TieredStore,
    WritePolicy,
)
from tierkv.tiers.records import block_record_bytes

# 8 KiB blocks: each record is stored as a head in a leaf page and a body of two overflow pages
# (tierkv.tiers.records.split_record), so a kill can land between the two values' writes. Kept
# here so that this script does not import the test suite.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=32, block_size=4)
NAMESPACE = Namespace("test-model", LAYOUT)
BLOCK_BYTES = LAYOUT.bytes_per_block
RECORD_BYTES = block_record_bytes(LAYOUT)
MAX_CYCLES = 20
MAX_BLOCKS_PER_CYCLE = 2000
# Never needs eviction: every block every cycle could write fits the budget.
DISK_CAPACITY_BYTES = MAX_CYCLES * MAX_BLOCKS_PER_CYCLE * RECORD_BYTES
HOST_BYTES = 16 * BLOCK_BYTES
PAGE_BYTES = 256


def block_hash(cycle: int, index: int) -> bytes:
    """The 32-byte hash block ``index`` of ``cycle`` is stored under."""
    return hashlib.sha256(f"crash-{cycle}-{index}".encode()).digest()


def block_content(cycle: int, index: int) -> torch.Tensor:
    """The one block (random bits, NaNs included) stored under ``block_hash(cycle, index)``."""
    generator = torch.Generator().manual_seed(cycle * 1_000_003 + index)
    raw = torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=generator)
    return raw.view(LAYOUT.torch_dtype).reshape(LAYOUT.block_shape)


def store_config(disk_path: Path) -> StoreConfig:
    """The config both the writer and the checking test open the store with."""
    return StoreConfig(
        host=HostTierConfig(HOST_BYTES, PAGE_BYTES),
        disk=DiskTierConfig(disk_path, DISK_CAPACITY_BYTES),
    )


def main(argv: list[str]) -> int:
    disk_path, cycle = Path(argv[1]), int(argv[2])
    store = TieredStore(store_config(disk_path))
    store.register(NAMESPACE)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    index = 0
    while index < MAX_BLOCKS_PER_CYCLE:
        count = 1 + index % 4  # batches of 1, 2, 3, 4 blocks
        indices = range(index, index + count)
        hashes = [block_hash(cycle, i) for i in indices]
        data = torch.stack([block_content(cycle, i) for i in indices])
        out.write(f"begin {index} {count}\n")
        out.flush()
        store.put(NAMESPACE, hashes, data, write_policy=WritePolicy.WRITE_THROUGH)
        out.write(f"ack {index} {count}\n")
        out.flush()
        index += count
    out.write("idle\n")
    out.flush()
    while True:  # wait for the kill without exiting (an exit would close the store cleanly)
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
