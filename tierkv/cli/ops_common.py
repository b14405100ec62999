"""What the operator commands (``stats``, ``clear``) share: how they reach a server and how
they lay out a table."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierkv.client import Client
from tierkv.sizes import format_size
from tierkv.types import layout_label
from tierkv.wire.limits import DEFAULT_TARGET

CALL_TIMEOUT_S = 10.0
"""Deadline of an operator command's unary calls."""


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """``--target``, ``--token`` and ``--tls-ca``: which server, as whom, over what."""
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"unix:///path or host:port (default {DEFAULT_TARGET})")
    parser.add_argument("--token", default=None,
                        help="the server's bearer token, if it has tokens (its tenant decides "
                        "what this command reaches)")
    parser.add_argument("--tls-ca", type=Path, default=None,
                        help="PEM root certificates: connect over TLS")


def open_client(args: argparse.Namespace) -> Client:
    """A client of ``args.target``: calls only, never the shared-memory slab (an operator's
    command moves no blocks), and no retries (a server that is down is said so at once)."""
    settings: dict[str, Any] = {"token": args.token, "use_shm": False, "retries": 0,
                                "timeout_s": CALL_TIMEOUT_S}
    if args.tls_ca is not None:
        settings["root_certificates"] = Path(args.tls_ca).read_bytes()
    return Client(args.target, **settings)


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (escape sequences, newlines,
    other controls and unprintables) written as a Python escape: model ids and session keys
    come from clients and disk records, and printed raw they could redraw an operator's screen
    or forge rows of a table."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """``rows`` under ``headers`` in aligned columns (text left, numbers right), every cell
    ``printable``."""
    cells = [[printable(str(h)) for h in headers],
             *[[printable(str(c)) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], int | float) for row in rows) and bool(rows)
               for i in range(len(headers))]
    lines = []
    for row in cells:
        lines.append("  ".join(
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, right in zip(row, widths, numeric, strict=True)
        ).rstrip())
    return "\n".join(lines)


def namespaces_table(namespaces: Sequence[Any]) -> str:
    """One row per namespace: each has ``namespace``, ``num_blocks``, ``stored_bytes`` and
    ``num_sessions`` (``tierkv.store.NamespaceStats``, or inspect's ``NamespaceReport``)."""
    rows = [[n.namespace.tenant, n.namespace.model_id, layout_label(n.namespace.layout),
             f"{n.namespace.tp_rank}/{n.namespace.tp_size}", n.num_blocks,
             format_size(n.stored_bytes), n.num_sessions]
            for n in namespaces]
    return table(["tenant", "model", "layout", "tp", "blocks", "stored", "sessions"], rows)
