"""ChatSession on random-weight Llama models: the same greedy tokens with the cache as without,
through an in-process TieredStore and a sidecar Client; no hits across tenants or models; a
store that is down costs a recompute, never a turn; and (slow) a resume after a SIGKILL of the
sidecar and a restart of the app continues from the conversation's KV on DISK."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import child_env
from tests.support.harness import SidecarFactory
from tests.support.tiny_llama import kv_store_config, load_llama, prefill, prompt, tiny_llama
from tierkv import BlockStore, Client, TieredStore
from tierkv.errors import (
    AuthenticationError,
    DeadlineExceededError,
    IntegrityError,
    InvalidArgumentError,
    StaleSlabError,
    TierKVError,
)
from tierkv.integrations.transformers import ChatSession, TurnResult

OpenBlocks = Callable[[str], BlockStore]
NUM_NEW_TOKENS = 6


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
    session = ChatSession(model, open_blocks("alice"), tenant="alice", max_new_tokens=NUM_NEW_TOKENS)
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
    alice = ChatSession(model, open_blocks("alice"), tenant="alice", max_new_tokens=NUM_NEW_TOKENS)
    first = [alice.turn(m) for m in turns]
    assert [r.num_cached_tokens for r in first] == own_hits(first)
    # The same conversation again, for the same tenant: it finds the first one's later turns.
    again = ChatSession(model, open_blocks("alice"), tenant="alice", max_new_tokens=NUM_NEW_TOKENS)
    assert sum(again.turn(m).num_cached_tokens for m in turns) > sum(own_hits(first))
    # Another tenant, or another model, finds only what its own conversation stored.
    for other in (tiny_llama(num_layers=3), tiny_llama(num_kv_heads=4),
                  tiny_llama(dtype=torch.bfloat16), model):
        tenant = "bob" if other is model else "alice"
        session = ChatSession(other, open_blocks(tenant), tenant=tenant,
                              max_new_tokens=NUM_NEW_TOKENS)
        results = [session.turn(m) for m in turns]
        assert [r.num_cached_tokens for r in results] == own_hits(results)


def test_resume_continues_from_the_cached_conversation(tmp_path: Path) -> None:
    model = tiny_llama()
    turns = messages(5)
    store = TieredStore(kv_store_config(tmp_path))
    session = ChatSession(model, store, tenant="alice", max_new_tokens=NUM_NEW_TOKENS)
    for message in turns[:4]:
        session.turn(message)
    history = list(session.token_ids)
    store.close()
    with TieredStore(kv_store_config(tmp_path)) as reopened:  # blocks and record from DISK
        resumed = ChatSession.resume(model, reopened, session.session_id, tenant="alice",
                                     max_new_tokens=NUM_NEW_TOKENS)
        assert resumed.token_ids == history
        result = resumed.turn(turns[4])
    assert result.num_cached_tokens == len(history) // 16 * 16 > 0
    assert [result.reply_token_ids] == recomputed_replies(model, turns[4:], history)
    with TieredStore(kv_store_config(tmp_path)) as reopened, pytest.raises(ValueError):
        ChatSession.resume(tiny_llama(num_layers=3), reopened, session.session_id,
                           tenant="alice")


def test_a_store_that_is_down_costs_a_recompute_not_a_turn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_llama()
    turns = messages(3)
    with Client(f"unix://{tmp_path}/nobody.sock", retries=0, timeout_s=2.0) as client:
        session = ChatSession(model, client, max_new_tokens=NUM_NEW_TOKENS)
        with caplog.at_level(logging.WARNING):
            results = [session.turn(message) for message in turns]
    assert [r.reply_token_ids for r in results] == recomputed_replies(model, turns)
    assert [r.num_cached_tokens for r in results] == [0, 0, 0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()


CHAT_IN_ANOTHER_PROCESS = textwrap.dedent("""
    import sys
    from tierkv import Client
    from tierkv.integrations.transformers import ChatSession
    from tests.integrations.transformers.test_transformers_chat import messages, NUM_NEW_TOKENS
    from tests.support.tiny_llama import load_llama
    model = load_llama(sys.argv[1])
    with Client(sys.argv[2]) as client:
        session = ChatSession(model, client, session_id="chat-1",
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
        env=child_env())
    assert app.returncode == 0, app.stderr
    history = [int(token) for token in app.stdout.split()]
    sidecar.kill()
    sidecar.start()

    turns = messages(6)
    with Client(sidecar.unix_target) as client:
        session = ChatSession.resume(model, client, "chat-1",
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
        session = ChatSession(model, store, tokenizer=tokenizer,
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
        # The template's end of an assistant message ("</>") follows the reply in the history;
        # it is not in the cache yet (nor is the reply's last token).
        assert history[first.num_prompt_tokens + len(first.reply_token_ids):] == (
            tokenizer.encode("</>"))
        assert second.num_cached_tokens == (len(history) - 4) // 16 * 16 > 0


class FaultyBlocks:
    """A ``BlockStore`` over ``inner`` whose calls named in ``failing`` raise ``error`` (after
    sleeping ``delay_s``, as a hung sidecar would until its deadline); counts every call."""

    def __init__(self, inner: BlockStore, error: Exception, failing: set[str]) -> None:
        self.inner, self.error, self.failing = inner, error, failing
        self.num_calls = 0

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.num_calls += 1
        if name in self.failing:
            raise self.error
        return getattr(self.inner, name)(*args, **kwargs)

    def register(self, namespace: Any) -> None:
        self.inner.register(namespace)  # not a call to count: a client's makes none

    def lookup(self, *args: Any) -> int:
        return int(self._call("lookup", *args))

    def get_into(self, *args: Any) -> int:
        return int(self._call("get_into", *args))

    def put(self, *args: Any, **kwargs: Any) -> int:
        return int(self._call("put", *args, **kwargs))

    def save_session(self, *args: Any) -> int:
        return int(self._call("save_session", *args))

    def resume_session(self, session_id: str, **kwargs: Any) -> Any:
        return self._call("resume_session", session_id, **kwargs)


@pytest.mark.parametrize("error", [
    IntegrityError("DATA_LOSS: disk write failed"), StaleSlabError("stale slab"),
    AuthenticationError("token revoked"), TierKVError("something else"),
    DeadlineExceededError("deadline exceeded"), OSError("broken pipe"),
])
@pytest.mark.parametrize("failing", [{"put"}, {"save_session"}, {"lookup"}])
def test_any_store_error_costs_a_recompute_never_the_reply(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, error: Exception, failing: set[str]
) -> None:
    model = tiny_llama()
    turns = messages(3)
    with TieredStore(kv_store_config(tmp_path)) as store:
        faulty = FaultyBlocks(store, error, failing)
        # A clock that stands still: no probe of the store within the three turns, however
        # long a turn takes on a busy machine (a probe that fails again warns again).
        session = ChatSession(model, faulty, max_new_tokens=NUM_NEW_TOKENS, clock=lambda: 0.0)
        with caplog.at_level(logging.WARNING):
            results = [session.turn(message) for message in turns]
    assert [r.reply_token_ids for r in results] == recomputed_replies(model, turns)
    conversation = [t for m, r in zip(turns, results, strict=True) for t in [*m, *r.reply_token_ids]]
    assert session.token_ids == conversation
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()


def test_a_refused_call_turns_the_cache_off_once_not_every_turn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_llama()
    turns = messages(4)
    with TieredStore(kv_store_config(tmp_path)) as store:
        faulty = FaultyBlocks(store, InvalidArgumentError("bad blocks"), {"put"})
        session = ChatSession(model, faulty, max_new_tokens=NUM_NEW_TOKENS)
        with caplog.at_level(logging.WARNING):
            results = [session.turn(message) for message in turns[:2]]
            num_calls = faulty.num_calls
            results += [session.turn(message) for message in turns[2:]]
    assert [r.reply_token_ids for r in results] == recomputed_replies(model, turns)
    assert faulty.num_calls == num_calls  # no store call once the cache is off
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_store_that_is_down_is_probed_once_per_backoff_not_every_call(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, clock = tiny_llama(), FakeClock()
    turns = messages(8)
    with TieredStore(kv_store_config(tmp_path)) as store:
        hung = FaultyBlocks(store, DeadlineExceededError("hung"),
                            {"lookup", "get_into", "put", "save_session"})
        session = ChatSession(model, hung, max_new_tokens=NUM_NEW_TOKENS, clock=clock)
        calls = []
        with caplog.at_level(logging.WARNING):
            for message, now_s in zip(turns[:6], [0, 1, 4.9, 5, 6, 14.9], strict=True):
                clock.now_s, before = now_s, hung.num_calls
                session.turn(message)
                calls.append(hung.num_calls - before)
            # One call per probe: at 0, at 5 (backoff 5 s), then not before 15 (10 s).
            assert calls == [1, 0, 0, 1, 0, 0]
            hung.failing = set()  # the store is back: the next probe finds it
            clock.now_s, history = 15, list(session.token_ids)
            back = session.turn(turns[6])
            assert hung.num_calls > sum(calls)
            after = session.turn(turns[7])
    assert back.num_cached_tokens == 0 and after.num_cached_tokens > 0
    assert [r.reply_token_ids for r in (back, after)] == recomputed_replies(
        model, turns[6:], history)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 2 and "unavailable" in lines[0] and "is back" in lines[1]


def test_a_sliding_window_model_keeps_its_kv_across_turns_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 24: a sliding-window model is cached (it ran uncached with a warning before)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                           sliding_window=32, eos_token_id=2)
    model = MistralForCausalLM(config).eval()
    turns = [prompt(20 + 10 * turn, seed=turn) for turn in range(3)]
    with TieredStore(kv_store_config(tmp_path)) as store:
        with caplog.at_level(logging.WARNING):
            session = ChatSession(model, store, max_new_tokens=NUM_NEW_TOKENS)
            results = [session.turn(message) for message in turns]
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.reply_token_ids for r in results] == recomputed_replies(model, turns)
    cached = [r.num_cached_tokens for r in results]
    assert cached[0] == 0 and 0 < cached[1] < cached[2]
    assert warnings == []


class DroppingTemplateTokenizer(TemplateTokenizer):
    """Qwen3's template in miniature: earlier assistant messages lose their reasoning, so the
    history re-renders differently once a message is added; replies carry reasoning."""

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool,
                            add_generation_prompt: bool) -> str:
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        text = "".join(
            f"<{m['role']}>"
            f"{re.sub('<think>.*?</think>', '', m['content']) if i < last_user else m['content']}"
            "</>" for i, m in enumerate(messages))
        return text + ("<assistant>" if add_generation_prompt else "")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "<think>x</think>" + super().decode(token_ids, skip_special_tokens)


