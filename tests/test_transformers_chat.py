"""ChatSession on random-weight Llama models: the same greedy tokens with the cache as without,
through an in-process TieredStore and a sidecar Client; no hits across tenants or models; a
store that is down costs a recompute, never a turn; and (slow) a resume after a SIGKILL of the
sidecar and a restart of the app continues from the conversation's KV on DISK."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from harness import SidecarFactory
from tiny_llama import kv_store_config, load_llama, prefill, prompt, tiny_llama

from tierkv import Client, TieredStore
from tierkv.integrations.transformers import BlockStore, ChatSession, TurnResult, blocks_of

OpenBlocks = Callable[[str], BlockStore]
NUM_NEW_TOKENS = 6
HELPER_PATHS = [str(Path(__file__).parent), str(Path(__file__).parent / "service")]


def messages(num_turns: int) -> list[list[int]]:
    return [prompt(5 + 3 * turn, seed=100 + turn) for turn in range(num_turns)]


def recomputed_replies(model: object, turns: list[list[int]], history: list[int] | None = None,
                       num_new_tokens: int = NUM_NEW_TOKENS) -> list[list[int]]:
    """Each turn's greedy reply with no cache at all: the whole conversation prefilled anew."""
    tokens, replies = list(history or []), []
    for message in turns:
        tokens += message
        logits, cache = prefill(model, tokens)
        reply = [int(logits.argmax())]
        while len(reply) < num_new_tokens and reply[-1] != 2:  # 2: LlamaConfig's EOS
            logits, cache = prefill(model, reply[-1:], cache)
            reply.append(int(logits.argmax()))
        tokens += reply
        replies.append(reply)
    return replies


def test_ten_turns_give_the_same_tokens_with_the_cache_as_without(
    open_blocks: OpenBlocks,
) -> None:
    model = tiny_llama()
    turns = messages(10)
    session = ChatSession(model, open_blocks("alice"), max_new_tokens=NUM_NEW_TOKENS)
    results = [session.turn(message) for message in turns]
    assert [r.reply_token_ids for r in results] == recomputed_replies(model, turns)
    # Every full block of the conversation so far is a hit, from the second turn on.
    assert [r.num_cached_tokens for r in results] == own_hits(results)
    assert results[-1].num_cached_tokens > 0
    assert all(r.ttft_s > 0 and r.reply_text is None for r in results)
    conversation = [t for m, r in zip(turns, results, strict=True) for t in [*m, *r.reply_token_ids]]
    assert session.token_ids == conversation


def own_hits(results: list[TurnResult]) -> list[int]:
    """What a conversation finds of its own: every full block of the turns before."""
    return [0, *((r.num_prompt_tokens + len(r.reply_token_ids) - 1) // 16 * 16
                 for r in results[:-1])]


def test_another_tenant_and_another_model_get_no_hit(open_blocks: OpenBlocks) -> None:
    model = tiny_llama()
    turns = messages(4)
    alice = ChatSession(model, open_blocks("alice"), max_new_tokens=NUM_NEW_TOKENS)
    first = [alice.turn(m) for m in turns]
    assert [r.num_cached_tokens for r in first] == own_hits(first)
    # The same conversation again, for the same tenant: it finds the first one's later turns.
    again = ChatSession(model, open_blocks("alice"), max_new_tokens=NUM_NEW_TOKENS)
    assert sum(again.turn(m).num_cached_tokens for m in turns) > sum(own_hits(first))
    # Another tenant, or another model, finds only what its own conversation stored.
    for other in (tiny_llama(num_layers=3), tiny_llama(num_kv_heads=4),
                  tiny_llama(dtype=torch.bfloat16), model):
        session = ChatSession(other, open_blocks("bob" if other is model else "alice"),
                              max_new_tokens=NUM_NEW_TOKENS)
        results = [session.turn(m) for m in turns]
        assert [r.num_cached_tokens for r in results] == own_hits(results)


def test_resume_continues_from_the_cached_conversation(tmp_path: Path) -> None:
    model = tiny_llama()
    turns = messages(5)
    store = TieredStore(kv_store_config(tmp_path))
    session = ChatSession(model, blocks_of(store, "alice"), max_new_tokens=NUM_NEW_TOKENS)
    for message in turns[:4]:
        session.turn(message)
    history = list(session.token_ids)
    store.close()
    with TieredStore(kv_store_config(tmp_path)) as reopened:  # blocks and record from DISK
        resumed = ChatSession.resume(model, blocks_of(reopened, "alice"), session.session_id,
                                     max_new_tokens=NUM_NEW_TOKENS)
        assert resumed.token_ids == history
        result = resumed.turn(turns[4])
    assert result.num_cached_tokens == len(history) // 16 * 16 > 0
    assert [result.reply_token_ids] == recomputed_replies(model, turns[4:], history)
    with TieredStore(kv_store_config(tmp_path)) as reopened, pytest.raises(ValueError):
        ChatSession.resume(tiny_llama(num_layers=3), blocks_of(reopened, "alice"),
                           session.session_id)


