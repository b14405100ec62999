"""Attacks on deploy/ and ``tierkv health`` (a review's tests).

What tests/test_deploy_manifests.py left unchecked, found by mutating copies of the files:
the uid of every container that maps the slab, the time a pod gives the sidecar to flush, the
claim that holds the disk tier, the files compose mounts, the test files the comments name; and
that its probe check refuses what kubelet cannot reach. Then ``tierkv health`` against real
servers: SERVING, NOT_SERVING before a store is attached, a TLS listener, nothing listening.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_deploy_manifests import CONTAINERS, IMAGE, _resolve, check_probe
from tests.support.deploy_files import DEPLOY, k8s_manifests, pod_spec, read_yaml, size_of
from tests.support.harness import serving, short_socket_dir
from tierkv.cli import main as cli_main
from tierkv.cli.health_cmd import check
from tierkv.service.config import ServiceConfig, TlsConfig
from tierkv.service.server import SERVICE_NAME, TierKVServer

CHECKOUT = DEPLOY.parent
FLUSH_S = 60
"""What a pod must give the sidecar between SIGTERM and SIGKILL (systemd's unit is held to it)."""


def _image_uid() -> int:
    match = re.search(r"useradd .*--uid (\d+)", (DEPLOY / "Dockerfile").read_text())
    assert match
    return int(match.group(1))


def _seconds(duration: str) -> float:
    """A compose duration (``2m``, ``90s``, ``1m30s``)."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, duration
    return int(parts.group(1) or 0) * 60 + int(parts.group(2) or 0)


# --- what the manifests must also say -----------------------------------------------------


@pytest.mark.parametrize(("where", "spec", "container"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_every_container_that_maps_the_slab_runs_as_the_images_uid(
    where: str, spec: dict[str, Any], container: dict[str, Any]
) -> None:
    """The slab is mode 0600: a worker of another uid (a container-level runAsUser) cannot map
    it, and its client falls back to streams without a word."""
    shm_volume = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    pod_uid = spec["securityContext"]["runAsUser"]
    for other in spec["containers"]:
        if any(m["name"] == shm_volume for m in other.get("volumeMounts", [])):
            uid = other.get("securityContext", {}).get("runAsUser", pod_uid)
            assert uid == _image_uid(), f"{where}: {other['name']} runs as {uid}"


@pytest.mark.parametrize(("where", "spec", "container"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_every_pod_gives_the_sidecar_time_to_flush(
    where: str, spec: dict[str, Any], container: dict[str, Any]
) -> None:
    assert spec.get("terminationGracePeriodSeconds", 30) >= FLUSH_S, where


def test_the_compose_sidecar_gets_time_to_flush_and_mounts_files_that_exist() -> None:
    (compose,) = read_yaml(DEPLOY / "compose.yaml")
    assert _seconds(compose["services"]["tierkv"].get("stop_grace_period", "10s")) >= FLUSH_S
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):  # a bind mount, not a named volume
                assert (DEPLOY / source).exists(), f"{name}: {volume}"


def test_a_claim_named_by_a_pod_exists_and_holds_the_disk_budget() -> None:
    for name, docs in k8s_manifests().items():
        claims = {doc["metadata"]["name"]: doc for doc in docs
                  if doc["kind"] == "PersistentVolumeClaim"}
        for doc in docs:
            spec = pod_spec(doc)
            for container in (spec or {}).get("containers", []):
                if container["image"] != "tierkv:latest":
                    continue
                assert spec is not None
                env = {item["name"]: str(item["value"]) for item in container.get("env", [])}
                settings = _resolve([str(a) for a in container.get("args", [])], env)
                mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
                volume = next(v for v in spec["volumes"]
                              if v["name"] == mounts[settings["disk_path"]])
                if "persistentVolumeClaim" not in volume:
                    continue
                claim = claims[volume["persistentVolumeClaim"]["claimName"]]
                storage = claim["spec"]["resources"]["requests"]["storage"]
                assert size_of(storage) >= settings["disk_bytes"], f"{name}: {storage}"


def test_every_test_file_a_deploy_file_names_exists() -> None:
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file():
            for named in re.findall(r"tests/[\w/]+\.py", path.read_text()):
                assert (CHECKOUT / named).is_file(), f"{path.name} names {named}"


# --- the probe check refuses what kubelet cannot reach ------------------------------------


def test_a_kubelet_probe_of_a_loopback_listener_is_refused() -> None:
    """The manifests had grpc probes of port 50051 on a server listening on 127.0.0.1:50051:
    kubelet dials the pod's IP, so no probe ever passed (the pods never got ready, and the
    liveness probe restarted them)."""
    loopback = _resolve(["--listen", "unix:///run/tierkv/tierkv.sock",
                         "--listen", "127.0.0.1:50051"], {})
    with pytest.raises(AssertionError, match="kubelet dials the pod's IP"):
        check_probe({"grpc": {"port": 50051}}, loopback)
    every = _resolve(["--listen", "0.0.0.0:50051"], {})
    check_probe({"grpc": {"port": 50051}}, every)
    health = [f"{IMAGE.workdir}/{IMAGE.entrypoint[0]}", "health", "--target",
              "unix:///run/tierkv/tierkv.sock"]
    check_probe({"exec": {"command": health}, "timeoutSeconds": 10}, loopback)
    with pytest.raises(AssertionError):  # kubelet's default timeout: 1 s
        check_probe({"exec": {"command": health}}, loopback)
    with pytest.raises(AssertionError):  # a socket the server does not listen on
        check_probe({"exec": {"command": [*health[:3], "unix:///tmp/x.sock"]},
                     "timeoutSeconds": 10}, loopback)


# --- tierkv health against real servers ---------------------------------------------------


@pytest.mark.asyncio
async def test_health_says_serving_and_exits_0_even_with_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    async with serving(tmp_path / "store") as served:  # tokens: health needs none
        for target in (served.unix_target, served.tcp_target):
            assert await _main(["health", "--target", target]) == 0
            assert await _main(["health", "--target", target, "--service", SERVICE_NAME]) == 0
        assert await _main(["health", "--target", served.tcp_target, "--service", "no.Such"]) == 1
    assert capsys.readouterr().out.count("SERVING") == 4


@pytest.mark.asyncio
async def test_health_exits_1_before_the_store_is_attached_and_2_when_nothing_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    socket_dir = short_socket_dir()
    server = TierKVServer(ServiceConfig(listen=(f"unix://{socket_dir}/s.sock",)))
    server.bind()
    await server.start()
    try:
        assert await _main(["health", "--target", f"unix://{socket_dir}/s.sock"]) == 1
        assert "NOT_SERVING" in capsys.readouterr().err
    finally:
        await server.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
    assert await _main(["health", "--target", f"unix://{socket_dir}/s.sock",
                          "--timeout-s", "0.5", "--quiet"]) == 1  # Docker reserves 2
    assert await _main(["health", "--target", "127.0.0.1:1", "--tls-ca",
                          str(tmp_path / "missing.pem")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.strip().endswith("No such file or directory)")


@pytest.mark.asyncio
async def test_health_over_a_tls_listener(tmp_path: Path) -> None:
    """No test started a TLS listener: the certificate of 127.0.0.1, and health with and
    without its --tls-ca."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=tierkv",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True, timeout=60)
    async with serving(tmp_path / "store", tls=TlsConfig(cert, key)) as served:
        target = served.tcp_target
        assert await _check(target, tls_ca=cert) == "SERVING"
        assert await _check(target) == "UNREACHABLE"  # plain text to a TLS listener
        assert await _check(served.unix_target) == "SERVING"  # sockets stay plain


async def _check(target: str, tls_ca: Path | None = None) -> str:
    return await asyncio.to_thread(check, target, "", 3.0, tls_ca)


async def _main(argv: list[str]) -> int:
    """``tierkv <argv>`` off the loop, which serves the server it asks."""
    return await asyncio.to_thread(cli_main.main, argv)
