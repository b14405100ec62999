"""Chained block hashes, bit-identical to vLLM v1's prefix-cache hashes (vLLM 0.32).

Contract: for the same tokens, block size, seed, extra keys and algorithm, ``block_hashes``
returns exactly the hashes a vLLM 0.32 worker computes with ``--prefix-caching-hash-algo
<algorithm>``, so blocks stored by one are found by the other. By default (``algorithm="sha256"``,
``seed=None``) that is a default-configured vLLM:

* ``"sha256"`` (vLLM's default): ``sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))``;
  ``"sha256_cbor"``: ``sha256(cbor2.dumps(obj, canonical=True))``. vLLM's non-cryptographic
  ``xxhash`` algorithms are not offered: without ``PYTHONHASHSEED`` their seed is random per
  process, so no one else can reproduce their hashes anyway;
* ``NONE_HASH = hash_fn(seed)``, the parent of the first block. ``seed=None`` follows vLLM's rule
  (``default_seed``): ``PYTHONHASHSEED`` from the environment if it is set (even to ``""``),
  else ``"vllm-none-hash"``. Here it is *this* process's environment: pass ``seed`` explicitly
  when the vLLM workers run with another ``PYTHONHASHSEED`` than this process;
* block ``i`` hashes ``(parent or NONE_HASH, tuple(block_i_tokens), extra_keys_i or None)``,
  the parent as plain ``bytes``;
* only full blocks are hashed: a trailing partial block gets no hash;
* a block's extra keys are ``lora_keys + mm_keys + cache_salt_keys`` (vLLM's order), ``None``
  when empty: ``("lora", lora_name, lora_path)`` on every block, ``("mm", identifier, offset -
  block_start)`` for each multimodal item the block overlaps, and ``("cache_salt", salt)`` on
  the block that starts at token 0 only. vLLM's prompt-embeds keys are not supported: tierkv
  hashes token ids.

One caveat of ``"sha256"`` that is vLLM's own: pickle writes a string that occurs twice in one
block's tuple as a back-reference when both occurrences are the *same object*, so the bytes
depend on object identity, not only on values. tierkv puts the strings of ``ExtraKeys`` into
the tuple as given; whether vLLM's equal strings are one object depends on how it built them.
Only a block whose extra keys hold one string value twice (two multimodal items with the same
identifier in one block, a LoRA name equal to its path, ...) can be affected.
"""

from __future__ import annotations

import array
import functools
import hashlib
import itertools
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args

import cbor2
import numpy as np
import numpy.typing as npt

from tierkv.errors import InvalidArgumentError
from tierkv.keys import BlockHash

HashAlgorithm = Literal["sha256", "sha256_cbor"]
HASH_ALGORITHMS: tuple[HashAlgorithm, ...] = get_args(HashAlgorithm)
DEFAULT_ALGORITHM: HashAlgorithm = "sha256"
"""vLLM's default ``--prefix-caching-hash-algo``."""

VLLM_DEFAULT_SEED = "vllm-none-hash"
"""The seed of ``NONE_HASH`` in vLLM (cryptographic algorithms) when ``PYTHONHASHSEED`` is unset."""

