"""Imports flow one way: the rules of the package boundary, checked on the source.

- ``tierkv.types`` (the result types), ``tierkv.checks`` (the checks of caller input) and
  ``tierkv.block_store`` (the calls both sides offer) sit below both sides: the store and the
  client import them; they import neither.
- ``tierkv.client`` imports the wire (``tierkv.wire``), the shared-memory layouts
  (``tierkv.shm``) and public modules, never the store (not even its package), its tiers or the
  server: a process that imports the client loads neither the store nor LMDB.
- ``tierkv.service`` uses the store's public API only (``tierkv.store`` itself), never the
  store's modules, the tiers or the page allocator, and never the client.
- ``tierkv.wire`` and ``tierkv.shm`` are below both sides: they import neither.
- The store and the tiers never import the server or the client.
- The eviction policies (``tierkv.eviction``, with the frequencies and the filter it reads) sit
  below the store: the store gives them its books, they import neither it nor the tiers.

Every ``import`` counts, including those inside functions.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each package's files are: tierkv/, except the server's, which is the top-level service/
# folder (installed as tierkv.service; pyproject.toml's package-dir).
FOLDERS = {"tierkv": ROOT / "tierkv", "tierkv.service": ROOT / "service"}

# Modules any side may import: they define public types and stand-alone functions.
PUBLIC = frozenset({
    "tierkv", "tierkv.errors", "tierkv.config", "tierkv.keys", "tierkv.checksums",
    "tierkv.codec", "tierkv.layout", "tierkv.hashing", "tierkv.logs", "tierkv.types",
    "tierkv.buffers", "tierkv.checks", "tierkv.block_store",
})
# The server may use the store's public API (the package itself) as well.
SERVER_PUBLIC = PUBLIC | {"tierkv.store"}
BELOW_BOTH_SIDES = ("tierkv.store", "tierkv.tiers", "tierkv.client", "tierkv.service",
                    "tierkv.integrations", "tierkv.cli")


def _folder(name: str) -> Path:
    """Where the package or module ``name`` would be (its folder, or its file less ``.py``)."""
    base = max((p for p in FOLDERS if _within(name, p)), key=len)
    return FOLDERS[base].joinpath(*name.split(".")[base.count(".") + 1:])


def _all_modules() -> Iterator[tuple[str, Path]]:
    """``(dotted name, path)`` of every module of tierkv, the server's included."""
    for base, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join((base, *parts)), path


def _modules(package: str) -> Iterator[tuple[str, Path]]:
    """``(dotted name, path)`` of every module of ``package``."""
    found = [(name, path) for name, path in _all_modules() if _within(name, package)]
    assert found, f"no modules of {package}"
    yield from found


