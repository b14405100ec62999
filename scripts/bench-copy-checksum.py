"""How fast the copy that checksums as it goes runs, against a bare copy, and how fast Debian's
libxxhash (the C library a native kernel would link) hashes against python-xxhash: issue 26's
kernel question (BENCHMARKS.md, "The copy that checksums as it goes").

    .venv/bin/python scripts/bench-copy-checksum.py [ROUNDS]    # needs libxxhash0; a line a round
"""

import ctypes
import sys
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from tierkv import checksums
from tierkv.bench.report import median_of, timed

TOTAL_BYTES = 64 << 20
REPEATS = 11


def gbps(work: Callable[[], object]) -> float:
    """GB/s of ``work`` over ``TOTAL_BYTES``: the median of ``REPEATS`` timed calls, after one."""
    work()
    seconds, _ = median_of(lambda: timed(work), REPEATS)
    return round(TOTAL_BYTES / seconds / 1e9, 1)


def main(num_rounds: int) -> None:
    source = np.random.default_rng(0).integers(0, 256, TOTAL_BYTES, dtype=np.uint8)
    destination = np.empty_like(source)
    library = ctypes.CDLL("libxxhash.so.0")
    library.XXH3_64bits.restype = ctypes.c_uint64
    library.XXH3_64bits.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    address = source.ctypes.data
    assert library.XXH3_64bits(address, TOTAL_BYTES) == xxhash.xxh3_64_intdigest(source)
    split = {block_bytes: [[(destination[i : i + block_bytes], source[i : i + block_bytes])]
                           for i in range(0, TOTAL_BYTES, block_bytes)]
             for block_bytes in (2 << 20, 128 << 10)}
    for _ in range(num_rounds):
        row = {
            "torch copy_": gbps(lambda: torch.from_numpy(destination).copy_(torch.from_numpy(source))),
            "np.copyto": gbps(lambda: np.copyto(destination, source)),
            "python-xxhash hash": gbps(lambda: xxhash.xxh3_64_intdigest(source)),
            "libxxhash hash": gbps(lambda: library.XXH3_64bits(address, TOTAL_BYTES)),
        }
        for block_bytes, blocks in split.items():
            row[f"copy+checksum {block_bytes >> 10} KiB, 1 thread"] = gbps(
                lambda blocks=blocks: [checksums.copy_with_checksum(parts) for parts in blocks])
        print(row, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