def test_a_template_that_re_renders_the_history_appends_only_the_new_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, tokenizer = tiny_llama(), DroppingTemplateTokenizer()
    with TieredStore(kv_store_config(tmp_path)) as store:
        session = ChatSession(model, store, tokenizer=tokenizer,
                              max_new_tokens=NUM_NEW_TOKENS)
        with caplog.at_level(logging.WARNING):
            for message in ["hello there", "and again", "third"]:
                history = list(session.token_ids)
                result = session.turn(message)
                assert session.token_ids[: len(history)] == history
                assert session.token_ids[len(history): result.num_prompt_tokens] == (
                    tokenizer.encode(f"<user>{message}</><assistant>"))
                end = result.num_prompt_tokens + len(result.reply_token_ids)
                assert session.token_ids[end:] == tokenizer.encode("</>")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "renders the history differently" in warnings[0].getMessage()



def test_a_conversation_under_pressure_loses_its_latest_turns_first(tmp_path: Path) -> None:
    """Each turn saves only its new blocks, continuing the history: they name their parent, so
    the store evicts a conversation from its end, never its head. Three turns of A, three of B
    through a store that holds 8 blocks in HOST and 12 on DISK: A's next turn still hits its
    first four blocks (before issue 43, each turn's save was newer than the history it
    continued: one block)."""
    from tierkv import DiskTierConfig, HostTierConfig, StoreConfig

    model = tiny_llama()
    config = StoreConfig(host=HostTierConfig(8 * 8192, 4096),
                         disk=DiskTierConfig(tmp_path / "disk", 12 * 8320))  # 12 records
    with TieredStore(config) as store:
        blocks = store
        a = ChatSession(model, blocks, max_new_tokens=NUM_NEW_TOKENS)
        b = ChatSession(model, blocks, max_new_tokens=NUM_NEW_TOKENS)
        for turn in range(3):
            a.turn(prompt(40, seed=10 + turn))
        for turn in range(3):
            b.turn(prompt(40, seed=50 + turn))
        assert a.turn(prompt(10, seed=99)).num_cached_tokens >= 4 * 16
