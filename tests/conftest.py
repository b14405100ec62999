"""Shared fixtures: tiny layouts and stores with real tiers (shared memory, LMDB in tmp_path).

Nothing imports this module by name (every folder's ``conftest.py`` is a module named
``conftest``): the helpers tests import are in ``tiny_blocks``."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.harness import SidecarFactory, SidecarPool
from tests.support.tiny_blocks import BLOCK_BYTES, PAGE_BYTES, RECORD_BYTES, TINY_LAYOUT, StoreFactory
from tierkv import (
    DiskTierConfig,
    GpuTierConfig,
    HostTierConfig,
    Namespace,
    StoreConfig,
    TieredStore,
)


@pytest.fixture
def namespace() -> Namespace:
    """A namespace with the tiny layout."""
    return Namespace("test-model", TINY_LAYOUT)


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[StoreFactory]:
    """Build stores with real tiers; every store is closed at the end of the test.

    Keyword arguments: ``host_blocks`` (HOST budget in blocks), ``gpu_blocks`` (emulated GPU
    tier, 0 = off), ``disk_blocks`` (0 = no disk tier), ``disk_path``, and any ``StoreConfig``
    field (``write_policy``, ``promote_on_read``, ...) plus ``clock``.
    """
    stores: list[TieredStore] = []

    def build(
        host_blocks: int = 8,
        gpu_blocks: int = 0,
        disk_blocks: int = 0,
        disk_path: Path | None = None,
        clock: Callable[[], float] | None = None,
        **store_fields: object,
    ) -> TieredStore:
        disk = None
        if disk_blocks:
            # Records are a block plus a header of under 128 bytes.
            disk = DiskTierConfig(disk_path or tmp_path / "disk", disk_blocks * RECORD_BYTES)
        config = StoreConfig(
            host=HostTierConfig(host_blocks * BLOCK_BYTES, PAGE_BYTES),
            gpu=GpuTierConfig(gpu_blocks * BLOCK_BYTES, PAGE_BYTES, "emulated"),
            disk=disk,
            **store_fields,  # type: ignore[arg-type]
        )
        store = TieredStore(config, clock=clock) if clock else TieredStore(config)
        stores.append(store)
        return store

    yield build
    for store in stores:
        store.close(flush=False)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``tmpfs(size_mib)``: a real tmpfs of that size mounted for the test (CI runs as root),
    a filesystem that fills up; unmounted at the end."""
    mounts: list[Path] = []

    def mount(size_mib: int) -> Path:
        mount_point = tmp_path / f"tmpfs-{len(mounts)}"
        mount_point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs",
                               str(mount_point)], capture_output=True, text=True, check=False)
        # No skip: a disk-full test that quietly does not run is a test that cannot fail.
        assert done.returncode == 0, f"mounting a tmpfs failed (run as root): {done.stderr}"
        mounts.append(mount_point)
        return mount_point

    yield mount
    for mount_point in mounts:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture
def sidecar_factory(tmp_path: Path) -> Iterator[SidecarFactory]:
    """``start(*flags, disk_path=None, socket_dir=None)``: a started ``tierkv serve`` (the
    subprocess harness, ``tests/support/harness.py``); every one is stopped at the end of the
    test."""
    pool = SidecarPool(tmp_path)
    yield pool.start
    pool.close()
