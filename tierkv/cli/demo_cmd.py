"""``tierkv demo chat``: a newcomer's first contact with tierkv.

A scripted multi-turn chat with a transformers model (``ChatSession``), its KV kept in a running
sidecar (``--target``) or, with ``--in-process`` or when no sidecar answers, in an in-process
``TieredStore`` whose disk tier lives in the cache folder. Every turn also runs on a twin session
without a cache (the same code over a store that holds nothing), so that the table shows, per
turn, the prompt length, the tokens restored from the cache, the time to first token with and
without the cache, and that both replies are the same tokens.

Notes:
1. The built-in model is the tiny random-weight Llama of the tests (``TINY``, 17.6M parameters),
   built once into ``<cache dir>/bench-models/llama-tiny`` (nothing is downloaded) and run in
   fp32; its prompts are token ids. ``--model PATH`` runs a local Hugging Face model directory
   instead, with its tokenizer and chat template when it has them (then the script is text).
2. ``--session ID`` continues the conversation saved under ``ID`` (its first turn restores the
   whole history: after a restart of this command, of the sidecar, or both), or starts one
   under that id. The store must be the same one (the same sidecar's disk, or the same cache
   folder) and so must the model and its dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierkv.config import Priority, WritePolicy
from tierkv.errors import ConfigError, SessionNotFoundError
from tierkv.wire.limits import DEFAULT_TARGET

if TYPE_CHECKING:
    import torch

    from tierkv.keys import Namespace
    from tierkv.types import PutDetail, ResumedSession, SessionInfo, StoreStats

HOST_BYTES = 256 << 20  # the in-process store's HOST tier
DISK_BYTES = 4 << 30  # and its DISK tier (a sparse file: du shows what it holds)
SCRIPT_TEXT = (
    "You are a travel assistant. I have three days in Lisbon in May, I like museums, seafood "
    "and long walks, and I would rather avoid crowds. Suggest a plan for the first day.",
    "Which of those places are best early in the morning?",
    "Where could I have lunch near the first museum?",
    "How do I get from there to Belem by public transport?",
    "Now the second day, please, with a day trip to Sintra.",
    "What should I pack for those two days?",
)
"""The script with a tokenizer: one message per turn (repeated if ``--turns`` asks for more)."""
FIRST_TURN_TOKENS = 480  # the script without one: a system prompt and question, then ...
TURN_TOKENS = 64  # ... a follow-up of this many random token ids per turn


def register(subparsers: Any) -> None:
    """Add ``demo`` to the command line."""
    parser = subparsers.add_parser("demo", help="see tierkv at work")
    demos = parser.add_subparsers(dest="demo", required=True)
    chat = demos.add_parser(
        "chat", help="a scripted chat whose KV is kept in tierkv: TTFT with and without it",
        description="Run a few turns of a scripted chat with ChatSession and print, per turn, "
        "the prompt length, the tokens restored from tierkv and the time to first token with "
        "and without the cache.",
    )
    chat.add_argument("--target", default=DEFAULT_TARGET,
                      help=f"the sidecar to use (default {DEFAULT_TARGET}); when none answers, "
                           "an in-process store is used")
    chat.add_argument("--token", default=None, help="the sidecar's bearer token, if it has any")
    chat.add_argument("--in-process", action="store_true",
                      help="use an in-process TieredStore, not a sidecar")
    chat.add_argument("--model", type=Path, default=None,
                      help="a local Hugging Face model directory (default: a tiny random-weight "
                           "Llama built once in the cache folder)")
    chat.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                      help="what the model runs in (default float32)")
    chat.add_argument("--session", default=None,
                      help="continue the conversation saved under this id (or start it)")
    chat.add_argument("--turns", type=int, default=5, help="turns to run (default 5)")
    chat.add_argument("--max-new-tokens", type=int, default=16,
                      help="reply length limit per turn (default 16)")
    chat.add_argument("--cache-dir", type=Path, default=None,
                      help="where the built-in model and the in-process store's disk tier live "
                           "(default: the user cache folder, ~/.cache/tierkv)")
    chat.add_argument("--json", type=Path, default=None, help="also write the turns as JSON")
    chat.set_defaults(func=run_chat)


@dataclass(frozen=True, slots=True)
class DemoTurn:
    """One turn of the demo, with and without the cache."""

    turn: int
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_ms: float
    ttft_no_cache_ms: float
    same_reply: bool
    reply_text: str | None


class _NoCache:
    """A ``BlockStore`` that holds nothing: the twin session recomputes every prompt."""

    def register(self, namespace: Namespace) -> None:
        pass

    def put(self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
            priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
            detail: PutDetail | None = None) -> int:
        return 0

    def lookup(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        return 0

    def get(self, namespace: Namespace, hashes: Sequence[bytes],
            device: str | torch.device = "cpu") -> torch.Tensor:
        import torch

        return torch.empty((0, *namespace.layout.block_shape), device=device)

    def get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor) -> int:
        return 0

    def prefetch(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        return 0

    def pin(self, namespace: Namespace, hashes: Sequence[bytes],
            ttl_s: float | None = None) -> int:
        return 0

    def unpin(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        return 0

    def delete(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        return 0

    def publish(self, namespace: Namespace, hashes: Sequence[bytes], *,
                wait_s: float = 5.0) -> int:
        return 0

    def stats(self) -> StoreStats:
        raise ConfigError("the demo's twin holds nothing to report")

    def save_session(self, namespace: Namespace, session_id: str, token_ids: Sequence[int],
                     ttl_s: float | None = None) -> int:
        return len(token_ids)

    def resume_session(self, session_id: str, *,
                       tenant: str = "default") -> ResumedSession:
        raise SessionNotFoundError(f"no session {session_id!r}: this store holds nothing")

    def delete_session(self, session_id: str, *, tenant: str = "default") -> bool:
        return False

    def list_sessions(self, *, tenant: str = "default") -> list[SessionInfo]:
        return []


def _cache_dir(args: argparse.Namespace) -> Path:
    from platformdirs import user_cache_path

    return Path(args.cache_dir) if args.cache_dir is not None else user_cache_path("tierkv")


def _open_store(args: argparse.Namespace, stack: contextlib.ExitStack) -> tuple[Any, str]:
    """The ``BlockStore`` to chat with, and a line saying which it is."""
    from tierkv.client import Client
    from tierkv.config import DiskTierConfig, HostTierConfig, StoreConfig
    from tierkv.errors import DeadlineExceededError, ServiceUnavailableError
    from tierkv.store import TieredStore

    why = "--in-process"
    if not args.in_process:
        try:
            with Client(args.target, token=args.token, timeout_s=3.0, retries=0) as probe:
                probe.describe()
        except (ServiceUnavailableError, DeadlineExceededError) as exc:
            why = f"no sidecar answers at {args.target}: {str(exc).splitlines()[0]}"
        else:
            client = stack.enter_context(Client(args.target, token=args.token))
            path = "shared memory" if client.uses_shared_memory else "streamed, not same-host"
            return client, f"the sidecar at {args.target} ({path})"
    disk = _cache_dir(args) / "demo-store"
    config = StoreConfig(host=HostTierConfig(HOST_BYTES), disk=DiskTierConfig(disk, DISK_BYTES))
    store = stack.enter_context(TieredStore(config))
    return store, f"an in-process TieredStore, its DISK tier in {disk} ({why})"


def _load_model(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """``(model, tokenizer or None, a line describing them)`` (note 1)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tierkv.bench.models import TINY, build_llama

    path = args.model
    if path is None:
        path = build_llama(_cache_dir(args) / "bench-models" / "llama-tiny", TINY)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    model.eval()
    tokenizer = None
    if args.model is not None:
        with contextlib.suppress(OSError, ValueError):
            tokenizer = AutoTokenizer.from_pretrained(path)
    num_params = sum(p.numel() for p in model.parameters()) / 1e6
    kind = "the built-in tiny random-weight Llama" if args.model is None else str(path)
    prompts = "text, chat template" if getattr(tokenizer, "chat_template", None) else (
        "text" if tokenizer is not None else "token ids")
    return model, tokenizer, f"{kind} ({num_params:.1f}M parameters, {args.dtype}; {prompts})"


