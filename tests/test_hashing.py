"""tierkv.hashing against an independent copy of vLLM v1's sha256_cbor block hashing.

The reference below is the straightforward per-block loop (hashlib + cbor2), written out here so
that it shares no code with the fast implementation under test.
"""

from __future__ import annotations

import hashlib
import random

import cbor2
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.errors import InvalidArgumentError
from tierkv.hashing import (
    DEFAULT_SEED,
    ExtraKeys,
    MultiModalItem,
    block_hashes,
    hash_block_tokens,
    none_hash,
)
from tierkv.keys import BlockHash

# ---------------------------------------------------------------------------------------------
# Reference: vLLM v1 (kv_cache_utils) with hash_fn = sha256_cbor, mm items as plain tuples.


def ref_sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def ref_mm_keys(
    mm_items: list[tuple[str, int, int]], start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[list[str], int]:
    extra_keys: list[str] = []
    if not mm_items:
        return extra_keys, start_mm_idx
    _, last_offset, last_length = mm_items[-1]
    if last_offset + last_length < start_token_idx:
        return extra_keys, start_mm_idx
    curr = start_mm_idx
    while curr < len(mm_items):
        identifier, offset, length = mm_items[curr]
        if end_token_idx > offset:
            if start_token_idx > offset + length:
                curr += 1
                continue
            extra_keys.append(identifier)
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
    seed: str = "0",
    *,
    lora: str | None = None,
    mm: list[tuple[str, int, int]] | None = None,
    salt: str | None = None,
) -> list[bytes]:
    parent = ref_sha256_cbor(seed)  # NONE_HASH
    out: list[bytes] = []
    mm_idx = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        end = start + block_size
        mm_keys, mm_idx = ref_mm_keys(mm or [], start, end, mm_idx)
        lora_keys = [lora] if lora is not None else []
        salt_keys = [salt] if start == 0 and salt else []
        keys = lora_keys + mm_keys + salt_keys
        extra = tuple(keys) if keys else None
        parent = ref_sha256_cbor((parent, tuple(tokens[start:end]), extra))
        out.append(parent)
    return out


