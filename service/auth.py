"""Who is calling: the tenant of a call comes from its bearer token, never from the request.

Tokens are compared as bytes: ``hmac.compare_digest`` raises ``TypeError`` on a ``str`` that is
not ASCII, and a raise there would answer a client's bad token with UNKNOWN instead of
UNAUTHENTICATED. Every string encodes to UTF-8 (lone surrogates included, with
``surrogatepass``), so no metadata a client can send makes the comparison raise.

A rejected call is logged as the event ``auth_failure``, at most one line per
``AUTH_FAILURE_LOG_INTERVAL_S``: a client retrying a bad token in a loop must not flood the
log, so each line carries the number of failures since the previous one (``tierkv.logs``'s
``Throttle``).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable

import grpc

from tierkv.keys import DEFAULT_TENANT
from tierkv.logs import Throttle, log_event

CLIENT_ID_KEY = "x-tierkv-client"
_BEARER = b"Bearer "
AUTH_FAILURE_LOG_INTERVAL_S = 10.0

log = logging.getLogger(__name__)


def _as_bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")


class Authenticator:
    """Maps ``authorization: Bearer <token>`` metadata to a tenant (or rejects the call, and
    logs it: one ``auth_failure`` line per ``AUTH_FAILURE_LOG_INTERVAL_S`` on ``clock``)."""

    def __init__(self, tokens: dict[str, str], clock: Callable[[], float] = time.monotonic) -> None:
        self._tokens = {_as_bytes(token): tenant for token, tenant in tokens.items()}
        self._failures = Throttle(AUTH_FAILURE_LOG_INTERVAL_S, clock)

    @property
    def required(self) -> bool:
        """Whether calls must carry a token."""
        return bool(self._tokens)

    def tenant_of(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
        """The caller's tenant, or None when the credentials are missing or wrong. Never
        raises, whatever the metadata holds."""
        if not self._tokens:
            return DEFAULT_TENANT
        offered_any = False
        for key, value in metadata or ():
            if key != "authorization" or not isinstance(value, str | bytes):
                continue
            raw = _as_bytes(value)
            if not raw.startswith(_BEARER):
                continue
            offered_any = True
            offered = raw.removeprefix(_BEARER).strip()
            for token, tenant in self._tokens.items():  # constant time per token
                if hmac.compare_digest(token, offered):
                    return tenant
        self._log_failure("unknown bearer token" if offered_any else "no bearer token")
        return None

    def _log_failure(self, reason: str) -> None:
        num_failures = self._failures.admit()
        if num_failures:
            log_event(log, logging.WARNING, "auth_failure",
                      f"call refused: {reason} ({num_failures} refused since the last line)",
                      reason=reason, num_failures=num_failures,
                      interval_s=AUTH_FAILURE_LOG_INTERVAL_S)


def client_id_of(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
    """The client instance id the SDK sends (leases are owned per client), or ``""``."""
    for key, value in metadata or ():
        if key == CLIENT_ID_KEY and isinstance(value, str):
            return value[:64]
    return ""


UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
