"""A ``TierKVConnector`` that SIGKILLs the sidecar (pid in ``TIERKV_TEST_KILL_PID``) when the
worker starts its first load: "the sidecar dies while the engine loads", at a deterministic
moment. Loaded by vLLM as ``tests.support.vllm_killer:KillingConnector`` (the tests put the
checkout on the engine's PYTHONPATH)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from tierkv.integrations.vllm import TierKVConnector
from tierkv.integrations.vllm.connector import TierKVMetadata


class KillingConnector(TierKVConnector):
    """Kills the sidecar once, just before the first load would fetch its blocks."""

    _killed = False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, TierKVMetadata) and meta.loads and not KillingConnector._killed:
            KillingConnector._killed = True
            pid = int(os.environ["TIERKV_TEST_KILL_PID"])
            os.kill(pid, signal.SIGKILL)
            _wait_dead(pid)
        super().start_load_kv(forward_context, **kwargs)


def _wait_dead(pid: int) -> None:
    """Until the process is gone or a zombie (its parent, the test, reaps it later)."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.005)