_TOKEN_LIMIT = 2**63  # exclusive: every id is one CBOR unsigned int and fits in int64
_TRIPLE_WITH_HASH = b"\x83\x58\x20"  # CBOR: 3-element array, then a 32-byte byte string
_CBOR_NULL = b"\xf6"
_Tails = list[tuple[bytes, slice | list[int]]]  # extra-keys encoding -> the blocks that carry it
_Keys = tuple[tuple[Any, ...], ...] | None  # one block's extra keys, as vLLM hashes them


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """One multimodal input: its content identifier and where its placeholder tokens lie."""

    identifier: str
    offset: int  # token position where the item's placeholder tokens start
    length: int  # number of placeholder tokens

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise InvalidArgumentError(
                f"MultiModalItem {self.identifier!r} needs offset >= 0 and length >= 1: {self}"
            )


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What besides the tokens goes into block hashes (vLLM's per-request extra keys).

    ``lora_name`` and ``lora_path`` are the ``LoRARequest``'s (vLLM 0.32 hashes both, so that
    re-pointing a name at another adapter misses the cache); give both or neither.
    """

    lora_name: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()  # sorted by offset
    cache_salt: str | None = None
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if (self.lora_name is None) != (self.lora_path is None):
            raise InvalidArgumentError(
                "ExtraKeys: give lora_name and lora_path together (vLLM hashes "
                f"('lora', name, path)), got lora_name={self.lora_name!r}, "
                f"lora_path={self.lora_path!r}"
            )
        items = tuple(self.mm_items)  # accept a list, store a tuple: stays hashable
        object.__setattr__(self, "mm_items", items)
        # vLLM's extra-key walk assumes sorted items; unsorted ones would silently mismatch.
        for prev, item in itertools.pairwise(items):
            if item.offset < prev.offset:
                raise InvalidArgumentError(
                    f"ExtraKeys.mm_items must be sorted by offset: {item.identifier!r} at "
                    f"{item.offset} comes after {prev.identifier!r} at {prev.offset}"
                )


def default_seed() -> str:
    """vLLM's seed of ``NONE_HASH`` (cryptographic algorithms): ``PYTHONHASHSEED`` if set in
    this process's environment (even to ``""``), else ``VLLM_DEFAULT_SEED``."""
    seed = os.environ.get("PYTHONHASHSEED")
    return VLLM_DEFAULT_SEED if seed is None else seed


def check_algorithm(algorithm: object) -> HashAlgorithm:
    """``algorithm`` if it is one of ``HASH_ALGORITHMS``, else ``InvalidArgumentError``."""
    if algorithm not in HASH_ALGORITHMS:
        raise InvalidArgumentError(
            f"unknown hash algorithm {algorithm!r}: choose one of {', '.join(HASH_ALGORITHMS)}"
        )
    return algorithm


def _resolve_seed(seed: str | None) -> str:
    if seed is None:
        return default_seed()
    if not isinstance(seed, str):
        raise InvalidArgumentError(f"the hash seed must be a str or None, got {type(seed).__name__}")
    return seed


def _pickle_dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_dumps(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


_SERIALIZERS: dict[str, Callable[[Any], bytes]] = {"sha256": _pickle_dumps, "sha256_cbor": _cbor_dumps}


def none_hash(seed: str | None = None, algorithm: HashAlgorithm = DEFAULT_ALGORITHM) -> BlockHash:
    """vLLM's ``NONE_HASH`` for ``seed`` (``None``: ``default_seed()``): the parent hash of the
    first block."""
    return _none_hash(_resolve_seed(seed), check_algorithm(algorithm))


@functools.lru_cache(maxsize=64)
def _none_hash(seed: str, algorithm: HashAlgorithm) -> BlockHash:
    return BlockHash(hashlib.sha256(_SERIALIZERS[algorithm](seed)).digest())


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Any,
    extra_keys: tuple[Any, ...] | None,
    seed: str | None = None,
    algorithm: HashAlgorithm = DEFAULT_ALGORITHM,
) -> BlockHash:
    """The hash of one block whose parent is ``parent`` (``None`` for the first block), as
    vLLM's ``hash_block_tokens``; ``extra_keys`` goes into the hash as given."""
    obj = (
        bytes(parent or none_hash(seed, algorithm)),
        tuple(_as_token_array(token_ids).tolist()),
        extra_keys,
    )
    return BlockHash(hashlib.sha256(_SERIALIZERS[algorithm](obj)).digest())


