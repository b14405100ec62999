"""One harness per kind of server, for every test that needs a real one.

* In process: ``serve`` (and ``serving``) starts ``create_server`` on a Unix socket and
  ``127.0.0.1:0`` in front of a fresh ``TieredStore`` with a shared-memory HOST slab and an LMDB
  disk tier in a temporary folder, on the caller's event loop; ``BackgroundServer`` runs the same
  server on its own loop in a thread, for synchronous clients.
* A subprocess: a ``Sidecar`` is one real ``tierkv serve`` process, listening on a Unix socket in
  its own short folder and on ``127.0.0.1:0``; ``SidecarPool`` starts them and stops every one.

The fixtures over them are in ``tests/conftest.py`` (``sidecar_factory``, for every folder),
``tests/service/conftest.py`` and ``tests/support/client_fixtures.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tests.support.tiny_blocks import BLOCK_BYTES, PAGE_BYTES, RECORD_BYTES
from tierkv import Client, DiskTierConfig, GpuTierConfig, HostTierConfig, StoreConfig, TieredStore
from tierkv.service.config import ServiceConfig
from tierkv.service.server import TierKVServer, create_server
from tierkv.service.servicer import TierKVServicer
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

ALICE_TOKEN = "t" * 32
BOB_TOKEN = "u" * 32
TOKENS = {ALICE_TOKEN: "alice", BOB_TOKEN: "bob"}

# Client channels: let the client send and receive more than 4 MiB, so that the *server's*
# limits are what a test sees.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]


def store_config(
    root: Path, host_blocks: int = 64, disk_blocks: int = 1024, page_bytes: int = PAGE_BYTES,
    host_bytes: int | None = None, disk_bytes: int | None = None, gpu_bytes: int = 0,
    verify_commit: bool = False,
) -> StoreConfig:
    """A store with ``host_blocks`` tiny blocks of HOST (or ``host_bytes``), a disk tier of
    ``disk_blocks`` tiny blocks (or ``disk_bytes``; no disk tier when both are 0), and an
    emulated GPU tier of ``gpu_bytes`` (0: off)."""
    disk = None
    if disk_bytes or disk_blocks:
        disk = DiskTierConfig(root / "disk", disk_bytes or disk_blocks * RECORD_BYTES,
                              map_slack_bytes=16 << 20)
    host = HostTierConfig(host_bytes or host_blocks * BLOCK_BYTES, page_bytes)
    gpu = GpuTierConfig(gpu_bytes, page_bytes, "emulated") if gpu_bytes else GpuTierConfig(0)
    return StoreConfig(host=host, gpu=gpu, disk=disk, verify_commit=verify_commit)


def short_socket_dir() -> Path:
    """A short folder for a Unix socket (their paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="tkv-", dir="/tmp"))


@dataclass
class Served:
    """A running server, its store, and client channels to it (closed by ``close``)."""

    server: TierKVServer
    store: TieredStore
    port: int
    socket_dir: Path
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    @property
    def tcp_target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def unix_target(self) -> str:
        return f"unix://{self.socket_dir}/s.sock"

    def stub(self, unix: bool = False) -> pb_grpc.TierKVStub:
        """A TierKV stub on a new aio channel (TCP, or the Unix socket)."""
        return pb_grpc.TierKVStub(self.channel(unix))

    def channel(self, unix: bool = False) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(
            self.unix_target if unix else self.tcp_target, options=CHANNEL_OPTIONS
        )
        self.channels.append(channel)
        return channel

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        await self.server.stop()
        self.store.close(flush=False)  # idempotent: stop() closed it already
        shutil.rmtree(self.socket_dir, ignore_errors=True)


async def serve(
    root: Path, *, tokens: dict[str, str] | None = None, host_blocks: int = 64,
    disk_blocks: int = 1024, page_bytes: int = PAGE_BYTES, host_bytes: int | None = None,
    disk_bytes: int | None = None, gpu_bytes: int = 0, verify_commit: bool = False,
    servicer: Callable[[ServiceConfig], TierKVServicer] | None = None, **service_fields: Any,
) -> Served:
    """Start a real server on a Unix socket and ``127.0.0.1:0`` in front of a fresh store;
    ``servicer`` builds the servicer from the server's config (default: the real one)."""
    root.mkdir(parents=True, exist_ok=True)
    store = TieredStore(
        store_config(root, host_blocks, disk_blocks, page_bytes, host_bytes, disk_bytes, gpu_bytes,
                     verify_commit)
    )
    socket_dir = short_socket_dir()
    config = ServiceConfig(
        listen=(f"unix://{socket_dir}/s.sock", "127.0.0.1:0"),
        tokens=dict(TOKENS if tokens is None else tokens),
        **service_fields,
    )
    try:
        server, port = await create_server(
            config, store, servicer(config) if servicer is not None else None
        )
    except BaseException:
        store.close(flush=False)
        shutil.rmtree(socket_dir, ignore_errors=True)
        raise
    assert port > 0
    return Served(server, store, port, socket_dir)


@contextlib.asynccontextmanager
async def serving(root: Path, **serve_args: Any) -> AsyncIterator[Served]:
    """``serve`` for ``async with``: the server is closed at the end."""
    handle = await serve(root, **serve_args)
    try:
        yield handle
    finally:
        await handle.close()


class BackgroundServer:
    """``serve`` on its own event loop in a thread, for synchronous clients (the client SDK,
    hypothesis, the vLLM connector)."""

    def __init__(self, root: Path, **serve_args: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.served: Served = self.call(serve(root, **serve_args))

    def call(self, coroutine: Any, timeout_s: float = 60.0) -> Any:
        """Run ``coroutine`` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    @property
    def target(self) -> str:
        return self.served.tcp_target

    @property
    def tcp_target(self) -> str:
        return self.served.tcp_target

    @property
    def unix_target(self) -> str:
        return self.served.unix_target

    @property
    def store(self) -> TieredStore:
        return self.served.store

    def close(self) -> None:
        try:
            self.call(self.served.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            with contextlib.suppress(RuntimeError):
                self.loop.close()



# --- a `tierkv serve` subprocess ---------------------------------------------------------------

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


def stream_client(sidecar: Sidecar, **settings: Any) -> Client:
    return Client(sidecar.tcp_target, use_shm=False, **settings)


def shm_client(sidecar: Sidecar, **settings: Any) -> Client:
    client = Client(sidecar.unix_target, **settings)
    assert client.uses_shared_memory
    return client




def tokens_saved(port: int, model_id: str) -> float:
    """``tierkv_prefill_tokens_saved_total`` of ``model_id`` (every tenant's), scraped from a
    real server's metrics endpoint on ``port``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode("utf-8")
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == "tierkv_prefill_tokens_saved_total"
               and sample.labels.get("model") == model_id)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel's pick), for servers that must be
    told a port (metrics, Prometheus) rather than pick one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


INTERRUPTIBLE = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
"""Code a child the test will Ctrl-C runs first: a shell running the suite in the background
(``cmd &``, no job control) starts it with SIGINT ignored, as POSIX asks, every child inherits
that, and Python then installs no KeyboardInterrupt handler. (Not a ``preexec_fn``: unsafe in a
process with threads, as every test with a ``BackgroundServer`` is.)"""


def interruptible_tierkv(*args: str) -> list[str]:
    """The command line of ``python -m tierkv <args>`` in a child that Ctrl-C reaches."""
    code = INTERRUPTIBLE + "import runpy; runpy.run_module('tierkv', run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", code, *args]
