"""Readers of the files in ``deploy/`` for the tests that check them: the Dockerfile's
instructions, the YAML manifests' containers, the systemd unit's ``ExecStart``.

They read the files as the tools that consume them would (line continuations, exec-form JSON
arrays, multi-document YAML), so that a test checks what Docker, Kubernetes or systemd would run,
not a copy of it.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support import REPO

DEPLOY = REPO / "deploy"
TIERKV_IMAGES = ("tierkv:latest",)
"""Images that run ``tierkv serve`` (their ``args`` go to the real parser)."""


@dataclass
class Dockerfile:
    """The instructions a build reads, after joining continuation lines."""

    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)
    healthcheck_options: dict[str, str] = field(default_factory=dict)
    expose: list[int] = field(default_factory=list)
    user: str = ""
    workdir: str = ""
    volumes: list[str] = field(default_factory=list)


def _logical_lines(text: str) -> list[str]:
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current)
    return lines


def _exec_form(text: str) -> list[str]:
    value = json.loads(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), text
    return value


def read_dockerfile(path: Path = DEPLOY / "Dockerfile") -> Dockerfile:
    """The Dockerfile's ENV, ENTRYPOINT, CMD, HEALTHCHECK, EXPOSE, USER, WORKDIR and VOLUME
    (exec forms only: a shell form would run under /bin/sh -c, which the image must not need)."""
    out = Dockerfile()
    for line in _logical_lines(path.read_text()):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword == "ENV":
            for item in shlex.split(rest):
                name, sep, value = item.partition("=")
                assert sep, f"ENV {item!r}: use the NAME=value form"
                out.env[name] = value
        elif keyword == "ENTRYPOINT":
            out.entrypoint = _exec_form(rest)
        elif keyword == "CMD":
            out.cmd = _exec_form(rest)
        elif keyword == "HEALTHCHECK":
            options, _, command = rest.partition("CMD ")
            out.healthcheck = _exec_form(command)
            for option in options.split():
                name, _, value = option.removeprefix("--").partition("=")
                out.healthcheck_options[name] = value
        elif keyword == "EXPOSE":
            out.expose += [int(port.split("/")[0]) for port in rest.split()]
        elif keyword == "USER":
            out.user = rest
        elif keyword == "WORKDIR":
            out.workdir = rest
        elif keyword == "VOLUME":
            out.volumes += _exec_form(rest)
    return out


def read_yaml(path: Path) -> list[dict[str, Any]]:
    """Every document of a YAML file."""
    with path.open() as file:
        return [doc for doc in yaml.safe_load_all(file) if doc is not None]


def k8s_manifests() -> dict[str, list[dict[str, Any]]]:
    """Every Kubernetes manifest in deploy/k8s, by file name."""
    return {path.name: read_yaml(path) for path in sorted((DEPLOY / "k8s").glob("*.yaml"))}


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The pod spec of a Pod, or of a workload's pod template; None for other kinds."""
    if doc["kind"] == "Pod":
        return dict(doc["spec"])
    template = doc.get("spec", {}).get("template")
    return dict(template["spec"]) if template else None


def pod_metadata(doc: dict[str, Any]) -> dict[str, Any]:
    """The metadata of a Pod, or of a workload's pod template (where its annotations are)."""
    if doc["kind"] == "Pod":
        return dict(doc.get("metadata", {}))
    return dict(doc.get("spec", {}).get("template", {}).get("metadata", {}))


def size_of(quantity: str) -> int:
    """Bytes of a Kubernetes memory quantity (``9Gi``, ``512Mi``, ``100G``)."""
    match = re.fullmatch(r"(\d+)([KMGT]i?)?", quantity)
    assert match, f"not a memory quantity: {quantity!r}"
    number, unit = int(match.group(1)), match.group(2) or ""
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    if not unit:
        return number
    base = 1024 if unit.endswith("i") else 1000
    return number * base ** powers[unit[0]]


def unit_values(path: Path, key: str) -> list[str]:
    """Every value of ``key=`` in a systemd unit file (continuations joined)."""
    values = []
    for line in _logical_lines(path.read_text()):
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            values.append(value.strip())
    return values