def _as_token_array(token_ids: Any) -> npt.NDArray[np.int64]:
    """Token ids (sequence of ints, numpy array, torch tensor) as a checked 1-D int64 array."""
    if hasattr(token_ids, "detach"):  # a torch tensor, possibly on a GPU
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex:
            raise InvalidArgumentError(f"token ids must be integers, got {token_ids.dtype}")
        token_ids = token_ids.detach().cpu().numpy()
    elif not isinstance(token_ids, np.ndarray) and hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    else:
        try:  # ~4x faster than np.asarray on a list, and it refuses floats instead of truncating
            arr = np.frombuffer(array.array("Q", token_ids), dtype=np.uint64)
        except (TypeError, OverflowError) as exc:  # exc names the problem: a float, a negative...
            raise InvalidArgumentError(f"token ids must be integers in [0, 2**63): {exc}") from exc
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"token ids must be 1-D integers, got {arr.dtype} {arr.shape}")
    if arr.size:
        lo, hi = (0 if arr.dtype.kind == "u" else int(arr.min())), int(arr.max())
        if lo < 0 or hi >= _TOKEN_LIMIT:
            raise InvalidArgumentError(f"token id {lo if lo < 0 else hi} is outside [0, 2**63)")
    return arr.view(np.int64) if arr.dtype == np.uint64 else arr.astype(np.int64, copy=False)


def _array_header(n: int) -> bytes:
    """The CBOR header of an array of ``n`` items (major type 4)."""
    if n < 24:
        return bytes([0x80 + n])
    size = next(size for size in (1, 2, 4, 8) if n < 1 << (8 * size))
    return bytes([0x97 + size.bit_length()]) + n.to_bytes(size, "big")  # 0x98, 0x99, 0x9a, 0x9b


