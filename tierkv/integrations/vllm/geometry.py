"""vLLM's KV cache as the connector sees it: one ``BlockGeometry`` per KV cache group (vLLM's
hybrid allocator gives each group its own block ids), the rule of what a hit needs in each
group, and the list of attention kinds the connector serves (``SPEC_KINDS``, which the README's
model table is generated from).

A tierkv block of a group is every layer of that group's page of one vLLM block, in layer
order. Each group is a namespace of its own (``settings.namespace_of``), so blocks of two groups,
windows or families never meet. What a hit of ``P`` tokens needs, per group (vLLM's own rule,
``find_longest_cache_hit`` of each group's manager):

* full attention (and MLA, sinks): every block before ``P``;
* a sliding window of ``W`` tokens: the blocks holding tokens ``[P - W + 1, P)``;
* chunked local attention of ``C`` tokens: the blocks from the chunk ``P`` is in.

Groups whose state is not KV blocks (Mamba, gated delta nets, encoder caches, circular buffers)
are named in ``EngineGeometry.uncached``: an engine with one answers no hits and saves nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tierkv.errors import ConfigError
from tierkv.layout import DType, KVLayout

FULL, SLIDING, CHUNKED = "full", "sliding", "chunked"
NULL_BLOCK_ID = 0  # vLLM's null block: a skipped position (out of a window), never data


@dataclass(frozen=True, slots=True)
class SpecKind:
    """One vLLM 0.32 KV cache spec and what the connector does with it (a README table row)."""

    spec: str
    families: str
    cached: str


SPEC_KINDS: tuple[SpecKind, ...] = (
    SpecKind("FullAttentionSpec", "Llama, Qwen, Mistral without a window, Gemma 3 global "
             "layers, gpt-oss full layers", "every block of the prefix"),
    SpecKind("SlidingWindowSpec", "Mistral-style windows, Gemma 2/3 local layers, gpt-oss "
             "(window layers, attention sinks)", "every block; a hit loads only the window "
             "before its first computed token"),
    SpecKind("ChunkedLocalAttentionSpec", "Llama 4 local layers", "every block; a hit loads "
             "only the chunk it ends in"),
    SpecKind("MLAAttentionSpec", "DeepSeek V2/V3, Kimi K2 (MLA)", "one latent page per layer; "
             "stored once (TP rank 0) and loaded by every rank; refused on vLLM's reference CPU "
             "MLA backend (no AMX), which cannot compute after a cached prefix"),
    SpecKind("SinkFullAttentionSpec", "OpenPangu with static sinks", "every block (the sinks "
             "are weights, not blocks)"),
    SpecKind("fp8 cache (kv_cache_dtype fp8*)", "any of the above", "the pages' bytes as they "
             "are, the cache dtype in the namespace"),
    SpecKind("MambaSpec", "Jamba, Bamba, Qwen3-Next, other SSM and linear-attention hybrids",
             "refused: the engine starts, the connector answers no hits and says so once"),
    SpecKind("other (cross/encoder-only attention, circular buffers, sparse host caches)",
             "encoder-decoder and multimodal encoders", "refused, as for Mamba"),
)


@dataclass(frozen=True, slots=True)
class BlockGeometry:
    """One KV cache group: its attention layers in block order, tokens per block, and the
    tierkv layout of one block (every layer's ``[H, N, C]`` page, in layer order; C packs K
    and V, or is one MLA latent, as vLLM's backend holds it). ``page_dtype``: the element type
    vLLM's cache tensors hold (``torch.uint8`` for an fp8 cache, whose bytes move as they
    are); None: the layout's. ``kind``: ``full``, ``sliding`` (``window_tokens``) or ``chunked``
    (``window_tokens`` is the chunk). ``replicated``: the same pages on every TP rank (MLA)."""

    layer_names: tuple[str, ...]
    block_size: int
    hash_block_size: int
    layout: KVLayout
    page_dtype: torch.dtype | None = None
    kind: str = FULL
    window_tokens: int | None = None
    group_index: int = 0
    replicated: bool = False
    spec_name: str = "FullAttentionSpec"

    @property
    def cache_dtype(self) -> torch.dtype:
        """The element type of vLLM's cache tensors (and of the connector's staging)."""
        return self.page_dtype or self.layout.torch_dtype

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """One layer's page of one block as vLLM's cache view holds it: ``[H, N, C]``."""
        layout = self.layout
        return (layout.num_kv_heads, layout.block_size, layout.head_dim + layout.value_head_dim)

    @property
    def label(self) -> str:
        """The group in a namespace: ``full``, ``sliding:4096``, ``chunked:8192``."""
        return self.kind if self.window_tokens is None else f"{self.kind}:{self.window_tokens}"

    def first_needed_block(self, num_tokens: int) -> int:
        """The first block a hit of ``num_tokens`` tokens needs in this group (blocks from it to
        ``num_tokens // block_size`` are needed; 0 for full attention)."""
        if self.kind == SLIDING and self.window_tokens is not None:
            return max(0, num_tokens - self.window_tokens + 1) // self.block_size
        if self.kind == CHUNKED and self.window_tokens is not None:
            return num_tokens // self.window_tokens * self.window_tokens // self.block_size
        return 0


@dataclass(frozen=True, slots=True)
class EngineGeometry:
    """Every KV cache group of an engine that takes part in KV transfer, in vLLM's group order
    (``groups[i].group_index`` is its index in ``kv_cache_groups``). ``block_size``: the tokens
    a hit is a multiple of (the groups' least common multiple, as vLLM aligns its own hits).
    ``uncached``: one line per group whose state the connector cannot cache; when there is
    one, the engine gets no hits and saves nothing."""

    groups: tuple[BlockGeometry, ...]
    uncached: tuple[str, ...] = ()

    @classmethod
    def of(cls, geometry: BlockGeometry | EngineGeometry) -> EngineGeometry:
        """``geometry`` as an engine's (one group)."""
        return geometry if isinstance(geometry, EngineGeometry) else cls((geometry,))

    @property
    def block_size(self) -> int:
        return math.lcm(*(g.block_size for g in self.groups)) if self.groups else 1

    @property
    def hash_block_size(self) -> int:
        return self.groups[0].hash_block_size if self.groups else 1

    @property
    def serves(self) -> bool:
        """Whether hits and saves happen at all."""
        return bool(self.groups) and not self.uncached

    @property
    def is_plain(self) -> bool:
        """One full-attention group: the namespace names no group (as before groups existed)."""
        return len(self.groups) == 1 and self.groups[0].kind == FULL


def geometry_of(vllm_config: Any, kv_cache_config: Any) -> EngineGeometry:
    """The geometry of every KV cache group of a vLLM engine that takes part in KV transfer;
    ``ConfigError`` for a group the connector could serve but whose pages it cannot read (a
    cache dtype it does not know). A group whose blocks vLLM hashes more coarsely than their
    size is uncached, as state groups are."""
    from vllm.v1 import kv_cache_interface as kvi

    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None)
                          or vllm_config.cache_config.block_size)
    groups: list[BlockGeometry] = []
    uncached: list[str] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue  # vLLM moves nothing of it through connectors (an EAGLE draft, a host group)
        spec = group.kv_cache_spec
        names = tuple(sorted(group.layer_names, key=_layer_order))
        kind, window = _kind_of(spec, kvi)
        if kind is not None and isinstance(spec, kvi.MLAAttentionSpec) and (
                not _mla_continues_from_a_prefix(vllm_config)):
            uncached.append(f"KV cache group {index} ({type(spec).__name__}) runs on vLLM's "
                            "reference CPU MLA backend, which cannot compute after a cached "
                            "prefix (vLLM turns its own prefix cache off for it)")
            continue
        if kind is None:
            uncached.append(f"KV cache group {index} ({type(spec).__name__}, {len(names)} "
                            f"layers from {names[0] if names else '?'}) holds state the "
                            "connector does not cache")
            continue
        dtype, page_dtype = cache_dtype_of(spec.dtype, cache_dtype)
        head_size, head_size_v = int(spec.head_size), int(spec.head_size_v)
        layout = KVLayout(num_layers=len(names), num_kv_heads=int(spec.num_kv_heads),
                          head_dim=head_size, block_size=int(spec.block_size), dtype=dtype,
                          head_dim_v=head_size_v)
        if layout.block_size % hash_block_size:
            # vLLM hashes every group at one size (a Mamba group without prefix caching makes
            # it the model length): a group of smaller blocks has no hash of its own blocks.
            uncached.append(f"KV cache group {index} ({type(spec).__name__}) has blocks of "
                            f"{layout.block_size} tokens, hashed every {hash_block_size}")
            continue
        groups.append(BlockGeometry(
            names, layout.block_size, hash_block_size, layout,
            page_dtype if page_dtype != layout.torch_dtype else None, kind, window, index,
            replicated=isinstance(spec, kvi.MLAAttentionSpec), spec_name=type(spec).__name__))
    return EngineGeometry(tuple(groups), tuple(uncached))


