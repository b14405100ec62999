"""The gRPC sidecar around a ``TieredStore``, imported as ``tierkv.service``.

The code lives in the repository's top-level ``service/`` folder, which pyproject.toml's
``package-dir`` maps to ``tierkv.service`` (there is no ``tierkv/service`` folder): the wheel
installs it inside the ``tierkv`` package, the editable install's import hook finds it here, and
no top-level ``service`` module exists. mypy checks it through ``scripts/typecheck.py``.
"""
