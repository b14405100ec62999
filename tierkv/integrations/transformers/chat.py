"""``ChatSession``: a multi-turn chat whose KV lives in tierkv across turns, processes and
restarts.

Each turn: build the prompt (the conversation so far plus the new message), restore its longest
cached prefix, prefill the rest, generate greedily, then store the new full blocks
(``write_through``, ``Priority.SESSION``) and the session record.

Notes:
1. The store is an accelerator, never a dependency of a turn: when it is down (refused,
   unavailable, timed out, closed, full) the turn recomputes and gives the same tokens. One
   warning is logged when it goes away, one line when it is back.
2. The conversation is its token ids (``token_ids``), which is what the session record holds.
   A new message is appended as tokens: with a chat template, the text the template adds for it
   (the rendering of the history with the message minus the rendering without); otherwise the
   tokenizer's encoding, or the ids given. After ``resume`` the history's messages are not
   known, only its tokens: the first new message is rendered as if it opened a conversation.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tierkv.config import Priority, WritePolicy
from tierkv.errors import (
    CapacityError,
    DeadlineExceededError,
    DiskIOError,
    InvalidArgumentError,
    ServiceUnavailableError,
    StoreClosedError,
)
from tierkv.integrations.transformers.kv import model_namespace, restore_kv, save_kv
from tierkv.integrations.transformers.store import BlockStore

log = logging.getLogger(__name__)
T = TypeVar("T")
# What "the store is down" looks like from here (note 1); anything else is a bug and raises.
STORE_DOWN = (ServiceUnavailableError, DeadlineExceededError, StoreClosedError, CapacityError,
              DiskIOError, OSError)


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One turn: the reply, how long the prompt was and how much of it came from the cache,
    and the time to the first token (restore + prefill + the first token's choice)."""

    reply_token_ids: list[int]
    reply_text: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float


