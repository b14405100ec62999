"""The shape of one block of KV cache, and the KV-size formula.

KV bytes per token = num_layers x num_kv_heads x (K head dim + V head dim) x bytes per element
(2 x ... x head_dim when K and V have one head size). A block holds ``block_size`` tokens; its
canonical tensor is ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` when K and V have
one head size, else ``[num_layers, block_size, num_kv_heads, head_dim + head_dim_v]`` (K then
V of each head; an MLA latent is one "head" of ``head_dim`` with ``head_dim_v=0``). Contiguous;
int4 packs two values per byte, halving the last dimension.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tierkv.errors import ConfigError


class DType(enum.Enum):
    """Element types a KV cache is stored in. The value is the name used on the command line."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def num_bits(self) -> int:
        """Bits per element."""
        return _BITS[self]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype blocks of this type are held in (int4: packed pairs in uint8)."""
        return _TORCH[self]

    @property
    def elements_per_storage(self) -> int:
        """How many logical elements share one element of ``torch_dtype`` (2 for int4)."""
        return 2 if self is DType.INT4 else 1

    @classmethod
    def parse(cls, value: str | DType | torch.dtype) -> DType:
        """Accept ``"fp16"``, ``"float16"``, ``"bfloat16"``, a ``torch.dtype`` or a ``DType``."""
        if isinstance(value, DType):
            return value
        if isinstance(value, torch.dtype):
            for member, dtype in _TORCH.items():
                if dtype == value and member is not DType.INT4:
                    return member
            raise ConfigError(f"dtype: torch dtype {value} is not a supported KV dtype")
        name = str(value).lower().removeprefix("torch.")
        name = _ALIASES.get(name, name)
        try:
            return cls(name)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ConfigError(f"dtype: unknown dtype {value!r}; choose one of {choices}") from None


_BITS = {
    DType.FP32: 32,
    DType.FP16: 16,
    DType.BF16: 16,
    DType.FP8: 8,
    DType.INT8: 8,
    DType.INT4: 4,
}
_TORCH = {
    DType.FP32: torch.float32,
    DType.FP16: torch.float16,
    DType.BF16: torch.bfloat16,
    DType.FP8: torch.float8_e4m3fn,
    DType.INT8: torch.int8,
    DType.INT4: torch.uint8,
}
_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8",
    "fp8_e4m3": "fp8",
    "e4m3": "fp8",
}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One tensor-parallel shard's KV cache geometry.

    Contract: every block stored under a layout is a contiguous tensor of ``block_shape`` and
    ``dtype.torch_dtype``, exactly ``bytes_per_block`` bytes long. ``fingerprint`` changes
    whenever any field changes, so records written under another layout never load as this one.
    ``head_dim_v``: the V head size when it is not ``head_dim`` (None: the same; 0: no V, one
    latent per token, as MLA caches hold). Layouts with one head size keep the fingerprint
    they had before ``head_dim_v`` existed.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    # A string ("bf16") or torch dtype is accepted too and normalised to a DType.
    dtype: DType = DType.FP16
    head_dim_v: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        value_dim = self.head_dim_v
        if value_dim is not None and (not isinstance(value_dim, int)
                                      or isinstance(value_dim, bool) or value_dim < 0):
            raise ConfigError(f"KVLayout.head_dim_v must be None or an integer >= 0, "
                              f"got {value_dim!r}")
        if value_dim == self.head_dim:
            object.__setattr__(self, "head_dim_v", None)  # one form for one layout
        if self.dtype is DType.INT4 and (self.head_dim % 2 or self.value_head_dim % 2):
            raise ConfigError(f"KVLayout.head_dim must be even for int4, got {self.head_dim}"
                              f" (V: {self.value_head_dim})")

    @property
    def value_head_dim(self) -> int:
        """V's head size: ``head_dim_v``, or ``head_dim`` when it is None (0: no V)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def is_split(self) -> bool:
        """Whether K and V have one head size (the ``[L, 2, N, H, D]`` block)."""
        return self.head_dim_v is None

    @property
    def bytes_per_token(self) -> int:
        """Layers x kv heads x (K + V head dims) x element size, in bytes."""
        dims = self.head_dim + self.value_head_dim
        return self.num_layers * self.num_kv_heads * dims * self.dtype.num_bits // 8

    @property
    def bytes_per_block(self) -> int:
        """``bytes_per_token * block_size``."""
        return self.bytes_per_token * self.block_size

    @property
    def block_shape(self) -> tuple[int, ...]:
        """``(num_layers, 2, block_size, num_kv_heads, head_dim)``, else (K and V of two head
        sizes, or a latent) ``(num_layers, block_size, num_kv_heads, head_dim + head_dim_v)``;
        int4 halves the last."""
        per = self.dtype.elements_per_storage
        if self.is_split:
            return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim // per)
        last = (self.head_dim + self.value_head_dim) // per
        return (self.num_layers, self.block_size, self.num_kv_heads, last)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of a block tensor."""
        return self.dtype.torch_dtype

    @property
    def fingerprint(self) -> str:
        """A stable 16-hex-digit digest of every field (same across processes and versions)."""
        text = (
            f"tierkv-layout-v1:{self.num_layers}:{self.num_kv_heads}:{self.head_dim}:"
            f"{self.block_size}:{self.dtype.value}"
        )
        if self.head_dim_v is not None:
            text += f":v{self.head_dim_v}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def bytes_for(self, num_tokens: int, batch_size: int = 1) -> int:
        """KV bytes for ``batch_size`` sequences of ``num_tokens`` tokens (not rounded to blocks)."""
        return self.bytes_per_token * num_tokens * batch_size

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        block_size: int = 16,
        dtype: str | DType | torch.dtype | None = None,
        tp_size: int = 1,
    ) -> KVLayout:
        """Build the layout of one TP shard from a transformers ``PretrainedConfig`` (or a dict).

        Uses ``num_key_value_heads`` (falling back to ``num_attention_heads``: MHA), and
        ``head_dim`` (falling back to ``hidden_size // num_attention_heads``); an MLA config
        (``kv_lora_rank``, DeepSeek V2/V3) is one latent "head" of ``kv_lora_rank`` and a "V"
        of ``qk_rope_head_dim``, not split over TP ranks.
        ``dtype`` defaults to the config's ``torch_dtype``/``dtype``, else fp16. KV heads are
        split over ``tp_size``.
        """
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ConfigError(f"tp_size must be a positive integer, got {tp_size!r}")
        get = _getter(config)
        num_heads = get("num_attention_heads")
        num_layers = get("num_hidden_layers")
        if not num_heads or num_layers is None:
            raise ConfigError(
                "model config: needs num_attention_heads (>= 1) and num_hidden_layers "
                "to derive a layout"
            )
        num_kv_heads = get("num_key_value_heads") or num_heads
        head_dim = get("head_dim")
        if not head_dim:
            hidden_size = get("hidden_size")
            if hidden_size is None or hidden_size % num_heads:
                raise ConfigError(
                    "model config: without head_dim, hidden_size must be a multiple of "
                    f"num_attention_heads (got {hidden_size} and {num_heads})"
                )
            head_dim = hidden_size // num_heads
        head_dim_v = None
        if get("kv_lora_rank") and get("qk_rope_head_dim"):
            # DeepSeek V2/V3 (MLA): a cache holds one latent per token and layer, the same on
            # every TP rank; transformers keeps it as a "K" of kv_lora_rank and a "V" of the
            # rope part (vLLM as one page of both: the same bytes).
            num_kv_heads, tp_size = 1, 1
            head_dim, head_dim_v = int(get("kv_lora_rank")), int(get("qk_rope_head_dim"))
        if num_kv_heads % tp_size:
            raise ConfigError(f"tp_size: {tp_size} does not divide {num_kv_heads} KV heads")
        if dtype is None:
            dtype = get("torch_dtype") or get("dtype") or DType.FP16
        return cls(num_layers, num_kv_heads // tp_size, head_dim, block_size, DType.parse(dtype),
                   head_dim_v)


def _getter(config: Any) -> Any:
    if isinstance(config, Mapping):
        return config.get
    return lambda name: getattr(config, name, None)


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """Published KV geometry of a well-known model (the full model, before TP splitting)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int | None = None  # see KVLayout (0: an MLA latent of head_dim per token)

    def layout(self, dtype: DType = DType.FP16, block_size: int = 16) -> KVLayout:
        """This model's layout in ``dtype``."""
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, block_size, dtype,
                        self.head_dim_v)


PRESETS: dict[str, ModelPreset] = {
    p.name.lower(): p
    for p in (
        ModelPreset("Llama-3-8B", 32, 8, 128),
        ModelPreset("Llama-3-70B", 80, 8, 128),
        ModelPreset("Llama-3-405B", 126, 8, 128),
        ModelPreset("Mistral-7B", 32, 8, 128),
        ModelPreset("Qwen2.5-7B", 28, 4, 128),
        ModelPreset("Qwen2.5-72B", 80, 8, 128),
        # MLA as vLLM caches it: one latent (kv_lora_rank 512 + rope 64) per token and layer.
        ModelPreset("DeepSeek-V3", 61, 1, 576, 0),
        ModelPreset("DeepSeek-V2-Lite", 27, 1, 576, 0),
    )
}
