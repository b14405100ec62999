"""tierkv.hashing against an independent copy of vLLM 0.32's block hashing (both algorithms).

The reference below is the straightforward per-block loop (hashlib + pickle / cbor2), written
out here so that it shares no code with the implementation under test. tests/test_hashing_vllm.py
compares against the installed vLLM itself.
"""

from __future__ import annotations

import hashlib
import pickle
import random
from collections.abc import Iterator
from typing import Any

import cbor2
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.errors import InvalidArgumentError
from tierkv.hashing import (
    HASH_ALGORITHMS,
    VLLM_DEFAULT_SEED,
    ExtraKeys,
    HashAlgorithm,
    MultiModalItem,
    block_hashes,
    default_seed,
    hash_block_tokens,
    none_hash,
)
from tierkv.keys import BlockHash

ALGORITHMS = pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)


@pytest.fixture(autouse=True)
def _no_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``seed=None`` reads PYTHONHASHSEED: every test here starts without it."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    yield


# ---------------------------------------------------------------------------------------------
# Reference: vLLM 0.32 (kv_cache_utils), mm items as plain (identifier, offset, length) tuples.


def ref_hash(obj: object, algorithm: str = "sha256") -> bytes:
    if algorithm == "sha256":
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def lora_path(name: str) -> str:
    return f"/adapters/{name}"


def ref_mm_keys(
    mm_items: list[tuple[str, int, int]], start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[list[tuple[str, str, int]], int]:
    extra_keys: list[tuple[str, str, int]] = []
    if not mm_items:
        return extra_keys, start_mm_idx
    _, last_offset, last_length = mm_items[-1]
    if last_offset + last_length <= start_token_idx:
        return extra_keys, start_mm_idx
    curr = start_mm_idx
    while curr < len(mm_items):
        identifier, offset, length = mm_items[curr]
        if end_token_idx > offset:
            if start_token_idx >= offset + length:
                curr += 1
                continue
            extra_keys.append(("mm", identifier, offset - start_token_idx))
            if end_token_idx >= offset + length:
                curr += 1
            else:
                break
        else:
            break
    return extra_keys, curr


def ref_block_hashes(
    tokens: list[int],
    block_size: int = 16,
    seed: str = VLLM_DEFAULT_SEED,
    *,
    lora: str | None = None,
    mm: list[tuple[str, int, int]] | None = None,
    salt: str | None = None,
    algorithm: str = "sha256",
) -> list[bytes]:
    parent = ref_hash(seed, algorithm)  # NONE_HASH
    out: list[bytes] = []
    mm_idx = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        end = start + block_size
        mm_keys, mm_idx = ref_mm_keys(mm or [], start, end, mm_idx)
        lora_keys = [("lora", lora, lora_path(lora))] if lora is not None else []
        salt_keys = [("cache_salt", salt)] if start == 0 and salt else []
        keys: list[Any] = lora_keys + mm_keys + salt_keys
        extra = tuple(keys) if keys else None
        parent = ref_hash((parent, tuple(tokens[start:end]), extra), algorithm)
        out.append(parent)
    return out


def extra(
    lora: str | None = None,
    mm: list[tuple[str, int, int]] | None = None,
    salt: str | None = None,
) -> ExtraKeys:
    return ExtraKeys(
        lora_name=lora,
        lora_path=None if lora is None else lora_path(lora),
        mm_items=tuple(MultiModalItem(i, o, n) for i, o, n in (mm or [])),
        cache_salt=salt,
    )


def raw(hashes: list[BlockHash]) -> list[bytes]:
    return [bytes(h) for h in hashes]


def tokens_of(n: int, vocab: int = 128_256, seed: int = 0) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(vocab) for _ in range(n)]


# ---------------------------------------------------------------------------------------------


def test_golden_values_are_pinned() -> None:
    # The default is a default vLLM 0.32: sha256 (pickle), seed "vllm-none-hash". Computed once
    # with vLLM itself (test_hashing_vllm checks it again against the installed vLLM).
    golden = "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"
    assert ref_block_hashes(list(range(16)))[0].hex() == golden
    assert block_hashes(range(16))[0].hex() == golden
    assert none_hash().hex() == "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    assert default_seed() == VLLM_DEFAULT_SEED == "vllm-none-hash"
    # sha256_cbor with seed "0": what tierkv produced by default before (unchanged).
    golden_cbor = "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c"
    assert ref_block_hashes(list(range(16)), seed="0", algorithm="sha256_cbor")[0].hex() == golden_cbor
    assert block_hashes(range(16), seed="0", algorithm="sha256_cbor")[0].hex() == golden_cbor
    assert none_hash("0", "sha256_cbor").hex() == (
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    )


