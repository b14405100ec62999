"""What every TierKV handler does around its store call: parse leniently, authenticate, map
refusals to status codes (the plumbing of ``tierkv.service.servicer``'s handlers)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from tierkv.errors import InvalidArgumentError, TierKVError
from tierkv.service.errors import status_of


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: the tenant (from credentials) and the lease owner (tenant + client)."""

    tenant: str
    owner: str
    client_id: str = ""
    is_admin: bool = False  # its operator calls reach every tenant (``admin_tenants``)


CALLER_TENANT: ContextVar[str] = ContextVar("tierkv_caller_tenant", default="unknown")
"""The tenant of the call this task runs, set once its credentials are checked: what the
metrics wrapper around the handler (same task, so same context) counts tokens under, without
checking the token a second time."""


class CallerSource(Protocol):
    """What a handler's ``self`` provides: the caller of a call (``CallRefusedError`` when the
    call is refused before it reaches the store)."""

    async def _caller(self, context: grpc.aio.ServicerContext) -> Caller: ...


@dataclass(frozen=True, slots=True)
class Malformed:
    """What a request that does not parse deserializes to (answered INVALID_ARGUMENT)."""

    reason: str


def lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A request deserializer that turns a parse error into ``Malformed`` (gRPC itself would
    answer UNKNOWN for the exception)."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except (DecodeError, InvalidArgumentError) as exc:
            return Malformed(str(exc)[:256])

    return deserialize


def check_parsed(message: Any) -> None:
    """``InvalidArgumentError`` for a request that did not parse."""
    if isinstance(message, Malformed):
        raise InvalidArgumentError(f"malformed request: {message.reason}")


class CallRefusedError(Exception):
    """A call refused before it reaches the store (credentials, recovery): its status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


REFUSALS = (CallRefusedError, TierKVError, ValueError)
"""What a handler answers with a status code instead of failing."""


def status_of_refusal(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a refusal (one of ``REFUSALS``) is answered with."""
    return (exc.code, str(exc)) if isinstance(exc, CallRefusedError) else status_of(exc)


def end_call(context: grpc.aio.ServicerContext, status: tuple[grpc.StatusCode, str]) -> None:
    """End a refused call with ``status``; call it after the ``except`` block that took the
    status (not ``context.abort``: docs/design/operations.md#refused-calls-hold-no-memory)."""
    context.set_code(status[0])
    context.set_details(status[1])


def unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Wrap a unary (or stream-in) handler: authenticate, then map tierkv errors to codes."""

    @functools.wraps(fn)
    async def handler(self: CallerSource, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            caller = await self._caller(context)
            check_parsed(request)
            return await fn(self, request, context, caller)
        except REFUSALS as exc:
            status = status_of_refusal(exc)
        end_call(context, status)
        return None

    return handler
