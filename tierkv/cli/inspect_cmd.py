"""``tierkv inspect --disk-path P``: what a disk store holds, offline and read-only.

No server is needed, and one may be running on the store: nothing on disk changes either way
(``tierkv.tiers.lmdb_readonly``). While a store no server runs on is read, a server cannot
start on it (it is refused, as by another server, until the inspection ends). Every record
is verified by the store's own parsers; those that fail (torn, flipped, foreign) are counted
and listed. Exit codes: 0 every record verified, 3 the store holds bad records, 1 the path is
not a readable tierkv disk store.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tierkv.cli.ops_common import namespaces_table, printable
from tierkv.errors import ConfigError
from tierkv.sizes import format_size
from tierkv.store import DiskReport, inspect_disk

CLEAN_EXIT = 0
NOT_A_STORE_EXIT = 1
BAD_RECORDS_EXIT = 3
_NUM_LISTED_IN_TEXT = 20


def register(subparsers: Any) -> None:
    """Add ``inspect`` to the command line."""
    parser = subparsers.add_parser(
        "inspect", help="what a disk store holds (offline, read-only)",
        description="Read a tierkv disk store (the --disk-path of tierkv serve) without "
        "changing it, with or without a server running on it: its namespaces, blocks, bytes "
        "and sessions, and every record that fails its checks. While it reads a store no "
        "server runs on, a server cannot start there. Exit 0 when every record verifies, 3 "
        "when some do not, 1 when the path is not a tierkv disk store.",
    )
    parser.add_argument("--disk-path", type=Path, required=True, help="the store's folder")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Inspect, print, and exit as the module docstring says."""
    bar = tqdm(desc="verifying", unit="B", unit_scale=True, file=sys.stderr,
               disable=not sys.stderr.isatty(), leave=False)
    try:
        with bar:
            report = inspect_disk(args.disk_path, progress=bar.update)
    except ConfigError as exc:
        print(f"tierkv inspect: {exc}", file=sys.stderr)
        return NOT_A_STORE_EXIT
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report))
    return BAD_RECORDS_EXIT if report.num_bad_records else CLEAN_EXIT


def render(report: DiskReport) -> str:
    """The report as text: totals, namespaces, bad records."""
    running = " (a server is running on it: figures of one moment)" if report.server_running else ""
    lines = [
        f"disk store {printable(str(report.path))}{running}",
        f"{len(report.namespaces)} namespaces, {report.num_blocks} blocks "
        f"({format_size(report.stored_bytes)}), {report.num_sessions} sessions, "
        f"{report.num_bad_records} bad records",
        "",
    ]
    if report.namespaces:
        lines += [namespaces_table(report.namespaces), ""]
    if report.num_bad_records:
        lines.append("bad records:")
        listed = report.bad_records[:_NUM_LISTED_IN_TEXT]
        lines += [f"  {bad.db:<10} {bad.key_hex}  {printable(bad.reason)}" for bad in listed]
        if report.num_bad_records > len(listed):
            lines.append(f"  ... and {report.num_bad_records - len(listed)} more (--json lists "
                         f"up to {len(report.bad_records)})")
    return "\n".join(lines).rstrip()
