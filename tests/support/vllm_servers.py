"""Real OpenAI servers of vLLM for tests (``tierkv.bench.servers``' launcher), with the
connector configured as the README says, and plain HTTP calls to them."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.vllm_engines import ALPHA, BLOCK_SIZE
from tierkv.bench.servers import start_openai_server, wait_for_openai_server


def start_server(model: Path, sidecar_target: str, log: Path, *, role: str = "kv_both",
                 token: str = ALPHA, max_model_len: int = 2048, omp_threads: int | None = None,
                 **extra: Any
                 ) -> tuple[subprocess.Popen[bytes], str]:
    """Start an OpenAI server with the connector (``kv_role`` ``role``, ``extra`` in its
    ``kv_connector_extra_config``); returns it and its base URL, without waiting (``ready``)."""
    transfer = {
        "kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.integrations.vllm",
        "kv_role": role, "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": sidecar_target, "token": token, **extra},
    }
    return start_openai_server(model, log, transfer=transfer, block_size=BLOCK_SIZE,
                               max_model_len=max_model_len, omp_threads=omp_threads)


def ready(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Wait until the server at ``url`` answers its health check."""
    wait_for_openai_server(process, url, log)


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
