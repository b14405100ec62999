"""Who is calling: the tenant of a call comes from its bearer token, never from the request."""

from __future__ import annotations

import hmac

import grpc

DEFAULT_TENANT = "default"
CLIENT_ID_KEY = "x-tierkv-client"


class Authenticator:
    """Maps ``authorization: Bearer <token>`` metadata to a tenant (or rejects the call)."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self._tokens = dict(tokens)

    @property
    def required(self) -> bool:
        """Whether calls must carry a token."""
        return bool(self._tokens)

    def tenant_of(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
        """The caller's tenant, or None when the credentials are missing or wrong."""
        if not self._tokens:
            return DEFAULT_TENANT
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                offered = value.removeprefix("Bearer ").strip()
                for token, tenant in self._tokens.items():  # constant time per token
                    if hmac.compare_digest(token, offered):
                        return tenant
        return None


def client_id_of(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
    """The client instance id the SDK sends (leases are owned per client), or ``""``."""
    for key, value in metadata or ():
        if key == CLIENT_ID_KEY and isinstance(value, str):
            return value[:64]
    return ""


UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