@ALGORITHMS
@pytest.mark.parametrize("n", [16, 17, 160, 1000, 16 * 513])
@pytest.mark.parametrize("vocab", [20, 256, 32_000, 128_256])
def test_matches_reference_without_extra_keys(n: int, vocab: int, algorithm: HashAlgorithm) -> None:
    tokens = tokens_of(n, vocab, seed=n)
    got = block_hashes(tokens, algorithm=algorithm)
    assert all(type(h) is BlockHash for h in got)
    assert raw(got) == ref_block_hashes(tokens, algorithm=algorithm)


@ALGORITHMS
@pytest.mark.parametrize("block_size", [1, 2, 3, 16, 23, 24, 32, 255, 256, 300])
def test_matches_reference_for_block_sizes(block_size: int, algorithm: HashAlgorithm) -> None:
    # 24 and 256 are where the CBOR array header grows to 2 and 3 bytes.
    tokens = tokens_of(block_size * 3 + 1, seed=block_size)
    got = raw(block_hashes(tokens, block_size, algorithm=algorithm))
    assert got == ref_block_hashes(tokens, block_size, algorithm=algorithm)


@ALGORITHMS
def test_seeds(algorithm: HashAlgorithm, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = tokens_of(64)
    by_seed = {}
    for seed in [VLLM_DEFAULT_SEED, "0", "1", "42", "", "seed-ü"]:
        assert bytes(none_hash(seed, algorithm)) == ref_hash(seed, algorithm)
        got = raw(block_hashes(tokens, seed=seed, algorithm=algorithm))
        assert got == ref_block_hashes(tokens, seed=seed, algorithm=algorithm)
        by_seed[seed] = got
    all_hashes = [h for hashes in by_seed.values() for h in hashes]
    assert len(set(all_hashes)) == len(all_hashes)  # every seed gives different hashes
    # seed=None is vLLM's rule: PYTHONHASHSEED when set (even to ""), else "vllm-none-hash".
    assert raw(block_hashes(tokens, algorithm=algorithm)) == by_seed[VLLM_DEFAULT_SEED]
    for env in ["42", ""]:
        monkeypatch.setenv("PYTHONHASHSEED", env)
        assert default_seed() == env
        assert none_hash(None, algorithm) == none_hash(env, algorithm)
        assert raw(block_hashes(tokens, algorithm=algorithm)) == by_seed[env]
        assert raw(block_hashes(tokens, seed="1", algorithm=algorithm)) == by_seed["1"]
    # The two algorithms never agree.
    other: HashAlgorithm = "sha256_cbor" if algorithm == "sha256" else "sha256"
    assert none_hash("0", algorithm) != none_hash("0", other)


@ALGORITHMS
def test_partial_last_block_is_ignored(algorithm: HashAlgorithm) -> None:
    tokens = tokens_of(3 * 16 + 15)
    got = raw(block_hashes(tokens, algorithm=algorithm))
    assert len(got) == 3
    assert got == ref_block_hashes(tokens[:48], algorithm=algorithm)


@ALGORITHMS
@pytest.mark.parametrize("n", [0, 1, 15])
def test_fewer_tokens_than_a_block(n: int, algorithm: HashAlgorithm) -> None:
    assert block_hashes(tokens_of(n), algorithm=algorithm) == []
    assert block_hashes(np.zeros(n, dtype=np.int64), algorithm=algorithm) == []


@ALGORITHMS
def test_lora(algorithm: HashAlgorithm) -> None:
    tokens = tokens_of(100)
    got = raw(block_hashes(tokens, extra_keys=extra(lora="adapter-1"), algorithm=algorithm))
    assert got == ref_block_hashes(tokens, lora="adapter-1", algorithm=algorithm)
    assert got[0] != ref_block_hashes(tokens, algorithm=algorithm)[0]
    assert got != raw(block_hashes(tokens, extra_keys=extra(lora="adapter-2"), algorithm=algorithm))
    # vLLM 0.32 hashes the path too: the same name pointed at another adapter is another key.
    moved = ExtraKeys(lora_name="adapter-1", lora_path="/elsewhere")
    assert got != raw(block_hashes(tokens, extra_keys=moved, algorithm=algorithm))
    # An empty ExtraKeys is the same as none.
    assert raw(block_hashes(tokens, extra_keys=ExtraKeys(), algorithm=algorithm)) == (
        ref_block_hashes(tokens, algorithm=algorithm)
    )


@ALGORITHMS
def test_cache_salt_only_on_first_block(algorithm: HashAlgorithm) -> None:
    tokens = tokens_of(64)
    got = block_hashes(tokens, extra_keys=extra(salt="tenant-a"), algorithm=algorithm)
    assert raw(got) == ref_block_hashes(tokens, salt="tenant-a", algorithm=algorithm)
    salt_key = (("cache_salt", "tenant-a"),)
    assert got[0] == hash_block_tokens(None, tokens[:16], salt_key, algorithm=algorithm)
    for i in range(1, 4):  # later blocks carry no extra keys, only the salted parent
        block = tokens[16 * i : 16 * (i + 1)]
        assert got[i] == hash_block_tokens(got[i - 1], block, None, algorithm=algorithm)
    # A falsy salt is no salt, as in vLLM.
    assert raw(block_hashes(tokens, extra_keys=extra(salt=""), algorithm=algorithm)) == (
        ref_block_hashes(tokens, algorithm=algorithm)
    )


@ALGORITHMS
def test_lora_mm_and_salt_are_in_vllm_order(algorithm: HashAlgorithm) -> None:
    tokens = tokens_of(32)
    keys = extra(lora="L", mm=[("img", 2, 20)], salt="S")
    got = block_hashes(tokens, extra_keys=keys, algorithm=algorithm)
    lora = ("lora", "L", lora_path("L"))
    first = (lora, ("mm", "img", 2), ("cache_salt", "S"))
    assert got[0] == hash_block_tokens(None, tokens[:16], first, algorithm=algorithm)
    second = (lora, ("mm", "img", -14))  # the item's offset from the block's start
    assert got[1] == hash_block_tokens(got[0], tokens[16:], second, algorithm=algorithm)
    assert raw(got) == ref_block_hashes(tokens, lora="L", mm=[("img", 2, 20)], salt="S", algorithm=algorithm)


def _mm(*keys: tuple[str, int]) -> tuple[tuple[str, str, int], ...]:
    return tuple(("mm", identifier, offset) for identifier, offset in keys)


MM_CASES: dict[str, tuple[list[tuple[str, int, int]], list[Any]]] = {
    # name: (items, the extra keys each block must get, block size 16)
    "spans_boundaries": ([("a", 10, 30)], [_mm(("a", 10)), _mm(("a", -6)), _mm(("a", -22)), None]),
    "starts_mid_block": ([("a", 20, 5)], [None, _mm(("a", 4)), None, None]),
    "several_in_one_block": (
        [("a", 1, 3), ("b", 5, 2), ("c", 9, 10)],
        [_mm(("a", 1), ("b", 5), ("c", 9)), _mm(("c", -7))],
    ),
    "ends_on_boundary": ([("a", 4, 12), ("b", 16, 16)], [_mm(("a", 4)), _mm(("b", 0)), None, None]),
    "starts_on_boundary": ([("a", 16, 3)], [None, _mm(("a", 0)), None, None]),
    "same_identifier_twice": ([("x", 0, 4), ("x", 40, 4)], [_mm(("x", 0)), None, _mm(("x", 8)), None]),
    # vLLM's walk stops at the end of the *last* item, and at an item that runs past the block,
    # so a longer earlier one is cut short and a later one inside it is never keyed.
    "overlapping_items_vllm_quirk": ([("a", 0, 40), ("b", 5, 3)], [_mm(("a", 0)), None, None, None]),
}


@ALGORITHMS
@pytest.mark.parametrize("case", sorted(MM_CASES))
def test_multimodal_items(case: str, algorithm: HashAlgorithm) -> None:
    items, per_block = MM_CASES[case]
    tokens = tokens_of(16 * len(per_block) + 3)
    got = block_hashes(tokens, extra_keys=extra(mm=items), algorithm=algorithm)
    assert raw(got) == ref_block_hashes(tokens, mm=items, algorithm=algorithm)
    # The extra keys each block carries, spelled out rather than derived from the algorithm.
    parent = None
    for i, keys in enumerate(per_block):
        parent = hash_block_tokens(parent, tokens[16 * i : 16 * (i + 1)], keys, algorithm=algorithm)
        assert got[i] == parent, f"block {i}"


@ALGORITHMS
def test_multimodal_with_lora_and_many_blocks(algorithm: HashAlgorithm) -> None:
    items = [("i0", 3, 40), ("i1", 50, 2), ("i2", 52, 100), ("i3", 300, 16)]
    tokens = tokens_of(16 * 30)
    got = block_hashes(tokens, extra_keys=extra(lora="L", mm=items, salt="s"), algorithm=algorithm)
    assert raw(got) == ref_block_hashes(tokens, lora="L", mm=items, salt="s", algorithm=algorithm)


EDGE_IDS = [0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63 - 1]


@ALGORITHMS
@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_every_integer_width(block_size: int, algorithm: HashAlgorithm) -> None:
    # CBOR's widths, and pickle's BININT1 / BININT2 / BININT / LONG1.
    tokens = EDGE_IDS * 4 + [1, 2, 25, 300, 70_000]
    got = raw(block_hashes(tokens, block_size, algorithm=algorithm))
    assert got == ref_block_hashes(tokens, block_size, algorithm=algorithm)
    for ids in (EDGE_IDS[:6], EDGE_IDS[:10]):  # the narrower-word paths on their own
        tokens = ids * 8
        got = raw(block_hashes(tokens, block_size, algorithm=algorithm))
        assert got == ref_block_hashes(tokens, block_size, algorithm=algorithm)


@ALGORITHMS
def test_each_width_alone(algorithm: HashAlgorithm) -> None:
    for token in EDGE_IDS:
        tokens = [token] * 32
        assert raw(block_hashes(tokens, algorithm=algorithm)) == (
            ref_block_hashes(tokens, algorithm=algorithm)
        ), token


@ALGORITHMS
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint64, np.uint32, np.uint16, np.int16, np.uint8])
def test_numpy_input(dtype: type[np.integer], algorithm: HashAlgorithm) -> None:
    tokens = [t % (np.iinfo(dtype).max + 1) for t in tokens_of(100)]
    arr = np.array(tokens, dtype=dtype)
    assert raw(block_hashes(arr, algorithm=algorithm)) == ref_block_hashes(tokens, algorithm=algorithm)
    # not contiguous
    assert raw(block_hashes(arr[::2], algorithm=algorithm)) == (
        ref_block_hashes(tokens[::2], algorithm=algorithm)
    )


