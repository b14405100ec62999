"""One harness for a real ``tierkv serve`` subprocess (the end-to-end and fault tests).

A ``Sidecar`` listens on a Unix socket in its own short folder and on ``127.0.0.1:0``; the
``sidecar_factory`` fixture (in ``conftest``) starts them and stops every one at the end.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from service_fixtures import short_socket_dir

from tierkv import Client

READY_TIMEOUT_S = 120.0


@dataclass
class Sidecar:
    """One ``tierkv serve`` process on a Unix socket (in ``socket_dir``) and ``127.0.0.1:0``."""

    disk_path: Path
    socket_dir: Path
    log_path: Path
    flags: list[str]
    process: subprocess.Popen[str] | None = None
    ready: dict[str, Any] = field(default_factory=dict)

    @property
    def unix_target(self) -> str:
        return f"unix://{self.socket_dir}/tierkv.sock"

    @property
    def tcp_target(self) -> str:
        return f"127.0.0.1:{self.ready['port']}"

    def start(self) -> Sidecar:
        command = [
            sys.executable, "-m", "tierkv", "serve", "--gpu-bytes", "0", "--stats-interval-s", "0",
            "--disk-path", str(self.disk_path), "--listen", self.unix_target,
            "--listen", "127.0.0.1:0", *self.flags,
        ]
        env = {**os.environ, "TQDM_DISABLE": "1"}
        with self.log_path.open("a") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True,
                                            env=env)
        assert self.process.stdout is not None
        readable, _, _ = select.select([self.process.stdout], [], [], READY_TIMEOUT_S)
        line = self.process.stdout.readline() if readable else ""
        if not line:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"tierkv serve did not get ready:\n{self.log_path.read_text()}")
        self.ready = json.loads(line)
        assert self.ready["ready"] is True and self.ready["port"] > 0
        return self

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no draining, no flush, and the shared-memory slab is left behind, as it
        would be (the next server start removes it)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        assert self.process.wait(timeout=30) == -signal.SIGKILL
        if self.process.stdout is not None:
            self.process.stdout.close()

    def terminate(self) -> None:
        """SIGTERM, and wait for the graceful exit."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=60) == 0
        if self.process.stdout is not None:
            self.process.stdout.close()

    def stop(self) -> None:
        """SIGTERM (graceful), or SIGKILL when that takes too long."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._remove_slab()

    def _remove_slab(self) -> None:
        name = self.ready.get("host_shm_name")
        if name:
            Path(f"/dev/shm/{name}").unlink(missing_ok=True)


SidecarFactory = Callable[..., Sidecar]


class SidecarPool:
    """Starts sidecars whose logs and default disk live under ``root``; ``close`` stops every
    one and removes their socket folders. Backs ``sidecar_factory`` and longer-lived fixtures
    (a module's engines share sidecars)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[Sidecar] = []
        self._socket_dirs: list[Path] = []

    def start(self, *flags: str, disk_path: Path | None = None,
              socket_dir: Path | None = None) -> Sidecar:
        if socket_dir is None:
            socket_dir = short_socket_dir()
            self._socket_dirs.append(socket_dir)
        sidecar = Sidecar(disk_path or self.root / "disk", socket_dir,
                          self.root / f"serve-{len(self.started)}.log", list(flags))
        self.started.append(sidecar)
        return sidecar.start()

    def close(self) -> None:
        for sidecar in self.started:
            sidecar.stop()
        for socket_dir in self._socket_dirs:
            shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.fixture
def sidecar_factory(tmp_path: Path) -> Iterator[SidecarFactory]:
    """``start(*flags, disk_path=None, socket_dir=None)``: a started ``tierkv serve``; every one
    is stopped at the end of the test."""
    pool = SidecarPool(tmp_path)
    yield pool.start
    pool.close()


def stream_client(sidecar: Sidecar, **settings: Any) -> Client:
    return Client(sidecar.tcp_target, use_shm=False, **settings)


def shm_client(sidecar: Sidecar, **settings: Any) -> Client:
    client = Client(sidecar.unix_target, **settings)
    assert client.uses_shared_memory
    return client


