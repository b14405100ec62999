"""The connector's settings, namespace and block geometry, from real vLLM configs (no engine
is started: ``EngineArgs.create_engine_config`` reads the model's config.json)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from tierkv import ConfigError, Priority, WritePolicy
from tierkv.bench.models import TINY, build_llama
from tierkv.hashing import none_hash
from tierkv.integrations.vllm.geometry import geometry_of
from tierkv.integrations.vllm.settings import ConnectorSettings, namespace_of, namespaces_of
from tierkv.layout import DType

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in (0, 1))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("models") / "tiny", TINY)


@pytest.fixture(autouse=True)
def vllm_seed_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own rule for the seed (PYTHONHASHSEED, else its default), not what another test
    in this process made vLLM adopt."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(kv_cache_utils, "_NONE_HASH_SEED", None)


def engine_config(model: Path, **overrides: Any) -> Any:
    args: dict[str, Any] = {"model": str(model), "skip_tokenizer_init": True,
                            "dtype": "bfloat16", "block_size": 32, "max_model_len": 2048}
    return EngineArgs(**(args | overrides)).create_engine_config()


def cache_config(dtype: torch.dtype = torch.bfloat16, layers: tuple[str, ...] = LAYERS) -> Any:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=dtype)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)])


def namespace(model: Path, kv_dtype: torch.dtype = torch.bfloat16, tp_rank: int = 0,
              **overrides: Any) -> Any:
    vllm_config = engine_config(model, **overrides)
    kv = cache_config(kv_dtype)
    return namespace_of(vllm_config, kv, geometry_of(vllm_config, kv), tp_rank)


# --- settings ----------------------------------------------------------------------------------


def test_settings_defaults_and_values(tmp_path: Path) -> None:
    assert ConnectorSettings.from_extra_config(None) == ConnectorSettings()
    token_file = tmp_path / "token"
    token_file.write_text("secret-token-0123456789\n")
    settings = ConnectorSettings.from_extra_config({
        "address": "127.0.0.1:50051", "token_file": str(token_file),
        "write_policy": "write_through", "priority": "high", "lookup_timeout_s": 0.2,
    })
    assert settings.address == "127.0.0.1:50051" and settings.token == "secret-token-0123456789"
    assert settings.write_policy is WritePolicy.WRITE_THROUGH
    assert settings.priority is Priority.HIGH and settings.lookup_timeout_s == 0.2


@pytest.mark.parametrize(("extra", "named"), [
    ({"adress": "unix:///tmp/x.sock", "tokn": "x"}, "['adress', 'tokn']"),
    ({"token": "a", "token_file": "/x"}, "token or token_file"),
    ({"token_file": "/nonexistent/token"}, "token_file"),
    ({"write_policy": "sometimes"}, "write_policy='sometimes'"),
    ({"priority": "urgent"}, "priority='urgent'"),
    ({"lookup_timeout_s": 0}, "lookup_timeout_s"),
    ({"save_queue_bytes": True}, "save_queue_bytes"),
    ({"address": ""}, "address"),
])
def test_bad_settings_are_refused_by_name(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=r"TierKVConnector") as info:
        ConnectorSettings.from_extra_config(extra)
    assert named in str(info.value)


# --- namespace ---------------------------------------------------------------------------------


def test_the_same_engine_config_gives_the_same_namespace(model: Path) -> None:
    first, second = namespace(model), namespace(model)
    assert first == second and first.id == second.id
    assert first.layout.num_layers == 2 and first.layout.block_size == 32
    assert first.layout.bytes_per_block == 2 * 2 * 2 * 32 * 64 * 2


def test_everything_that_changes_a_block_changes_the_namespace(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = namespace(model)
    other_model = build_llama(tmp_path / "other", replace(TINY, seed=1))
    variants = {
        "dtype": namespace(model, torch.float16, dtype="float16"),
        "model": namespace(other_model),
        "revision": namespace(model, revision="v2"),
        "algorithm": namespace(model, prefix_caching_hash_algo="sha256_cbor"),
        "tp rank": namespace(model, tp_rank=1, tensor_parallel_size=2),
    }
    monkeypatch.setenv("PYTHONHASHSEED", "4711")
    variants["seed"] = namespace(model)
    ids = {name: ns.id for name, ns in variants.items()}
    assert base.id not in ids.values(), ids
    assert len(set(ids.values())) == len(ids), ids


def test_the_namespace_names_the_hash_scheme_tierkv_computes_by_default(model: Path) -> None:
    """The hash part of the model id is vLLM's NONE_HASH, which is tierkv's default one: the
    hashes tierkv.block_hashes gives land in the namespace the connector reads."""
    assert f"hash=sha256:{none_hash().hex()[:16]}" in namespace(model).model_id
    cbor = namespace(model, prefix_caching_hash_algo="sha256_cbor")
    assert f"hash=sha256_cbor:{none_hash(algorithm='sha256_cbor').hex()[:16]}" in cbor.model_id


# --- geometry ----------------------------------------------------------------------------------


def test_layers_are_in_model_order() -> None:
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1, 0, 9))
    vllm_config = engine_config_stub()
    (geometry,) = geometry_of(vllm_config, cache_config(layers=names)).groups
    assert [int(n.split(".")[2]) for n in geometry.layer_names] == [0, 1, 2, 9, 10]


def engine_config_stub() -> Any:
    class Cache:
        block_size = 32

    class Config:
        cache_config = Cache()

    return Config()


def groups_config(*groups: tuple[tuple[str, ...], Any]) -> Any:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(list(names), spec) for names, spec in groups])


SLIDING = tuple(f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 4))
GLOBAL = ("model.layers.3.self_attn.attn",)


def test_each_group_is_a_namespace_with_the_window_its_hits_need(model: Path) -> None:
    """Gemma-3-like: sliding-window layers and a global one, two groups of their own."""
    window = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64,
                               dtype=torch.bfloat16, sliding_window=100)
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv = groups_config((GLOBAL, full), (SLIDING, window))
    vllm_config = engine_config(model)
    geometry = geometry_of(vllm_config, kv)
    assert geometry.serves and not geometry.is_plain and geometry.block_size == 32
    first, second = geometry.groups
    assert (first.kind, first.layout.num_layers, second.kind, second.window_tokens) == (
        "full", 1, "sliding", 100)
    # A hit of 320 tokens needs tokens 221..319 of the window: blocks 6 to 9.
    assert second.first_needed_block(320) == 6 and first.first_needed_block(320) == 0
    assert second.first_needed_block(64) == 0  # shorter than the window: all of it
    namespaces = namespaces_of(vllm_config, kv, geometry, 0)
    assert namespaces[0].model_id.endswith("|group=0:full")
    assert namespaces[1].model_id.endswith("|group=1:sliding:100")
    # Chunked local attention (Llama 4's local layers): a hit needs the blocks of its chunk.
    chunked = ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                        dtype=torch.bfloat16, attention_chunk_size=128)
    (_, local) = geometry_of(vllm_config, groups_config((GLOBAL, full), (SLIDING, chunked))).groups
    assert (local.kind, local.window_tokens, local.label) == ("chunked", 128, "chunked:128")
    assert [local.first_needed_block(n) for n in (96, 128, 320)] == [0, 4, 8]
    # One full-attention group names none: the namespace every stored block already has.
    plain = namespace_of(vllm_config, cache_config(), geometry_of(vllm_config, cache_config()), 0)
    assert "group=" not in plain.model_id
    assert plain.model_id == namespaces[0].model_id.removesuffix("|group=0:full")


def test_an_mla_latent_is_one_page_per_layer_stored_once_for_every_rank(
    model: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kv = groups_config((LAYERS, mla))
    vllm_config = engine_config(model, tensor_parallel_size=1)
    # vLLM's reference CPU MLA backend (this CPU has no AMX) cannot compute after a cached
    # prefix: no hits for it, said once.
    (line,) = geometry_of(vllm_config, kv).uncached
    assert "reference CPU MLA backend" in line
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)  # as on a GPU
    geometry = geometry_of(vllm_config, kv)
    (group,) = geometry.groups
    assert group.replicated and group.layout.head_dim_v == 0
    assert group.layout.bytes_per_block == 2 * 32 * 576 * 2  # layers x tokens x latent x 2 B
    assert group.layout.block_shape == (2, 32, 1, 576)
    rank0 = namespace_of(vllm_config, kv, group, 0, plain=False)
    assert namespace_of(vllm_config, kv, group, 3, plain=False) == rank0
    assert (rank0.tp_rank, rank0.tp_size) == (0, 1)


def test_groups_whose_state_is_not_kv_blocks_turn_hits_off(model: Path) -> None:
    """A hybrid state-space model: the engine starts, the connector says once which group it
    does not cache, and serves nothing (a hit must restore every group)."""
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))
    geometry = geometry_of(engine_config(model), groups_config(
        (GLOBAL, full), (("model.layers.0.mixer",), mamba)))
    assert not geometry.serves
    assert geometry.uncached == ("KV cache group 1 (MambaSpec, 1 layers from "
                                 "model.layers.0.mixer) holds state the connector does not "
                                 "cache",)


def test_an_fp8_cache_is_stored_as_its_bytes_in_a_namespace_of_its_own(model: Path) -> None:
    # vLLM keeps an fp8 cache in uint8 tensors: the connector moves those bytes as they are,
    # one byte an element, and names the cache dtype so that e4m3 and e5m2 never meet.
    fp8 = engine_config(model, kv_cache_dtype="fp8")
    (geometry,) = geometry_of(fp8, cache_config(torch.uint8)).groups
    assert geometry.layout.dtype is DType.FP8 and geometry.cache_dtype == torch.uint8
    assert geometry.layout.bytes_per_block == 2 * 2 * 32 * 2 * 64  # 1 B an element
    names = {namespace_of(engine_config(model, kv_cache_dtype=d), cache_config(torch.uint8),
                          geometry, 0).model_id for d in ("fp8", "fp8_e4m3", "fp8_e5m2")}
    assert len(names | {namespace(model).model_id}) == 4
    with pytest.raises(ConfigError, match="uint8"):  # uint8 pages of a cache that is not fp8
        geometry_of(engine_config(model), cache_config(torch.uint8))
