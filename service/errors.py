"""What a failed call answers: the status code of ``tierkv.wire.status``'s table, a message
short enough for gRPC, and a log line for anything that is not the caller's doing."""

from __future__ import annotations

import logging

import grpc

from tierkv.errors import TierKVError
from tierkv.wire.status import code_of

log = logging.getLogger(__name__)
# gRPC clients refuse status messages over 8-16 KiB (they travel as metadata), and a message
# may quote the caller's input: 1 KiB says enough.
_MAX_MESSAGE_CHARS = 1024


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call answers with."""
    message = str(exc)
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "..."
    code = code_of(type(exc))
    if code is not None:
        return code, message
    if isinstance(exc, TierKVError):  # a disk that failed, not the caller's input
        log.error("store error: %s", exc)
        return grpc.StatusCode.UNAVAILABLE, message
    log.exception("unexpected error in a call", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error (logged by the server)"
