"""tierkv.hashing against the installed vLLM's own block hashing (vllm is a test dependency).

Each case builds a real ``vllm.v1.request.Request`` (LoRA request, cache salt, multimodal
features) with vLLM's ``get_request_block_hasher``, so the extra keys, the NONE_HASH seed rule and
the chaining are all vLLM's; ``init_none_hash`` runs after PYTHONHASHSEED is set, as in a worker.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256, sha256_cbor
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

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

HASH_FNS: dict[HashAlgorithm, Callable[[Any], bytes]] = {"sha256": sha256, "sha256_cbor": sha256_cbor}
assert set(HASH_FNS) == set(HASH_ALGORITHMS)
ALGORITHMS = pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
Mm = list[tuple[str, int, int]]  # (identifier, offset, length), sorted by offset


@pytest.fixture(params=[None, "0", "4711", ""], ids=["unset", "0", "4711", "empty"])
def hashseed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str | None]:
    """PYTHONHASHSEED for the test (``None``: unset). vLLM's NONE_HASH globals are put back after."""
    for name in ("NONE_HASH", "_NONE_HASH_SEED"):
        monkeypatch.setattr(kv_cache_utils, name, getattr(kv_cache_utils, name, None), raising=False)
    if request.param is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", request.param)
    yield request.param


def vllm_request(
    tokens: list[int],
    block_size: int,
    algorithm: HashAlgorithm,
    lora: tuple[str, str] | None = None,
    mm: Mm | None = None,
    salt: str | None = None,
) -> Request:
    """A vLLM request whose ``block_hashes`` vLLM computes, as its scheduler gets them."""
    fn = HASH_FNS[algorithm]
    kv_cache_utils.init_none_hash(fn)
    return Request(
        "req-0",
        list(tokens),
        SamplingParams(max_tokens=16),
        None,
        lora_request=None if lora is None else LoRARequest(lora[0], 1, lora[1]),
        cache_salt=salt,
        mm_features=[
            MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset, length))
            for identifier, offset, length in mm or []
        ],
        block_hasher=kv_cache_utils.get_request_block_hasher(block_size, fn),
    )


def tierkv_keys(lora: tuple[str, str] | None, mm: Mm | None, salt: str | None) -> ExtraKeys:
    return ExtraKeys(
        lora_name=None if lora is None else lora[0],
        lora_path=None if lora is None else lora[1],
        mm_items=tuple(MultiModalItem(*item) for item in mm or []),
        cache_salt=salt,
    )


def check_case(
    tokens: list[int],
    block_size: int,
    algorithm: HashAlgorithm,
    lora: tuple[str, str] | None = None,
    mm: Mm | None = None,
    salt: str | None = None,
) -> list[bytes]:
    expected = [bytes(h) for h in vllm_request(tokens, block_size, algorithm, lora, mm, salt).block_hashes]
    keys = tierkv_keys(lora, mm, salt)
    got = [bytes(h) for h in block_hashes(tokens, block_size, extra_keys=keys, algorithm=algorithm)]
    assert got == expected
    # The seed given explicitly is the same as vLLM's rule.
    seed = kv_cache_utils.get_none_hash_seed()
    explicit = block_hashes(tokens, block_size, seed=seed, extra_keys=keys, algorithm=algorithm)
    assert [bytes(h) for h in explicit] == expected
    return expected


# ---------------------------------------------------------------------------------------------


def test_default_golden_value_is_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NONE_HASH", "_NONE_HASH_SEED"):
        monkeypatch.setattr(kv_cache_utils, name, getattr(kv_cache_utils, name, None), raising=False)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    golden = "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"
    kv_cache_utils.init_none_hash(sha256)  # vLLM's default prefix_caching_hash_algo
    assert kv_cache_utils.hash_block_tokens(sha256, None, list(range(16)), None).hex() == golden
    assert block_hashes(range(16))[0].hex() == golden  # all defaults


@ALGORITHMS
def test_none_hash_and_seed_rule(algorithm: HashAlgorithm, hashseed: str | None) -> None:
    fn = HASH_FNS[algorithm]
    kv_cache_utils.init_none_hash(fn)
    expected_seed = VLLM_DEFAULT_SEED if hashseed is None else hashseed
    assert default_seed() == kv_cache_utils.resolve_none_hash_seed(fn) == expected_seed
    assert kv_cache_utils.get_none_hash_seed() == expected_seed
    assert bytes(none_hash(None, algorithm)) == kv_cache_utils.NONE_HASH
    assert bytes(none_hash(expected_seed, algorithm)) == kv_cache_utils.NONE_HASH