@ALGORITHMS
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_torch_input(dtype: torch.dtype, algorithm: HashAlgorithm) -> None:
    tokens = [t % 256 if dtype == torch.uint8 else t % 30_000 for t in tokens_of(100)]
    tensor = torch.tensor(tokens, dtype=dtype)
    assert raw(block_hashes(tensor, algorithm=algorithm)) == ref_block_hashes(tokens, algorithm=algorithm)
    assert raw(block_hashes(tensor[1::3], algorithm=algorithm)) == (
        ref_block_hashes(tokens[1::3], algorithm=algorithm)
    )


@ALGORITHMS
def test_sequence_inputs_agree(algorithm: HashAlgorithm) -> None:
    tokens = tokens_of(64)
    expected = ref_block_hashes(tokens, algorithm=algorithm)
    assert raw(block_hashes(tuple(tokens), algorithm=algorithm)) == expected
    assert raw(block_hashes([np.int64(t) for t in tokens], algorithm=algorithm)) == expected


@ALGORITHMS
def test_chain_property(algorithm: HashAlgorithm) -> None:
    tokens = tokens_of(16 * 20)
    full = block_hashes(tokens, algorithm=algorithm)
    for k in (0, 1, 5, 19, 20):
        assert block_hashes(tokens[: 16 * k], algorithm=algorithm) == full[:k]
    for pos in (0, 15, 16, 100, 16 * 20 - 1):
        changed = list(tokens)
        changed[pos] = (changed[pos] + 1) % 128_256
        other = block_hashes(changed, algorithm=algorithm)
        j = pos // 16
        assert other[:j] == full[:j]
        assert all(a != b for a, b in zip(other[j:], full[j:], strict=True))
    # Each hash is hash_block_tokens of its block with the previous hash as parent.
    parent = None
    for i, h in enumerate(full):
        parent = hash_block_tokens(parent, tokens[16 * i : 16 * (i + 1)], None, algorithm=algorithm)
        assert h == parent


