"""Request fields -> store arguments, server side: what only the server checks.

Every wire table (enums, namespaces, leases, stats) is ``tierkv.wire``'s. Only what the
wire alone can get wrong is validated here; everything else is validated by the store (and
mapped to status codes in ``errors``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tierkv.errors import InvalidArgumentError, PermissionDeniedError
from tierkv.keys import Namespace
from tierkv.store import check_lookup_hashes
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire.namespaces import namespace_from

__all__ = ["ClearFilters", "clear_filters_from", "hashes_from", "hashes_within", "ttl_from"]


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


def num_copied_from(release: pb.LeaseRequest) -> int | None:
    """A Release's ``num_copied`` (None when unset: every block before the first corrupt one)."""
    return release.num_copied if release.HasField("num_copied") else None


def ttl_from(value: float) -> float | None:
    """0 means no TTL (until unpinned / the default); the store checks the rest."""
    return None if value == 0 else value


@dataclass(frozen=True, slots=True)
class ClearFilters:
    """``TieredStore.clear``'s filters for one Clear call (None: any)."""

    tenant: str | None
    model_id: str | None
    namespace: Namespace | None


def clear_filters_from(request: pb.ClearRequest, tenant: str, is_admin: bool) -> ClearFilters:
    """The filters of a Clear by a caller of ``tenant`` (an admin tenant when ``is_admin``).

    A caller reaches its own tenant's namespaces, an admin every tenant's: an empty
    ``request.tenant`` means all it reaches, another tenant than its own is
    ``PermissionDeniedError`` for a caller that is not an admin. ``all`` takes no other
    filter, and a request with neither is ``InvalidArgumentError`` (a clear of everything is
    never an accident). A namespace is of ``request.tenant``, or of the caller's own tenant.
    """
    has_namespace = request.HasField("namespace")
    has_filter = bool(request.tenant or request.model_id or has_namespace)
    if request.all and has_filter:
        raise InvalidArgumentError("Clear: `all` takes no tenant, model_id or namespace with it")
    if not request.all and not has_filter:
        raise InvalidArgumentError("Clear: name a tenant, a model_id or a namespace, or set `all`")
    if request.tenant and request.tenant != tenant and not is_admin:
        raise PermissionDeniedError(
            f"tenant {tenant!r} may clear only its own namespaces, not {request.tenant!r} "
            "(only an admin tenant may: --admin-tenants)"
        )
    scope = request.tenant or (None if is_admin else tenant)
    namespace = namespace_from(request.namespace, request.tenant or tenant) if has_namespace else None
    return ClearFilters(scope, request.model_id or None, namespace)
