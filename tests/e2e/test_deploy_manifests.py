"""The files in ``deploy/`` say what the server accepts: every flag, variable, port, path, probe
and budget in them goes through the real ``tierkv serve`` parser and settings schema
(``tierkv.cli.settings.resolve``), never a copy of them.

A tierkv container's settings are resolved as the container would start: the image's ``ENV``
(deploy/Dockerfile) under the manifest's own ``env``, and the manifest's ``args`` as flags.

Beyond the flags, checked against mutated copies of the files: the uid of every container that
maps the slab, the time a pod gives the sidecar to flush, the claim that holds the disk tier,
the files compose mounts, the test files the comments name; and that the probe check refuses
what kubelet cannot reach. Then ``tierkv health`` against real servers: SERVING, NOT_SERVING
before a store is attached, a TLS listener, nothing listening.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO
from tests.support.deploy_files import (
    DEPLOY,
    TIERKV_IMAGES,
    k8s_manifests,
    pod_metadata,
    pod_spec,
    read_dockerfile,
    read_yaml,
    size_of,
    unit_values,
)
from tests.support.harness import serving, short_socket_dir
from tierkv.cli import main as cli_main
from tierkv.cli.health_cmd import check
from tierkv.cli.settings import BY_FLAG, Resolved, resolve, unknown_variables
from tierkv.config import MiB
from tierkv.service.config import ServiceConfig, TlsConfig
from tierkv.service.server import SERVICE_NAME, TierKVServer
from tierkv.sizes import parse_size

PROCESS_MEMORY_BYTES = 512 * MiB
"""What a memory limit must leave above the HOST slab for the server process itself."""
IMAGE = read_dockerfile()


def _resolve(args: list[str], env: dict[str, str]) -> Resolved:
    environ = {**IMAGE.env, **env}
    assert unknown_variables(environ) == [], "a TIERKV_* variable that is no setting"
    _check_flags(args)
    return resolve(args, environ)


def _check_flags(args: list[str]) -> None:
    # Whole flag names only: argparse would take a prefix (--host-byte), which a new flag can
    # make ambiguous.
    for arg in args:
        if arg.startswith("--"):
            assert arg.split("=", 1)[0] in BY_FLAG, f"{arg}: not a flag of tierkv serve"


def _tcp_ports(settings: Resolved) -> set[int]:
    return {int(a.rsplit(":", 1)[1]) for a in settings["listen"] if not a.startswith("unix:")}


def _socket_folders(settings: Resolved) -> set[str]:
    return {str(Path(a.removeprefix("unix://")).parent)
            for a in settings["listen"] if a.startswith("unix://")}


def _tierkv_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    found = []
    for name, docs in k8s_manifests().items():
        for doc in docs:
            spec = pod_spec(doc)
            for container in (spec or {}).get("containers", []):
                if container["image"] in TIERKV_IMAGES:
                    assert spec is not None
                    spec = {**spec, "metadata": pod_metadata(doc)}  # the pod's annotations
                    found.append((f"{name}:{container['name']}", spec, container))
    return found


HEALTH_START_S = 2.0
"""What ``tierkv health`` may take to start before it asks (0.15 s here; more on a busy node)."""
ALL_INTERFACES = frozenset({"0.0.0.0", "[::]", "[::0]"})


def check_probe(probe: dict[str, Any], settings: Resolved) -> None:
    """``probe`` reaches the server from where it runs. kubelet runs an ``exec`` probe inside
    the container: it must be ``tierkv health`` on an address the server listens on, with a
    ``timeoutSeconds`` that leaves it time (kubelet's default is 1 s). kubelet dials a
    ``grpc``, ``tcpSocket`` or ``httpGet`` probe at the pod's IP, which a listener on
    127.0.0.1 never sees: its port must be on a listener of every interface."""
    if "exec" in probe:
        command = probe["exec"]["command"]
        assert command[0] in (IMAGE.entrypoint[0], f"{IMAGE.workdir}/{IMAGE.entrypoint[0]}")
        parsed = cli_main.build_parser().parse_args(command[1:])
        assert parsed.func.__module__ == "tierkv.cli.health_cmd", command
        assert parsed.target in settings["listen"], command
        assert parsed.service in ("", SERVICE_NAME), command
        assert probe.get("timeoutSeconds", 1) >= parsed.timeout_s + HEALTH_START_S, probe
        return
    (kind,) = probe.keys() & {"grpc", "tcpSocket", "httpGet"}
    port = probe[kind]["port"]
    hosts = {a.rsplit(":", 1)[0] for a in settings["listen"]
             if not a.startswith("unix:") and int(a.rsplit(":", 1)[1]) == port}
    assert hosts & ALL_INTERFACES, (
        f"a {kind} probe of port {port}: kubelet dials the pod's IP, the server listens on "
        f"{sorted(hosts) or 'no such port'} only")


CONTAINERS = _tierkv_containers()


def test_every_manifest_parses_and_names_its_kind() -> None:
    manifests = k8s_manifests()
    assert set(manifests) == {"daemonset.yaml", "sidecar-pod.yaml", "vllm-pod.yaml"}
    for docs in manifests.values():
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= doc.keys()
    assert len(CONTAINERS) == 3
    assert {doc["kind"] for doc in manifests["daemonset.yaml"]} == {"DaemonSet"}


@pytest.mark.parametrize(("where", "spec", "container"), CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_a_tierkv_container_runs_settings_the_server_accepts(
    where: str, spec: dict[str, Any], container: dict[str, Any]
) -> None:
    assert "command" not in container, "the image's ENTRYPOINT (tierkv serve) must run"
    env = {item["name"]: str(item["value"]) for item in container.get("env", [])}
    settings = _resolve([str(arg) for arg in container.get("args", [])], env)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}

    # The disk tier and the socket live on volumes, not in the container's layer.
    assert settings["disk_path"] in mounts
    assert _socket_folders(settings) and _socket_folders(settings) <= mounts.keys()
    # The probes ask the gRPC health service where the server answers them.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check_probe(container[probe], settings)
    # Metrics: the declared port is the one the server binds, on every interface.
    assert settings["metrics_port"] > 0 and settings["metrics_host"] == "0.0.0.0"
    assert {p["containerPort"] for p in container["ports"]} == {settings["metrics_port"]}
    annotations = spec.get("metadata", {}).get("annotations", {})
    if "prometheus.io/port" in annotations:
        assert int(annotations["prometheus.io/port"]) == settings["metrics_port"]
    # /dev/shm holds the HOST slab; the memory limit is the slab plus the process.
    shm = volumes[mounts["/dev/shm"]]
    if "emptyDir" in shm:
        assert shm["emptyDir"]["medium"] == "Memory"
        assert size_of(shm["emptyDir"]["sizeLimit"]) >= settings["host_bytes"]
    else:
        assert shm["hostPath"]["path"] == "/dev/shm"
    limit = size_of(container["resources"]["limits"]["memory"])
    assert limit >= settings["host_bytes"] + PROCESS_MEMORY_BYTES
    assert size_of(container["resources"]["requests"]["memory"]) <= limit
    # The uid the image runs as, so that workers of the same uid can map the slab.
    assert spec["securityContext"]["runAsUser"] == 10001


def test_the_pod_templates_keep_the_probes_and_annotations_in_the_template() -> None:
    doc = k8s_manifests()["daemonset.yaml"][0]
    template = doc["spec"]["template"]
    assert template["metadata"]["labels"] == doc["spec"]["selector"]["matchLabels"]


def test_workers_share_the_slab_and_the_socket_with_their_sidecar() -> None:
    for name in ("sidecar-pod.yaml", "vllm-pod.yaml"):
        spec = pod_spec(k8s_manifests()[name][0])
        assert spec is not None
        tierkv, *workers = spec["containers"]
        tierkv_mounts = {m["mountPath"]: m["name"] for m in tierkv["volumeMounts"]}
        for worker in workers:
            mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
            assert mounts["/dev/shm"] == tierkv_mounts["/dev/shm"], name
            assert mounts["/run/tierkv"] == tierkv_mounts["/run/tierkv"], name


def test_the_vllm_pod_configures_the_connector_the_connector_accepts() -> None:
    from tierkv.integrations.vllm.settings import ConnectorSettings

    spec = pod_spec(k8s_manifests()["vllm-pod.yaml"][0])
    assert spec is not None
    tierkv = next(c for c in spec["containers"] if c["image"] in TIERKV_IMAGES)
    vllm = next(c for c in spec["containers"] if c["name"] == "vllm")
    command = vllm["command"]
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "TierKVConnector"
    assert config["kv_role"] == "kv_both"
    # The module path names the real connector class.
    source = REPO / "tierkv" / "integrations" / "vllm"
    assert config["kv_connector_module_path"] == "tierkv.integrations.vllm"
    assert "TierKVConnector" in (source / "__init__.py").read_text()
    settings = ConnectorSettings.from_extra_config(config["kv_connector_extra_config"])
    server = _resolve([str(a) for a in tierkv["args"]], {})
    assert settings.address in server["listen"]


def test_the_compose_file_runs_the_sidecar_a_worker_and_prometheus() -> None:
    (compose,) = read_yaml(DEPLOY / "compose.yaml")
    services = compose["services"]
    assert set(services) == {"tierkv", "worker", "prometheus"}
    sidecar = services["tierkv"]
    assert sidecar["build"]["dockerfile"] == "deploy/Dockerfile"
    settings = _resolve(sidecar["command"], dict(sidecar.get("environment", {})))
    assert parse_size(sidecar["shm_size"].upper().replace("GB", "GiB")) >= settings["host_bytes"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in sidecar["volumes"]}
    assert settings["disk_path"] in mounts
    (socket_folder,) = _socket_folders(settings)
    assert socket_folder in mounts
    assert any(p.endswith(f":{settings['metrics_port']}") for p in sidecar["ports"])
    # The worker: a real tierkv command line, aimed at the sidecar's socket, through the
    # sidecar's IPC namespace (its /dev/shm) and socket volume, as the image's uid.
    worker = services["worker"]
    parsed = cli_main.build_parser().parse_args(worker["command"])
    assert parsed.target in settings["listen"]
    assert worker["ipc"] == "service:tierkv" and sidecar["ipc"] == "shareable"
    assert f"{mounts[socket_folder]}:{socket_folder}" in worker["volumes"]
    assert worker["user"] == "10001:10001"
    assert worker["depends_on"]["tierkv"]["condition"] == "service_healthy"
    assert IMAGE.healthcheck, "service_healthy needs the image's HEALTHCHECK"
    # Prometheus scrapes the port the server binds.
    (scrape,) = read_yaml(DEPLOY / "prometheus.yml")
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"tierkv:{settings['metrics_port']}"]


def test_the_image_runs_tierkv_as_a_non_root_user_with_a_health_check() -> None:
    assert IMAGE.user == "tierkv"
    assert "useradd --system --uid 10001" in (DEPLOY / "Dockerfile").read_text()
    assert IMAGE.entrypoint == [".venv/bin/tierkv", "serve"]
    settings = _resolve(IMAGE.cmd, {})
    assert IMAGE.workdir == "/opt/tierkv"
    assert settings["disk_path"] in IMAGE.volumes
    assert set(IMAGE.expose) == _tcp_ports(settings) | {settings["metrics_port"]}
    health = cli_main.build_parser().parse_args(IMAGE.healthcheck[1:])
    assert IMAGE.healthcheck[0] == IMAGE.entrypoint[0]
    assert health.func.__module__ == "tierkv.cli.health_cmd"
    assert health.target in settings["listen"]
    assert float(IMAGE.healthcheck_options["timeout"].removesuffix("s")) > health.timeout_s


def _unit_command() -> tuple[list[str], dict[str, str]]:
    (exec_start,) = unit_values(DEPLOY / "tierkv.service", "ExecStart")
    env = dict(item.split("=", 1) for value in unit_values(DEPLOY / "tierkv.service", "Environment")
               for item in shlex.split(value))
    return shlex.split(exec_start), env


def test_the_systemd_unit_starts_settings_the_server_accepts() -> None:
    argv, env = _unit_command()
    assert argv[0] == "/opt/tierkv/.venv/bin/tierkv" and argv[1] == "serve"
    assert unknown_variables(env) == []
    _check_flags(argv[2:])
    settings = resolve(argv[2:], env)
    # StateDirectory=tierkv is /var/lib/tierkv, RuntimeDirectory=tierkv is /run/tierkv: owned
    # by the unit's user, so the disk tier and the socket need no root.
    unit = DEPLOY / "tierkv.service"
    assert unit_values(unit, "StateDirectory") == ["tierkv"]
    assert settings["disk_path"] == "/var/lib/tierkv"
    assert unit_values(unit, "RuntimeDirectory") == ["tierkv"]
    assert _socket_folders(settings) == {"/run/tierkv"}
    assert unit_values(unit, "User") == ["tierkv"]
    assert float(unit_values(unit, "TimeoutStopSec")[0]) >= 60


def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze (Debian's systemd package) is on this machine's kind"
    # The unit as written, with /opt/tierkv pointing at this checkout: verify checks that
    # ExecStart's program exists and is executable.
    checkout = Path(sys.prefix).parent
    text = (DEPLOY / "tierkv.service").read_text().replace("/opt/tierkv", str(checkout))
    unit = tmp_path / "tierkv.service"
    unit.write_text(text)
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # Unknown keys and bad values are only warnings ("..., ignoring"): none may appear.
    assert "tierkv.service" not in output, output


# --- beyond the flags: uids, grace periods, claims, mounts, probes; tierkv health ---------------


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


# --- what the manifests must also say ----------------------------------------------------------


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


# --- the probe check refuses what kubelet cannot reach -----------------------------------------


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


# --- tierkv health against real servers --------------------------------------------------------


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