@ALGORITHMS
def test_hash_block_tokens_matches_reference(algorithm: HashAlgorithm) -> None:
    parent = ref_hash("7", algorithm)
    block = [5, 70_000, 2**40]
    keys = (("lora", "k", "/k"),)
    expected = ref_hash((parent, tuple(block), keys), algorithm)
    assert hash_block_tokens(BlockHash(parent), block, keys, seed="7", algorithm=algorithm) == expected
    assert hash_block_tokens(None, np.array(block), keys, seed="7", algorithm=algorithm) == expected
    default_parent = ref_hash(VLLM_DEFAULT_SEED, algorithm)
    assert hash_block_tokens(None, block, None, algorithm=algorithm) == (
        ref_hash((default_parent, tuple(block), None), algorithm)
    )


@st.composite
def hashing_inputs(draw: st.DrawFn) -> tuple[list[int], int, str, ExtraKeys | None, dict[str, Any]]:
    block_size = draw(st.integers(1, 40))
    widths = st.sampled_from([23, 255, 65535, 2**31, 2**32 - 1, 2**63 - 1])
    limit = draw(widths)
    tokens = draw(st.lists(st.integers(0, limit), max_size=6 * block_size))
    seed = draw(st.sampled_from(["0", "1", "abc", VLLM_DEFAULT_SEED]))
    lora = draw(st.none() | st.sampled_from(["", "lora-a"]))
    salt = draw(st.none() | st.sampled_from(["", "salt"]))
    offsets = sorted(draw(st.lists(st.integers(0, len(tokens) + 5), max_size=4)))
    mm = [(f"mm{i}", o, draw(st.integers(1, 3 * block_size))) for i, o in enumerate(offsets)]
    keys = None if lora is None and salt is None and not mm else extra(lora, mm, salt)
    algorithm = draw(st.sampled_from(HASH_ALGORITHMS))
    return tokens, block_size, seed, keys, {"lora": lora, "mm": mm, "salt": salt, "algorithm": algorithm}


