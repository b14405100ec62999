"""save_kv / restore_kv / ChatSession on the model families whose caches are not one group of
full-attention layers: sliding window on every layer (Mistral), sliding and full layers mixed
(Gemma 3, Qwen2, gpt-oss with attention sinks), and DeepSeek V2/V3's MLA cache. Random
weights from tiny configs (nothing downloaded), fp32; through an in-process TieredStore and a
sidecar on a real socket (``open_blocks``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.support.tiny_llama import kv_store_config, prefill, prompt, tiny_llama
from tierkv import BlockStore, Priority, PutDetail, ResumedSession, TieredStore, WritePolicy
from tierkv.integrations.transformers import (
    ChatSession,
    KVGroups,
    hashes_of,
    model_groups,
    model_namespace,
    restore_kv,
    restore_kv_detail,
    save_kv,
)
from tierkv.keys import Namespace

OpenBlocks = Callable[[str], BlockStore]
FP32_TOLERANCE = 1e-4
BLOCK_SIZE = 16
HISTORY = 200  # tokens: 6 windows of 32, 5 of 40; 12 full blocks
NUM_CACHED = 192
NUM_NEW_TOKENS = 5
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 4096}


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: these models are tiny, and on a busy CPU the threads' barriers
    cost 30 times their matmuls."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def _build(cls: str, config: Any, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return getattr(transformers, cls)(config).eval()


@functools.cache
def family(name: str) -> Any:
    """A tiny random-weight model of family ``name`` (built once per test process)."""
    if name == "mistral":  # sliding window on every layer
        return _build("MistralForCausalLM", transformers.MistralConfig(
            num_hidden_layers=2, sliding_window=32, **SMALL))
    if name == "gemma3":  # sliding-window layers around a global one
        model = _build("Gemma3ForCausalLM", transformers.Gemma3TextConfig(
            num_hidden_layers=3, sliding_window=40, initializer_range=0.1,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], **SMALL))
        with torch.no_grad():  # else the scaled embedding drowns the attention: one token
            model.model.embed_tokens.weight.mul_(0.05)
        return model
    if name == "qwen2":  # a full layer, then sliding ones
        return _build("Qwen2ForCausalLM", transformers.Qwen2Config(
            num_hidden_layers=3, use_sliding_window=True, sliding_window=48, max_window_layers=1,
            **SMALL))
    if name == "gpt-oss":  # sliding window with attention sinks, and full layers
        return _build("GptOssForCausalLM", transformers.GptOssConfig(
            num_hidden_layers=2, sliding_window=32, num_local_experts=2, num_experts_per_tok=1,
            layer_types=["sliding_attention", "full_attention"], **SMALL))
    mla = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 4, "intermediate_size": 128, "moe_intermediate_size": 32,
           "vocab_size": 128, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
           "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1}
    if name == "deepseek-v2":
        return _build("DeepseekV2ForCausalLM", transformers.DeepseekV2Config(
            q_lora_rank=None, **mla))
    if name == "deepseek-v3":
        return _build("DeepseekV3ForCausalLM", transformers.DeepseekV3Config(
            q_lora_rank=24, n_group=2, topk_group=1, **mla))
    raise AssertionError(name)


SLIDING = ["mistral", "gemma3", "qwen2", "gpt-oss"]
FAMILIES = [*SLIDING, "deepseek-v2", "deepseek-v3"]


def recording_prefill(model: Any, token_ids: Sequence[int]) -> Any:
    """The cache of a prefill of ``token_ids`` whose sliding layers keep every token (as
    ``ChatSession`` prefills): what lets ``save_kv`` store every full block."""
    cache = transformers.DynamicCache(config=model.config)
    cache.activate_past_recording()
    with torch.no_grad():
        model(torch.tensor([list(token_ids)]), past_key_values=cache, use_cache=True)
    return cache


def saved_history(blocks: BlockStore, model: Any) -> tuple[KVGroups, list[int]]:
    """``model``'s groups, and a turn that extends a stored history of ``HISTORY`` tokens."""
    groups = model_groups(model, block_size=BLOCK_SIZE)
    history = prompt(HISTORY)
    assert save_kv(blocks, groups, history, recording_prefill(model, history)) == (
        NUM_CACHED // BLOCK_SIZE * len(groups.groups))
    return groups, [*history, *prompt(20, seed=2)]


def logit_error(model: Any, token_ids: list[int], cache: Any, num_cached: int) -> float:
    expected, _ = prefill(model, token_ids)
    got, _ = prefill(model, token_ids[num_cached:], cache)
    return float((got - expected).abs().max())


def generated(model: Any, token_ids: list[int], cache: Any = None) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), past_key_values=cache,
                             max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
                             do_sample=False)
    return [int(token) for token in out[0, len(token_ids):]]


