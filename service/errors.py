"""tierkv exceptions -> gRPC status codes (one place, one table)."""

from __future__ import annotations

import logging

import grpc

from tierkv.errors import (
    CapacityError,
    DeadlineExceededError,
    IntegrityError,
    InvalidArgumentError,
    LeaseNotFoundError,
    LeaseStateError,
    SessionNotFoundError,
    StaleSlabError,
    StoreClosedError,
    TierKVError,
)
from tierkv.tiers.disk import DiskIOError

log = logging.getLogger(__name__)
# gRPC clients refuse status messages over 8-16 KiB (they travel as metadata), and a message
# may quote the caller's input: 1 KiB says enough.
_MAX_MESSAGE_CHARS = 1024

# Checked in order: the first class that matches decides.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LeaseNotFoundError, grpc.StatusCode.NOT_FOUND),
    (SessionNotFoundError, grpc.StatusCode.NOT_FOUND),
    (LeaseStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (StoreClosedError, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (StaleSlabError, grpc.StatusCode.ABORTED),
    (IntegrityError, grpc.StatusCode.DATA_LOSS),
    # The device failed a write with room left: retrying (UNAVAILABLE) cannot help.
    (DiskIOError, grpc.StatusCode.DATA_LOSS),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call answers with."""
    message = str(exc)
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "..."
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, message
    if isinstance(exc, TierKVError):  # a disk that failed, not the caller's input
        log.error("store error: %s", exc)
        return grpc.StatusCode.UNAVAILABLE, message
    log.exception("unexpected error in a call", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error (logged by the server)"
