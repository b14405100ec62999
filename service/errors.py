"""What a failed call answers: the status code of ``tierkv.wire.status``'s table, a message
short enough for gRPC, and a log line for anything that is not the caller's doing."""

from __future__ import annotations

import logging

import grpc

from tierkv.errors import IntegrityError, TierKVError
from tierkv.store import DiskIOError
from tierkv.wire.status import code_of

log = logging.getLogger(__name__)
# gRPC clients refuse status messages over 8-16 KiB (they travel as metadata), and a message
# may quote the caller's input: 1 KiB says enough.
_MAX_MESSAGE_CHARS = 1024
# The disk tier's own error (not in tierkv.errors, so the wire cannot name it) is served as
# the error it stands for: the device failed a write with room left, so retrying
# (UNAVAILABLE) cannot help; DATA_LOSS says so.
_SERVED_AS: tuple[tuple[type[TierKVError], type[TierKVError]], ...] = (
    (DiskIOError, IntegrityError),
)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call answers with."""
    message = str(exc)
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "..."
    kind = next((as_ for served, as_ in _SERVED_AS if isinstance(exc, served)), type(exc))
    code = code_of(kind)
    if code is not None:
        return code, message
    if isinstance(exc, TierKVError):  # a disk that failed, not the caller's input
        log.error("store error: %s", exc)
        return grpc.StatusCode.UNAVAILABLE, message
    log.exception("unexpected error in a call", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error (logged by the server)"