def extra(
    lora: str | None = None,
    mm: list[tuple[str, int, int]] | None = None,
    salt: str | None = None,
) -> ExtraKeys:
    return ExtraKeys(
        lora_name=lora,
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
    # Computed once with the reference; guards against the reference and the code drifting
    # together.
    golden = "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c"
    assert ref_block_hashes(list(range(16)))[0].hex() == golden
    assert block_hashes(range(16), seed="0")[0].hex() == golden
    assert none_hash("0").hex() == ("4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e")
    assert DEFAULT_SEED == "0"


@pytest.mark.parametrize("n", [16, 17, 160, 1000, 16 * 513])
@pytest.mark.parametrize("vocab", [20, 256, 32_000, 128_256])
def test_matches_reference_without_extra_keys(n: int, vocab: int) -> None:
    tokens = tokens_of(n, vocab, seed=n)
    got = block_hashes(tokens)
    assert all(type(h) is BlockHash for h in got)
    assert raw(got) == ref_block_hashes(tokens)


@pytest.mark.parametrize("block_size", [1, 2, 3, 16, 23, 24, 32, 255, 256, 300])
def test_matches_reference_for_block_sizes(block_size: int) -> None:
    # 24 and 256 are where the CBOR array header grows to 2 and 3 bytes.
    tokens = tokens_of(block_size * 3 + 1, seed=block_size)
    assert raw(block_hashes(tokens, block_size)) == ref_block_hashes(tokens, block_size)


def test_seeds() -> None:
    tokens = tokens_of(64)
    by_seed = {}
    for seed in ["0", "1", "42", "", "seed-ü"]:
        assert bytes(none_hash(seed)) == hashlib.sha256(cbor2.dumps(seed)).digest()
        got = raw(block_hashes(tokens, seed=seed))
        assert got == ref_block_hashes(tokens, seed=seed)
        by_seed[seed] = got
    all_hashes = [h for hashes in by_seed.values() for h in hashes]
    assert len(set(all_hashes)) == len(all_hashes)  # every seed gives different hashes
    assert raw(block_hashes(tokens)) == by_seed["0"]


def test_partial_last_block_is_ignored() -> None:
    tokens = tokens_of(3 * 16 + 15)
    got = raw(block_hashes(tokens))
    assert len(got) == 3
    assert got == ref_block_hashes(tokens[:48])


@pytest.mark.parametrize("n", [0, 1, 15])
def test_fewer_tokens_than_a_block(n: int) -> None:
    assert block_hashes(tokens_of(n)) == []
    assert block_hashes(np.zeros(n, dtype=np.int64)) == []


def test_lora_name() -> None:
    tokens = tokens_of(100)
    got = raw(block_hashes(tokens, extra_keys=extra(lora="adapter-1")))
    assert got == ref_block_hashes(tokens, lora="adapter-1")
    assert got[0] != ref_block_hashes(tokens)[0]
    assert got != raw(block_hashes(tokens, extra_keys=extra(lora="adapter-2")))
    # An empty ExtraKeys is the same as none.
    assert raw(block_hashes(tokens, extra_keys=ExtraKeys())) == ref_block_hashes(tokens)


def test_cache_salt_only_on_first_block() -> None:
    tokens = tokens_of(64)
    got = block_hashes(tokens, extra_keys=extra(salt="tenant-a"))
    assert raw(got) == ref_block_hashes(tokens, salt="tenant-a")
    assert got[0] == hash_block_tokens(None, tokens[:16], ("tenant-a",))
    for i in range(1, 4):  # later blocks carry no extra keys, only the salted parent
        assert got[i] == hash_block_tokens(got[i - 1], tokens[16 * i : 16 * (i + 1)], None)
    # A falsy salt is no salt, as in vLLM.
    assert raw(block_hashes(tokens, extra_keys=extra(salt=""))) == ref_block_hashes(tokens)


def test_lora_mm_and_salt_are_in_vllm_order() -> None:
    tokens = tokens_of(32)
    keys = extra(lora="L", mm=[("img", 2, 4)], salt="S")
    got = block_hashes(tokens, extra_keys=keys)
    assert got[0] == hash_block_tokens(None, tokens[:16], ("L", "img", "S"))
    assert got[1] == hash_block_tokens(got[0], tokens[16:], ("L",))
    assert raw(got) == ref_block_hashes(tokens, lora="L", mm=[("img", 2, 4)], salt="S")


MM_CASES = {
    # name: (items, the extra keys each block must get, block size 16)
    "spans_boundaries": ([("a", 10, 30)], [("a",), ("a",), ("a",), None]),
    "starts_mid_block": ([("a", 20, 5)], [None, ("a",), None, None]),
    "several_in_one_block": ([("a", 1, 3), ("b", 5, 2), ("c", 9, 10)], [("a", "b", "c"), ("c",)]),
    "ends_on_boundary": ([("a", 4, 12), ("b", 16, 16)], [("a",), ("b",), None, None]),
    "starts_on_boundary": ([("a", 16, 3)], [None, ("a",), None, None]),
    "same_identifier_twice": ([("x", 0, 4), ("x", 40, 4)], [("x",), None, ("x",), None]),
    # vLLM's walk stops at the end of the *last* item, so a longer earlier one is cut short.
    "overlapping_items_vllm_quirk": ([("a", 0, 40), ("b", 5, 3)], [("a",), None, None, None]),
}


@pytest.mark.parametrize("case", sorted(MM_CASES))
def test_multimodal_items(case: str) -> None:
    items, per_block = MM_CASES[case]
    tokens = tokens_of(16 * len(per_block) + 3)
    got = block_hashes(tokens, extra_keys=extra(mm=items))
    assert raw(got) == ref_block_hashes(tokens, mm=items)
    # The extra keys each block carries, spelled out rather than derived from the algorithm.
    parent = None
    for i, keys in enumerate(per_block):
        parent = hash_block_tokens(parent, tokens[16 * i : 16 * (i + 1)], keys)
        assert got[i] == parent, f"block {i}"


def test_multimodal_with_lora_and_many_blocks() -> None:
    items = [("i0", 3, 40), ("i1", 50, 2), ("i2", 52, 100), ("i3", 300, 16)]
    tokens = tokens_of(16 * 30)
    got = block_hashes(tokens, extra_keys=extra(lora="L", mm=items, salt="s"))
    assert raw(got) == ref_block_hashes(tokens, lora="L", mm=items, salt="s")


EDGE_IDS = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**40, 2**63 - 1]


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_every_cbor_integer_width(block_size: int) -> None:
    tokens = EDGE_IDS * 4 + [1, 2, 25, 300, 70_000]
    assert raw(block_hashes(tokens, block_size)) == ref_block_hashes(tokens, block_size)
    for ids in (EDGE_IDS[:6], EDGE_IDS[:8]):  # the narrower-word paths on their own
        tokens = ids * 8
        assert raw(block_hashes(tokens, block_size)) == ref_block_hashes(tokens, block_size)


