"""What the client's calls give back, where the wire's message is not the answer itself.

``Client.stats()`` answers with the same type as ``TieredStore.stats()`` (``StoreStats``), and
one figure only a server has: the leases open on it. ``lookup_detail`` answers with
``tierkv.wire.convert.LookupDetail``, ``describe`` with ``tierkv.wire.convert.ServerInfo``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.store import StoreStats


@dataclass(frozen=True, slots=True)
class ServerStats(StoreStats):
    """A server's ``StoreStats`` and ``num_leases``: the shared-memory leases open on it (read
    and write, every client's), 0 once every put and get has finished."""

    num_leases: int