def test_a_store_that_is_down_costs_a_recompute_not_a_turn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_llama()
    turns = messages(3)
    with Client(f"unix://{tmp_path}/nobody.sock", retries=0, timeout_s=2.0) as client:
        session = ChatSession(model, blocks_of(client), max_new_tokens=NUM_NEW_TOKENS)
        with caplog.at_level(logging.WARNING):
            results = [session.turn(message) for message in turns]
    assert [r.reply_token_ids for r in results] == recomputed_replies(model, turns)
    assert [r.num_cached_tokens for r in results] == [0, 0, 0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()


CHAT_IN_ANOTHER_PROCESS = textwrap.dedent("""
    import sys
    from tierkv import Client
    from tierkv.integrations.transformers import ChatSession, blocks_of
    from test_transformers_chat import messages, NUM_NEW_TOKENS
    from tiny_llama import load_llama
    model = load_llama(sys.argv[1])
    with Client(sys.argv[2]) as client:
        session = ChatSession(model, blocks_of(client), session_id="chat-1",
                              max_new_tokens=NUM_NEW_TOKENS)
        for message in messages(4):
            session.turn(message)
    print(" ".join(map(str, session.token_ids)))
""")


@pytest.mark.slow
def test_resume_after_a_sigkill_of_the_sidecar_and_an_app_restart(
    sidecar_factory: SidecarFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_path = tmp_path / "model"
    tiny_llama(path=model_path)
    model = load_llama(model_path)
    sidecar = sidecar_factory("--host-bytes", str(8 << 20), "--disk-bytes", str(32 << 20),
                              "--page-bytes", "4096")
    app = subprocess.run(
        [sys.executable, "-c", CHAT_IN_ANOTHER_PROCESS, str(model_path), sidecar.unix_target],
        check=False, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(HELPER_PATHS)})
    assert app.returncode == 0, app.stderr
    history = [int(token) for token in app.stdout.split()]
    sidecar.kill()
    sidecar.start()

    turns = messages(6)
    with Client(sidecar.unix_target) as client:
        session = ChatSession.resume(model, blocks_of(client), "chat-1",
                                     max_new_tokens=NUM_NEW_TOKENS)
        assert session.token_ids == history
        result = session.turn(turns[4])
        assert result.num_cached_tokens == len(history) // 16 * 16 > 0
        assert [result.reply_token_ids] == recomputed_replies(model, turns[4:5], history)
        # The sidecar goes away mid-conversation: the next turn recomputes, same tokens.
        sidecar.kill()
        with caplog.at_level(logging.WARNING):
            down = session.turn(turns[5])
    assert down.num_cached_tokens == 0
    assert [down.reply_token_ids] == recomputed_replies(
        model, turns[5:6], [*history, *turns[4], *result.reply_token_ids])
    assert any("unavailable" in r.getMessage() for r in caplog.records)


class TemplateTokenizer:
    """A stand-in tokenizer with a chat template: one token per character (no download)."""

    chat_template = "<user>{content}<bot>"

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool,
                            add_generation_prompt: bool) -> str:
        assert not tokenize
        text = "<s>" + "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + ord(char) % 120 for char in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + token % 26) for token in token_ids)


def test_a_chat_template_renders_only_the_new_message_each_turn(tmp_path: Path) -> None:
    model, tokenizer = tiny_llama(), TemplateTokenizer()
    with TieredStore(kv_store_config(tmp_path)) as store:
        session = ChatSession(model, blocks_of(store), tokenizer=tokenizer,
                              max_new_tokens=NUM_NEW_TOKENS)
        first = session.turn("hello there")
        assert session.token_ids[: first.num_prompt_tokens] == tokenizer.encode(
            "<s><user>hello there</><assistant>")
        assert first.reply_text == tokenizer.decode(first.reply_token_ids)
        history = list(session.token_ids)
        second = session.turn("and again")
        assert session.token_ids[: len(history)] == history  # the history is never re-rendered
        assert session.token_ids[len(history): second.num_prompt_tokens] == tokenizer.encode(
            "<user>and again</><assistant>")  # what the template adds after the history
        assert second.num_cached_tokens == (len(history) - 1) // 16 * 16 > 0
