"""Status codes <-> tierkv exceptions: one table, read in both directions.

The server answers a failed call with ``code_of(exc)``; the client raises ``error_of(code)``.
Each row is a status code, the exception a client raises for it, and the exceptions a server
answers with it. Rows are read in order on the server side (the first class that matches
decides: ``ValueError`` comes last, after every tierkv error that is also a ``ValueError``).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from tierkv.errors import (
    AuthenticationError,
    CapacityError,
    DeadlineExceededError,
    DiskIOError,
    IntegrityError,
    InvalidArgumentError,
    LeaseNotFoundError,
    LeaseStateError,
    NotFoundError,
    PermissionDeniedError,
    ServiceUnavailableError,
    SessionNotFoundError,
    StaleSlabError,
    StoreClosedError,
    TierKVError,
)


@dataclass(frozen=True, slots=True)
class StatusRow:
    """``code`` is raised as ``raised_as`` by a client; a server answers ``served_for`` with it
    (none: the code is the server's own or grpc's, never an exception's)."""

    code: grpc.StatusCode
    raised_as: type[TierKVError]
    served_for: tuple[type[BaseException], ...] = ()


STATUS_TABLE: tuple[StatusRow, ...] = (
    StatusRow(grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError, (InvalidArgumentError,)),
    StatusRow(grpc.StatusCode.RESOURCE_EXHAUSTED, CapacityError, (CapacityError,)),
    StatusRow(grpc.StatusCode.NOT_FOUND, NotFoundError, (LeaseNotFoundError, SessionNotFoundError)),
    StatusRow(grpc.StatusCode.FAILED_PRECONDITION, LeaseStateError, (LeaseStateError,)),
    StatusRow(grpc.StatusCode.UNAVAILABLE, ServiceUnavailableError, (StoreClosedError,)),
    StatusRow(grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError, (DeadlineExceededError,)),
    StatusRow(grpc.StatusCode.ABORTED, StaleSlabError, (StaleSlabError,)),
    StatusRow(grpc.StatusCode.PERMISSION_DENIED, PermissionDeniedError, (PermissionDeniedError,)),
    # A device that failed a write with room left: retrying (UNAVAILABLE) cannot help.
    StatusRow(grpc.StatusCode.DATA_LOSS, IntegrityError, (IntegrityError, DiskIOError)),
    # Bad input that is not a tierkv error: last, so that every subclass above decides first.
    StatusRow(grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError, (ValueError,)),
    StatusRow(grpc.StatusCode.UNAUTHENTICATED, AuthenticationError),
    # A server that is stopping cancels its calls: whatever they started dies with it.
    StatusRow(grpc.StatusCode.CANCELLED, ServiceUnavailableError),
)

_ERROR_OF_CODE: dict[grpc.StatusCode, type[TierKVError]] = {}
for _row in STATUS_TABLE:
    _ERROR_OF_CODE.setdefault(_row.code, _row.raised_as)
_SERVED: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = tuple(
    (kind, row.code) for row in STATUS_TABLE for kind in row.served_for
)

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
"""Codes a client sends again: the call did not reach a serving server (UNAVAILABLE), or a
server that is shutting down cancelled it (CANCELLED)."""


def code_of(kind: type[BaseException]) -> grpc.StatusCode | None:
    """The status code a server answers an exception of class ``kind`` with, or None when no
    row serves it (the server decides then: ``tierkv.service.errors``)."""
    for served, code in _SERVED:
        if issubclass(kind, served):
            return code
    return None


def error_of(code: grpc.StatusCode) -> type[TierKVError]:
    """The exception a client raises for ``code`` (``TierKVError`` for one no row names)."""
    return _ERROR_OF_CODE.get(code, TierKVError)
