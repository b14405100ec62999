"""Limits and defaults that both sides of the wire must agree on (one owner for each).

The server's ``ServiceConfig`` takes its defaults from here and the client sizes its channel
and its Put chunks with the same figures; the CLI's defaults are these too.
"""

from __future__ import annotations

from pathlib import Path

from tierkv.config import KiB, MiB

DEFAULT_SOCKET_PATH = "/tmp/tierkv.sock"
DEFAULT_TARGET = f"unix://{DEFAULT_SOCKET_PATH}"
"""Where a client connects when told nothing: the sidecar's default Unix socket."""
DEFAULT_TCP_ADDRESS = "127.0.0.1:50051"
DEFAULT_LISTEN = (DEFAULT_TARGET, DEFAULT_TCP_ADDRESS)
"""What ``tierkv serve`` listens on when told nothing (never another host's address)."""

CHUNK_BYTES = 1 * MiB
"""Bulk bytes per stream message (Put and Get), well under the message limit."""
MAX_MESSAGE_BYTES = 4 * MiB
"""gRPC's default message limit; no message of tierkv is larger, on either side."""
MESSAGE_HEADER_ROOM_BYTES = 64 * KiB
"""What a chunk leaves free under ``MAX_MESSAGE_BYTES`` for the rest of its message."""
MAX_HASHES_PER_CALL = 65536
"""Hashes one call may name (the server's default; Describe reports the one it applies)."""
MAX_CARRIED_RELEASES = 64
"""Read-lease releases one Acquire or Allocate may carry (a client sends the rest on their own)."""
MAX_MODEL_ID_CHARS = 256
"""Length limit of ``Namespace.model_id`` on the wire."""

_BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def host_id() -> str:
    """This machine's boot id: what the server reports in Describe as ``host_id``, and what a
    client compares it with to know it runs on the same host ("" when unknown: never equal)."""
    try:
        return _BOOT_ID_PATH.read_text().strip()
    except OSError:
        return ""
