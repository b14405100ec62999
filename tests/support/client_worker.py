"""Helper process for ``test_client_e2e``: one client of a running ``tierkv serve``.

Usage::

    client_worker.py put TARGET PATH MODEL COUNT
    client_worker.py get TARGET PATH MODEL COUNT OUT_FILE

``PATH`` is ``shm`` (the client may choose shared memory, and must get it) or ``stream``
(``use_shm=False``). ``put`` stores blocks ``0 .. COUNT - 1`` of ``MODEL`` in batches of 7;
``get`` fetches all of them in one call and writes the raw bytes it got to ``OUT_FILE``. Each
prints one JSON line: ``{"uses_shared_memory": bool, "count": blocks stored / got}``.

Block ``i`` of ``MODEL`` has hash ``block_hash(MODEL, i)`` and content ``block_content(i)``
(random bits, NaNs included); the test imports both to check what the other process read.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from tierkv import Client, KVLayout, Namespace

# 2 layers x 2 (K,V) x 16 tokens x 4 heads x 64 dims x fp16 = 32 KiB a block: 96 of them are
# 3 MiB, several stream chunks in one get.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16)
BLOCK_BYTES = LAYOUT.bytes_per_block
PUT_BATCH = 7


def namespace(model: str) -> Namespace:
    return Namespace(model, LAYOUT)


def block_hash(model: str, index: int) -> bytes:
    """The 32-byte hash block ``index`` of ``model`` is stored under."""
    return hashlib.sha256(f"e2e-{model}-{index}".encode()).digest()


def block_content(index: int) -> torch.Tensor:
    """The one block stored under block ``index`` (of any model)."""
    generator = torch.Generator().manual_seed(7919 * index + 17)
    raw = torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=generator)
    return raw.view(LAYOUT.torch_dtype).reshape(LAYOUT.block_shape)


def main(argv: list[str]) -> int:
    mode, target, path, model, count = argv[1], argv[2], argv[3], argv[4], int(argv[5])
    settings = {"use_shm": False} if path == "stream" else {}
    hashes = [block_hash(model, i) for i in range(count)]
    with Client(target, **settings) as client:
        uses_shm = client.uses_shared_memory
        if mode == "put":
            done = 0
            for start in range(0, count, PUT_BATCH):
                indices = range(start, min(start + PUT_BATCH, count))
                data = torch.stack([block_content(i) for i in indices])
                done += client.put(namespace(model), hashes[start : start + len(indices)], data)
        elif mode == "get":
            got = client.get(namespace(model), hashes)
            done = got.shape[0]
            Path(argv[6]).write_bytes(got.contiguous().view(torch.uint8).numpy().tobytes())
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps({"uses_shared_memory": uses_shm, "count": done}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
