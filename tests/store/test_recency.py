"""What a read refreshes and in what order a chain leaves: every read path touches the blocks it
serves (tail first), and a chain saved in several puts is evicted tail first, never head first
(docs/design/eviction.md#chains)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.support.tiny_blocks import StoreFactory, blocks, keys, same_bytes
from tierkv import Namespace, TieredStore
from tierkv.config import Tier
from tierkv.hashing import block_hashes
from tierkv.types import PutDetail

HOST_BLOCKS = 16


def _read_by_get(store: TieredStore, namespace: Namespace, hashes: list[bytes]) -> None:
    store.get(namespace, hashes)


def _read_by_get_into(store: TieredStore, namespace: Namespace, hashes: list[bytes]) -> None:
    out = torch.empty((len(hashes), *namespace.layout.block_shape),
                      dtype=namespace.layout.torch_dtype)
    assert store.get_into(namespace, hashes, out) == len(hashes)


def _read_by_lease(store: TieredStore, namespace: Namespace, hashes: list[bytes]) -> None:
    lease = store.sidecar.acquire(namespace, hashes, slab_id=store.sidecar.host_slab_id)
    assert len(lease.blocks) == len(hashes)
    store.sidecar.release(lease.lease_id)


READS: dict[str, Callable[[TieredStore, Namespace, list[bytes]], None]] = {
    "get": _read_by_get, "get_into": _read_by_get_into, "acquire": _read_by_lease,
}


def _store(make_store: StoreFactory, namespace: Namespace, **fields: object) -> TieredStore:
    store = make_store(**fields)
    store.register(namespace)
    return store


def _held(store: TieredStore, namespace: Namespace, hashes: list[bytes]) -> list[int]:
    return [i for i, h in enumerate(hashes) if store.lookup(namespace, [h])]


@pytest.mark.parametrize("read", sorted(READS))
def test_a_block_read_often_outlives_blocks_stored_after_it(
        make_store: StoreFactory, namespace: Namespace, read: str) -> None:
    store = _store(make_store, namespace, host_blocks=HOST_BLOCKS)
    hot = keys(4, salt="hot")
    store.put(namespace, hot, blocks(4, seed=1))
    for i in range(6):  # 24 blocks through a 16-block HOST, the hot prefix read each round
        READS[read](store, namespace, hot)
        store.put(namespace, keys(4, salt=f"cold-{i}"), blocks(4, seed=10 + i))
    assert store.lookup(namespace, hot) == 4
    # The oldest cold chains went instead, each tail first.
    assert _held(store, namespace, keys(4, salt="cold-0")) == []


def test_a_resumed_session_is_refreshed(make_store: StoreFactory, namespace: Namespace) -> None:
    store = _store(make_store, namespace, host_blocks=HOST_BLOCKS)
    size = namespace.layout.block_size
    tokens = list(range(4 * size))
    history = [bytes(h) for h in block_hashes(tokens, size)]
    store.put(namespace, history, blocks(4, seed=1))
    store.save_session(namespace, "chat", tokens)
    for i in range(6):
        assert store.resume_session("chat").num_cached_tokens == 4 * size
        store.put(namespace, keys(4, salt=f"other-{i}"), blocks(4, seed=10 + i))
    assert store.lookup(namespace, history) == 4


@pytest.mark.parametrize("how", ["parent_hash", "parent_hashes"])
def test_a_chain_saved_in_several_puts_keeps_its_head(
        make_store: StoreFactory, namespace: Namespace, how: str) -> None:
    """The issue's case, scaled: a 16-block chain put in 4 puts of 4 into a 32-block HOST, then
    other chains fill three quarters of it. The chain's head stays reachable, and what is left
    of it is one prefix (nothing stranded behind a missing head)."""
    store = _store(make_store, namespace, host_blocks=2 * HOST_BLOCKS)
    chain = keys(16, salt="long")
    for start in range(0, 16, 4):
        parent = chain[start - 1] if start else None
        detail = (PutDetail(parent_hash=parent) if how == "parent_hash" else
                  PutDetail(parent_hashes=(parent, *chain[start : start + 3])))
        store.put(namespace, chain[start : start + 4], blocks(4, seed=start), detail=detail)
    for i in range(6):
        store.put(namespace, keys(4, salt=f"other-{i}"), blocks(4, seed=100 + i))
    held = _held(store, namespace, chain)
    assert held == list(range(len(held))) and len(held) == 8  # the head half, the tail gone
    assert store.lookup(namespace, chain) == 8


def test_without_parents_a_later_put_of_a_chain_is_newer(
        make_store: StoreFactory, namespace: Namespace) -> None:
    """What a writer that names no parent gets (the old order): each put most recently used,
    so the chain's head goes first. The connector always names parents."""
    store = _store(make_store, namespace, host_blocks=2 * HOST_BLOCKS)
    chain = keys(16, salt="long")
    for start in range(0, 16, 4):
        store.put(namespace, chain[start : start + 4], blocks(4, seed=start))
    for i in range(6):
        store.put(namespace, keys(4, salt=f"other-{i}"), blocks(4, seed=100 + i))
    assert store.lookup(namespace, chain) == 0
    assert _held(store, namespace, chain) == list(range(8, 16))


