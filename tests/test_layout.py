"""KVLayout, DType and the presets: the design's KV-size numbers, pinned."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tierkv.errors import ConfigError, InvalidArgumentError
from tierkv.layout import PRESETS, DType, KVLayout

GIB = 1024**3


def test_llama3_8b_fp16_is_128kib_per_token_and_1gib_per_8k_request() -> None:
    layout = PRESETS["llama-3-8b"].layout()
    assert layout.bytes_per_token == 131_072
    assert layout.bytes_for(8192) == 1_073_741_824 == GIB


def test_llama3_70b_gqa_and_mha() -> None:
    assert PRESETS["llama-3-70b"].layout().bytes_per_token == 327_680
    mha = KVLayout(num_layers=80, num_kv_heads=64, head_dim=128)
    assert mha.bytes_per_token == 2_621_440


def test_70b_geometry_batch_of_16_at_16k_tokens() -> None:
    # 2 x 80 layers x 16 requests x 16384 tokens x 8 KV heads x 128 head_dim x 2 bytes.
    # That product is 80 GiB (327,680 B/token x 262,144 tokens), not 64 GiB (68,719,476,736).
    layout = KVLayout(num_layers=80, num_kv_heads=8, head_dim=128, dtype=DType.FP16)
    assert layout.bytes_for(16384, batch_size=16) == 85_899_345_920 == 80 * GIB


def test_presets_are_keyed_by_lowercase_name() -> None:
    assert set(PRESETS) == {p.name.lower() for p in PRESETS.values()}
    assert PRESETS["llama-3-8b"].name == "Llama-3-8B"


@pytest.mark.parametrize(
    ("dtype", "bits", "torch_dtype"),
    [
        (DType.FP32, 32, torch.float32),
        (DType.FP16, 16, torch.float16),
        (DType.BF16, 16, torch.bfloat16),
        (DType.FP8, 8, torch.float8_e4m3fn),
        (DType.INT8, 8, torch.int8),
        (DType.INT4, 4, torch.uint8),
    ],
)
def test_every_dtype_size(dtype: DType, bits: int, torch_dtype: torch.dtype) -> None:
    assert dtype.num_bits == bits
    assert dtype.torch_dtype == torch_dtype
    layout = KVLayout(32, 8, 128, dtype=dtype)
    assert layout.bytes_per_token == 2 * 32 * 8 * 128 * bits // 8
    assert layout.torch_dtype == torch_dtype


def test_block_bytes_and_shape() -> None:
    layout = KVLayout(32, 8, 128, block_size=16)
    assert layout.bytes_per_block == 131_072 * 16 == 2_097_152
    assert layout.block_shape == (32, 2, 16, 8, 128)
    # The block tensor is exactly bytes_per_block long.
    block = torch.empty(layout.block_shape, dtype=layout.torch_dtype)
    assert block.numel() * block.element_size() == layout.bytes_per_block


def test_int4_halves_the_last_dim_and_the_bytes() -> None:
    fp8 = KVLayout(32, 8, 128, block_size=32, dtype=DType.FP8)
    int4 = KVLayout(32, 8, 128, block_size=32, dtype=DType.INT4)
    assert int4.block_shape == (32, 2, 32, 8, 64)
    assert int4.bytes_per_token == fp8.bytes_per_token // 2 == 32_768
    assert int4.bytes_per_block == fp8.bytes_per_block // 2
    assert DType.INT4.elements_per_storage == 2
    block = torch.empty(int4.block_shape, dtype=int4.torch_dtype)
    assert block.numel() * block.element_size() == int4.bytes_per_block


def test_fingerprint_is_pinned() -> None:
    # sha256("tierkv-layout-v1:32:8:128:16:fp16")[:16]; changing it orphans stored records.
    assert KVLayout(32, 8, 128, 16, DType.FP16).fingerprint == "f00dde4c0e8594db"


@pytest.mark.parametrize(
    "change",
    [
        {"num_layers": 33},
        {"num_kv_heads": 4},
        {"head_dim": 64},
        {"block_size": 32},
        {"dtype": DType.BF16},
        {"dtype": DType.INT4},
    ],
)
def test_fingerprint_changes_with_every_field(change: dict[str, object]) -> None:
    base = KVLayout(32, 8, 128, 16, DType.FP16)
    other = dataclasses.replace(base, **change)  # type: ignore[arg-type]
    assert other != base
    assert other.fingerprint != base.fingerprint
    assert dataclasses.replace(base).fingerprint == base.fingerprint


def test_layout_accepts_dtype_strings() -> None:
    assert KVLayout(2, 2, 8, dtype="bfloat16").dtype is DType.BF16  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0, "num_kv_heads": 8, "head_dim": 128},
        {"num_layers": -1, "num_kv_heads": 8, "head_dim": 128},
        {"num_layers": 32, "num_kv_heads": 0, "head_dim": 128},
        {"num_layers": 32, "num_kv_heads": 8, "head_dim": -128},
        {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 0},
        {"num_layers": 32.0, "num_kv_heads": 8, "head_dim": 128},
        {"num_layers": True, "num_kv_heads": 8, "head_dim": 128},
        {"num_layers": 32, "num_kv_heads": 8, "head_dim": 127, "dtype": DType.INT4},
        {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "fp64"},
    ],
)
def test_invalid_layouts_raise_value_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError) as info:
        KVLayout(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ConfigError)


def test_odd_head_dim_is_fine_without_int4() -> None:
    assert KVLayout(1, 1, 127, dtype=DType.INT8).bytes_per_token == 254


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("fp16", DType.FP16),
        ("FP16", DType.FP16),
        ("float16", DType.FP16),
        ("half", DType.FP16),
        ("torch.float16", DType.FP16),
        ("bfloat16", DType.BF16),
        ("float32", DType.FP32),
        ("float8_e4m3fn", DType.FP8),
        ("int4", DType.INT4),
        (torch.bfloat16, DType.BF16),
        (torch.float16, DType.FP16),
        (torch.float32, DType.FP32),
        (torch.float8_e4m3fn, DType.FP8),
        (torch.int8, DType.INT8),
        (DType.INT8, DType.INT8),
    ],
)
def test_dtype_parse(value: str | torch.dtype | DType, expected: DType) -> None:
    assert DType.parse(value) is expected


@pytest.mark.parametrize("value", ["fp64", "", torch.float64, torch.uint8])
def test_dtype_parse_rejects(value: str | torch.dtype) -> None:
    with pytest.raises(ConfigError, match="dtype"):
        DType.parse(value)


LLAMA3_8B_CONFIG = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}


def test_from_hf_config_dict() -> None:
    layout = KVLayout.from_hf_config(LLAMA3_8B_CONFIG)
    assert layout == KVLayout(32, 8, 128, 16, DType.BF16)
    assert KVLayout.from_hf_config(LLAMA3_8B_CONFIG, dtype="fp16").bytes_per_token == 131_072


def test_from_hf_config_object_with_kv_heads_and_head_dim() -> None:
    # Stands in for a transformers PretrainedConfig: plain attributes.
    config = SimpleNamespace(
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        hidden_size=8192,
        head_dim=128,
        torch_dtype=torch.float16,
    )
    layout = KVLayout.from_hf_config(config, block_size=32)
    assert layout == KVLayout(80, 8, 128, 32, DType.FP16)
    assert layout.bytes_per_token == 327_680


def test_from_hf_config_explicit_head_dim_wins_over_hidden_size() -> None:
    # Gemma-style: head_dim is not hidden_size // num_attention_heads.
    config = SimpleNamespace(
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=16,
        hidden_size=3072,
        head_dim=256,
    )
    assert KVLayout.from_hf_config(config).head_dim == 256


def test_from_hf_config_mha_fallback_and_derived_head_dim() -> None:
    config = SimpleNamespace(num_hidden_layers=32, num_attention_heads=32, hidden_size=4096)
    layout = KVLayout.from_hf_config(config)
    assert layout.num_kv_heads == 32
    assert layout.head_dim == 128
    assert layout.dtype is DType.FP16  # no dtype in the config


def test_from_hf_config_dtype_string_and_dtype_attribute() -> None:
    as_string = SimpleNamespace(**LLAMA3_8B_CONFIG)
    assert KVLayout.from_hf_config(as_string).dtype is DType.BF16
    newer = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "torch_dtype"}
    newer["dtype"] = torch.float32
    assert KVLayout.from_hf_config(newer).dtype is DType.FP32
    assert KVLayout.from_hf_config(as_string, dtype=torch.int8).dtype is DType.INT8


def test_from_hf_config_splits_kv_heads_over_tp() -> None:
    config = SimpleNamespace(**LLAMA3_8B_CONFIG)
    assert KVLayout.from_hf_config(config, tp_size=2).num_kv_heads == 4
    assert KVLayout.from_hf_config(config, tp_size=8).num_kv_heads == 1
    assert KVLayout.from_hf_config(config, tp_size=2, dtype="fp16").bytes_per_token == 65_536
    with pytest.raises(ConfigError, match="tp_size"):
        KVLayout.from_hf_config(config, tp_size=3)


def test_from_hf_config_missing_fields() -> None:
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        KVLayout.from_hf_config({"num_attention_heads": 32, "hidden_size": 4096})


# --- K and V of two head sizes, and MLA latents ------------------------------------------------


def test_a_latent_layout_is_one_head_without_v() -> None:
    latent = KVLayout(num_layers=61, num_kv_heads=1, head_dim=576, block_size=64,
                      dtype="bf16", head_dim_v=0)
    assert latent.value_head_dim == 0 and not latent.is_split
    assert latent.bytes_per_token == 61 * 576 * 2
    assert latent.block_shape == (61, 64, 1, 576)
    assert latent.bytes_per_block == 61 * 64 * 576 * 2
    skewed = KVLayout(4, 8, 192, 16, DType.BF16, head_dim_v=128)  # DeepSeek in transformers
    assert skewed.bytes_per_token == 4 * 8 * (192 + 128) * 2
    assert skewed.block_shape == (4, 16, 8, 320)


def test_head_dim_v_equal_to_head_dim_is_the_split_layout_and_its_fingerprint() -> None:
    split = KVLayout(32, 8, 128)
    assert KVLayout(32, 8, 128, head_dim_v=128) == split
    assert KVLayout(32, 8, 128, head_dim_v=128).fingerprint == split.fingerprint
    others = {KVLayout(32, 8, 128, head_dim_v=v).fingerprint for v in (0, 64, 96)}
    assert len(others | {split.fingerprint}) == 4


@pytest.mark.parametrize("value", [-1, 1.5, True, "64"])
def test_head_dim_v_must_be_a_count(value: object) -> None:
    with pytest.raises(ConfigError, match="head_dim_v"):
        KVLayout(2, 2, 64, head_dim_v=value)  # type: ignore[arg-type]


def test_layouts_with_a_v_head_size_cross_every_boundary_unchanged() -> None:
    """The wire, a stored namespace descriptor and a layout label all keep ``head_dim_v``."""
    from tierkv.keys import Namespace
    from tierkv.store import layout_label, parse_layout_label
    from tierkv.store.namespaces import namespace_descriptor, namespace_from_descriptor
    from tierkv.wire.namespaces import namespace_from, namespace_to

    for layout in (KVLayout(2, 1, 576, 16, DType.BF16, 0), KVLayout(2, 4, 192, 16, "fp16", 128),
                   KVLayout(2, 4, 64)):
        namespace = Namespace("m", layout, tenant="t")
        assert namespace_from(namespace_to(namespace), "t") == namespace
        assert namespace_from_descriptor(namespace_descriptor(namespace)) == namespace
        assert parse_layout_label(layout_label(layout)) == layout
    assert layout_label(KVLayout(2, 1, 576, 16, DType.BF16, 0)) == "2x1x576+0/16/bf16"
    with pytest.raises(InvalidArgumentError, match="V_HEAD_DIM"):
        parse_layout_label("2x1x576+/16/bf16")


def test_latent_blocks_round_trip_through_a_sidecar_and_its_restart(
    sidecar_factory: Any, tmp_path: Path,
) -> None:
    """An MLA latent and a K/V of two head sizes: stored, read back bit-exact over the Unix
    socket and TCP, and again from DISK after a SIGKILL and a restart (the stored namespace
    descriptor keeps ``head_dim_v``)."""
    from tierkv import Client
    from tierkv.keys import Namespace

    layouts = (KVLayout(2, 1, 576, 16, DType.BF16, 0), KVLayout(2, 2, 96, 16, DType.BF16, 64))
    flags = ("--host-bytes", "64MiB", "--disk-bytes", "256MiB", "--write-policy",
             "write_through")
    sidecar = sidecar_factory(*flags, disk_path=tmp_path / "disk")
    stored = []
    for index, layout in enumerate(layouts):
        namespace = Namespace(f"latent-{index}", layout)
        hashes = [bytes([index, k]) * 16 for k in range(5)]
        data = torch.randint(-(2**15), 2**15, (5, *layout.block_shape), dtype=torch.int16)
        blocks = data.view(layout.torch_dtype)
        with Client(sidecar.unix_target) as client:
            assert client.put(namespace, hashes, blocks) == 5
        stored.append((namespace, hashes, data))
    for attempt in ("before", "after"):
        if attempt == "after":
            sidecar.kill()
            sidecar = sidecar_factory(*flags, disk_path=tmp_path / "disk")
        for target in (sidecar.unix_target, sidecar.tcp_target):
            with Client(target) as client:
                for namespace, hashes, data in stored:
                    got = client.get(namespace, hashes)
                    assert tuple(got.shape) == (5, *namespace.layout.block_shape), attempt
                    assert torch.equal(got.view(torch.int16), data), attempt
