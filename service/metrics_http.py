"""The HTTP server Prometheus scrapes: ``prometheus_client``'s WSGI app for one registry, behind
a server that bounds what a client can hold (a read timeout, at most ``max_connections``), and
whose ``close`` leaves no thread, socket or port behind.
Design: docs/design/operations.md#5-the-scrape-endpoint-bounds-what-a-client-can-hold
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0
"""How long a connection may take to send its request (and to take the answer)."""
MAX_CONNECTIONS = 16
"""Connections served at once."""


class _QuietHandler(WSGIRequestHandler):
    """One request a connection, read under the server's timeout; no access log lines."""

    server: ScrapeServer

    def setup(self) -> None:
        self.request.settimeout(self.server.read_timeout_s)  # every read and write of it
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing: a scrape every few seconds is not worth a log line."""


def _family(host: str, port: int) -> socket.AddressFamily:
    """The address family ``host`` binds with (IPv6 for ``::``, say), as
    ``prometheus_client`` picks it; ``OSError`` (``socket.gaierror``) when it does not resolve."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return socket.AddressFamily(infos[0][0])


class ScrapeServer(WSGIServer):
    """``registry`` served over HTTP on ``host:port`` (port 0: any free one; ``server_port`` is
    the bound one) from ``start`` to ``close``, within the bounds of the module docstring.
    ``OSError`` when the address cannot be bound."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 read_timeout_s: float = READ_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.address_family = _family(host, port)
        self.read_timeout_s = read_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._open: dict[socket.socket, threading.Thread] = {}
        super().__init__((host, port), _QuietHandler)
        self.set_app(make_wsgi_app(registry))
        self._thread = threading.Thread(target=self.serve_forever, name="tierkv-metrics",
                                        daemon=True)

    @property
    def num_open_connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._open)

    def start(self) -> None:
        """Answer scrapes from now on (on a thread of the server's own)."""
        self._thread.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve ``request`` on a thread of its own, or close it when every slot is taken."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        thread = threading.Thread(target=self._serve_connection, args=(request, client_address),
                                  name="tierkv-metrics-scrape", daemon=True)
        with self._lock:
            self._open[request] = thread
        thread.start()

    def _serve_connection(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # the connection's own failure: it is closed below, the server goes on
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._lock:
                self._open.pop(request, None)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed (timed out, reset): a debug line, not a traceback."""
        log.debug("metrics connection from %s failed", client_address, exc_info=True)

    def close(self) -> None:
        """Stop accepting, end every open connection, and join every thread. Idempotent."""
        if self._thread.is_alive():
            self.shutdown()  # serve_forever returns: no connection is accepted after this
            self._thread.join()
        self.server_close()
        with self._lock:
            open_connections = list(self._open.items())
        for connection, _ in open_connections:
            with contextlib.suppress(OSError):  # already closed by its thread
                connection.shutdown(socket.SHUT_RDWR)
        for _, thread in open_connections:
            thread.join()
