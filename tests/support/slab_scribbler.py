"""A stray writer for the fault tests: maps a tierkv HOST slab and writes 0xEE over all of it
until it is killed (``python slab_scribbler.py SHM_NAME``)."""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np


def main() -> None:
    fd = os.open(f"/dev/shm/{sys.argv[1]}", os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    slab = np.frombuffer(mapping, np.uint8)
    while True:
        slab[:] = 0xEE


if __name__ == "__main__":
    main()