def test_a_chain_saved_in_several_puts_leaves_disk_tail_first(
        make_store: StoreFactory, namespace: Namespace) -> None:
    """The same order holds in DISK, where write-through records of each put are linked."""
    store = _store(make_store, namespace, host_blocks=4, disk_blocks=2 * HOST_BLOCKS,
                   write_policy="write_through")
    chain = keys(16, salt="long")
    for start in range(0, 16, 4):
        store.put(namespace, chain[start : start + 4], blocks(4, seed=start),
                  detail=PutDetail(parent_hash=chain[start - 1] if start else None))
    for i in range(6):
        store.put(namespace, keys(4, salt=f"other-{i}"), blocks(4, seed=100 + i))
    held = _held(store, namespace, chain)
    assert held == list(range(len(held))) and len(held) >= 8


@pytest.mark.parametrize("read", sorted(READS))
def test_a_chain_demoted_in_several_batches_leaves_disk_tail_first(
        make_store: StoreFactory, namespace: Namespace, read: str) -> None:
    """The replay's pattern with DISK below a small HOST: a prompt's head is demoted, read back
    (a hit), and its continuation stored and demoted later. On DISK the continuation must sit
    behind the head it continues, not ahead of it: what is held of the chain stays one
    prefix however far DISK's own eviction goes."""
    store = _store(make_store, namespace, host_blocks=HOST_BLOCKS, disk_blocks=3 * HOST_BLOCKS)
    chain = keys(16, salt="long")
    for start in range(0, 16, 4):
        if start:
            READS[read](store, namespace, chain[:start])
        store.put(namespace, chain[start : start + 4], blocks(4, seed=start),
                  detail=PutDetail(parent_hash=chain[start - 1] if start else None))
        store.put(namespace, keys(16, salt=f"fill-{start}"), blocks(16, seed=50 + start))
    num_held = []
    for i in range(8):  # other traffic, until DISK has evicted all of the chain
        store.put(namespace, keys(8, salt=f"other-{i}"), blocks(8, seed=100 + i))
        held = _held(store, namespace, chain)
        assert held == list(range(len(held))), f"after {i + 1} puts: holds {held}"
        num_held.append(len(held))
    assert any(0 < n < 16 for n in num_held), num_held  # it went a part at a time


def test_a_block_demoted_after_its_child_still_leaves_disk_after_it(
        make_store: StoreFactory, namespace: Namespace) -> None:
    """A read of a shorter prefix leaves a chain's tail older than its middle, so the tail is
    demoted first; the middle, demoted later, sits behind its (older) head on DISK, ahead of
    the tail it leads to, and must still leave DISK after that tail."""
    store = _store(make_store, namespace, host_blocks=8, disk_blocks=24)
    chain = keys(12, salt="long")
    store.put(namespace, chain[:4], blocks(4, seed=1))
    store.put(namespace, keys(8, salt="fill-a"), blocks(8, seed=2))  # the head goes to DISK
    store.get(namespace, chain[:4])  # a hit from DISK
    store.put(namespace, chain[4:12], blocks(8, seed=3), detail=PutDetail(parent_hash=chain[3]))
    store.get(namespace, chain[:8])  # a shorter prefix: the tail is now the oldest
    num_held = []
    for i in range(8):
        store.put(namespace, keys(4, salt=f"other-{i}"), blocks(4, seed=100 + i))
        held = _held(store, namespace, chain)
        assert held == list(range(len(held))), f"after {i + 1} puts: holds {held}"
        num_held.append(len(held))
    assert any(0 < n < 12 for n in num_held), num_held


def test_parents_a_writer_made_into_a_cycle_still_demote_and_read(
        make_store: StoreFactory, namespace: Namespace) -> None:
    """Parents are the writer's word: two blocks naming each other still demote and read."""
    store = _store(make_store, namespace, host_blocks=4, disk_blocks=16)
    first, second = keys(2, salt="cycle")
    store.put(namespace, [first], blocks(1, seed=1), detail=PutDetail(parent_hash=second))
    store.put(namespace, [second], blocks(1, seed=2), detail=PutDetail(parent_hash=first))
    store.get(namespace, [second])  # the first is older: demoted first
    store.put(namespace, keys(4, salt="fill"), blocks(4, seed=3))
    assert same_bytes(store.get(namespace, [first, second])[0], blocks(1, seed=1)[0])
    assert store.lookup(namespace, [second]) == 1