def window_blocks(window: int | None, num_tokens: int) -> int:
    """How many blocks a restore of ``num_tokens`` tokens loads for a group of ``window``."""
    if window is None:
        return num_tokens // BLOCK_SIZE
    return num_tokens // BLOCK_SIZE - max(0, num_tokens - window + 1) // BLOCK_SIZE


@pytest.mark.parametrize("name", FAMILIES)
def test_a_restore_gives_the_logits_and_tokens_of_a_full_recompute(
    open_blocks: OpenBlocks, name: str
) -> None:
    model = family(name)
    blocks = open_blocks("alice")
    groups, turn = saved_history(blocks, model)
    restored = restore_kv_detail(blocks, groups, turn)
    assert restored.num_cached_tokens == NUM_CACHED
    assert restored.cache.get_seq_length() == NUM_CACHED
    assert restored.num_loaded_blocks == tuple(
        window_blocks(group.sliding_window_tokens, NUM_CACHED) for group in groups.groups)
    assert logit_error(model, turn, restored.cache, NUM_CACHED) <= FP32_TOLERANCE
    again, num_cached = restore_kv(blocks, groups, turn)
    assert generated(model, turn, again) == generated(model, turn)
    assert num_cached == NUM_CACHED


@pytest.mark.parametrize("name", FAMILIES)
def test_the_restored_layers_are_what_a_prefill_leaves(tmp_path: Path, name: str) -> None:
    model = family(name)
    history = prompt(HISTORY)
    groups = model_groups(model, block_size=BLOCK_SIZE)
    saved = recording_prefill(model, history)  # every layer holds tokens [0, 200)
    with TieredStore(kv_store_config(tmp_path)) as store:
        save_kv(store, groups, history, saved)
        restored, num_cached = restore_kv(store, groups, [*history, 7])
    with torch.no_grad():
        reference = model(torch.tensor([history[:num_cached]]), use_cache=True).past_key_values
    assert num_cached == NUM_CACHED and len(restored.layers) == len(reference.layers)
    for got, stored, expected in zip(restored.layers, saved.layers, reference.layers,
                                     strict=True):
        assert type(got) is type(expected)
        assert got.get_seq_length() == expected.get_seq_length() == num_cached
        assert got.get_mask_sizes(7) == expected.get_mask_sizes(7)
        assert got.keys.shape == expected.keys.shape  # a sliding layer: the last window - 1
        assert got.values.shape == expected.values.shape
        # The stored bytes exactly; a prefill of 192 tokens is another matmul shape (ulps).
        start = num_cached - got.keys.shape[2]
        assert torch.equal(got.keys, stored.keys[:, :, start:num_cached])
        assert torch.equal(got.values, stored.values[:, :, start:num_cached])
        assert torch.allclose(got.keys, expected.keys, atol=1e-5)


def test_a_sliding_window_restore_loads_only_the_window(open_blocks: OpenBlocks) -> None:
    # Mistral of the tiny Llama's shape (2 layers, 2 KV heads of 16, fp32): 8 KiB blocks.
    blocks = open_blocks("alice")
    llama = tiny_llama()
    turn = [*prompt(HISTORY), *prompt(20, seed=2)]
    namespace = model_namespace(llama, block_size=BLOCK_SIZE)
    save_kv(blocks, namespace, turn[:HISTORY], prefill(llama, turn[:HISTORY])[1])
    full = restore_kv_detail(blocks, namespace, turn)
    groups, _ = saved_history(blocks, family("mistral"))
    sliding = restore_kv_detail(blocks, groups, turn)
    assert groups.groups[0].namespace.layout == namespace.layout
    assert full.num_cached_tokens == sliding.num_cached_tokens == NUM_CACHED
    assert full.num_loaded_bytes == 12 * 8192  # every block of the prefix
    assert sliding.num_loaded_bytes == 2 * 8192  # tokens [161, 192): blocks 10 and 11


def test_a_gemma3_like_hit_over_8_windows_loads_a_quarter_of_a_full_attention_model(
    tmp_path: Path,
) -> None:
    # Gemma 3's pattern (5 sliding layers per global one), a window of 32, a prefix of 256.
    config = transformers.Gemma3TextConfig(
        num_hidden_layers=6, sliding_window=32, initializer_range=0.2,
        layer_types=[*["sliding_attention"] * 5, "full_attention"], **SMALL)
    model = _build("Gemma3ForCausalLM", config)
    history, turn = prompt(256), [*prompt(256), *prompt(16, seed=2)]
    groups = model_groups(model, block_size=BLOCK_SIZE)
    with TieredStore(kv_store_config(tmp_path)) as store:
        blocks = store
        assert save_kv(blocks, groups, history, recording_prefill(model, history)) == 2 * 16
        restored = restore_kv_detail(blocks, groups, turn)
    layer_block_bytes = 2 * BLOCK_SIZE * 2 * 16 * 4  # K and V, 16 tokens, 2 heads of 16, fp32
    stored_bytes = 16 * 6 * layer_block_bytes  # every block of every layer: as full attention
    assert sum(g.namespace.layout.bytes_per_block for g in groups.groups) * 16 == stored_bytes
    assert restored.num_cached_tokens == 256 and restored.num_loaded_blocks == (16, 2)
    # The full layer's 16 blocks, and 2 blocks (tokens [225, 256)) of each sliding layer.
    assert restored.num_loaded_bytes == (16 * 1 + 2 * 5) * layer_block_bytes  # 104 KiB
    assert restored.num_loaded_bytes / stored_bytes == pytest.approx(26 / 96)  # full: 384 KiB
    assert logit_error(model, turn, restored.cache, 256) <= FP32_TOLERANCE


