"""Models with random weights, built from a config and saved locally (nothing is downloaded):
what the vLLM tests and ``tierkv bench vllm`` run engines on. Llama of any shape, and one tiny
model of each family the connector serves (``build_family``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The config fields that decide a model's size and KV layout."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 32000
    max_positions: int = 16384
    dtype: str = "bfloat16"
    seed: int = 0


TINY = LlamaShape(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                  intermediate_size=512)
"""The test model: 17.6M parameters, 64-wide heads (the smallest the CPU backend takes)."""

BENCH_156M = LlamaShape(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4,
                        intermediate_size=4096)
"""The benchmark model of the vLLM issue: 156M parameters, bf16."""


def build_llama(path: Path, shape: LlamaShape) -> Path:
    """Save a random-weight Llama of ``shape`` at ``path`` (``save_pretrained``), unless the
    same shape is already there; returns ``path``."""
    stamp = path / "tierkv-shape.json"
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(shape):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(shape.seed)
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_positions, dtype=shape.dtype,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, shape.dtype))  # type: ignore[no-untyped-call]
    model.save_pretrained(path)
    stamp.write_text(json.dumps(asdict(shape)))
    return path


SLIDING_WINDOW_TOKENS = 64
"""The window of the sliding-window test families: a 200-token prefix is three windows."""

FAMILIES = ("llama", "mistral-sliding", "gemma3", "gpt-oss", "deepseek-v2")
"""The model families the connector's tests build (see ``build_family``)."""


def build_family(path: Path, family: str, seed: int = 0,
                 window_tokens: int = SLIDING_WINDOW_TOKENS,
                 shape: LlamaShape | None = None) -> Path:
    """Save a tiny random-weight model of ``family`` at ``path`` (``FAMILIES``), unless it is
    already there; returns ``path``. Each is shaped as the CPU backend takes it (64-wide heads;
    ``shape``, when given, sets the width, heads and layers of ``gemma3`` instead):

    * ``llama``: ``TINY``.
    * ``mistral-sliding``: Mistral, a sliding window on every layer.
    * ``gemma3``: Gemma 3, five sliding-window layers and a global one.
    * ``gpt-oss``: gpt-oss, sliding-window and full layers in turn, attention sinks, MoE.
    * ``deepseek-v2``: DeepSeek-V2 MLA (a 512 + 64 latent, the CPU MLA backend's), dense MLPs.
    * ``gemma3-global``: ``gemma3`` with every layer global (what its windows save against).
    * ``lfm2-hybrid``: LFM2, short-convolution layers (vLLM's ``MambaSpec``: state, not KV
      blocks) and full-attention ones in turn.
    """
    if family == "llama":
        return build_llama(path, replace(TINY, seed=seed))
    if shape is not None and family != "gemma3":
        raise ValueError(f"a shape is taken for gemma3 only, not {family!r}")
    stamp = path / "tierkv-shape.json"
    wanted: dict[str, Any] = {"family": family, "seed": seed, "window": window_tokens}
    if shape is not None:
        wanted["shape"] = asdict(shape)
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return path
    import torch
    import transformers

    common: dict[str, Any] = {
        "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16384,
        "dtype": "bfloat16",
    }
    num_layers = 6
    if shape is not None:
        common.update(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                      intermediate_size=shape.intermediate_size,
                      num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                      max_position_embeddings=shape.max_positions, dtype=shape.dtype)
        num_layers = shape.num_layers
    window = window_tokens
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    # Gemma 3's pattern: five window layers, then a global one.
    gemma3 = {**common, "num_hidden_layers": num_layers, "head_dim": head_dim,
              "sliding_window": window,
              "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention"
                              for i in range(num_layers)],
              "query_pre_attn_scalar": head_dim}
    configs: dict[str, tuple[str, str, dict[str, Any]]] = {
        "mistral-sliding": ("MistralConfig", "MistralForCausalLM",
                            {**common, "num_hidden_layers": 2, "head_dim": 64,
                             "sliding_window": window}),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", gemma3),
        "gemma3-global": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                          {**gemma3, "layer_types": ["full_attention"] * 6}),
        "lfm2-hybrid": ("Lfm2Config", "Lfm2ForCausalLM",
                        {**common, "num_hidden_layers": 4, "block_auto_adjust_ff_dim": False,
                         "layer_types": ["conv", "full_attention"] * 2, "conv_L_cache": 3,
                         # Fields of the published LFM2 configs that vLLM reads (transformers
                         # does not set them).
                         "conv_dim": 256, "conv_dim_out": 256, "block_dim": 256,
                         "block_ff_dim": 512}),
        "gpt-oss": ("GptOssConfig", "GptOssForCausalLM",
                    {**common, "num_hidden_layers": 2, "head_dim": 64, "sliding_window": window,
                     "layer_types": ["sliding_attention", "full_attention"],
                     "num_local_experts": 4, "num_experts_per_tok": 2}),
        "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                        {**common, "num_hidden_layers": 2, "num_key_value_heads": 4,
                         "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
                         "qk_nope_head_dim": 64, "v_head_dim": 64, "first_k_dense_replace": 2,
                         "n_routed_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 128, "rope_scaling": None}),
    }
    if family not in configs:
        raise ValueError(f"unknown model family {family!r}; choose one of {FAMILIES}")
    config_name, model_name, fields = configs[family]
    torch.manual_seed(seed if shape is None else shape.seed + seed)
    config = getattr(transformers, config_name)(**fields)
    model = getattr(transformers, model_name)(config).to(getattr(torch, common["dtype"]))
    model.save_pretrained(path)
    stamp.write_text(json.dumps(wanted))
    return path


CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def save_word_tokenizer(model: Path, num_words: int = 2000) -> list[str]:
    """Give ``model`` a word-level tokenizer (``w0`` .. ``w<n>``, one token a word) and a chat
    template, built with ``tokenizers`` (nothing is downloaded): enough for ``vllm serve``.
    Returns the vocabulary's words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    words = [f"w{i}" for i in range(num_words)]
    vocab = {token: index for index, token in enumerate(specials + words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model)
    return words