# Orders of arrival a review found that placement alone got wrong: a block's last copy now
# passes over while its children are held (docs/design/eviction.md#chains).


def _assert_prefix_while_evicting(store: TieredStore, namespace: Namespace, chain: list[bytes],
                                  num_puts: int, tier: Tier | None = None) -> None:
    history = []
    for i in range(num_puts):
        store.put(namespace, keys(2, salt=f"evict-{i}"), blocks(2, seed=200 + i), tier=tier)
        history.append(_held(store, namespace, chain))
    assert all(held == list(range(len(held))) for held in history), history


def test_a_continuation_demoted_before_the_block_it_continues(
        make_store: StoreFactory, namespace: Namespace) -> None:
    """chain[5:8] reaches DISK while chain[4] is in HOST only: the head already on DISK is not
    refreshed, and DISK makes room for chain[4] by evicting that head."""
    store = _store(make_store, namespace, host_blocks=8, disk_blocks=12, promote_on_read=False)
    chain = keys(8, salt="long")
    store.put(namespace, chain[:4], blocks(4, seed=1))
    store.put(namespace, keys(8, salt="fill-a"), blocks(8, seed=2))  # the head goes to DISK
    store.get(namespace, chain[:4])
    store.put(namespace, chain[4:8], blocks(4, seed=3), detail=PutDetail(parent_hash=chain[3]))
    store.get(namespace, chain[:5])  # chain[5:8] is now older than chain[4]
    store.put(namespace, keys(4, salt="fill-b"), blocks(4, seed=4))
    store.put(namespace, keys(3, salt="fill-c"), blocks(3, seed=5))  # chain[5:8] goes to DISK
    _assert_prefix_while_evicting(store, namespace, chain, 4)


def test_a_parent_demoted_from_gpu_after_its_children(
        make_store: StoreFactory, namespace: Namespace) -> None:
    """The "after its children" rule is DISK's only: on HOST (no DISK below) a parent demoted
    from GPU after its children goes behind its own older parent, and is dropped first."""
    store = _store(make_store, namespace, gpu_blocks=4, host_blocks=8, promote_on_read=False)
    chain = keys(4, salt="chain")
    store.put(namespace, chain[:1], blocks(1, seed=1), tier=Tier.GPU)
    store.put(namespace, keys(4, salt="f"), blocks(4, seed=2), tier=Tier.GPU)  # g to HOST
    store.put(namespace, chain[1:], blocks(3, seed=3), tier=Tier.GPU,
              detail=PutDetail(parent_hash=chain[0]))
    store.get(namespace, chain[:2])  # the children are now older than their parent on GPU
    store.put(namespace, keys(3, salt="n1"), blocks(3, seed=4), tier=Tier.GPU)  # they go
    store.put(namespace, keys(1, salt="n2"), blocks(1, seed=5), tier=Tier.GPU)  # the parent
    _assert_prefix_while_evicting(store, namespace, chain, 8, tier=Tier.HOST)


def test_a_parent_deleted_and_stored_again_while_its_child_is_on_disk(
        make_store: StoreFactory, namespace: Namespace) -> None:
    """A parent stored again finds its children's count, kept by its hash while it was gone."""
    store = _store(make_store, namespace, host_blocks=4, disk_blocks=10, promote_on_read=False)
    chain = keys(3, salt="chain")
    store.put(namespace, chain[:1], blocks(1, seed=1))
    store.put(namespace, keys(4, salt="f0"), blocks(4, seed=2))  # g goes to DISK
    store.put(namespace, chain[1:], blocks(2, seed=3), detail=PutDetail(parent_hash=chain[0]))
    store.get(namespace, chain[:2])  # c is now older than p
    store.put(namespace, keys(1, salt="f1"), blocks(1, seed=4))  # c goes to DISK
    store.put(namespace, keys(2, salt="f1b"), blocks(2, seed=4))
    assert store.delete(namespace, chain[1:2]) == 1
    store.put(namespace, chain[1:2], blocks(2, seed=3)[:1], detail=PutDetail(parent_hash=chain[0]))
    store.put(namespace, keys(4, salt="f2"), blocks(4, seed=5))  # p goes to DISK
    _assert_prefix_while_evicting(store, namespace, chain, 6)


def test_a_block_whose_children_are_held_still_goes_when_nothing_else_can(
        make_store: StoreFactory, namespace: Namespace) -> None:
    """The rule yields to room: with the chain's leaf pinned, every other block of HOST leads
    on to it, and a put still gets its room (the chain's tail end first)."""
    store = _store(make_store, namespace, host_blocks=4)
    chain = keys(4, salt="pinned-leaf")
    store.put(namespace, chain, blocks(4, seed=1))
    assert store.pin(namespace, chain[3:]) == 1
    assert store.put(namespace, keys(2, salt="new"), blocks(2, seed=2)) == 2
    assert _held(store, namespace, chain) == [0, 3]