def test_blocks_of_one_family_or_group_never_hit_another(tmp_path: Path) -> None:
    models = [tiny_llama(), *(family(name) for name in FAMILIES)]
    namespaces = [group.namespace for model in models for group in model_groups(model).groups]
    assert len({namespace.id for namespace in namespaces}) == len(namespaces) == 10
    assert model_groups(tiny_llama()).groups[0].namespace == model_namespace(tiny_llama())
    names = [group.namespace.model_id.rsplit("|", 1)[1]
             for group in model_groups(family("gemma3")).groups]
    assert names == ["group=full", "group=sliding:40"]

    gemma, history = family("gemma3"), prompt(HISTORY)
    groups = model_groups(gemma, block_size=BLOCK_SIZE)
    full, sliding = (group.namespace for group in groups.groups)
    hashes = hashes_of(full, history)
    with TieredStore(kv_store_config(tmp_path)) as store:
        blocks = store
        # A plain prefill: the sliding layers hold only tokens [161, 200), so block 11 alone.
        save_kv(blocks, groups, history, prefill(gemma, history)[1])
        assert blocks.lookup(full, hashes) == 12
        assert blocks.lookup(sliding, hashes) == 0
        assert blocks.lookup(sliding, hashes[11:]) == 1
        # The full group's blocks never stand in for the sliding group's: no window, no hit.
        assert restore_kv(blocks, groups, [*history, 5]) == (None, 0)
        # Nor do one family's blocks for another's, of the same layer shape.
        groups_of_mistral = model_groups(family("mistral"), block_size=BLOCK_SIZE)
        save_kv(blocks, groups_of_mistral, history, recording_prefill(family("mistral"), history))
        assert restore_kv(blocks, groups, [*history, 5]) == (None, 0)
        assert restore_kv(blocks, groups_of_mistral, [*history, 5])[1] == NUM_CACHED


class DroppingBlocks:
    """A ``BlockStore`` that loses the blocks ``lost`` of ``namespace`` (never stores them),
    and reads at most ``max_read`` blocks of it at a time (an eviction since the lookup)."""

    def __init__(self, inner: BlockStore, namespace: Namespace, lost: set[bytes],
                 max_read: int | None = None) -> None:
        self.inner, self.namespace, self.lost, self.max_read = inner, namespace, lost, max_read

    def register(self, namespace: Namespace) -> None:
        self.inner.register(namespace)

    def lookup(self, namespace: Namespace, hashes: Sequence[bytes]) -> int:
        return self.inner.lookup(namespace, hashes)

    def get_into(self, namespace: Namespace, hashes: Sequence[bytes], out: torch.Tensor) -> int:
        if namespace.id == self.namespace.id and self.max_read is not None:
            hashes = hashes[: self.max_read]
        return self.inner.get_into(namespace, hashes, out)

    def put(self, namespace: Namespace, hashes: Sequence[bytes], blocks: torch.Tensor, *,
            priority: Priority = Priority.NORMAL, write_policy: WritePolicy | None = None,
            detail: PutDetail | None = None) -> int:
        keep = [i for i, h in enumerate(hashes)
                if namespace.id != self.namespace.id or h not in self.lost]
        if not keep:
            return 0
        return self.inner.put(
            namespace, [hashes[i] for i in keep], blocks[keep], priority=priority,
            write_policy=write_policy,
            detail=detail if keep[0] == 0 else PutDetail(parent_hash=hashes[keep[0] - 1]))

    def save_session(self, namespace: Namespace, session_id: str,
                     token_ids: Sequence[int]) -> int:
        return self.inner.save_session(namespace, session_id, token_ids)

    def resume_session(self, session_id: str) -> ResumedSession:
        return self.inner.resume_session(session_id)


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
@pytest.mark.parametrize(("lost", "num_cached"), [
    ({10}, 160),  # inside the window of 192: cut to 160, whose window is blocks 7/8-9
    ({11}, 176),  # the last block: 176's window (tokens [137|145, 176)) is there
    (set(range(0, 12, 2)), 0),  # every other block: no window is whole, a miss
])
def test_a_sliding_group_missing_a_window_block_restores_a_shorter_prefix(
    tmp_path: Path, name: str, lost: set[int], num_cached: int
) -> None:
    model, history = family(name), prompt(HISTORY)
    groups = model_groups(model, block_size=BLOCK_SIZE)
    sliding = groups.groups[-1].namespace
    hashes = hashes_of(sliding, history)
    turn = [*history, *prompt(20, seed=2)]
    with TieredStore(kv_store_config(tmp_path)) as store:
        blocks = DroppingBlocks(store, sliding, {hashes[i] for i in lost})
        save_kv(blocks, groups, history, recording_prefill(model, history))
        restored, got = restore_kv(blocks, groups, turn)
        again, _ = restore_kv(blocks, groups, turn)  # the checks below grow their cache
    assert got == num_cached
    if num_cached:
        assert logit_error(model, turn, restored, got) <= FP32_TOLERANCE
        assert generated(model, turn, again) == generated(model, turn)
    else:
        assert restored is None


