"""The client SDK of the ``tierkv serve`` sidecar: ``Client`` (blocking) and ``AsyncClient``."""

from tierkv.client.aio import AsyncClient
from tierkv.client.sync import Client

__all__ = ["AsyncClient", "Client"]