@settings(max_examples=300, deadline=None)
@given(hashing_inputs())
def test_property_matches_reference(
    case: tuple[list[int], int, str, ExtraKeys | None, dict[str, Any]],
) -> None:
    tokens, block_size, seed, keys, ref_kwargs = case
    got = block_hashes(tokens, block_size, seed=seed, extra_keys=keys, algorithm=ref_kwargs["algorithm"])
    assert raw(got) == ref_block_hashes(tokens, block_size, seed, **ref_kwargs)


BAD_TOKENS = [
    [1, -1],
    [1, 2.0],
    [1, 2.5],
    [1, "2"],
    [1, None],
    [2**63],
    [-1, 2**63],
    [2**64],
    np.array([1.0, 2.0]),
    np.array([-3, 4]),
    np.array([[1, 2], [3, 4]]),
    np.array([True, False]),
    torch.tensor([1.0, 2.0]),
    torch.tensor([1.0], dtype=torch.bfloat16),
    torch.tensor([5, -1]),
    12,
]


@pytest.mark.parametrize("tokens", BAD_TOKENS, ids=range(len(BAD_TOKENS)))
def test_invalid_tokens_raise(tokens: object) -> None:
    with pytest.raises(InvalidArgumentError):
        block_hashes(tokens, block_size=1)
    with pytest.raises(ValueError):  # what a caller that knows nothing of tierkv catches
        block_hashes(tokens, block_size=1)


@pytest.mark.parametrize("block_size", [0, -16, 1.5, "16", True, None])
def test_invalid_block_size_raises(block_size: object) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(list(range(32)), block_size=block_size)  # type: ignore[arg-type]


def test_invalid_extra_keys_raise() -> None:
    with pytest.raises(ValueError, match="sorted"):
        extra(mm=[("b", 10, 2), ("a", 5, 2)])
    with pytest.raises(ValueError):
        MultiModalItem("a", -1, 2)
    with pytest.raises(ValueError):
        MultiModalItem("a", 0, 0)
    with pytest.raises(ValueError):
        block_hashes(list(range(32)), extra_keys=("lora",))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        block_hashes(list(range(32)), seed=0)  # type: ignore[arg-type]
    for half in ({"lora_name": "L"}, {"lora_path": "/L"}):
        with pytest.raises(ValueError, match="lora_name and lora_path together"):
            ExtraKeys(**half)  # type: ignore[arg-type]


@pytest.mark.parametrize("algorithm", ["xxhash", "sha256_pickle", "SHA256", "", None, b"sha256"])
def test_invalid_algorithm_raises(algorithm: object) -> None:
    for call in (
        lambda: block_hashes(list(range(32)), algorithm=algorithm),  # type: ignore[arg-type]
        lambda: none_hash("0", algorithm),  # type: ignore[arg-type]
        lambda: hash_block_tokens(None, [1], None, algorithm=algorithm),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidArgumentError, match="choose one of sha256, sha256_cbor"):
            call()


def test_extra_keys_accepts_a_list_and_stays_hashable() -> None:
    keys = ExtraKeys(mm_items=[MultiModalItem("a", 0, 4)])  # type: ignore[arg-type]
    assert keys.mm_items == (MultiModalItem("a", 0, 4),)
    assert hash(keys) == hash(ExtraKeys(mm_items=(MultiModalItem("a", 0, 4),)))