def _imports(module: str, path: Path) -> Iterator[tuple[int, str]]:
    """``(line, imported module)`` for every import in the file (once per module a statement
    names)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            # `from tierkv.store import leases` imports the module tierkv.store.leases.
            folder = _folder(name) if _within(name, "tierkv") else None
            names = {
                f"{name}.{alias.name}"
                if folder is not None and (folder.joinpath(alias.name + ".py").exists()
                                           or folder.joinpath(alias.name).is_dir())
                else name
                for alias in node.names
            }
            for imported in sorted(names):
                yield node.lineno, imported


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(package: str, allowed: tuple[str, ...], also: frozenset[str]) -> list[str]:
    """Imports of tierkv modules by ``package`` that are neither in ``allowed`` packages (or
    ``package`` itself) nor in ``also``."""
    found = []
    for module, path in _modules(package):
        for line, name in _imports(module, path):
            if not _within(name, "tierkv") or name in also:
                continue
            if any(_within(name, p) for p in (package, *allowed)):
                continue
            found.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    return found


def _forbidden(package: str, forbidden: tuple[str, ...]) -> list[str]:
    """Imports by ``package`` of anything inside ``forbidden`` packages."""
    return [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for module, path in _modules(package)
        for line, name in _imports(module, path)
        if any(_within(name, p) for p in forbidden)
    ]


def test_the_client_imports_the_wire_the_shared_memory_view_and_public_types_only() -> None:
    assert _violations("tierkv.client", ("tierkv.wire", "tierkv.shm"), PUBLIC) == []


def test_the_client_never_imports_the_store_its_tiers_or_the_server() -> None:
    assert _forbidden("tierkv.client", ("tierkv.store", "tierkv.tiers", "tierkv.service")) == []


def test_importing_the_client_loads_neither_the_store_nor_lmdb() -> None:
    code = ("import sys, tierkv.client; print(sorted(m for m in sys.modules if m == 'lmdb' or "
            "m.startswith(('tierkv.store', 'tierkv.tiers', 'tierkv.service'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_service_uses_the_stores_public_api_only() -> None:
    assert _violations("tierkv.service", ("tierkv.wire", "tierkv.shm"), SERVER_PUBLIC) == []


@pytest.mark.parametrize("module", ["tierkv.types", "tierkv.checks", "tierkv.block_store"])
def test_the_result_types_the_checks_and_the_protocol_sit_below_both_sides(module: str) -> None:
    path = ROOT / "tierkv" / (module.split(".")[1] + ".py")
    assert [name for _, name in _imports(module, path)
            if any(_within(name, p) for p in BELOW_BOTH_SIDES)] == []


@pytest.mark.parametrize("module", ["tierkv.eviction", "tierkv.admission", "tierkv.frequency"])
def test_the_eviction_policies_sit_below_the_store(module: str) -> None:
    path = ROOT / "tierkv" / (module.split(".")[1] + ".py")
    assert [name for _, name in _imports(module, path)
            if any(_within(name, p) for p in BELOW_BOTH_SIDES)] == []


@pytest.mark.parametrize("package", ["tierkv.wire", "tierkv.shm"])
def test_the_wire_and_the_shared_memory_layouts_sit_below_both_sides(package: str) -> None:
    assert _forbidden(package, BELOW_BOTH_SIDES) == []


@pytest.mark.parametrize("package", ["tierkv.store", "tierkv.tiers"])
def test_the_store_never_imports_the_server_or_the_client(package: str) -> None:
    assert _forbidden(package, ("tierkv.service", "tierkv.client")) == []


def test_the_rules_see_imports_inside_functions_and_from_imports_of_modules(
        tmp_path: Path) -> None:
    # The checker itself: a lazy `from tierkv.store import leases` is a store internal.
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from tierkv.store import leases\n    import tierkv.paging\n")
    assert [name for _, name in _imports("tierkv.client.probe", path)] == [
        "tierkv.store.leases", "tierkv.paging"]


@pytest.mark.parametrize(("module", "line", "rule"), [
    ("tierkv.client.probe", "from tierkv.store import TieredStore", "client"),
    ("tierkv.client.probe", "from tierkv.types import StoreStats\nimport tierkv.tiers.disk", "client"),
    ("tierkv.service.probe", "from tierkv.store.leases import Leases", "service"),
    ("tierkv.types", "from tierkv.store import TieredStore", "below"),
    ("tierkv.eviction", "from tierkv.store.tenants import TenantShare", "below"),
])
def test_a_probe_that_breaks_a_rule_is_caught(tmp_path: Path, module: str, line: str,
                                              rule: str) -> None:
    path = tmp_path / "probe.py"
    path.write_text(f"def f():\n    {line.replace(chr(10), chr(10) + '    ')}\n")
    names = [name for _, name in _imports(module, path)]
    if rule == "client":
        broken = [n for n in names if any(_within(n, p) for p in ("tierkv.store", "tierkv.tiers"))]
    elif rule == "service":
        broken = [n for n in names if _within(n, "tierkv") and n not in SERVER_PUBLIC]
    else:
        broken = [n for n in names if any(_within(n, p) for p in BELOW_BOTH_SIDES)]
    assert broken, f"{line!r} should break the {rule} rule"


def test_the_rules_see_the_servers_modules_under_their_installed_names() -> None:
    # service/ is the package tierkv.service: its modules are checked, named as they import.
    modules = dict(_modules("tierkv.service"))
    assert modules["tierkv.service"] == ROOT / "service" / "__init__.py"
    assert modules["tierkv.service.server"] == ROOT / "service" / "server.py"
    assert len(modules) == len(list((ROOT / "service").rglob("*.py")))
    assert not any(_within(name, "tierkv.service") for name, _ in _modules("tierkv.client"))


# The sidecar's port on the store (``store.sidecar``: leases, the slab's facts, locate, event
# restating) is the server's: only it, the command that starts it and the benchmarks of its
# data plane reach it.
SIDECAR_USERS = ("tierkv.service", "tierkv.store", "tierkv.bench", "tierkv.cli.serve_cmd")


def _sidecar_uses(module: str, path: Path) -> Iterator[int]:
    """The lines of ``path`` that reach an attribute named ``sidecar``, or import
    ``tierkv.store.sidecar``."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "sidecar":
            yield node.lineno
    for line, name in _imports(module, path):
        if _within(name, "tierkv.store.sidecar"):
            yield line


def test_only_the_server_reaches_the_stores_sidecar_port() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}"
             for module, path in _all_modules()
             if not any(_within(module, user) for user in SIDECAR_USERS)
             for line in _sidecar_uses(module, path)]
    assert found == []


def test_a_probe_that_reaches_the_sidecar_port_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("def f(store):\n    return store.sidecar.acquire\n")
    assert list(_sidecar_uses("tierkv.client.probe", path)) == [2]
