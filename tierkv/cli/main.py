"""Entry point of the ``tierkv`` console script.

Each sub-command lives in its own module exposing ``register(subparsers)``, which adds its parser
and sets ``func`` (``args -> exit code``) as the parser default.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tierkv.cli import (
    bench_cmd,
    clear_cmd,
    demo_cmd,
    health_cmd,
    inspect_cmd,
    serve_cmd,
    size_cmd,
    stats_cmd,
)
from tierkv.errors import TierKVError


def build_parser() -> argparse.ArgumentParser:
    """The full ``tierkv`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="tierkv", description="Tiered KV-cache store for LLM inference."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    size_cmd.register(subparsers)
    serve_cmd.register(subparsers)
    bench_cmd.register(subparsers)
    demo_cmd.register(subparsers)
    health_cmd.register(subparsers)
    stats_cmd.register(subparsers)
    inspect_cmd.register(subparsers)
    clear_cmd.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tierkv`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except TierKVError as exc:
        print(f"tierkv {args.command}: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
