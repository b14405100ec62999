"""Fixtures of the vLLM integration tests."""

from __future__ import annotations

from tests.support.dynamo_indexer import dynamo_indexer

__all__ = ["dynamo_indexer"]
