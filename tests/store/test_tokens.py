"""A block's tokens (``tierkv.store.tokens``): packed, published and kept across a restart, and a
bad record beside a block reads as no tokens, never as other tokens (the block still reads)."""
from __future__ import annotations

from pathlib import Path

import lmdb
import pytest
import torch

from tests.support.harness import store_config
from tests.support.tiny_blocks import TINY_LAYOUT, blocks, keys
from tierkv import Namespace, PutDetail, Tier
from tierkv.errors import InvalidArgumentError
from tierkv.store import SNAPSHOT, EventLog, Snapshot, TieredStore
from tierkv.store.tokens import decode, encode, extra_key, lora_name, pack_put, token_ids

NAMESPACE = Namespace("model-a", TINY_LAYOUT)
BS = TINY_LAYOUT.block_size


def test_a_put_packs_each_blocks_tokens_with_its_lora_and_extra_key() -> None:
    detail = PutDetail(tuple(range(100, 112)), lora_name=None,
                       extra_keys=(None, ("salt", 7), None))
    packed = pack_put(detail, 3, BS)
    assert [token_ids(p) for p in packed if p is not None] == [
        [100, 101, 102, 103], [104, 105, 106, 107], [108, 109, 110, 111]]
    assert isinstance(packed[0], bytes) and len(packed[0]) == 4 * BS  # 4 B a token, alone
    assert packed[1] is not None and extra_key(packed[1]) == ("salt", 7)
    lora = pack_put(PutDetail((2**32 - 1,) * BS, lora_name="adapter"), 1, BS)[0]
    assert lora is not None and lora_name(lora) == "adapter" and token_ids(lora) == [2**32 - 1] * 4
    assert pack_put(PutDetail(), 2, BS) == [None, None]
    assert pack_put(None, 1, BS) == [None]


def test_token_ids_out_of_uint32_are_refused() -> None:
    for bad in ((-1, 0, 0, 0), (2**32, 0, 0, 0)):
        with pytest.raises(InvalidArgumentError, match="token id"):
            PutDetail(bad).check(1, BS)


@pytest.mark.parametrize("tokens", [None, b"\x01\x00\x00\x00" * BS,
                                    (b"\x02\x00\x00\x00" * BS, "adapter", ("mm", 3))])
def test_the_disk_form_round_trips_and_a_truncated_or_foreign_one_reads_as_none(tokens: object) -> None:
    parent = bytes(range(32))
    data = encode(parent, tokens)  # type: ignore[arg-type]
    assert decode(data, BS) == (parent, tokens)
    assert decode(encode(None, tokens), BS) == (None, tokens)  # type: ignore[arg-type]
    if tokens is not None:
        assert decode(data, BS + 1) is None  # a block of another size
    for cut in range(len(data)):  # truncated anywhere: none (a flipped byte is the seal's)
        assert decode(data[:cut], BS) is None, cut
    for foreign in (b"", b"\xc1", b"\x90", b"\x91\x01", b"\x92\xc4\x20" + bytes(32) + b"\x01"):
        assert decode(foreign, BS) is None


def _restated(store: TieredStore, log: EventLog) -> Snapshot:
    store.sidecar.restate_events()
    records, _ = log.take()
    [snapshot] = [value for kind, _, _, value, _ in records if kind == SNAPSHOT]
    assert isinstance(snapshot, Snapshot)
    return snapshot


def test_tokens_and_parents_survive_a_restart_and_a_bad_record_loses_only_its_own(
        tmp_path: Path) -> None:
    config = store_config(tmp_path, host_blocks=4, disk_blocks=64)
    chain = keys(6, start=300)
    tokens = tuple(range(7000, 7000 + 6 * BS))
    data = blocks(6, seed=3)
    with TieredStore(config, events=EventLog()) as store:  # a publisher that wants tokens
        store.register(NAMESPACE)
        store.put(NAMESPACE, chain, data, tier=Tier.DISK,
                  detail=PutDetail(tokens, keys(1, start=299)[0]))
    log = EventLog()
    with TieredStore(config, events=log) as store:
        store.register(NAMESPACE)
        entries = {entry.block_hash: entry for entry in _restated(store, log).by_tier[Tier.DISK]}
        for number, block_hash in enumerate(chain):
            entry = entries[block_hash]
            assert entry.tokens is not None
            assert token_ids(entry.tokens) == list(tokens[number * BS:(number + 1) * BS])
            assert entry.parent == (keys(1, start=299)[0] if number == 0 else chain[number - 1])
    # Flip one byte of the third block's record beside it: that block recovers without tokens
    # or parent (its own bytes still read), every other one with its own.
    env = lmdb.open(str(config.disk.path), max_dbs=5, map_size=1 << 30)  # type: ignore[union-attr]
    with env.begin(write=True, db=env.open_db(b"tokens")) as txn:
        raw_key = NAMESPACE.id + chain[2]
        value = bytearray(txn.get(raw_key))
        value[-1] ^= 0x01
        txn.put(raw_key, bytes(value))
    env.close()
    log = EventLog()
    with TieredStore(config, events=log) as store:
        store.register(NAMESPACE)
        entries = {entry.block_hash: entry for entry in _restated(store, log).by_tier[Tier.DISK]}
        assert entries[chain[2]].tokens is None and entries[chain[2]].parent is None
        assert all(entries[h].tokens is not None for h in chain if h != chain[2])
        out = torch.zeros_like(data)
        assert store.get_into(NAMESPACE, chain, out) == 6
        assert torch.equal(out.view(torch.uint8), data.view(torch.uint8))  # every bit


@pytest.mark.parametrize("events", [None, EventLog(keep_tokens=False)])
def test_a_store_whose_events_publish_no_tokens_keeps_none(tmp_path: Path,
                                                           events: EventLog | None) -> None:
    """Token ids are prompt content: kept only for events that publish them (parents are
    kept: the eviction order needs them after a restart too)."""
    config = store_config(tmp_path, host_blocks=4, disk_blocks=64)
    chain = keys(3, start=500)
    with TieredStore(config, events=events) as store:
        store.register(NAMESPACE)
        store.put(NAMESPACE, chain, blocks(3), tier=Tier.DISK,
                  detail=PutDetail(tuple(range(3 * BS)), None))
    log = EventLog()
    with TieredStore(config, events=log) as store:
        store.register(NAMESPACE)
        entries = {entry.block_hash: entry for entry in _restated(store, log).by_tier[Tier.DISK]}
        assert all(entries[h].tokens is None for h in chain)
        assert [entries[h].parent for h in chain] == [None, chain[0], chain[1]]
