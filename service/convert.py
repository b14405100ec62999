"""Request fields -> store arguments, server side: what only the server checks.

Every wire table (enums, namespaces, leases, stats) is ``tierkv.wire``'s; the enum readers are
named here too because the handlers read them with the other request fields. Only what the
wire alone can get wrong is validated here; everything else is validated by the store (and
mapped to status codes in ``errors``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.errors import InvalidArgumentError
from tierkv.store import check_lookup_hashes
from tierkv.wire.enums import priority_from, write_policy_from

__all__ = ["hashes_from", "hashes_within", "priority_from", "ttl_from", "write_policy_from"]


def hashes_within(hashes: Sequence[bytes], max_hashes: int) -> Sequence[bytes]:
    """The request's hashes, checked for count only (for calls whose store method checks the
    lengths itself)."""
    if len(hashes) > max_hashes:
        raise InvalidArgumentError(
            f"{len(hashes)} hashes in one call; at most {max_hashes} (split the chain)"
        )
    return hashes


def hashes_from(hashes: Sequence[bytes], max_hashes: int) -> Sequence[bytes]:
    """The request's hashes (as given: no copy), checked for count and, with the store's own
    rule, length: before a Put's bytes are received, not after."""
    hashes_within(hashes, max_hashes)
    check_lookup_hashes(hashes)
    return hashes


def ttl_from(value: float) -> float | None:
    """0 means no TTL (until unpinned / the default); the store checks the rest."""
    return None if value == 0 else value