@ALGORITHMS
def test_plain_prompts(algorithm: HashAlgorithm, hashseed: str | None) -> None:
    rnd = random.Random(1)
    for n, block_size in [(0, 16), (15, 16), (16, 16), (1000, 16), (8192, 16), (333, 1), (600, 64)]:
        tokens = [rnd.randrange(128_256) for _ in range(n)]
        assert len(check_case(tokens, block_size, algorithm)) == n // block_size


@ALGORITHMS
def test_seeded_random_prompts_with_every_extra_key(algorithm: HashAlgorithm, hashseed: str | None) -> None:
    rnd = random.Random(2)
    for case in range(25):
        block_size = rnd.choice([1, 4, 16, 16, 16, 32])
        n = rnd.randrange(0, 40 * block_size)
        tokens = [rnd.randrange(2**17 if case % 5 else 2**63) for _ in range(n)]
        offsets = sorted(rnd.randrange(0, n + 3) for _ in range(rnd.randrange(0, 5)))
        mm = [(f"img-{rnd.randrange(3)}", o, rnd.randrange(1, 3 * block_size)) for o in offsets]
        lora = rnd.choice([None, ("adapter-a", "/adapters/a"), ("adapter-b", "/adapters/b")])
        salt = rnd.choice([None, "", "tenant-salt"])
        check_case(tokens, block_size, algorithm, lora, mm, salt)


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[int], int, Any, Mm, str | None]:
    block_size = draw(st.sampled_from([1, 2, 3, 16, 17]))
    limit = draw(st.sampled_from([255, 65535, 2**31, 2**63 - 1]))
    tokens = draw(st.lists(st.integers(0, limit), max_size=8 * block_size))
    offsets = sorted(draw(st.lists(st.integers(0, len(tokens) + 2), max_size=4)))
    identifiers = st.sampled_from(["a", "b", "image-hash-0123"])
    mm = [(draw(identifiers), o, draw(st.integers(1, 3 * block_size))) for o in offsets]
    lora = draw(st.none() | st.sampled_from([("L", "/p/L"), ("", "/p/empty-name")]))
    salt = draw(st.none() | st.sampled_from(["", "s", "salt ü"]))
    return tokens, block_size, lora, mm, salt


@ALGORITHMS
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=requests())
def test_property_matches_vllm(
    algorithm: HashAlgorithm, hashseed: str | None, case: tuple[list[int], int, Any, Mm, str | None]
) -> None:
    assert os.environ.get("PYTHONHASHSEED") == hashseed
    check_case(case[0], case[1], algorithm, *case[2:])


@ALGORITHMS
def test_hash_block_tokens_with_vllms_extra_keys(algorithm: HashAlgorithm, hashseed: str | None) -> None:
    rnd = random.Random(3)
    tokens = [rnd.randrange(128_256) for _ in range(16 * 12)]
    mm = [("x", 5, 20), ("y", 40, 3), ("x", 44, 60)]
    request = vllm_request(tokens, 16, algorithm, ("L", "/p"), mm, "salt")
    assert len(request.block_hashes) == 12
    parent: Any = None  # vLLM's BlockHash (bytes): what its scheduler passes
    mm_idx = 0
    for i, expected in enumerate(request.block_hashes):
        keys, mm_idx = kv_cache_utils.generate_block_hash_extra_keys(request, 16 * i, 16 * (i + 1), mm_idx)
        block = tokens[16 * i : 16 * (i + 1)]
        assert kv_cache_utils.hash_block_tokens(HASH_FNS[algorithm], parent, block, keys) == expected
        ours = hash_block_tokens(parent and BlockHash(parent), block, keys, algorithm=algorithm)
        assert bytes(ours) == expected
        parent = expected


@ALGORITHMS
def test_vllms_incremental_hashes_are_the_whole_sequences(algorithm: HashAlgorithm) -> None:
    # vLLM hashes new blocks as output tokens arrive, resuming its mm walk mid-request.
    rnd = random.Random(4)
    prompt = [rnd.randrange(128_256) for _ in range(70)]
    mm = [("img", 10, 30), ("img2", 60, 50)]  # the second runs past the prompt
    request = vllm_request(prompt, 16, algorithm, ("L", "/p"), mm, "salt")
    tokens = list(prompt)
    for _ in range(9):
        new = [rnd.randrange(128_256) for _ in range(rnd.randrange(1, 12))]
        request.append_output_token_ids(new)
        tokens += new
        got = block_hashes(tokens, 16, extra_keys=tierkv_keys(("L", "/p"), mm, "salt"), algorithm=algorithm)
        assert [bytes(h) for h in got] == list(request.block_hashes)
