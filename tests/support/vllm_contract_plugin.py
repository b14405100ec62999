"""A pytest plugin that runs vLLM 0.32.0's own connector unit tests against ``TierKVConnector``
with a live sidecar: loaded by ``tests/integrations/vllm/test_vllm_contract.py`` as ``-p
vllm_contract_plugin`` in a pytest of its own, whose root is the folder holding vLLM's
``tests`` package (``tests/support/vllm_sdist.py``). It imports nothing of this repository's
``tests`` package, whose name vLLM's shadows there.

Their tests build engines through the helpers of ``tests/v1/kv_connector/unit/utils.py``; this
plugin changes only those, before any test module imports them:

* ``create_vllm_config`` names ``TierKVConnector`` (on ``TIERKV_CONTRACT_TARGET``, the sidecar)
  instead of the connector a test asked for, and a local model folder
  (``TIERKV_CONTRACT_MODEL``) instead of a hub model (nothing is downloaded here);
* ``create_mock_connector`` gives a ``Mock`` that wraps the scheduler-side ``TierKVConnector``
  of the last scheduler built: the answers a test sets on it stand, every other call (the
  allocation, the step's metadata, the output's failed blocks, the ends of requests) reaches
  ours, and the test's assertions on vLLM's scheduler are kept as they are;
* the recording ``TestExampleConnector`` wraps ``TierKVConnector`` instead of vLLM's
  ``ExampleConnector``, and its metadata class is ours.
"""

from __future__ import annotations

import copy
import os
from typing import Any
from unittest.mock import Mock

_last: dict[str, Any] = {}


def pytest_configure(config: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_connector

    from tierkv.integrations.vllm.connector import TierKVConnector, TierKVMetadata

    # Before their test modules import it (``from ... import ExampleConnectorMetadata``).
    example_connector.ExampleConnectorMetadata = TierKVMetadata  # type: ignore[misc]

    from tests.v1.kv_connector.unit import utils  # vLLM's, from the sdist

    target, model = os.environ["TIERKV_CONTRACT_TARGET"], os.environ["TIERKV_CONTRACT_MODEL"]
    create_vllm_config, create_scheduler = utils.create_vllm_config, utils.create_scheduler
    create_mock_connector = utils.create_mock_connector

    def ours(*args: Any, **kwargs: Any) -> Any:
        wrapper = kwargs.get("kv_connector") == "TestExampleConnector"
        kwargs.update(model=model, kv_connector_module_path="tierkv.integrations.vllm",
                      kv_connector="TestExampleConnector" if wrapper else "TierKVConnector",
                      kv_role="kv_both",
                      kv_connector_extra_config={"address": target, "lookup_timeout_s": 2.0,
                                                 **({"name": "unit"} if wrapper else {})})
        if wrapper:
            kwargs["kv_connector_module_path"] = None  # registered with vLLM's factory
        return create_vllm_config(*args, **kwargs)

    def scheduler(*args: Any, **kwargs: Any) -> Any:
        built = create_scheduler(*args, **kwargs)
        assert isinstance(built.connector, TierKVConnector), built.connector
        _last["connector"] = built.connector
        return built

    def wrapped_connector() -> Mock:
        theirs = create_mock_connector()
        mock = Mock(wraps=_last["connector"])
        mock.get_external_cache_hit_sources.side_effect = (
            theirs.get_external_cache_hit_sources.side_effect)
        return mock

    class Inner(TierKVConnector):
        """``TierKVConnector`` as ``TestExampleConnector``'s wrapped connector (without the
        wrapper's own ``name`` key, which ours would refuse)."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            transfer = copy.copy(vllm_config.kv_transfer_config)
            transfer.kv_connector_extra_config = {
                k: v for k, v in transfer.kv_connector_extra_config.items() if k != "name"}
            config = copy.copy(vllm_config)
            config.kv_transfer_config = transfer
            super().__init__(config, role, kv_cache_config)

    utils.create_vllm_config = ours
    utils.create_scheduler = scheduler
    utils.create_mock_connector = wrapped_connector
    utils.ExampleConnector = Inner