def _block_bodies(tokens: npt.NDArray[np.int64], block_size: int, tails: _Tails) -> tuple[bytes, list[int]]:
    """What each block hashes after its parent (array header, token ids, extra keys) as canonical
    CBOR, all blocks concatenated, and the offsets where each starts (plus the end).

    No Python loop per token: a matrix with a row of machine words per block holds the array
    header, a big-endian word per token (the CBOR header byte, then the value) and the extra
    keys; a mask of the bytes that count then yields every body in one compress. Word ops beat
    byte scatters severalfold; writing straight into the matrix avoids page faults on fresh
    1 MiB temporaries, which were a large share of the time."""
    num_blocks, vmax = len(tokens) // block_size, int(tokens.max())
    cls = np.zeros(len(tokens), dtype=np.uint8)  # 0: the value is the header; 1..4: it follows
    width = np.zeros(len(tokens), dtype=np.uint8)  # value bytes after the header: 0, 1, 2, 4, 8
    for limit, step in ((23, 1), (255, 1), (65535, 2), (2**32 - 1, 4)):
        if vmax <= limit:
            break
        over = (tokens > limit).view(np.uint8)
        cls += over
        width += over * np.uint8(step)
    # A 4-byte word fits a header and 2 value bytes, an 8-byte one 4; 8-byte values (ids >= 2**32,
    # rare) take two words, the first holding only their header.
    word = np.dtype(np.uint32 if vmax <= 65535 else np.uint64)
    per_token = 2 if vmax >= 2**32 else 1
    head = _array_header(block_size)
    h = -(-len(head) // word.itemsize)  # words before the tokens
    t = h + block_size * per_token  # words before the extra keys
    row = t + -(-max(len(code) for code, _ in tails) // word.itemsize)
    body, mask = np.empty((num_blocks, row), dtype=word), np.zeros((num_blocks, row), dtype=word)
    shape = (num_blocks, block_size)
    value, value_mask = body[:, h + per_token - 1 : t : per_token], mask[:, h + per_token - 1 : t : per_token]
    header = np.where((cls > 0) & (width < 8), cls + np.uint8(0x17), np.uint8(0)).reshape(shape)
    np.left_shift(header, (width * np.uint8(8)).reshape(shape), out=value, dtype=word)
    np.bitwise_or(value, tokens.view(np.uint64).reshape(shape), out=value, casting="unsafe")
    # The mask word: a 1 in each of the low width + 1 bytes (in all 8 for an 8-byte value).
    pad = np.uint8(8 * word.itemsize - 8) - np.minimum(width, np.uint8(7)) * np.uint8(8)
    ones = word.type(0x0101010101010101 >> (64 - 8 * word.itemsize))
    np.right_shift(ones, pad.reshape(shape), out=value_mask, dtype=word)
    if per_token == 2:
        big = (width == 8).reshape(shape)
        body[:, h:t:2], mask[:, h:t:2] = big * word.type(0x1B), big
    if sys.byteorder == "little":  # CBOR is big-endian
        body[:, h:t].byteswap(inplace=True)
        mask[:, h:t].byteswap(inplace=True)
    body8, mask8 = body.view(np.uint8), mask.view(np.uint8)
    a, b = h * word.itemsize, t * word.itemsize
    body8[:, a - len(head) : a], mask8[:, a - len(head) : a] = np.frombuffer(head, np.uint8), 1
    lengths = width.reshape(shape).sum(axis=1, dtype=np.int64) + (len(head) + block_size)
    for code, blocks in tails:
        body8[blocks, b : b + len(code)] = np.frombuffer(code, dtype=np.uint8)
        mask8[blocks, b : b + len(code)] = 1
        lengths[blocks] += len(code)
    data = np.compress(mask8.ravel().view(np.bool_), body8.ravel()).tobytes()
    return data, [0, *np.cumsum(lengths).tolist()]


def _gen_mm_extra_hash_keys(
    mm_items: tuple[MultiModalItem, ...],
    start_token_idx: int,
    end_token_idx: int,
    start_mm_idx: int,
) -> tuple[list[tuple[str, str, int]], int]:
    """vLLM 0.32's ``_gen_mm_extra_hash_keys``, kept line for line so the two cannot drift apart."""
    extra_keys: list[tuple[str, str, int]] = []
    if not mm_items:
        return extra_keys, start_mm_idx
    last = mm_items[-1]
    if last.offset + last.length <= start_token_idx:
        return extra_keys, start_mm_idx
    curr = start_mm_idx
    while curr < len(mm_items):
        item = mm_items[curr]
        if end_token_idx > item.offset:
            if start_token_idx >= item.offset + item.length:
                curr += 1
                continue
            extra_keys.append(("mm", item.identifier, item.offset - start_token_idx))
            if end_token_idx >= item.offset + item.length:
                curr += 1
            else:
                break
        else:
            break
    return extra_keys, curr


def _walk_extra_keys(extra: ExtraKeys, num_blocks: int, block_size: int) -> tuple[list[_Keys], _Keys]:
    """The extra keys of each block, as vLLM's ``generate_block_hash_extra_keys`` gives them:
    those of the first blocks one by one, and those every later block carries (the LoRA key or
    ``None``). Both algorithms hash these; only the blocks up to the last multimodal item's end
    and block 0 (the salt) need the walk, so the rest costs no Python work per block."""
    lora: list[tuple[Any, ...]] = []
    if extra.lora_name is not None:
        lora = [("lora", extra.lora_name, extra.lora_path)]
    salt = [("cache_salt", extra.cache_salt)] if extra.cache_salt else []
    items = extra.mm_items
    # Blocks that start at or past the last item's end get no mm keys (vLLM's first check).
    last_end = items[-1].offset + items[-1].length if items else 0
    walked = min(num_blocks, max(1, -(-last_end // block_size)))
    keys: list[_Keys] = []
    mm_idx = 0
    for i in range(walked):
        start = i * block_size
        mm_keys, mm_idx = _gen_mm_extra_hash_keys(items, start, start + block_size, mm_idx)
        block_keys = lora + mm_keys + (salt if i == 0 else [])
        keys.append(tuple(block_keys) if block_keys else None)
    return keys, (tuple(lora) if lora else None)


def _extra_key_tails(extra: ExtraKeys, num_blocks: int, block_size: int) -> _Tails:
    """Each distinct CBOR encoding of a block's extra keys and the blocks that carry it."""
    walked, rest = _walk_extra_keys(extra, num_blocks, block_size)
    blocks: dict[_Keys, list[int]] = {}
    for i, keys in enumerate(walked):
        blocks.setdefault(keys, []).append(i)
    tails: _Tails = [(_encode_keys(keys), idx) for keys, idx in blocks.items()]
    if len(walked) < num_blocks:  # the rest, as a slice: no Python work per block
        tails.append((_encode_keys(rest), slice(len(walked), None)))
    return tails


def _encode_keys(keys: _Keys) -> bytes:
    return cbor2.dumps(keys, canonical=True) if keys else _CBOR_NULL


def block_hashes(
    token_ids: Any,
    block_size: int = 16,
    seed: str | None = None,
    extra_keys: ExtraKeys | None = None,
    algorithm: HashAlgorithm = DEFAULT_ALGORITHM,
) -> list[BlockHash]:
    """The chained hash of every full block of ``token_ids``, exactly as vLLM v1 computes it.

    ``token_ids`` is a sequence of ints, a numpy array or a 1-D torch tensor, each id in
    ``[0, 2**63)``. ``seed=None`` is vLLM's rule (``default_seed()``); ``algorithm`` is vLLM's
    ``--prefix-caching-hash-algo``: ``"sha256"`` (its default) or ``"sha256_cbor"``. The hashes
    of a prefix are a prefix of the hashes of the whole sequence.
    """
    algorithm = check_algorithm(algorithm)
    if isinstance(block_size, bool) or not isinstance(block_size, int | np.integer) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be an integer >= 1, got {block_size!r}")
    block_size = int(block_size)
    if extra_keys is not None and not isinstance(extra_keys, ExtraKeys):
        raise InvalidArgumentError(f"extra_keys must be ExtraKeys, got {type(extra_keys).__name__}")
    parent = bytes(none_hash(seed, algorithm))
    tokens = _as_token_array(token_ids)
    num_blocks = len(tokens) // block_size
    if num_blocks == 0:
        return []
    tokens = tokens[: num_blocks * block_size]
    if algorithm == "sha256":
        digests = _pickle_chain(tokens, block_size, parent, extra_keys)
    else:
        digests = _cbor_chain(tokens, block_size, parent, extra_keys)
    # Every digest is 32 bytes, so skip BlockHash's length check: map() builds the objects
    # without a Python-level call per block.
    return list(map(bytes.__new__, itertools.repeat(BlockHash), digests))


def _pickle_chain(
    tokens: npt.NDArray[np.int64], block_size: int, parent: bytes, extra_keys: ExtraKeys | None
) -> list[bytes]:
    """``"sha256"``: pickle each block's tuple as vLLM does. One ``tolist()`` of all tokens, and
    ``zip`` over one iterator cuts it into the blocks' tuples without Python work per token."""
    keys: Iterator[_Keys] = itertools.repeat(None)
    if extra_keys is not None:
        walked, rest = _walk_extra_keys(extra_keys, len(tokens) // block_size, block_size)
        keys = itertools.chain(walked, itertools.repeat(rest))
    dumps, sha256, protocol = pickle.dumps, hashlib.sha256, pickle.HIGHEST_PROTOCOL
    digests = []
    blocks = zip(*[iter(tokens.tolist())] * block_size, strict=False)
    for block, block_keys in zip(blocks, keys, strict=False):  # keys never ends
        parent = sha256(dumps((parent, block, block_keys), protocol)).digest()
        digests.append(parent)
    return digests


def _cbor_chain(
    tokens: npt.NDArray[np.int64], block_size: int, parent: bytes, extra_keys: ExtraKeys | None
) -> list[bytes]:
    """``"sha256_cbor"``: encode all blocks at once (``_block_bodies``); the Python loop only
    chains the hashes (the part that cannot be vectorised) and does as little else per block as
    it can."""
    tails: _Tails = [(_CBOR_NULL, slice(None))]
    if extra_keys is not None:
        tails = _extra_key_tails(extra_keys, len(tokens) // block_size, block_size)
    data, bounds = _block_bodies(tokens, block_size, tails)
    # Copying a context that has already absorbed the constant prefix is cheaper than a new one.
    fresh = hashlib.sha256(_TRIPLE_WITH_HASH).copy
    digests = []
    for start, end in itertools.pairwise(bounds):
        h = fresh()
        h.update(parent + data[start:end])
        parent = h.digest()
        digests.append(parent)
    return digests
