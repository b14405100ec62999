"""Random-weight Llama models (a few layers, GQA; nothing downloaded) and the checks the
transformers integration tests share: logits with a restored cache versus a full recompute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.support.harness import store_config
from tierkv import StoreConfig

VOCAB = 128


def tiny_llama(num_layers: int = 2, num_kv_heads: int = 2, dtype: torch.dtype = torch.float32,
               seed: int = 0, path: Path | None = None) -> Any:
    """A Llama with 4 attention heads of 16 dims and ``num_kv_heads`` KV heads, in ``dtype``;
    saved at ``path`` and loaded back from there when given (a second process loads the same)."""
    config = LlamaConfig(num_hidden_layers=num_layers, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=num_kv_heads, intermediate_size=128,
                         vocab_size=VOCAB, max_position_embeddings=4096)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    if path is None:
        return model
    model.save_pretrained(path)
    return load_llama(path, dtype)


def load_llama(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    return LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()


def prompt(num_tokens: int, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (num_tokens,), generator=generator).tolist()


def prefill(model: Any, token_ids: list[int], cache: Any = None) -> tuple[torch.Tensor, Any]:
    """The next-token logits (fp32) after ``token_ids`` (given ``cache``), and the cache."""
    with torch.no_grad():
        output = model(torch.tensor([token_ids]), past_key_values=cache, use_cache=True)
    return output.logits[0, -1].float(), output.past_key_values


def max_logit_error(model: Any, token_ids: list[int], cache: Any, num_cached: int) -> float:
    """How far the logits after prefilling ``token_ids[num_cached:]`` onto ``cache`` are from a
    full recompute of ``token_ids``."""
    expected, _ = prefill(model, token_ids)
    got, _ = prefill(model, token_ids[num_cached:], cache)
    return float((got - expected).abs().max())


def kv_store_config(root: Path) -> StoreConfig:
    """HOST and DISK large enough for these models' blocks (8 KiB in fp32)."""
    return store_config(root, host_bytes=8 << 20, disk_bytes=32 << 20, page_bytes=4096)
