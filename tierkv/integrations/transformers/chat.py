"""``ChatSession``: a multi-turn chat whose KV lives in tierkv across turns, processes and
restarts.

Each turn: build the prompt (the conversation so far plus the new message), restore its longest
cached prefix, prefill the rest, generate greedily, then store the new full blocks
(``write_through``, ``Priority.SESSION``) and the session record.

Notes:
1. The store is an accelerator, never a dependency of a turn: any store error (``TierKVError``
   or ``OSError``: down, slow, full, a fault on its disk, a stale slab, a revoked token...)
   makes the turn recompute, or skips its save, and the turn gives the same tokens. One warning
   is logged when the store goes away, one line when it is back. While it is away no call is
   made to it but one probe every ``STORE_RETRY_S`` (doubling up to ``STORE_RETRY_MAX_S``),
   so a hung store costs at most one short deadline per probe, not three per turn: the calls
   of a sidecar ``Client`` get ``restore_timeout_s`` for the restore and ``save_timeout_s`` for
   the saves, not the client's own deadline.
2. The cache is off for the whole session, with one message, when it cannot work. A model
   whose cache has layers ``model_groups`` refuses (linear attention, state-space, shared KV
   layers...) is found up front: no KV is restored or saved (the session record still is). An
   ``InvalidArgumentError`` from a store call is a bug on this side: logged as an error once,
   then no store call at all, rather than swallowed every turn. The turns recompute and give
   the same tokens.
3. The conversation is its token ids (``token_ids``), which is what the session record holds.
   ``token_ids`` (and the messages) advance only once the turn's reply is built.
4. A new message is appended as tokens: with a chat template, the text the template adds for it
   (the rendering of the history with the message minus the rendering without); otherwise the
   tokenizer's encoding, or the ids given. A template that re-renders the history differently
   (one that drops earlier reasoning, or moves the system prompt) gets one warning, and the
   message is then the rendering of the message alone: the history is never appended twice.
   After a reply, the text the template puts after an assistant message (its end-of-turn
   marker) is appended too, unless the reply already ends with it. After ``resume`` the
   history's messages are not known, only its tokens: the first new message is rendered as if
   it opened a conversation.
5. Sliding-window layers keep only their last ``window - 1`` tokens, but the next turn's
   restore needs the blocks of its own window, which may begin up to a block earlier. So a
   turn of a model with sliding layers records its whole past (``activate_past_recording``:
   the sliding layers then keep the restored window and the turn's tokens until the cache is
   dropped, with the same attention), and ``save_kv`` stores every full block.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tierkv.block_store import DEFAULT_PUBLISH_WAIT_S, BlockStore
from tierkv.client import Client
from tierkv.config import Priority, WritePolicy
from tierkv.errors import InvalidArgumentError, TierKVError
from tierkv.integrations.transformers.groups import KVGroups, model_groups, model_namespace
from tierkv.integrations.transformers.kv import restore_kv, save_kv
from tierkv.keys import DEFAULT_TENANT, Namespace
from tierkv.types import PutDetail, ResumedSession, SessionInfo, StoreStats

log = logging.getLogger(__name__)
T = TypeVar("T")
# What store trouble looks like from here (note 1); InvalidArgumentError is ours (note 2).
STORE_TROUBLE = (TierKVError, OSError)
STORE_RETRY_S = 5.0
STORE_RETRY_MAX_S = 60.0


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
    go into the namespace (``model_namespace``; a ``Client``'s tenant is its token's).
    ``restore_timeout_s`` and ``save_timeout_s`` bound the calls of a sidecar ``Client``; ``clock`` (seconds,
    monotonic) times the probes of a store that is down (note 1).
    """

    def __init__(self, model: Any, store: BlockStore, *, tokenizer: Any = None,
                 session_id: str | None = None, max_new_tokens: int = 32, block_size: int = 16,
                 tenant: str = "default", model_id: str | None = None,
                 restore_timeout_s: float = 1.0, save_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model = model
        self.store = store
        self.tokenizer = tokenizer
        self.session_id = session_id or uuid.uuid4().hex
        self.max_new_tokens = max_new_tokens
        self._groups, self._kv_unsupported = _groups_of(model, block_size, tenant, model_id)
        self.namespace = self._groups.namespace if self._groups is not None else (
            model_namespace(model, block_size=block_size, tenant=tenant, model_id=model_id))
        self.token_ids: list[int] = []
        self._messages: list[dict[str, str]] = []
        self._restore_store, self._save_store = store, store
        if isinstance(store, Client):
            self._restore_store = _Bounded(store, restore_timeout_s)
            self._save_store = _Bounded(store, save_timeout_s)
        self._clock = clock
        self._store_down = False
        self._retry_at = 0.0
        self._retry_s = STORE_RETRY_S
        self._template_warned = False
        self._cache_off = ""  # why every store call is skipped (note 2)
        if self._kv_unsupported:
            log.warning("tierkv: %s; session %s runs without the KV cache (the same tokens, "
                        "every prompt recomputed; its record is still saved)",
                        self._kv_unsupported, self.session_id)

    @classmethod
    def resume(cls, model: Any, store: BlockStore, session_id: str, *, tokenizer: Any = None,
               **kwargs: Any) -> ChatSession:
        """The session ``session_id`` as recorded in ``store``, ready for its next turn (whose
        prompt restores the conversation's KV). Raises ``NotFoundError`` if there is no
        such session (``SessionNotFoundError`` from a ``TieredStore``; a sidecar's client
        raises the ``NotFoundError`` it stands for), the store's error if it cannot be read,
        and ``InvalidArgumentError`` if it was recorded for another model."""
        session = cls(model, store, tokenizer=tokenizer, session_id=session_id, **kwargs)
        resumed = store.resume_session(session_id, tenant=session.namespace.tenant)
        namespace, token_ids = resumed.namespace, resumed.token_ids
        mine = session.namespace
        if (namespace.model_id, namespace.layout) != (mine.model_id, mine.layout):
            raise InvalidArgumentError(
                f"session {session_id!r} was recorded for model {namespace.model_id!r} "
                f"({namespace.layout}); this one is {mine.model_id!r} ({mine.layout})")
        session.token_ids = list(token_ids)
        return session

    def turn(self, message: str | Sequence[int], max_new_tokens: int | None = None) -> TurnResult:
        """Add ``message`` (text, or token ids), answer it greedily with up to
        ``max_new_tokens`` tokens (default: the session's), and store the conversation. Store
        errors never fail a turn (note 1)."""
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt_ids = [*self.token_ids, *self._encode(message)]
        start = time.perf_counter()
        cache, num_cached = None, 0
        if self._groups is not None:
            groups = self._groups
            cache, num_cached = self._guard(
                lambda: restore_kv(self._restore_store, groups, prompt_ids,
                                   device=self.model.device), (None, 0))
            cache = _recording(self.model, groups, cache)
        logits, cache = self._forward(prompt_ids[num_cached:], cache)
        reply = [int(logits.argmax())]
        ttft_s = time.perf_counter() - start
        reply = self._generate(reply, cache, max_new_tokens)
        text, messages = None, self._messages
        if self.tokenizer is not None:
            text = str(self.tokenizer.decode(reply, skip_special_tokens=True))
            if isinstance(message, str):
                messages = [*messages, {"role": "user", "content": message},
                            {"role": "assistant", "content": text}]
        token_ids = [*prompt_ids, *reply, *self._end_of_reply(messages, reply)]
        result = TurnResult(reply, text, len(prompt_ids), num_cached, ttft_s)
        self._save(token_ids, cache)
        self.token_ids, self._messages = token_ids, messages
        return result

    def _save(self, token_ids: list[int], cache: Any) -> None:
        if self._groups is not None:
            groups = self._groups
            self._guard(lambda: save_kv(self._save_store, groups, token_ids, cache,
                                        priority=Priority.SESSION,
                                        write_policy=WritePolicy.WRITE_THROUGH), 0)
        self._guard(lambda: self._save_session(token_ids), 0, reaches_store=True)

    def _save_session(self, token_ids: list[int]) -> int:
        self._save_store.register(self.namespace)
        return self._save_store.save_session(self.namespace, self.session_id, token_ids)

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

    def _has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def _encode(self, message: str | Sequence[int]) -> list[int]:
        if not isinstance(message, str):
            return [int(token) for token in message]
        if self.tokenizer is None:
            raise InvalidArgumentError("ChatSession.turn: a text message needs a tokenizer; "
                                       "give token ids, or pass tokenizer=")
        if not self._has_template():
            return list(self.tokenizer.encode(message, add_special_tokens=not self.token_ids))
        user = {"role": "user", "content": message}
        after = self._render([*self._messages, user], add_generation_prompt=True)
        before = self._render(self._messages, add_generation_prompt=False)
        if before and after.startswith(before):
            delta = after[len(before):]
        else:  # note 4: a first message, or a template that re-renders the history
            if before and not self._template_warned:
                log.warning("tierkv: the chat template renders the history differently once a "
                            "message is added; session %s appends each message rendered alone",
                            self.session_id)
                self._template_warned = True
            delta = self._render([user], add_generation_prompt=True)
        return list(self.tokenizer.encode(delta, add_special_tokens=False))

    def _end_of_reply(self, messages: list[dict[str, str]], reply: list[int]) -> list[int]:
        """The tokens the template puts after the reply's text (note 4) that ``reply`` does
        not end with; none without a template or a text message."""
        if not self._has_template() or not messages or messages is self._messages:
            return []
        upto = self._render(messages[:-1], add_generation_prompt=True)
        full = self._render(messages, add_generation_prompt=False)
        text = messages[-1]["content"].strip()
        end = full.rfind(text) if text else len(upto)
        if end < 0 or (not text and not full.startswith(upto)):
            return []
        suffix = list(self.tokenizer.encode(full[end + len(text):], add_special_tokens=False))
        for overlap in range(min(len(suffix), len(reply)), 0, -1):
            if reply[-overlap:] == suffix[:overlap]:
                return suffix[overlap:]
        return suffix

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if not messages:
            return ""
        return str(self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt))

    def _guard(self, call: Callable[[], T], fallback: T, reaches_store: bool = False) -> T:
        """``call()``, or ``fallback`` when the cache is off, the store is down and not due for
        a probe, or the call fails (notes 1-2). Only a call that always reaches the store
        (``reaches_store``) shows that it is back: restores and saves of sequences without a
        full block do not call it."""
        if self._cache_off or (self._store_down and self._clock() < self._retry_at):
            return fallback
        try:
            result = call()
        except InvalidArgumentError as exc:
            self._cache_off = f"{type(exc).__name__}: {exc}"
            log.error("tierkv refused a call of session %s (%s): a bug, not the store's state; "
                      "the session runs without the cache", self.session_id, self._cache_off)
            return fallback
        except STORE_TROUBLE as exc:
            self._went_down(exc)
            return fallback
        if self._store_down and reaches_store:
            log.warning("tierkv store is back: session %s uses the cache again", self.session_id)
            self._store_down, self._retry_s = False, STORE_RETRY_S
        return result

    def _went_down(self, exc: BaseException) -> None:
        if self._store_down:
            self._retry_s = min(2 * self._retry_s, STORE_RETRY_MAX_S)
        else:
            log.warning("tierkv store unavailable (%s: %s): session %s recomputes its prompts "
                        "and is not saved until the store is back (next try in %.0f s)",
                        type(exc).__name__, exc, self.session_id, self._retry_s)
            self._store_down = True
        self._retry_at = self._clock() + self._retry_s


