"""The namespaces calls name: resolved once per (wire namespace, tenant), bounded per tenant.

Decisions:
1. Only calls that store (Put, Allocate, SaveSession) and Acquire register a namespace.
   Read-only calls on one that is not registered get None and answer a miss: a lookup must not
   create state (one tenant filled the server-wide limit with lookups alone in 5 s).
2. Namespaces are stored until they hold nothing. When a tenant reaches its share
   (``max_namespaces_per_tenant``) or the server its limit (``max_namespaces``), the empty
   namespaces (of that tenant) are removed first (``TieredStore.prune_namespaces``), and only
   then is the new one refused with ``CapacityError``: no tenant can fill another's share, or
   lock itself out for good.
3. The cache skips rebuilding a ``Namespace`` (a hash of its fields) on every call. An entry is
   used only while the store still has its namespace, and entries of removed namespaces are
   dropped, so a removed namespace is never served from the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.errors import CapacityError
from tierkv.keys import Namespace
from tierkv.service.config import ServiceConfig
from tierkv.store import TieredStore
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire.namespaces import namespace_from

_MAX_CACHED = 4096


class NamespaceBook:
    """Resolves wire namespaces of a tenant to the store's namespaces. Thread safe (dict
    operations under the GIL; the store locks its own tables)."""

    def __init__(self, config: ServiceConfig) -> None:
        self._config = config
        self._cache: dict[tuple[bytes, str], Namespace] = {}

    @staticmethod
    def _key(spec: pb.Namespace, tenant: str) -> tuple[bytes, str]:
        return spec.SerializeToString(deterministic=True), tenant

    def cached(self, store: TieredStore, spec: pb.Namespace, tenant: str) -> Namespace | None:
        """The namespace of ``spec``, if resolved before and still registered (no parsing:
        cheap enough for the event loop)."""
        namespace = self._cache.get(self._key(spec, tenant))
        return namespace if namespace is not None and store.is_registered(namespace) else None

    def existing(self, store: TieredStore, spec: pb.Namespace, tenant: str) -> Namespace | None:
        """The namespace of ``spec`` if it is registered, else None (never registers one),
        except with a REMOTE tier: there another node may hold its blocks, so it is registered
        (as ``registered`` does) and the read asks REMOTE. Raises ``InvalidArgumentError`` for
        a malformed ``spec``."""
        if store.has_remote_tier:
            try:
                return self.registered(store, spec, tenant)
            except CapacityError:  # the tenant's namespaces are full: a read is a miss
                return None
        namespace = self.cached(store, spec, tenant)
        if namespace is None:
            namespace = namespace_from(spec, tenant)
            if not store.is_registered(namespace):
                return None
            self._remember(spec, tenant, namespace)
        return namespace

    def registered(self, store: TieredStore, spec: pb.Namespace, tenant: str) -> Namespace:
        """The namespace of ``spec``, registered if it was not. Raises ``CapacityError`` when
        the tenant's share or the server's limit is full of namespaces that hold something."""
        namespace = self.cached(store, spec, tenant)
        if namespace is None:
            namespace = namespace_from(spec, tenant)
            if not store.is_registered(namespace):
                self._make_room(store, tenant)
                store.register(namespace)
            self._remember(spec, tenant, namespace)
        return namespace

    def _remember(self, spec: pb.Namespace, tenant: str, namespace: Namespace) -> None:
        if len(self._cache) < _MAX_CACHED:
            self._cache[self._key(spec, tenant)] = namespace

    def _make_room(self, store: TieredStore, tenant: str) -> None:
        config = self._config
        if store.num_namespaces(tenant) >= config.max_namespaces_per_tenant:
            self._forget(store.prune_namespaces(tenant))
            if store.num_namespaces(tenant) >= config.max_namespaces_per_tenant:
                raise CapacityError(
                    f"tenant {tenant!r} holds {config.max_namespaces_per_tenant} namespaces with "
                    "blocks or sessions already (--max-namespaces-per-tenant); delete some"
                )
        if store.num_namespaces() >= config.max_namespaces:
            self._forget(store.prune_namespaces())
            if store.num_namespaces() >= config.max_namespaces:
                raise CapacityError(
                    f"the server holds {config.max_namespaces} namespaces with blocks or "
                    "sessions already"
                )

    def _forget(self, removed: Sequence[Namespace]) -> None:
        gone = {namespace.id for namespace in removed}
        if gone:
            for key, namespace in list(self._cache.items()):  # a copy: other threads add
                if namespace.id in gone:
                    self._cache.pop(key, None)
