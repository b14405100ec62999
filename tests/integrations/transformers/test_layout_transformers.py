"""KVLayout from real transformers configs, checked against the cache a random-weight model builds.

No download: every model is built from a config with random weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen2Config,
)

from tests.support.tiny_blocks import StoreFactory, same_bytes
from tierkv import KVLayout, Namespace, block_hashes
from tierkv.integrations.transformers import model_groups
from tierkv.layout import PRESETS, DType


def test_published_configs_match_the_presets() -> None:
    llama_3_8b = LlamaConfig(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        dtype="bfloat16",
    )
    layout = KVLayout.from_hf_config(llama_3_8b)
    assert layout == PRESETS["llama-3-8b"].layout(DType.BF16)
    assert layout.bytes_per_token == 131_072
    mistral = KVLayout.from_hf_config(MistralConfig(), dtype="fp16")  # 32 layers, 8 KV heads
    assert mistral == PRESETS["mistral-7b"].layout()
    qwen = Qwen2Config(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28,
                       num_key_value_heads=4)
    assert KVLayout.from_hf_config(qwen, dtype="bf16") == PRESETS["qwen2.5-7b"].layout(DType.BF16)
    # Tensor parallelism splits the KV heads.
    assert KVLayout.from_hf_config(llama_3_8b, tp_size=4).num_kv_heads == 2


def tiny_llama() -> tuple[LlamaConfig, LlamaForCausalLM]:
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=100)
    torch.manual_seed(0)
    return config, LlamaForCausalLM(config).eval()


def cache_of(model: LlamaForCausalLM, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        output = model(torch.tensor([tokens]), use_cache=True)
    cache = getattr(output, "cache", None) or output.past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]  # [heads, tokens, dim]


def test_the_layout_describes_the_models_own_cache(make_store: StoreFactory) -> None:
    config, model = tiny_llama()
    layout = KVLayout.from_hf_config(config, block_size=16, dtype=torch.float32)
    tokens = list(range(3, 3 + 48))
    cache = cache_of(model, tokens)
    num_heads, num_tokens, head_dim = cache[0][0].shape
    assert (len(cache), num_heads, head_dim) == (layout.num_layers, layout.num_kv_heads,
                                                 layout.head_dim)
    cache_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                      for k, v in cache)
    assert cache_bytes == layout.bytes_per_token * num_tokens

    # The integration edge: per-layer [heads, tokens, dim] -> blocks [layers, 2, 16, heads, dim].
    stacked = torch.stack([torch.stack([k, v]) for k, v in cache])  # [L, 2, H, T, D]
    per_token = stacked.permute(3, 0, 1, 2, 4)  # [T, L, 2, H, D]
    blocks = per_token.reshape(3, 16, *per_token.shape[1:]).permute(0, 2, 3, 1, 4, 5)
    blocks = blocks.contiguous()
    assert tuple(blocks.shape[1:]) == layout.block_shape

    store = make_store(host_blocks=128)  # 64 KiB: room for the three 8 KiB blocks
    namespace = Namespace("tiny-llama", layout)
    store.register(namespace)
    hashes = block_hashes(tokens, block_size=16)
    store.put(namespace, hashes, blocks)
    # A second request with the same prompt prefix finds it and gets the model's own K/V back.
    assert store.lookup(namespace, block_hashes([*tokens, 7, 8], block_size=16)) == 3
    restored = store.get(namespace, hashes)
    assert same_bytes(restored, blocks)
    assert torch.equal(restored[1, 0, 0, 5], cache[0][0][:, 16 + 5])  # layer 0, K, token 21


def _deepseek_v2() -> tuple[DeepseekV2Config, DeepseekV2ForCausalLM]:
    config = DeepseekV2Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, moe_intermediate_size=32, vocab_size=100, kv_lora_rank=32,
        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1)
    torch.manual_seed(0)
    return config, DeepseekV2ForCausalLM(config).eval()


def _cache_bytes_per_token(model: Any, num_tokens: int) -> list[int]:
    """Each cache layer's bytes per token after a prefill of ``num_tokens`` that keeps every
    token (sliding layers too)."""
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    with torch.no_grad():
        model(torch.tensor([list(range(3, 3 + num_tokens))]), past_key_values=cache)
    return [(layer.keys.numel() * layer.keys.element_size()
             + layer.values.numel() * layer.values.element_size()) // num_tokens
            for layer in cache.layers]


def test_deepseeks_layout_in_the_transformers_integration_is_its_caches_latent() -> None:
    # transformers caches MLA's compressed latent (keys: [1, 1, S, kv_lora_rank]) and its
    # shared rope key (values: [1, 1, S, qk_rope_head_dim]) per layer, not per-head K and V.
    _, model = _deepseek_v2()
    layout = model_groups(model).namespace.layout
    assert (layout.num_kv_heads, layout.head_dim, layout.value_head_dim) == (1, 32, 8)
    assert layout.block_shape == (2, 16, 1, 40)  # vLLM's latent: kv_lora_rank + rope
    per_layer = _cache_bytes_per_token(model, 48)
    assert sum(per_layer) == layout.bytes_per_token == 2 * (32 + 8) * 4


def test_from_hf_config_gives_deepseeks_latent() -> None:
    config, model = _deepseek_v2()
    layout = KVLayout.from_hf_config(config, dtype=torch.float32)
    assert layout.num_kv_heads == 1 and layout.block_shape == (2, 16, 1, 40)
    assert layout.bytes_per_token == sum(_cache_bytes_per_token(model, 48))


@pytest.mark.parametrize("layer_types", [["sliding_attention", "full_attention"] * 2,
                                         ["sliding_attention"] * 3])
def test_each_groups_layout_describes_its_layers(layer_types: list[str]) -> None:
    config = Gemma3TextConfig(num_hidden_layers=len(layer_types), hidden_size=64,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              intermediate_size=128, vocab_size=100, sliding_window=32,
                              layer_types=layer_types)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    per_layer = _cache_bytes_per_token(model, 80)
    groups = model_groups(model)
    for group in groups.groups:
        assert group.namespace.layout.num_layers == len(group.layer_indices)
        assert group.namespace.layout.bytes_per_token == sum(
            per_layer[i] for i in group.layer_indices)
        kind = "full_attention" if group.sliding_window_tokens is None else "sliding_attention"
        assert {layer_types[i] for i in group.layer_indices} == {kind}
    assert groups.namespace.layout == KVLayout.from_hf_config(config, dtype=torch.float32)
