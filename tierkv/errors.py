"""The exceptions tierkv raises.

Every error a caller can provoke with bad input is a ``ValueError`` as well as a
``TierKVError``, so that plain ``except ValueError`` works. Each maps to one gRPC status code
(see ``service``); the mapping lives there, not here.
"""

from __future__ import annotations


class TierKVError(Exception):
    """Base class of every error tierkv raises on purpose."""


class InvalidArgumentError(TierKVError, ValueError):
    """The caller passed something malformed: wrong shape, dtype, count, or setting."""


class ConfigError(InvalidArgumentError):
    """A setting is out of range; the message names the setting to change."""


class UnknownNamespaceError(InvalidArgumentError, KeyError):
    """An operation named a namespace that was never registered with the store."""

    def __str__(self) -> str:  # KeyError would quote the message otherwise
        return str(self.args[0]) if self.args else ""


class CapacityError(TierKVError):
    """There is no room: every evictable block was evicted and the request still does not fit."""


class DiskFullError(CapacityError):
    """The disk (or LMDB's map) has no room left for a write, even after eviction."""


class NotFoundError(TierKVError, LookupError):
    """A named thing (lease, session) does not exist for this caller."""

    def __str__(self) -> str:  # LookupError subclasses may quote the message otherwise
        return str(self.args[0]) if self.args else ""


class LeaseNotFoundError(NotFoundError):
    """No such lease for this owner (never granted, or another client's)."""


class SessionNotFoundError(NotFoundError):
    """No session of that id for that tenant (never saved, deleted, or its TTL ran out)."""


class LeaseStateError(TierKVError):
    """The lease exists no more: it was committed, aborted, released or it expired."""


class IntegrityError(TierKVError):
    """DATA_LOSS: bytes failed their checksum on the way from a writer to the store, or the
    disk store is damaged or failing; nothing was stored."""


class DiskIOError(TierKVError):
    """The disk reported an I/O error with room left on it: the device is failing. The write
    did not happen; retrying it will not help."""


class StaleSlabError(TierKVError):
    """A shared-memory lease call named a slab this server does not have (the client's mapping
    is of an earlier server): describe the server again, remap, retry."""


class AuthenticationError(TierKVError):
    """The server rejected the call's credentials (missing or unknown bearer token)."""


class PermissionDeniedError(TierKVError):
    """PERMISSION_DENIED: an operator call (Clear) named another tenant than the caller's own,
    and the server does not name the caller an admin tenant."""


class ServiceUnavailableError(TierKVError):
    """The server could not be reached (after retries), or is starting or stopping."""


class DeadlineExceededError(TierKVError, TimeoutError):
    """A call did not finish within its deadline."""


class StoreClosedError(TierKVError):
    """The store was closed; no further operations are accepted."""