def script(tokenizer: Any, num_turns: int, vocab_size: int, history: int = 0
           ) -> list[str | list[int]]:
    """The scripted messages: text with a tokenizer, else seeded random token ids (a long first
    message opens a new conversation, ``history == 0``; short follow-ups continue one)."""
    if tokenizer is not None:
        return [SCRIPT_TEXT[i % len(SCRIPT_TEXT)] for i in range(num_turns)]
    rnd = random.Random(f"tierkv-demo-chat-{history}")
    lengths = [FIRST_TURN_TOKENS if i == 0 and history == 0 else TURN_TOKENS
               for i in range(num_turns)]
    return [[rnd.randrange(100, vocab_size) for _ in range(n)] for n in lengths]


def _sessions(args: argparse.Namespace, model: Any, store: Any, tokenizer: Any) -> tuple[Any, Any]:
    """The cached session (resumed with ``--session`` when it exists, note 2) and its twin
    without a cache, on the same history."""
    from tierkv.errors import NotFoundError
    from tierkv.integrations.transformers import ChatSession

    options = {"tokenizer": tokenizer, "max_new_tokens": args.max_new_tokens}
    session = None
    if args.session is not None:
        try:
            session = ChatSession.resume(model, store, args.session, **options)
            print(f"session {args.session}: resumed, {len(session.token_ids)} tokens of history")
        except NotFoundError:  # (through a sidecar, an unknown session is NOT_FOUND)
            print(f"session {args.session}: not saved yet, starting it")
    if session is None:
        session = ChatSession(model, store, session_id=args.session, **options)
    twin = ChatSession(model, _NoCache(), session_id=session.session_id, **options)
    twin.token_ids = list(session.token_ids)
    return session, twin


