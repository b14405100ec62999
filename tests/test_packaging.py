"""What ``pip install tierkv`` puts into an environment: one top-level package, ``tierkv``.

The gRPC server's code lives in the repository's top-level ``service/`` folder but installs as
``tierkv.service`` (pyproject.toml's ``package-dir``; there is no ``tierkv/service`` folder and
no link); a top-level ``service`` module would collide with any other package's. The sdist is
built from a copy of the sources (so the checkout gains no ``build/`` folder) and the wheel from
the unpacked sdist, as ``python -m build`` does; the wheel is installed into a fresh virtualenv
without its dependencies and imported from outside the checkout, with the dependencies borrowed
from the running environment. The editable install (``scripts/install``) is checked on the
running environment itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What the sdist is built from.
SOURCES = ("pyproject.toml", "README.md", "tierkv", "service")
# The server's modules, as files relative to service/ (and to tierkv/service/ once installed).
SERVICE_FILES = sorted(path.relative_to(ROOT / "service").as_posix()
                       for path in (ROOT / "service").rglob("*.py"))


def _without_pythonpath() -> dict[str, str]:
    """The environment for the fresh virtualenv's python: its path is its own and borrowed.pth."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def _run(*argv: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                            timeout=300, check=False, env=env)
    assert result.returncode == 0, f"{argv}: {result.stdout}\n{result.stderr}"
    return result.stdout


def test_the_repository_holds_no_symbolic_link() -> None:
    """A link is one module with two paths, and a checkout without links loses it."""
    assert shutil.which("git") is not None and (ROOT / ".git").exists(), "run from a git checkout"
    tracked = _run("git", "ls-files", "-s", "-z", cwd=ROOT).split("\0")
    assert [entry.split("\t", 1)[-1] for entry in tracked if entry.startswith("120000 ")] == []


def test_the_packages_pyproject_lists_are_the_package_folders() -> None:
    """setuptools' discovery cannot find a package that package-dir places elsewhere, so
    pyproject.toml lists them: every folder of tierkv/ with an ``__init__.py``, and the server."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"tierkv.service": "service"}
    folders = {".".join(init.parent.relative_to(ROOT).parts)
               for init in (ROOT / "tierkv").rglob("__init__.py")}
    assert sorted(setuptools["packages"]) == sorted(folders | {"tierkv.service"})
    assert (ROOT / "service" / "__init__.py").is_file()
    assert not os.path.lexists(ROOT / "tierkv" / "service"), "tierkv.service is service/, not tierkv/service"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(sdist, wheel)``: the sdist built from a copy of the sources, the wheel from it."""
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
    sdists = root / "sdists"
    code = "import sys\nfrom setuptools import build_meta\nprint(build_meta.build_sdist(sys.argv[1]))"
    sdist = sdists / _run(sys.executable, "-c", code, sdists, cwd=source).strip().splitlines()[-1]
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4+
            archive.extractall(root / "unpacked", filter="data")
        else:
            archive.extractall(root / "unpacked")  # our own sdist
    (unpacked,) = (root / "unpacked").iterdir()
    wheels = root / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", wheels, unpacked, cwd=root)
    (wheel,) = wheels.glob("tierkv-*.whl")
    return sdist, wheel


@pytest.mark.slow
def test_the_sdist_carries_the_service_folder_and_no_link(built: tuple[Path, Path]) -> None:
    sdist, _ = built
    with tarfile.open(sdist) as archive:
        members = archive.getmembers()
    names = {m.name.split("/", 1)[1] for m in members if "/" in m.name}
    assert {f"service/{name}" for name in SERVICE_FILES} <= names
    assert not any(name.startswith("tierkv/service") for name in names)
    assert [m.name for m in members if m.issym() or m.islnk()] == []


@pytest.mark.slow
def test_the_wheel_holds_the_server_inside_tierkv(built: tuple[Path, Path]) -> None:
    _, wheel = built
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"tierkv/service/{name}" for name in SERVICE_FILES} <= names
    assert {name.split("/")[0] for name in names} == {"tierkv", "tierkv-0.1.0.dist-info"}


