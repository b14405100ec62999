"""Request traces for ``tierkv bench trace``: Mooncake's format read from a file, and a synthetic
generator of chat and agent traffic. A request is its prompt's chained block ids (equal ids at the
same position of two requests mean the same prefix up to there) and its length in tokens."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tierkv.errors import ConfigError

# Mooncake's traces name one id per 512-token block.
MOONCAKE_BLOCK_TOKENS = 512
SYNTHETIC_KINDS = ("chat", "agent")


@dataclass(frozen=True, slots=True)
class Request:
    """One request: its prompt's block ids, head first, and its prompt's length in tokens."""

    block_ids: tuple[int, ...]
    num_tokens: int


def load_mooncake(path: Path, start: int = 0, num_requests: int | None = None) -> list[Request]:
    """Requests ``start`` to ``start + num_requests`` (all after ``start`` when None) of a trace
    in Mooncake's JSONL format (``hash_ids``, ``input_length``); ``ConfigError`` on a file
    that is not one."""
    requests: list[Request] = []
    try:
        with path.open() as lines:
            for number, line in enumerate(lines):
                if number < start or not line.strip():
                    continue
                if num_requests is not None and len(requests) >= num_requests:
                    break
                row = json.loads(line)
                requests.append(Request(tuple(int(i) for i in row["hash_ids"]),
                                        int(row["input_length"])))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{path}: not a Mooncake trace ({error})") from None
    if not requests:
        raise ConfigError(f"{path}: no requests from line {start}")
    return requests


def synthetic(kind: str, num_requests: int, seed: int = 0) -> list[Request]:
    """A trace of ``kind``:

    - ``chat``: conversations that start from one of 8 system prompts (4-16 blocks, Zipf-
      popular), two in five with a document of their own (8-40 blocks); each turn sends the
      whole history again, grown by the last reply and the user's message (1-6 blocks); a
      turn goes to one of up to 300 open conversations (Zipf: the most recent most often),
      a new conversation comes two times in five, and a conversation ends after a turn with
      probability 0.3.
    - ``agent``: tasks of 10 agent types, each with a long shared system prompt and tool
      schemas (24-64 blocks, Zipf-popular types); a task runs 2-16 steps, each appending a
      tool result (2-8 blocks); 48 tasks run interleaved.
    """
    if kind not in SYNTHETIC_KINDS:
        raise ConfigError(f"unknown synthetic trace {kind!r}: one of {', '.join(SYNTHETIC_KINDS)}")
    rng = random.Random(seed)
    ids = _Ids()
    requests = _chat(rng, ids) if kind == "chat" else _agent(rng, ids)
    return [next(requests) for _ in range(num_requests)]


class _Ids:
    """Fresh block ids."""

    def __init__(self) -> None:
        self.next_id = 0

    def take(self, num: int) -> list[int]:
        taken = list(range(self.next_id, self.next_id + num))
        self.next_id += num
        return taken


def _zipf_pick(rng: random.Random, num: int, alpha: float = 1.1) -> int:
    weights = [1 / (rank + 1) ** alpha for rank in range(num)]
    return rng.choices(range(num), weights)[0]


def _chat(rng: random.Random, ids: _Ids) -> Iterator[Request]:
    prompts = [ids.take(rng.randint(4, 16)) for _ in range(8)]
    open_chats: list[list[int]] = []
    while True:
        if not open_chats or rng.random() < 0.4:
            history = list(prompts[_zipf_pick(rng, len(prompts))])
            if rng.random() < 0.4:
                history += ids.take(rng.randint(8, 40))  # a document to talk about
            open_chats.insert(0, history)
            del open_chats[300:]
        index = _zipf_pick(rng, len(open_chats), alpha=0.8)
        history = open_chats[index]
        history += ids.take(rng.randint(1, 6))  # the last reply and the user's message
        yield Request(tuple(history), len(history) * MOONCAKE_BLOCK_TOKENS)
        if rng.random() < 0.3:
            del open_chats[index]


def _agent(rng: random.Random, ids: _Ids) -> Iterator[Request]:
    prompts = [ids.take(rng.randint(24, 64)) for _ in range(10)]
    tasks: list[tuple[list[int], int]] = []  # history, steps left
    while True:
        while len(tasks) < 48:
            tasks.append((list(prompts[_zipf_pick(rng, len(prompts))]), rng.randint(2, 16)))
        index = rng.randrange(len(tasks))
        history, steps_left = tasks[index]
        history += ids.take(rng.randint(2, 8))  # the last step's tool result
        yield Request(tuple(history), len(history) * MOONCAKE_BLOCK_TOKENS)
        if steps_left <= 1:
            del tasks[index]
        else:
            tasks[index] = (history, steps_left - 1)