def _groups_of(model: Any, block_size: int, tenant: str,
               model_id: str | None) -> tuple[KVGroups | None, str]:
    """``model``'s cache groups, or None and why its cache cannot be stored (note 2)."""
    try:
        return model_groups(model, block_size=block_size, tenant=tenant,
                            model_id=model_id), ""
    except InvalidArgumentError as exc:
        return None, str(exc)


def _recording(model: Any, groups: KVGroups, cache: Any) -> Any:
    """``cache`` (a new one of ``model``'s config when None) recording its whole past when
    the model has sliding-window layers (note 5); ``cache`` itself otherwise."""
    if all(group.sliding_window_tokens is None for group in groups.groups):
        return cache
    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


def _eos_ids(model: Any) -> frozenset[int]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class _Bounded:
    """A ``Client`` whose every call has the deadline ``timeout_s`` (note 1)."""

    def __init__(self, client: Client, timeout_s: float) -> None:
        self.client, self.timeout_s = client, timeout_s

    def register(self, namespace: Namespace) -> None:
        self.client.register(namespace)

    def put(self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
            priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
            detail: PutDetail | None = None) -> int:
        return self.client.put(namespace, hashes, blocks, priority=priority,
                               write_policy=write_policy, detail=detail, timeout_s=self.timeout_s)

    def lookup(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        return self.client.lookup(namespace, hashes, timeout_s=self.timeout_s)

    def get(self, namespace: Namespace, hashes: Sequence[bytes],
            device: str | torch.device = "cpu") -> torch.Tensor:
        return self.client.get(namespace, hashes, device, timeout_s=self.timeout_s)

    def get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor) -> int:
        return self.client.get_into(namespace, hashes, out, timeout_s=self.timeout_s)

    def prefetch(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        return self.client.prefetch(namespace, hashes, timeout_s=self.timeout_s)

    def pin(self, namespace: Namespace, hashes: Sequence[bytes],
            ttl_s: float | None = None) -> int:
        return self.client.pin(namespace, hashes, ttl_s, timeout_s=self.timeout_s)

    def unpin(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        return self.client.unpin(namespace, hashes, timeout_s=self.timeout_s)

    def delete(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        return self.client.delete(namespace, hashes, timeout_s=self.timeout_s)

    def publish(self, namespace: Namespace, hashes: Sequence[bytes], *,
                wait_s: float = DEFAULT_PUBLISH_WAIT_S) -> int:
        return self.client.publish(namespace, hashes, wait_s=wait_s, timeout_s=self.timeout_s)

    def stats(self) -> StoreStats:
        return self.client.stats(timeout_s=self.timeout_s)

    def save_session(self, namespace: Namespace, session_id: str, token_ids: Sequence[int],
                     ttl_s: float | None = None) -> int:
        return self.client.save_session(namespace, session_id, token_ids, ttl_s,
                                        timeout_s=self.timeout_s)

    def resume_session(self, session_id: str, *,
                       tenant: str = DEFAULT_TENANT) -> ResumedSession:
        return self.client.resume_session(session_id, timeout_s=self.timeout_s)

    def delete_session(self, session_id: str, *, tenant: str = DEFAULT_TENANT) -> bool:
        return self.client.delete_session(session_id, timeout_s=self.timeout_s)

    def list_sessions(self, *, tenant: str = DEFAULT_TENANT) -> list[SessionInfo]:
        return self.client.list_sessions(timeout_s=self.timeout_s)