def _kind_of(spec: Any, kvi: Any) -> tuple[str | None, int | None]:
    """What the connector does with a group of ``spec``: its kind and window, or None."""
    if not getattr(spec, "prefix_cacheable", True) or isinstance(spec, kvi.MambaSpec):
        return None, None
    if isinstance(spec, kvi.SlidingWindowSpec):
        # Tokens vLLM retains past the window (for multi-token prediction) are loaded too.
        return SLIDING, int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0))
    if isinstance(spec, kvi.ChunkedLocalAttentionSpec):
        return CHUNKED, int(spec.attention_chunk_size)
    if isinstance(spec, kvi.FullAttentionSpec) and not isinstance(
            spec, getattr(kvi, "HiSparseHotSpec", ())):
        # Full attention keeps every block, a window merged into it (allocator off) too.
        return FULL, None
    return None, None


def _mla_continues_from_a_prefix(vllm_config: Any) -> bool:
    """Whether vLLM's MLA backend for this engine computes after a cached prefix. vLLM 0.32's
    reference CPU backend (``CPU_MLA``, on CPUs without AMX or when asked for) does not: vLLM
    turns its own prefix cache and chunked prefill off for it, and a hit that left one token to
    compute gave other tokens than a recompute here. GPU backends and the AMX one do."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return True
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return amx and getattr(backend, "name", None) != "CPU_MLA"


def cache_dtype_of(page_dtype: torch.dtype, cache_dtype: str) -> tuple[DType, torch.dtype]:
    """The KV dtype of a cache whose tensors hold ``page_dtype`` under vLLM's ``cache_dtype``
    setting, and the tensors' dtype. vLLM keeps an fp8 cache (``fp8``, ``fp8_e4m3``,
    ``fp8_e5m2``) in ``uint8`` tensors: its bytes are stored as they are, one byte an element;
    the setting itself is in the namespace, so e4m3 and e5m2 pages never meet. Its scales are
    the checkpoint's (vLLM 0.32 computes none at run time), named with the model like every
    weight."""
    if cache_dtype.startswith("fp8") and page_dtype in (torch.uint8, torch.float8_e4m3fn,
                                                         torch.float8_e5m2):
        return DType.FP8, page_dtype
    try:
        return DType.parse(page_dtype), page_dtype
    except ConfigError as exc:
        raise ConfigError(f"TierKVConnector: KV cache dtype {page_dtype} (cache_dtype "
                          f"{cache_dtype!r}): {exc}") from None


def _layer_order(name: str) -> tuple[int, str]:
    """Layers in model order (``model.layers.10`` after ``model.layers.9``), by name after."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    return (numbers[0] if numbers else -1, name)


FAMILIES_START = ("<!-- model-families:start: scripts/gen-docs writes this from "
                  "tierkv/integrations/vllm/geometry.py -->")
FAMILIES_END = "<!-- model-families:end -->"


def families_markdown() -> str:
    """The README's table of model families (``SPEC_KINDS``), between its markers."""
    lines = [FAMILIES_START, "", "| vLLM KV cache spec | Model families | What is cached |",
             "|---|---|---|"]
    lines += [f"| `{kind.spec}` | {kind.families} | {kind.cached} |" if kind.spec[0].isupper()
              and " " not in kind.spec else f"| {kind.spec} | {kind.families} | {kind.cached} |"
              for kind in SPEC_KINDS]
    lines += ["", FAMILIES_END]
    return "\n".join(lines) + "\n"


def replace_families(readme: str) -> str:
    """``readme`` with its model-families section rewritten; ``ValueError`` without one."""
    start, end = readme.find(FAMILIES_START), readme.find(FAMILIES_END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no {FAMILIES_START!r} ... {FAMILIES_END!r} section")
    return readme[:start] + families_markdown() + readme[end + len(FAMILIES_END) + 1:]