def _borrowed_paths() -> list[str]:
    """This environment's import paths but the standard library's and the checkout's: its
    site-packages and what its ``.pth`` files add (a throwaway venv may borrow another's)."""
    stdlib = Path(sysconfig.get_path("stdlib")).resolve()
    borrowed = []
    for entry in (sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *sys.path):
        path = Path(entry or ".").resolve()
        # Any site-packages (the checkout's .venv too); else nothing of the stdlib or checkout.
        if path.is_dir() and ("site-packages" in path.parts or not (
                path.is_relative_to(stdlib) or path.is_relative_to(ROOT))):
            borrowed.append(str(path))
    return list(dict.fromkeys(borrowed))


@pytest.fixture(scope="module")
def installed(built: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the tierkv wheel installed; returns its python."""
    _, wheel = built
    root = tmp_path_factory.mktemp("installed")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel, cwd=root,
         env=_without_pythonpath())
    # The dependencies (grpcio, torch, ...) come from this environment, after the venv's own
    # site-packages: plain path entries, so this environment's editable tierkv (an import hook
    # that only its own .pth file installs) stays out.
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                     cwd=root, env=_without_pythonpath()).strip())
    (site / "borrowed.pth").write_text("".join(f"{path}\n" for path in _borrowed_paths()))
    return python


def _top_level_names(python: Path) -> set[str]:
    """The first path component of every file the wheel installed into site-packages."""
    code = (
        "import importlib.metadata as m\n"
        "files = m.distribution('tierkv').files or []\n"
        "print('\\n'.join(sorted({f.parts[0] for f in files})))\n"
    )
    return set(_run(python, "-c", code, cwd=python.parent, env=_without_pythonpath()).split())


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
    assert _run(installed, "-c", code, cwd=installed.parent, env=_without_pythonpath()).strip() == "ok"


def test_the_editable_install_maps_tierkv_service_to_the_service_folder(tmp_path: Path) -> None:
    """``scripts/install`` installs the checkout editable: setuptools' import hook maps
    ``tierkv`` to tierkv/ and ``tierkv.service`` to service/, and puts no folder of the checkout
    on the path (no top-level ``service``). Checked from outside the checkout."""
    code = (
        "import importlib.util, json\n"
        "spec = importlib.util.find_spec('tierkv')\n"
        "result = {'tierkv': spec.origin if spec else None}\n"
        "if spec:\n"
        "    server = importlib.util.find_spec('tierkv.service.server')\n"
        "    result['server'] = server.origin if server else None\n"
        "    result['service'] = str(importlib.util.find_spec('service'))\n"
        "print(json.dumps(result))\n"
    )
    # This environment as it is, less any path into the checkout (which would answer `service`).
    outside = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
               if entry and not Path(entry).resolve().is_relative_to(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(outside)}
    found = json.loads(_run(sys.executable, "-c", code, cwd=tmp_path, env=env))
    assert found["tierkv"] is not None and Path(found["tierkv"]).is_relative_to(ROOT), (
        f"this environment's tierkv is {found['tierkv']}, not this checkout's: re-run "
        "scripts/install --dev here")
    assert found["server"] == str(ROOT / "service" / "server.py"), (
        f"{found}: an editable install from before package-dir? re-run scripts/install --dev")
    assert found["service"] == "None"


# Import names of the runtime dependencies (distribution name -> the module it installs).
_MODULE_OF_DISTRIBUTION = {"grpcio": "grpc", "grpcio-health-checking": "grpc_health",
                           "grpcio-reflection": "grpc_reflection", "protobuf": "google",
                           "prometheus-client": "prometheus_client", "pyzmq": "zmq"}
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
            if parts[:2] in (("tierkv", "bench"), ("tierkv", "integrations")):
                continue
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
