"""``tierkv health``: ask a sidecar's gRPC health service whether it serves.

What a container's health check or a probe runs: exit 0 when the server answers SERVING, 1 when
it answers anything else (NOT_SERVING while its disk index recovers or while it drains at
shutdown) or nothing answers within ``--timeout-s`` (the line printed says which), 2 for a
mistake in the command itself (Docker reserves 2 in health checks: it never means the server is
down). It speaks the standard
``grpc.health.v1.Health`` protocol, so Kubernetes' built-in ``grpc`` probe and this command ask
the same question; this one also reaches a Unix socket, which Kubernetes' probe cannot.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tierkv.errors import ConfigError
from tierkv.wire.limits import DEFAULT_TARGET

SERVING_EXIT = 0
NOT_SERVING_EXIT = 1
UNREACHABLE_EXIT = 1


def register(subparsers: Any) -> None:
    """Add ``health`` to the command line."""
    parser = subparsers.add_parser(
        "health", help="exit 0 when a sidecar's gRPC health service answers SERVING",
        description="Ask a running sidecar's gRPC health service (grpc.health.v1) for its "
        "status: exit 0 when SERVING, 1 otherwise (NOT_SERVING, or no answer in time).",
    )
    # Its own --target/--tls-ca, not ops_common.add_server_args: that module imports the client
    # (and torch), 1.6 s a probe.
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"unix:///path or host:port (default {DEFAULT_TARGET})")
    parser.add_argument("--service", default="",
                        help="the service name to ask about ('' is the whole server, the "
                        "default; tierkv.v1.TierKV answers the same)")
    parser.add_argument("--timeout-s", type=float, default=3.0,
                        help="give up after this many seconds (default 3)")
    parser.add_argument("--tls-ca", default=None,
                        help="PEM root certificates: ask over TLS (a TCP listener with "
                        "--tls-cert)")
    parser.add_argument("--quiet", action="store_true", help="print nothing, exit code only")
    parser.set_defaults(func=run)


def check(target: str, service: str = "", timeout_s: float = 3.0,
          tls_ca: Path | None = None) -> str:
    """The health status name the server at ``target`` answers for ``service`` (``SERVING``,
    ``NOT_SERVING``, ...), or ``UNREACHABLE`` when it does not answer within ``timeout_s``.
    ``ConfigError`` when ``tls_ca`` cannot be read."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls_ca is not None:
        try:
            root_certificates = Path(tls_ca).read_bytes()
        except OSError as exc:  # exit 2 with one line, not 1 (NOT_SERVING) with a traceback
            raise ConfigError(f"--tls-ca {tls_ca}: cannot read it ({exc.strerror})") from None
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates))
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # an unknown service name
                return "SERVICE_UNKNOWN"
            return "UNREACHABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def run(args: argparse.Namespace) -> int:
    """Print the status (unless ``--quiet``) and map it to the exit code."""
    status = check(args.target, args.service, args.timeout_s,
                   Path(args.tls_ca) if args.tls_ca else None)
    if not args.quiet:
        print(f"{args.target}: {status}", file=sys.stdout if status == "SERVING" else sys.stderr)
    if status == "SERVING":
        return SERVING_EXIT
    return UNREACHABLE_EXIT if status == "UNREACHABLE" else NOT_SERVING_EXIT