def run_chat(args: argparse.Namespace) -> int:
    """Run ``demo chat``."""
    import torch

    from tierkv.errors import ConfigError

    if args.turns < 1 or args.max_new_tokens < 1:
        raise ConfigError("demo chat: --turns and --max-new-tokens must be at least 1")
    with contextlib.ExitStack() as stack:
        store, where = _open_store(args, stack)
        print(f"store: {where}")
        model, tokenizer, described = _load_model(args)
        print(f"model: {described}")
        session, twin = _sessions(args, model, store, tokenizer)
        with torch.no_grad():  # the first forward pays for kernel set-up: not in turn 1's figures
            model(torch.ones((1, 16), dtype=torch.long))
        turns = []
        messages = script(tokenizer, args.turns, model.config.vocab_size,
                          len(session.token_ids))
        for index, message in enumerate(messages, 1):
            cached, plain = session.turn(message), twin.turn(message)
            turns.append(DemoTurn(index, cached.num_prompt_tokens, cached.num_cached_tokens,
                                  1000 * cached.ttft_s, 1000 * plain.ttft_s,
                                  cached.reply_token_ids == plain.reply_token_ids,
                                  cached.reply_text))
    print(format_turns(turns))
    print(f"\nsession {session.session_id}: {len(session.token_ids)} tokens saved; continue it "
          f"with: tierkv demo chat --session {session.session_id} (and the same store flags)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"store": where, "model": described,
                                         "session": session.session_id,
                                         "turns": [asdict(t) for t in turns]}, indent=2))
        print(f"wrote {args.json}")
    status = exit_status(turns)
    if status:
        print("demo chat: a reply with the cache differs from the reply without it (turns "
              f"{[t.turn for t in turns if not t.same_reply]})", file=sys.stderr)
    return status


def exit_status(turns: list[DemoTurn]) -> int:
    """The command's exit status: 1 when a turn's reply differs with and without the cache,
    else 0."""
    return 0 if all(t.same_reply for t in turns) else 1


def format_turns(turns: list[DemoTurn]) -> str:
    """The per-turn table (and the replies, when they are text)."""
    header = (f"{'turn':>4} {'prompt':>7} {'cached':>7} {'prefilled':>9}  {'TTFT cached':>11} "
              f"{'TTFT no cache':>13} {'speedup':>8}  same reply")
    lines = ["time to first token (ms) with the KV from tierkv and without it", header,
             "-" * len(header)]
    for t in turns:
        lines.append(
            f"{t.turn:>4} {t.num_prompt_tokens:>7} {t.num_cached_tokens:>7} "
            f"{t.num_prompt_tokens - t.num_cached_tokens:>9}  {t.ttft_ms:>11.1f} "
            f"{t.ttft_no_cache_ms:>13.1f} {t.ttft_no_cache_ms / t.ttft_ms:>7.1f}x  "
            f"{'yes' if t.same_reply else 'NO'}")
    for t in turns:
        if t.reply_text is not None:
            lines.append(f"turn {t.turn}: {t.reply_text[:100]!r}")
    return "\n".join(lines)
