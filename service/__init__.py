"""The gRPC sidecar around a ``TieredStore``, imported as ``tierkv.service``.

The code lives in the repository's top-level ``service/`` folder; ``tierkv/service`` links to it,
so it installs inside the ``tierkv`` package and no top-level ``service`` module exists.
"""