@pytest.mark.parametrize(("name", "group_index"), [("mistral", 0), ("gemma3", 0),
                                                   ("gemma3", 1)])
def test_a_read_short_of_what_the_lookup_found_is_a_miss(
    tmp_path: Path, name: str, group_index: int
) -> None:
    # Blocks evicted between the lookup and the read: a shorter prefix would need another
    # window (its first block moves with it), so the restore is a miss, never a wrong cache.
    model, history = family(name), prompt(HISTORY)
    groups = model_groups(model, block_size=BLOCK_SIZE)
    turn = [*history, *prompt(20, seed=2)]
    with TieredStore(kv_store_config(tmp_path)) as store:
        inner = store
        save_kv(inner, groups, history, recording_prefill(model, history))
        blocks = DroppingBlocks(inner, groups.groups[group_index].namespace, set(), max_read=1)
        restored = restore_kv_detail(blocks, groups, turn)
    assert (restored.cache, restored.num_cached_tokens) == (None, 0)


def recomputed_replies(model: Any, turns: list[list[int]]) -> list[list[int]]:
    """Each turn's greedy reply with no cache at all: the whole conversation prefilled anew."""
    eos = model.generation_config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else eos or [])
    tokens, replies = [], []
    for message in turns:
        tokens += message
        logits, cache = prefill(model, tokens)
        reply = [int(logits.argmax())]
        while len(reply) < NUM_NEW_TOKENS and reply[-1] not in eos_ids:
            logits, cache = prefill(model, reply[-1:], cache)
            reply.append(int(logits.argmax()))
        tokens += reply
        replies.append(reply)
    return replies


@pytest.mark.parametrize("name", FAMILIES)
def test_a_chat_of_each_family_gives_the_recomputed_tokens_from_the_cache(
    open_blocks: OpenBlocks, name: str
) -> None:
    model = family(name)
    turns = [prompt(70 + 9 * turn, seed=50 + turn) for turn in range(3)]
    session = ChatSession(model, open_blocks("alice"), max_new_tokens=NUM_NEW_TOKENS,
                          block_size=BLOCK_SIZE)
    results = [session.turn(message) for message in turns]
    assert [r.reply_token_ids for r in results] == recomputed_replies(model, turns)
    # Every turn after the first restores the full blocks of the history the cache held (all
    # of it but the last reply token).
    history = 0
    for result in results:
        assert result.num_cached_tokens == max(0, history - 1) // BLOCK_SIZE * BLOCK_SIZE
        history = result.num_prompt_tokens + len(result.reply_token_ids)


def test_a_model_with_linear_attention_layers_is_refused_and_a_chat_runs_uncached(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = transformers.Qwen3NextConfig(
        num_hidden_layers=4, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, **SMALL)
    model = _build("Qwen3NextForCausalLM", config)
    with pytest.raises(ValueError, match="LinearAttentionLayer"):
        model_groups(model)
    with TieredStore(kv_store_config(tmp_path)) as store, caplog.at_level(logging.WARNING):
        session = ChatSession(model, store, max_new_tokens=2)
        results = [session.turn(prompt(40, seed=turn)) for turn in range(2)]
    assert [r.num_cached_tokens for r in results] == [0, 0]
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and r.name.startswith("tierkv")]
    assert len(warnings) == 1 and "LinearAttentionLayer" in warnings[0]


def test_a_sliding_cache_under_a_single_namespace_is_refused(tmp_path: Path) -> None:
    model, history = family("mistral"), prompt(40)
    _, cache = prefill(model, history)
    with (TieredStore(kv_store_config(tmp_path)) as store,
          pytest.raises(ValueError, match="model_groups")):
        save_kv(store, model_namespace(model), history, cache)
