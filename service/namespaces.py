"""The namespaces calls name: resolved once per (wire namespace, tenant), bounded per tenant.
Only storing calls and Acquire register one (a lookup creates no state); empty namespaces are
pruned before a new one is refused with ``CapacityError``.
Design: docs/design/namespaces.md#registration-server
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
