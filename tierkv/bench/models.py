"""Llama models with random weights, built from a config and saved locally (nothing is
downloaded): what the vLLM tests and ``tierkv bench vllm`` run engines on."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


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
