"""deploy/Dockerfile's entrypoint runs here as written and becomes healthy.

No Docker engine runs on this machine, so the test does what the image would: from the checkout
(the image's ``WORKDIR``, where ``COPY . .`` puts it, with ``.venv`` from ``scripts/install``),
with the image's ``ENV``, it runs ``ENTRYPOINT`` + ``CMD`` as written, then the ``HEALTHCHECK``
command as written until it passes, scrapes the metrics port, and stops the server with SIGTERM
as ``docker stop`` does. Only what is the machine's and not the image's is mapped: the volume
and socket folders to temporary folders (``/var/lib/tierkv`` and ``/run/tierkv`` belong to this
machine) and the two ports to free ones (tests run side by side). It runs as this machine's
user, not the image's uid 10001: here ``.venv``'s interpreter links into root's home (mode 0700),
which another uid cannot execute, while the image's venv is built from /usr/local's Python.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.deploy_files import read_dockerfile
from tests.support.harness import free_port

CHECKOUT = REPO
START_TIMEOUT_S = 120.0


class MappedImage:
    """The Dockerfile's commands with the machine's paths and ports mapped (see the module)."""

    def __init__(self, root: Path) -> None:
        self.image = read_dockerfile()
        self.folders = {"/var/lib/tierkv": root / "lib", "/run/tierkv": root / "run"}
        self.ports = {"50051": str(free_port()), "9433": str(free_port())}
        for folder in [*self.folders.values(), root / "home"]:
            folder.mkdir(parents=True)
        self.home = root / "home"

    def map(self, text: str) -> str:
        for old, new in self.folders.items():
            text = text.replace(old, str(new))
        for old, new in self.ports.items():
            text = text.replace(f":{old}", f":{new}") if ":" in text else (
                new if text == old else text)
        return text

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
        env.update({name: self.map(value) for name, value in self.image.env.items()})
        env["HOME"] = str(self.home)
        return env

    def command(self, argv: list[str]) -> list[str]:
        return [self.map(arg) for arg in argv]


@pytest.fixture
def image(tmp_path: Path) -> Iterator[MappedImage]:
    yield MappedImage(tmp_path)


def _wait_healthy(mapped: MappedImage, server: subprocess.Popen[bytes]) -> float:
    health = mapped.command(mapped.image.healthcheck)
    start = time.monotonic()
    while time.monotonic() - start < START_TIMEOUT_S:
        if server.poll() is not None:
            raise AssertionError(f"the entrypoint exited: {server.communicate()[1].decode()}")
        done = subprocess.run(health, cwd=CHECKOUT, env=mapped.environ(), capture_output=True,
                              timeout=60, check=False)
        if done.returncode == 0:
            return time.monotonic() - start
        time.sleep(1.0)
    raise AssertionError(f"not healthy after {START_TIMEOUT_S} s")


@pytest.mark.slow
def test_the_image_entrypoint_runs_as_written_and_becomes_healthy(image: MappedImage) -> None:
    argv = image.command([*image.image.entrypoint, *image.image.cmd])
    with subprocess.Popen(argv, cwd=CHECKOUT, env=image.environ(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as server:
        try:
            _wait_healthy(image, server)
            metrics_port = image.ports["9433"]
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                        timeout=10) as reply:
                body = reply.read().decode()
            assert 'tierkv_tier_capacity_bytes{tier="host"} 4.294967296e+09' in body
            # The disk tier and the socket are where the image's volumes are.
            assert (image.folders["/var/lib/tierkv"] / "data.mdb").is_file()
            assert (image.folders["/run/tierkv"] / "tierkv.sock").is_socket()
        finally:
            server.send_signal(signal.SIGTERM)  # docker stop
            stdout, stderr = server.communicate(timeout=120)
    assert server.returncode == 0, stderr.decode()[-2000:]
    ready = json.loads(stdout.decode().splitlines()[-1])
    assert ready["ready"] is True and ready["metrics_port"] == int(image.ports["9433"])
    # TIERKV_LOG_FORMAT=json: every log line is one JSON object.
    events = [json.loads(line)["event"] for line in stderr.decode().splitlines()]
    assert {"start", "ready", "shutdown"} <= set(events)


@pytest.mark.slow
def test_the_health_check_fails_while_nothing_serves(image: MappedImage) -> None:
    health = image.command(image.image.healthcheck)
    done = subprocess.run(health, cwd=CHECKOUT, env=image.environ(), capture_output=True,
                          timeout=60, check=False)
    assert done.returncode != 0
