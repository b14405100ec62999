"""The client SDK of the ``tierkv serve`` sidecar: ``Client`` (blocking) and ``AsyncClient``.

Both run the same logic (``tierkv.client.flows``); what their calls give back beside plain
values: ``ServerStats`` (``stats``), ``LookupDetail`` (``lookup_detail``), ``ServerInfo``
(``describe``); ``BlockFill`` is what ``put_with`` calls to write blocks in place, ``BlockUse`` what
``get_with`` calls to read them where they lie.
"""

from tierkv.client.aio import AsyncClient
from tierkv.client.base import BlockFill, BlockUse
from tierkv.client.results import ServerStats
from tierkv.client.sync import Client
from tierkv.wire.convert import LookupDetail, ServerInfo

__all__ = ["AsyncClient", "BlockFill", "BlockUse", "Client", "LookupDetail", "ServerInfo", "ServerStats"]
