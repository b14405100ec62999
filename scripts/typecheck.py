"""mypy (strict, as ``[tool.mypy]`` in pyproject.toml says) over tierkv and its server.

    .venv/bin/python scripts/typecheck.py [mypy's options and files]

The server's code lives in the top-level folder ``service/`` and installs as ``tierkv.service``
(setuptools' ``package-dir``). mypy names a file after the folders above it, so on its own it
would check ``service/server.py`` as ``service.server`` and find no ``tierkv.service`` for
``from tierkv.service.config import ...`` (it does not follow the editable install's import
hook either). This runs mypy's own option processing and build, with each file under
``service/`` named ``tierkv.service.*``: imports of the server from tierkv (the CLI), of tierkv
from the server, and within the server all resolve to the checked files. The server's package is
always part of the build, since nothing else could find it. Output and exit status are mypy's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mypy import build, util
from mypy.errors import CompileError
from mypy.fscache import FileSystemCache
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent
SERVICE = ROOT / "service"
PACKAGE = "tierkv.service"


def _service_module(path: Path) -> str | None:
    """``tierkv.service.<...>`` for a file under ``service/``, else None."""
    path = path.resolve()
    if not path.is_relative_to(SERVICE) or path.suffix not in (".py", ".pyi"):
        return None
    parts = path.relative_to(SERVICE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def sources_with_the_service_named(sources: list[BuildSource]) -> list[BuildSource]:
    """``sources`` with the files under ``service/`` renamed, and all of them present."""
    named: list[BuildSource] = []
    seen: set[str] = set()
    candidates = [*sources, *(BuildSource(str(p), None) for p in sorted(SERVICE.rglob("*.py")))]
    for source in candidates:
        module = _service_module(Path(source.path)) if source.path else None
        renamed = source if module is None else BuildSource(
            source.path, module, source.text, str(ROOT), source.followed)
        if renamed.module not in seen:
            seen.add(renamed.module)
            named.append(renamed)
    return named


def main(args: list[str]) -> int:
    os.chdir(ROOT)  # pyproject.toml's [tool.mypy] and its `files`; file arguments are relative to it
    fscache = FileSystemCache()
    sources, options = process_options(args, stdout=sys.stdout, stderr=sys.stderr, fscache=fscache)
    sources = sources_with_the_service_named(sources)
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    messages: list[str] = []

    def flush_errors(filename: str | None, new_messages: list[str], serious: bool) -> None:
        if options.pretty:
            new_messages = formatter.fit_in_terminal(new_messages)
        messages.extend(new_messages)
        stream = sys.stderr if serious else sys.stdout
        for message in new_messages:
            stream.write((formatter.colorize(message) if options.color_output else message) + "\n")
        stream.flush()

    blockers = False
    try:
        result = build.build(sources, options, None, flush_errors, fscache, sys.stdout, sys.stderr)
        close = getattr(result.manager.metastore, "close", None)  # mypy >= 1.15 (its SQLite cache)
        if close is not None:
            close()
    except CompileError:
        blockers = True
    n_errors, n_notes, n_files = util.count_stats(messages)
    if options.error_summary:
        if n_errors:
            summary = formatter.format_error(n_errors, n_files, len(sources), blockers=blockers,
                                             use_color=options.color_output)
        else:
            summary = formatter.format_success(len(sources), options.color_output)
        print(summary, flush=True)
    if messages and n_notes < len(messages):
        return 2 if blockers else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
