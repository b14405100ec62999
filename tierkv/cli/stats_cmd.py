"""``tierkv stats``: a live server's tiers, counters, largest namespaces and sessions.

A readable table by default, JSON with ``--json`` (one object per refresh with ``--watch``:
JSON lines). ``--watch [SECONDS]`` refreshes until Ctrl-C. What a caller sees of namespaces is
what its token reaches: its own tenant's, or every tenant's for an admin tenant; so are the
tiers and counters (a caller that is not an admin tenant sees its own tenant's figures) and
the tenants' shares of each tier.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tierkv.cli.ops_common import add_server_args, namespaces_table, open_client, table
from tierkv.client import ServerStats
from tierkv.errors import DeadlineExceededError, ServiceUnavailableError
from tierkv.sizes import format_size
from tierkv.types import route_label

DEFAULT_WATCH_S = 2.0
MAX_WATCH_S = 86400.0
MAX_NAMESPACES = 2**32 - 1
"""The largest --max-namespaces (0: the server's default, 20)."""
_CLEAR_SCREEN = "\x1b[H\x1b[2J"


def register(subparsers: Any) -> None:
    """Add ``stats`` to the command line."""
    parser = subparsers.add_parser(
        "stats", help="a live server's tiers, counters and largest namespaces",
        description="Show a running sidecar's tiers (used/budget, blocks, hit ratio, "
        "evictions), its counters, and its largest namespaces with their sessions.",
    )
    add_server_args(parser)
    parser.add_argument("--watch", type=_seconds, nargs="?", const=DEFAULT_WATCH_S,
                        default=None, metavar="SECONDS",
                        help=f"refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--max-namespaces", type=_count, default=20,
                        help="namespaces to show, largest first (default 20)")
    parser.set_defaults(func=run)


def _seconds(text: str) -> float:
    """A --watch interval: positive and at most ``MAX_WATCH_S`` (``time.sleep`` overflows
    on an infinite one)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= MAX_WATCH_S:
        raise argparse.ArgumentTypeError(f"must be in (0, {MAX_WATCH_S:g}] seconds, got {text}")
    return value


def _count(text: str) -> int:
    """A --max-namespaces count: what the wire's uint32 carries."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value <= MAX_NAMESPACES:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_NAMESPACES}], got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    """Print the stats once, or every ``--watch`` seconds until Ctrl-C (exit 0 then).

    A watch outlives the server going away (a restart, a recovery): it says so once on stderr
    and goes on asking; an answer that will not change by waiting (a wrong token) ends it."""
    with open_client(args) as client:
        try:
            down = False
            while True:
                try:
                    stats = client.stats(max_namespaces=args.max_namespaces)
                except _TRANSIENT as exc:
                    if args.watch is None:
                        raise
                    if not down:
                        print(f"tierkv stats: {exc}; asking again every {args.watch:g} s",
                              file=sys.stderr, flush=True)
                    down = True
                else:
                    down = False
                    _show(args, stats)
                if args.watch is None:
                    return 0
                time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


_TRANSIENT = (ServiceUnavailableError, DeadlineExceededError)
"""What a server that is restarting, recovering or stalled answers: a watch waits it out."""


def _show(args: argparse.Namespace, stats: ServerStats) -> None:
    if args.json:
        print(json.dumps(stats.as_dict()), flush=True)
        return
    screen = _CLEAR_SCREEN if args.watch and sys.stdout.isatty() else ""
    separator = "\n" if args.watch and not sys.stdout.isatty() else ""
    print(screen + render(stats, args.target) + separator, flush=True)


def _ratio(hits: int, misses: int) -> str:
    return f"{hits / (hits + misses):.1%}" if hits + misses else "-"


def _remote_lines(stats: ServerStats) -> list[str]:
    remote = stats.remote
    if remote is None:
        return []
    state = "connected" if remote.connected else "NOT CONNECTED"
    return [
        f"remote ({state}): hits {remote.hits}  misses {remote.misses} (corrupt "
        f"{remote.corrupt})  hit ratio {_ratio(remote.hits, remote.misses)}  lookups "
        f"{remote.lookups}  errors {remote.errors}  skipped {remote.skipped}",
        f"remote writes: {remote.written} put + {remote.demoted} demoted, "
        f"{format_size(remote.bytes_written)} written, {format_size(remote.bytes_read)} read, "
        f"queued {format_size(remote.queued_bytes)}, dropped {remote.queue_drops} (past "
        f"tenants' budgets {remote.budget_drops}), failed {remote.write_failures}",
    ]


def _tenants_table(stats: ServerStats) -> str:
    """Each tenant's share of each tier: what it holds against its guarantee and cap."""
    rows = [[t.tenant, t.tier.label, format_size(t.used_bytes), format_size(t.share_bytes),
             format_size(t.cap_bytes), t.num_blocks, t.hits, t.misses, _ratio(t.hits, t.misses),
             t.evictions, t.evicted_by_others]
            for t in stats.tenants]
    return table(["tenant", "tier", "used", "share", "cap", "blocks", "hits", "misses",
                  "hit ratio", "evictions", "by others"], rows)


def render(stats: ServerStats, target: str) -> str:
    """The stats as text: tiers, counters, tenants' shares, namespaces."""
    tier_rows = [
        [tier.label, f"{format_size(t.used_bytes)} / {format_size(t.capacity_bytes)}",
         f"{t.used_bytes / t.capacity_bytes:.0%}" if t.capacity_bytes else "-",
         "-" if t.utilisation is None else f"{t.utilisation:.1%}",
         t.num_blocks, t.hits, t.misses, _ratio(t.hits, t.misses), t.evictions]
        for tier, t in stats.tiers.items()
    ]
    moved = ", ".join(f"{route_label(route)} {format_size(n)}"
                      for route, n in sorted(stats.bytes_moved.items())) or "none"
    scope = (f" (tenant {stats.tenant!r}'s own figures: budget is its cap)"
             if stats.tenant is not None else "")
    lines = [
        f"tierkv at {target}{scope}",
        "",
        table(["tier", "used / budget", "full", "KV of used", "blocks", "hits", "misses",
               "hit ratio",
               "evictions"], tier_rows),
        "",
        f"puts {stats.puts}  gets {stats.gets}  promotions {stats.promotions}  demotions "
        f"{stats.demotions} (failed {stats.failed_demotions})  checksum failures "
        f"{stats.checksum_failures}",
        f"moved: {moved}",
        f"leases open {stats.num_leases} (expired {stats.leases_expired})  pinned "
        f"{stats.num_pinned}  namespaces {stats.num_namespaces}  sessions {stats.num_sessions}",
        *_remote_lines(stats),
        "",
    ]
    if stats.tenants:
        lines += [_tenants_table(stats), ""]
    if stats.namespaces:
        lines.append(namespaces_table(stats.namespaces))
    else:
        lines.append("no namespace holds blocks or sessions")
    return "\n".join(lines)
