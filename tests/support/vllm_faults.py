"""A ``TierKVConnector`` that breaks its sidecar at the moment a load starts, as the test asks:
loaded by vLLM as ``tests.support.vllm_faults:FaultConnector`` (the tests put the checkout on
the engine's PYTHONPATH). Before a round the test writes a fault file (``TIERKV_TEST_FAULT_FILE``,
JSON ``{"fault": ..., "pids": [...], "target": ..., "token": ...}``); the worker's first
``start_load_kv`` with loads after that runs the fault once, then renames the file ``.done``:

* ``kill``: SIGKILL the processes ``pids`` (the sidecar: the test restarts it on its disk
  after the round);
* ``stop``: SIGSTOP them (the sidecar: its load runs past ``load_timeout_s``; or the nodes of
  the Redis Cluster behind its REMOTE tier); the test sends SIGCONT after the round;
* ``clear``: clear every namespace of the token's tenant: blocks gone between lookup and load.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from tests.support.vllm_killer import _wait_dead
from tierkv.client import Client
from tierkv.integrations.vllm import TierKVConnector
from tierkv.integrations.vllm.connector import TierKVMetadata


class FaultConnector(TierKVConnector):
    """Runs the pending fault once, just before a step's loads start."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, TierKVMetadata) and (meta.loads or meta.async_loads):
            _run_pending_fault()
        super().start_load_kv(forward_context, **kwargs)


def _run_pending_fault() -> None:
    path = Path(os.environ["TIERKV_TEST_FAULT_FILE"])
    if not path.exists():
        return
    fault = json.loads(path.read_text())
    path.rename(path.with_suffix(".done"))
    pids = [int(pid) for pid in fault.get("pids", ())]
    if fault["fault"] == "kill":
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            _wait_dead(pid)
    elif fault["fault"] == "stop":
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
    elif fault["fault"] == "clear":
        with Client(fault["target"], token=fault.get("token"), timeout_s=30.0) as client:
            client.clear(all_namespaces=True)
    else:
        raise ValueError(f"unknown fault {fault['fault']!r}")