class ChatSession:
    """A conversation with ``model`` whose KV is kept in ``store`` (see the module notes).

    ``session_id`` names its record (default: a new random id); ``tenant`` and ``model_id``
    go into the namespace (``model_namespace``).
    """

    def __init__(self, model: Any, store: BlockStore, *, tokenizer: Any = None,
                 session_id: str | None = None, max_new_tokens: int = 32, block_size: int = 16,
                 tenant: str = "default", model_id: str | None = None) -> None:
        if max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model = model
        self.store = store
        self.tokenizer = tokenizer
        self.session_id = session_id or uuid.uuid4().hex
        self.max_new_tokens = max_new_tokens
        self.namespace = model_namespace(model, block_size=block_size, tenant=tenant,
                                         model_id=model_id)
        self.token_ids: list[int] = []
        self._messages: list[dict[str, str]] = []
        self._store_down = False

    @classmethod
    def resume(cls, model: Any, store: BlockStore, session_id: str, *, tokenizer: Any = None,
               **kwargs: Any) -> ChatSession:
        """The session ``session_id`` as recorded in ``store``, ready for its next turn (whose
        prompt restores the conversation's KV). Raises ``NotFoundError`` if there is no
        such session (``SessionNotFoundError`` from a ``TieredStore``; a sidecar's client
        raises the ``NotFoundError`` it stands for), the store's error if it cannot be read,
        and ``InvalidArgumentError`` if it was recorded for another model."""
        session = cls(model, store, tokenizer=tokenizer, session_id=session_id, **kwargs)
        namespace, token_ids = store.resume_session(session_id)
        mine = session.namespace
        if (namespace.model_id, namespace.layout) != (mine.model_id, mine.layout):
            raise InvalidArgumentError(
                f"session {session_id!r} was recorded for model {namespace.model_id!r} "
                f"({namespace.layout}); this one is {mine.model_id!r} ({mine.layout})")
        session.token_ids = list(token_ids)
        return session

    def turn(self, message: str | Sequence[int], max_new_tokens: int | None = None) -> TurnResult:
        """Add ``message`` (text, or token ids), answer it greedily with up to
        ``max_new_tokens`` tokens (default: the session's), and store the conversation."""
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt_ids = [*self.token_ids, *self._encode(message)]
        start = time.perf_counter()
        cache, num_cached = self._guard(
            lambda: restore_kv(self.store, self.namespace, prompt_ids, device=self.model.device),
            (None, 0))
        logits, cache = self._forward(prompt_ids[num_cached:], cache)
        reply = [int(logits.argmax())]
        ttft_s = time.perf_counter() - start
        reply = self._generate(reply, cache, max_new_tokens)
        self.token_ids = [*prompt_ids, *reply]
        self._guard(lambda: save_kv(self.store, self.namespace, self.token_ids, cache,
                                    priority=Priority.SESSION,
                                    write_policy=WritePolicy.WRITE_THROUGH), 0)
        self._guard(lambda: self.store.save_session(self.namespace, self.session_id,
                                                    self.token_ids), 0, reaches_store=True)
        text = None
        if self.tokenizer is not None:
            text = str(self.tokenizer.decode(reply, skip_special_tokens=True))
            if isinstance(message, str):
                self._messages += [{"role": "user", "content": message},
                                   {"role": "assistant", "content": text}]
        return TurnResult(reply, text, len(prompt_ids), num_cached, ttft_s)

    def _forward(self, token_ids: list[int], cache: Any) -> tuple[torch.Tensor, Any]:
        inputs = torch.tensor([token_ids], device=self.model.device)
        with torch.no_grad():
            # Only the last position's logits: a whole prompt's would be its length times the
            # vocabulary (1 GiB at 8K tokens of a 32K vocabulary in fp32).
            output = self.model(inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return output.logits[0, -1], output.past_key_values

    def _generate(self, reply: list[int], cache: Any, max_new_tokens: int) -> list[int]:
        """Greedy decoding from the first token on, until ``max_new_tokens`` or an EOS token;
        ``cache`` grows in place (it then holds every token but the last)."""
        eos = _eos_ids(self.model)
        while len(reply) < max_new_tokens and reply[-1] not in eos:
            logits, cache = self._forward(reply[-1:], cache)
            reply.append(int(logits.argmax()))
        return reply

    def _encode(self, message: str | Sequence[int]) -> list[int]:
        if not isinstance(message, str):
            return [int(token) for token in message]
        if self.tokenizer is None:
            raise InvalidArgumentError("ChatSession.turn: a text message needs a tokenizer; "
                                       "give token ids, or pass tokenizer=")
        if getattr(self.tokenizer, "chat_template", None):
            user = {"role": "user", "content": message}
            after = self._render([*self._messages, user], add_generation_prompt=True)
            before = self._render(self._messages, add_generation_prompt=False)
            delta = after[len(before):] if before and after.startswith(before) else after
            return list(self.tokenizer.encode(delta, add_special_tokens=False))
        return list(self.tokenizer.encode(message, add_special_tokens=not self.token_ids))

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if not messages:
            return ""
        return str(self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt))

    def _guard(self, call: Callable[[], T], fallback: T, reaches_store: bool = False) -> T:
        """``call()``, or ``fallback`` when the store is down (note 1). Only a call that always
        reaches the store (``reaches_store``) shows that it is back: restores and saves of
        sequences without a full block do not call it."""
        try:
            result = call()
        except STORE_DOWN as exc:
            if not self._store_down:
                log.warning("tierkv store unavailable (%s: %s): session %s recomputes its "
                            "prompts and is not saved until the store is back",
                            type(exc).__name__, exc, self.session_id)
            self._store_down = True
            return fallback
        if self._store_down and reaches_store:
            log.warning("tierkv store is back: session %s uses the cache again", self.session_id)
            self._store_down = False
        return result


def _eos_ids(model: Any) -> frozenset[int]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
