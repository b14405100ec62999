"""Fixtures of the client SDK tests: real servers and clients of each kind on each path
(``tests.support.client_fixtures``, shared with the service tests)."""

from tests.support.client_fixtures import client, connect, kind, make_server, open_client, path, server

__all__ = ["client", "connect", "kind", "make_server", "open_client", "path", "server"]
