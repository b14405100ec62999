"""What ``pip install tierkv`` puts into an environment: one top-level package, ``tierkv``.

The gRPC server's code lives in the repository's ``service/`` folder but installs as
``tierkv.service``; a top-level ``service`` module would collide with any other package's. The
wheel is built from a copy of the sources (so the checkout gains no ``build/`` folder), installed
into a fresh virtualenv without its dependencies, and imported from outside the checkout, with
the dependencies borrowed from the running environment.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What a wheel is built from (the link tierkv/service -> ../service is copied as a link).
SOURCES = ("pyproject.toml", "README.md", "tierkv", "service")


def _run(*argv: str | Path, cwd: Path) -> str:
    result = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, f"{argv}: {result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the tierkv wheel installed; returns its python."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    wheels = root / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", wheels, source, cwd=root)
    (wheel,) = wheels.glob("tierkv-*.whl")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel, cwd=root)
    # The dependencies (grpcio, torch, ...) come from this environment, after the venv's own
    # site-packages: a plain path entry, so this environment's editable tierkv stays out.
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                     cwd=root).strip())
    (site / "borrowed.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def _top_level_names(python: Path) -> set[str]:
    """The first path component of every file the wheel installed into site-packages."""
    code = (
        "import importlib.metadata as m\n"
        "files = m.distribution('tierkv').files or []\n"
        "print('\\n'.join(sorted({f.parts[0] for f in files})))\n"
    )
    return set(_run(python, "-c", code, cwd=python.parent).split())


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_package(installed: Path) -> None:
    names = _top_level_names(installed) - {"..", "tierkv-0.1.0.dist-info"}
    assert names == {"tierkv"}


@pytest.mark.slow
def test_the_server_imports_as_tierkv_service_and_service_is_not_a_module(installed: Path) -> None:
    code = (
        "import importlib.util, pathlib, sys\n"
        "import tierkv.service.server, tierkv.service.servicer\n"
        "import tierkv.cli.serve_cmd\n"
        "assert importlib.util.find_spec('service') is None, importlib.util.find_spec('service')\n"
        "path = pathlib.Path(tierkv.service.server.__file__)\n"
        "assert path.is_relative_to(sys.prefix), path\n"
        "print('ok')\n"
    )
    # From outside the checkout: its service/ folder must not be what answers.
    assert _run(installed, "-c", code, cwd=installed.parent).strip() == "ok"


# Import names of the runtime dependencies (distribution name -> the module it installs).
_MODULE_OF_DISTRIBUTION = {"grpcio": "grpc", "grpcio-health-checking": "grpc_health",
                           "grpcio-reflection": "grpc_reflection", "protobuf": "google",
                           "prometheus-client": "prometheus_client"}
# Imported only inside the functions that need them, and named in the error when missing.
_OPTIONAL_MODULES = {"transformers"}


def test_everything_the_server_and_the_store_import_is_a_runtime_dependency() -> None:
    """What ``scripts/serve`` installs runs ``tierkv serve`` with every tier: a module that the
    package (the benches and the engine integrations aside) or the server imports must come
    from ``[project].dependencies``, not only from the dev extras (redis-py once did)."""
    import ast
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = set()
    for requirement in project["dependencies"]:
        name = re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].lower()
        installed.add(_MODULE_OF_DISTRIBUTION.get(name, name))
    imported: dict[str, str] = {}
    for folder in (ROOT / "tierkv", ROOT / "service"):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(ROOT).parts
            if parts[:2] in (("tierkv", "bench"), ("tierkv", "integrations"), ("tierkv", "service")):
                continue  # tierkv/service is a link to service/
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                         and node.module else [])
                for name in names:
                    imported.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    third_party = {module: where for module, where in imported.items()
                   if module not in sys.stdlib_module_names and module != "tierkv"}
    missing = {module: where for module, where in third_party.items()
               if module not in installed and module not in _OPTIONAL_MODULES}
    assert not missing, f"imported but not a runtime dependency: {missing}"
