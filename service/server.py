"""The grpc.aio server: listeners, health, reflection, metrics, lease reaping, graceful stop.

``create_server(config, store)`` binds every listener and returns ``(server, port)``; ``port`` is
the first TCP listener's (useful with ``127.0.0.1:0``), or 0 when there is none. The health
service answers NOT_SERVING until a store is attached (its disk index recovered) and again once
shutdown begins; reflection lets a stock gRPC client list and call the API. With
``metrics_port`` set, a Prometheus endpoint (``tierkv.service.metrics``) answers from ``start``
to ``stop`` and every TierKV call is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tierkv.codec import decode_put_chunk
from tierkv.errors import ConfigError
from tierkv.service.config import ServiceConfig, TlsConfig
from tierkv.service.metrics import RpcRecorder, ServerMetrics
from tierkv.service.servicer import TierKVServicer, lenient
from tierkv.store import TieredStore
from tierkv.wire import tierkv_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TierKV"].full_name


_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _handlers(servicer: TierKVServicer, recorder: RpcRecorder | None = None
              ) -> grpc.GenericRpcHandler:
    """What ``add_TierKVServicer_to_server`` registers, except that a request that does not
    parse reaches its handler as ``Malformed`` (INVALID_ARGUMENT) instead of failing as UNKNOWN,
    and that ``recorder`` (when given) counts every call."""
    methods = {}
    for method in pb.DESCRIPTOR.services_by_name["TierKV"].methods:
        factory = _FACTORIES[method.client_streaming, method.server_streaming]
        # Put's chunks are decoded by hand: their data stays a view of the received bytes.
        parse = decode_put_chunk if method.name == "Put" else getattr(
            pb, method.input_type.name).FromString
        handler = getattr(servicer, method.name)
        if recorder is not None:
            handler = recorder.wrap(method.name, method.server_streaming, handler)
        methods[method.name] = factory(
            handler,
            request_deserializer=lenient(parse),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)


def _server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """``tls``'s files as gRPC credentials, once OpenSSL has read them as a certificate chain
    and its (unencrypted) private key."""
    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls.cert_path, tls.key_path, password=_no_password)
        key, chain = tls.key_path.read_bytes(), tls.cert_path.read_bytes()
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ConfigError(
            f"--tls-cert {tls.cert_path}, --tls-key {tls.key_path}: not a PEM certificate chain "
            f"and its unencrypted private key ({exc})"
        ) from None
    return grpc.ssl_server_credentials([(key, chain)])


def _no_password() -> bytes:
    # An encrypted key: refused (grpc cannot use it), never a prompt on the terminal.
    raise ValueError("the private key is encrypted")


class TierKVServer:
    """A started-or-not gRPC server around one ``TieredStore``.

    ``servicer`` answers the TierKV calls; by default a ``TierKVServicer(config)``. Passing one in
    lets a caller (a test's recording spy, say) wrap the real servicer without patching this
    module; it must have been built with the same ``config``. ``metrics`` is the server's
    Prometheus registry and endpoint (``metrics_port`` is its bound port once started, 0 when
    ``config.metrics_port`` is 0)."""

    def __init__(self, config: ServiceConfig, servicer: TierKVServicer | None = None) -> None:
        self.config = config
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self.grpc_server = grpc.aio.server(options=options)
        self.servicer = servicer if servicer is not None else TierKVServicer(config)
        self.metrics = ServerMetrics(config)
        recorder = self.metrics.recorder if self.metrics.enabled else None
        self.grpc_server.add_generic_rpc_handlers((_handlers(self.servicer, recorder),))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc_server
        )
        self.store: TieredStore | None = None
        self._reaper: asyncio.Task[None] | None = None

    def bind(self) -> int:
        """Add every listener; returns the first TCP port (0 if none). ``ConfigError`` naming
        the address for one that cannot be bound, and naming the files for TLS files that are
        not a certificate chain and its key (grpc raises a bare RuntimeError for both)."""
        first_port = 0
        credentials = None
        if self.config.tls is not None:
            credentials = _server_credentials(self.config.tls)
        for address in self.config.listen:
            try:
                if address.startswith("unix:") or credentials is None:
                    port = self.grpc_server.add_insecure_port(address)
                else:
                    port = self.grpc_server.add_secure_port(address, credentials)
            except RuntimeError:
                raise ConfigError(
                    f"--listen {address}: cannot listen there (in use, not an address of this "
                    "machine, a socket path over 107 bytes or in a folder that is not there, or "
                    "not host:port or unix:///path)"
                ) from None
            if not address.startswith("unix:") and not first_port:
                first_port = port
        return first_port

    @property
    def metrics_port(self) -> int:
        """The Prometheus endpoint's bound TCP port (0: none, or not started)."""
        return self.metrics.port

    async def start(self) -> None:
        """Start answering (health NOT_SERVING until ``attach``) and, with ``metrics_port``
        set, serving metrics (``ConfigError`` when its address cannot be bound)."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.metrics.start()
        try:
            await self.grpc_server.start()
        except BaseException:
            await self.metrics.stop()
            raise

    async def attach(self, store: TieredStore) -> None:
        """Serve ``store`` from now on."""
        self.store = store
        self.servicer.attach(store)
        self.metrics.attach(store)
        self._reaper = asyncio.create_task(self._reap_leases())
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def set_access(self, tokens: dict[str, str], admin_tenants: Sequence[str]) -> None:
        """Adopt a reloaded tokens file and admin tenants (``TierKVServicer.set_access``): the
        next call is checked against them; calls under way finish as they began."""
        self.servicer.set_access(tokens, admin_tenants)

    async def stop(self, close_store: bool = True) -> None:
        """Graceful stop: NOT_SERVING, drain in-flight calls, stop the metrics endpoint, then
        close (flush) the store."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc_server.stop(self.config.grace_s)
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.metrics.stop()
        self.servicer.close()
        if close_store and self.store is not None:
            await asyncio.to_thread(self.store.close)

    async def wait_for_termination(self) -> None:
        """Until the server stops."""
        await self.grpc_server.wait_for_termination()

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _reap_leases(self) -> None:
        # Leases of clients that died expire here even when no one else calls.
        store = self.store
        assert store is not None
        while True:
            await asyncio.sleep(self.config.lease_reap_interval_s)
            try:
                expired = await asyncio.to_thread(store.sidecar.expire_leases)
            except Exception:  # a closed store at shutdown; the loop is cancelled right after
                log.debug("lease reaping stopped", exc_info=True)
                return
            if expired:
                log.info("expired %d leases", expired)


async def create_server(
    config: ServiceConfig, store: TieredStore | None = None,
    servicer: TierKVServicer | None = None,
) -> tuple[TierKVServer, int]:
    """A bound, started server (serving ``store`` if given, answering through ``servicer`` if
    given, else a ``TierKVServicer(config)``) and its first TCP port."""
    server = TierKVServer(config, servicer)
    port = server.bind()
    await server.start()
    if store is not None:
        await server.attach(store)
    return server, port
