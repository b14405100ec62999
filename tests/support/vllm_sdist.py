"""vLLM 0.32.0's own connector unit tests, fetched from its source distribution on PyPI at test
time (never copied into this repository) and cached: ``vllm_tests_root()``.

``pip download --no-binary`` cannot fetch vLLM's sdist here: pip prepares an sdist's metadata
before it saves it, which for vLLM runs its build (it needs CUDA or ``VLLM_TARGET_DEVICE`` and
its build requirements). The sdist is one file of the package index: it is read from the index
pip uses (``PIP_INDEX_URL``, else PyPI's simple API) and checked against its pinned SHA-256."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import shutil
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from platformdirs import user_cache_path

VERSION = "0.32.0"
SDIST = f"vllm-{VERSION}.tar.gz"
SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
UNIT = "tests/v1/kv_connector/unit"
# What the unit tests import beside their own folder (package markers only).
PACKAGES = ("tests/__init__.py", "tests/v1/__init__.py", "tests/v1/kv_connector/__init__.py")
FETCH_TIMEOUT_S = 300.0


def cache_dir() -> Path:
    return Path(os.environ.get("TIERKV_VLLM_SDIST_CACHE")
                or user_cache_path("tierkv") / f"vllm-{VERSION}-sdist")


def vllm_tests_root() -> Path:
    """A folder holding vLLM's ``tests/`` package with ``tests/v1/kv_connector/unit``, from the
    cached sdist (fetched once)."""
    root = cache_dir() / "tree"
    if (root / UNIT / "utils.py").exists():
        return root
    archive = _sdist()
    partial = cache_dir() / "tree.partial"
    shutil.rmtree(partial, ignore_errors=True)
    prefix = f"vllm-{VERSION}/"
    with tarfile.open(archive) as tar:
        wanted = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(prefix) and (
            m.name[len(prefix):] in PACKAGES
            or re.fullmatch(re.escape(UNIT) + r"/[^/]+\.py", m.name[len(prefix):]))]
        for member in wanted:
            member.name = member.name[len(prefix):]
            tar.extract(member, partial, filter="data")
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)
    return root


DISTRIBUTED = ("tests/distributed/__init__.py", "tests/distributed/conftest.py",
               "tests/distributed/test_events.py")
"""vLLM's KV-event test helpers: ``MockSubscriber`` (conftest) and what it imports."""


def vllm_mock_subscriber() -> type[Any]:
    """vLLM 0.32.0's own ``MockSubscriber`` (``tests/distributed/conftest.py``), from the
    cached sdist, imported as a package of its own (``_vllm_distributed``: vLLM's ``tests``
    package would clash with this repository's)."""
    root = cache_dir() / "distributed"
    if not all((root / name).exists() for name in DISTRIBUTED):
        prefix = f"vllm-{VERSION}/"
        partial = cache_dir() / "distributed.partial"
        shutil.rmtree(partial, ignore_errors=True)
        with tarfile.open(_sdist()) as tar:
            for name in DISTRIBUTED:
                member = tar.getmember(prefix + name)
                member.name = name.rsplit("/", 1)[1]
                tar.extract(member, partial, filter="data")
        shutil.rmtree(root, ignore_errors=True)
        partial.rename(root)
    package = "_vllm_distributed"
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            package, root / "__init__.py", submodule_search_locations=[str(root)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        spec.loader.exec_module(module)
    conftest = importlib.import_module(f"{package}.conftest")
    mock: type[Any] = conftest.MockSubscriber
    return mock


def _sdist() -> Path:
    path = cache_dir() / SDIST
    if path.exists() and _sha256(path) == SHA256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    url = _sdist_url()
    partial = path.with_suffix(".partial")
    with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response, partial.open("wb") as out:
        shutil.copyfileobj(response, out, 1 << 20)
    digest = _sha256(partial)
    if digest != SHA256:
        partial.unlink()
        raise AssertionError(f"{url}: SHA-256 {digest}, expected {SHA256}")
    partial.rename(path)
    return path


def _sdist_url() -> str:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    with urllib.request.urlopen(f"{index}/vllm/", timeout=FETCH_TIMEOUT_S) as response:
        page = response.read().decode()
    for href in re.findall(r'href="([^"]+)"', page):
        if href.split("#")[0].rsplit("/", 1)[-1] == SDIST:
            return urllib.parse.urljoin(f"{index}/vllm/", href.split("#")[0])
    raise AssertionError(f"{index}/vllm/ lists no {SDIST}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