def test_each_width_alone() -> None:
    for token in EDGE_IDS:
        tokens = [token] * 32
        assert raw(block_hashes(tokens)) == ref_block_hashes(tokens), token


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint64, np.uint32, np.uint16, np.int16, np.uint8])
def test_numpy_input(dtype: type[np.integer]) -> None:
    tokens = [t % (np.iinfo(dtype).max + 1) for t in tokens_of(100)]
    arr = np.array(tokens, dtype=dtype)
    assert raw(block_hashes(arr)) == ref_block_hashes(tokens)
    assert raw(block_hashes(arr[::2])) == ref_block_hashes(tokens[::2])  # not contiguous


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_torch_input(dtype: torch.dtype) -> None:
    tokens = [t % 256 if dtype == torch.uint8 else t % 30_000 for t in tokens_of(100)]
    tensor = torch.tensor(tokens, dtype=dtype)
    assert raw(block_hashes(tensor)) == ref_block_hashes(tokens)
    assert raw(block_hashes(tensor[1::3])) == ref_block_hashes(tokens[1::3])


def test_sequence_inputs_agree() -> None:
    tokens = tokens_of(64)
    expected = ref_block_hashes(tokens)
    assert raw(block_hashes(tuple(tokens))) == expected
    assert raw(block_hashes([np.int64(t) for t in tokens])) == expected


def test_chain_property() -> None:
    tokens = tokens_of(16 * 20)
    full = block_hashes(tokens)
    for k in (0, 1, 5, 19, 20):
        assert block_hashes(tokens[: 16 * k]) == full[:k]
    for pos in (0, 15, 16, 100, 16 * 20 - 1):
        changed = list(tokens)
        changed[pos] = (changed[pos] + 1) % 128_256
        other = block_hashes(changed)
        j = pos // 16
        assert other[:j] == full[:j]
        assert all(a != b for a, b in zip(other[j:], full[j:], strict=True))
    # Each hash is hash_block_tokens of its block with the previous hash as parent.
    parent = None
    for i, h in enumerate(full):
        parent = hash_block_tokens(parent, tokens[16 * i : 16 * (i + 1)], None)
        assert h == parent


def test_hash_block_tokens_matches_reference() -> None:
    parent = ref_sha256_cbor("7")
    block = [5, 70_000, 2**40]
    expected = ref_sha256_cbor((parent, tuple(block), ("k",)))
    assert hash_block_tokens(BlockHash(parent), block, ("k",), seed="7") == expected
    assert hash_block_tokens(None, np.array(block), ("k",), seed="7") == expected
    assert hash_block_tokens(None, block, None) == ref_sha256_cbor((ref_sha256_cbor("0"), tuple(block), None))


@st.composite
def hashing_inputs(draw: st.DrawFn) -> tuple[list[int], int, str, ExtraKeys | None, dict]:
    block_size = draw(st.integers(1, 40))
    widths = st.sampled_from([23, 255, 65535, 2**32 - 1, 2**63 - 1])
    limit = draw(widths)
    tokens = draw(st.lists(st.integers(0, limit), max_size=6 * block_size))
    seed = draw(st.sampled_from(["0", "1", "abc"]))
    lora = draw(st.none() | st.sampled_from(["", "lora-a"]))
    salt = draw(st.none() | st.sampled_from(["", "salt"]))
    offsets = sorted(draw(st.lists(st.integers(0, len(tokens) + 5), max_size=4)))
    mm = [(f"mm{i}", o, draw(st.integers(1, 3 * block_size))) for i, o in enumerate(offsets)]
    keys = None if lora is None and salt is None and not mm else extra(lora, mm, salt)
    return tokens, block_size, seed, keys, {"lora": lora, "mm": mm, "salt": salt}


@settings(max_examples=300, deadline=None)
@given(hashing_inputs())
def test_property_matches_reference(
    case: tuple[list[int], int, str, ExtraKeys | None, dict],
) -> None:
    tokens, block_size, seed, keys, ref_kwargs = case
    got = block_hashes(tokens, block_size, seed=seed, extra_keys=keys)
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


def test_extra_keys_accepts_a_list_and_stays_hashable() -> None:
    keys = ExtraKeys(mm_items=[MultiModalItem("a", 0, 4)])  # type: ignore[arg-type]
    assert keys.mm_items == (MultiModalItem("a", 0, 4),)
    assert hash(keys) == hash(ExtraKeys(mm_items=(MultiModalItem("a", 0, 4),)))
