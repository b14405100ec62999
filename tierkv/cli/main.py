"""Entry point of the ``tierkv`` console script.

Each sub-command lives in its own module exposing ``register(subparsers)``, which adds its parser
and sets ``func`` (``args -> exit code``) as the parser default. Only the module of the command
being run is imported (all of them for ``tierkv --help`` or an unknown command): most import
torch, which costs more than a second, and ``tierkv health`` runs every few seconds in a
container's health check.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from tierkv.errors import TierKVError

COMMANDS = {
    "size": "tierkv.cli.size_cmd",
    "serve": "tierkv.cli.serve_cmd",
    "bench": "tierkv.cli.bench_cmd",
    "demo": "tierkv.cli.demo_cmd",
    "health": "tierkv.cli.health_cmd",
    "stats": "tierkv.cli.stats_cmd",
    "inspect": "tierkv.cli.inspect_cmd",
    "clear": "tierkv.cli.clear_cmd",
}
"""Command name -> its module, in the order ``tierkv --help`` lists them."""
INTERRUPTED_EXIT = 130


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``tierkv`` argument parser: with every command, or with ``command``'s alone."""
    parser = argparse.ArgumentParser(
        prog="tierkv", description="Tiered KV-cache store for LLM inference."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        if command is None or name == command:
            importlib.import_module(module).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tierkv`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(command).parse_args(argv)
    try:
        code: int = args.func(args)
    except TierKVError as exc:
        print(f"tierkv {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT, no traceback
        print(f"tierkv {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    return code


if __name__ == "__main__":
    sys.exit(main())
