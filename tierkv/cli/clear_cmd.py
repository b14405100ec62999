"""``tierkv clear``: delete every block and session of namespaces on a live server.

Scope: ``--tenant``, ``--model`` and ``--namespace`` combine (all must match), or ``--all``
alone: everything the token reaches (its own tenant, every tenant for an admin tenant). It asks
for confirmation on a terminal and refuses without one unless ``--yes``; a progress bar follows
the server's progress; the counts are printed at the end. Blocks being read at that moment are
misses at once like the others; their room comes back when those reads end.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from tqdm import tqdm

from tierkv.cli.ops_common import add_server_args, open_client
from tierkv.errors import InvalidArgumentError
from tierkv.keys import Namespace
from tierkv.sizes import format_size
from tierkv.types import ClearResult, parse_layout_label
from tierkv.wire.namespaces import namespace_from, namespace_to

REFUSED_EXIT = 1
INTERRUPTED_EXIT = 130
"""Ctrl-C (128 + SIGINT), as a shell reports a command it interrupted."""


def register(subparsers: Any) -> None:
    """Add ``clear`` to the command line."""
    parser = subparsers.add_parser(
        "clear", help="delete every block and session of namespaces on a live server",
        description="Delete every block (every tier, disk included, pinned ones too) and "
        "session of the namespaces named, on a running sidecar. Filters combine; --all "
        "instead clears everything the token reaches.",
    )
    add_server_args(parser)
    parser.add_argument("--tenant", default=None,
                        help="this tenant's namespaces (another tenant than the token's needs "
                        "an admin tenant's token)")
    parser.add_argument("--model", default=None, help="namespaces of this model id")
    parser.add_argument("--namespace", default=None, metavar="MODEL:LAYOUT[:RANK/SIZE]",
                        help="exactly one namespace, e.g. llama-3-8b:32x8x128/16/bf16:0/2 "
                        "(layers x KV heads x head dim / block size / dtype; tensor-parallel "
                        "rank/size, default 0/1), of --tenant or of the token's tenant")
    parser.add_argument("--all", action="store_true",
                        help="everything the token reaches (no other filter with it)")
    parser.add_argument("--yes", action="store_true",
                        help="do not ask (needed without a terminal)")
    parser.set_defaults(func=run)


_TP_SHARD = re.compile(r"([0-9]+)/([0-9]+)")


def parse_namespace(text: str) -> Namespace:
    """``MODEL:LAYOUT[:RANK/SIZE]`` as a namespace (its tenant is not part of it: the server
    names it). ``InvalidArgumentError`` saying the expected form, or naming the field out of
    the wire's bounds, otherwise."""
    parts = text.split(":")
    tp_rank, tp_size = 0, 1
    shard = _TP_SHARD.fullmatch(parts[-1]) if len(parts) >= 3 else None
    if shard is not None:
        parts.pop()
        tp_rank, tp_size = int(shard[1]), int(shard[2])
    if len(parts) < 2:
        raise InvalidArgumentError(
            f"--namespace {text!r}: expected MODEL:LAYOUT[:RANK/SIZE], e.g. m:32x8x128/16/fp16")
    layout = parse_layout_label(parts.pop())
    namespace = Namespace(":".join(parts), layout, tp_rank, tp_size)
    try:  # what the server would refuse (or the wire could not carry) is refused here
        namespace_from(namespace_to(namespace), namespace.tenant)
    except ValueError as exc:  # protobuf's "Value out of range" for a field past 32 bits
        raise InvalidArgumentError(f"--namespace {text!r}: {exc}") from None
    return namespace


def _scope(args: argparse.Namespace) -> str:
    """What the confirmation names: as the server reads the filters (a namespace without
    --tenant is of the token's own tenant, never of every tenant an admin reaches)."""
    if args.all:
        return "every namespace this token reaches"
    if args.tenant:
        tenant = f"tenant {args.tenant!r}"
    elif args.namespace:
        tenant = "this token's own tenant"
    else:
        tenant = "every tenant this token reaches"
    named = [tenant]
    if args.model:
        named.append(f"model {args.model!r}")
    if args.namespace:
        named.append(f"namespace {args.namespace!r}")
    return ", ".join(named)


def _confirmed(args: argparse.Namespace) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        print("tierkv clear: no terminal to confirm on; pass --yes to clear without asking",
              file=sys.stderr)
        return False
    print(f"Delete every block and session of {_scope(args)} on {args.target}? [y/N] ",
          end="", flush=True)
    answer = sys.stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        print("tierkv clear: nothing cleared", file=sys.stderr)
        return False
    return True


def run(args: argparse.Namespace) -> int:
    """Check the scope, confirm, clear with a progress bar, print the counts."""
    if args.all and (args.tenant or args.model or args.namespace):
        print("tierkv clear: --all takes no --tenant, --model or --namespace", file=sys.stderr)
        return REFUSED_EXIT
    if not (args.all or args.tenant or args.model or args.namespace):
        print("tierkv clear: name --tenant, --model or --namespace, or --all", file=sys.stderr)
        return REFUSED_EXIT
    namespace = parse_namespace(args.namespace) if args.namespace else None
    try:
        if not _confirmed(args):
            return REFUSED_EXIT
    except KeyboardInterrupt:
        print("\ntierkv clear: interrupted: nothing cleared", file=sys.stderr)
        return INTERRUPTED_EXIT
    try:
        result = _clear(args, namespace)
    except KeyboardInterrupt:  # the server does not stop a clear its caller left
        print("\ntierkv clear: interrupted: a clear the server had begun runs to its end "
              "there (tierkv stats shows what is left)", file=sys.stderr)
        return INTERRUPTED_EXIT
    print(summary(result))
    return 0


def _clear(args: argparse.Namespace, namespace: Namespace | None) -> ClearResult:
    with open_client(args) as client, tqdm(desc="clearing", unit="block", file=sys.stderr,
                                           disable=not sys.stderr.isatty()) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        return client.clear(tenant=args.tenant, model_id=args.model, namespace=namespace,
                            all_namespaces=args.all, progress=progress)


def summary(result: ClearResult) -> str:
    """The counts, in one or two lines."""
    line = (f"cleared {result.num_blocks} blocks ({format_size(result.cleared_bytes)}) and "
            f"{result.num_sessions} sessions of {result.num_namespaces} namespaces")
    if result.num_busy:
        line += (f"\n{result.num_busy} of them were being read: their room comes back when "
                 "those reads end")
    return line
