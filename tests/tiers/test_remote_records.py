"""REMOTE tier integrity, in process: a ``TieredStore`` A writes records to Redis (a real cluster,
and one plain server), a second store B with its own disk reads them.

Every damaged record (a flipped bit at each offset of the prefix and header, payload samples,
truncations, an extra byte, another block's or another namespace's record under the key, a record
of another format version) is a counted miss for B at exactly that block, never other bytes, and
never lands in B's HOST: once the value is fixed in Redis, B reads the right bytes. Keys carry the
tenant (no store reading as another tenant sees them), and ``ttl_s`` expires them.
"""

from __future__ import annotations

import random
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from tests.support.redis_cluster import RedisCluster, RedisServer
from tests.support.tiny_blocks import (
    BLOCK_BYTES,
    RECORD_BYTES,
    TINY_LAYOUT,
    StoreFactory,
    blocks,
    keys,
    same_bytes,
)
from tierkv import KVLayout, Namespace, TieredStore
from tierkv.config import RemoteTierConfig, Tier, WritePolicy
from tierkv.tiers.remote_keys import remote_key

# Same bytes a block as TINY_LAYOUT, another shape: another fingerprint, so another namespace id.
OTHER_LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=4, block_size=4)
PREFIX_BYTES = 8  # b"TKV1" | u32 header length
HEADER_END = RECORD_BYTES - BLOCK_BYTES  # prefix + msgpack header: every byte of it matters
# Generous: a 2-core machine shared with other work must not make a healthy Redis a miss.
TIMEOUT_S = 5.0


@dataclass
class Backend:
    kind: str
    url: str
    client: Any  # redis.RedisCluster or redis.Redis: get/set/ttl/exists on any key

    def remote_config(self, **options: object) -> RemoteTierConfig:
        return RemoteTierConfig.from_url(self.url, timeout_s=TIMEOUT_S, **options)


@pytest.fixture(scope="module", params=["cluster", "single"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """A 3-master Redis Cluster, or one non-cluster redis-server. Its directory is outside pytest's
    basetemp: another pytest run on this machine may prune old basetemps while this one runs."""
    work_dir = Path(tempfile.mkdtemp(prefix="tierkv-remote-records-"))
    server: RedisCluster | RedisServer = (
        RedisCluster(work_dir) if request.param == "cluster" else RedisServer(work_dir))
    try:
        server.start()
        client = server.client()
        try:
            yield Backend(request.param, server.url, client)
        finally:
            client.close()
    finally:
        server.stop()
        shutil.rmtree(work_dir, ignore_errors=True)


def open_pair(make_store: StoreFactory, tmp_path: Path, backend: Backend, num_blocks: int,
              **remote_options: object) -> tuple[TieredStore, TieredStore]:
    """Writer A and reader B, each with its own disk, on the same Redis."""
    writer = make_store(host_blocks=128, disk_blocks=num_blocks + 64, disk_path=tmp_path / "a",
                        remote=backend.remote_config(**remote_options))
    reader = make_store(host_blocks=num_blocks + 64, disk_blocks=64, disk_path=tmp_path / "b",
                        remote=backend.remote_config(**remote_options))
    for store in (writer, reader):  # it connects in the background; until then all is a miss
        deadline = time.monotonic() + 10
        while not (stats := store.stats().remote) or not stats.connected:
            assert time.monotonic() < deadline, "the store did not connect to Redis"
            time.sleep(0.05)
    return writer, reader


def write_through(store: TieredStore, namespace: Namespace, hashes: list[bytes],
                  data: torch.Tensor) -> None:
    """Put ``data`` write-through in batches, then wait until REMOTE holds every record."""
    store.register(namespace)
    for start in range(0, len(hashes), 64):
        store.put(namespace, hashes[start : start + 64], data[start : start + 64],
                  write_policy=WritePolicy.WRITE_THROUGH)
    assert store.flush_remote(30.0)


def rkey(namespace: Namespace, block_hash: bytes) -> bytes:
    return remote_key(namespace.id + block_hash)


def flip(value: bytes, offset: int, bit: int) -> bytes:
    damaged = bytearray(value)
    damaged[offset] ^= 1 << bit
    return bytes(damaged)


def with_version(record: bytes, version: int) -> bytes:
    """``record`` with its header rebuilt by hand (msgpack), the format version set to
    ``version``; every other field, the checksum included, is kept."""
    magic, header_len = struct.unpack_from("<4sI", record, 0)
    header = msgpack.unpackb(record[PREFIX_BYTES : PREFIX_BYTES + header_len])
    header["v"] = version
    packed = msgpack.packb(header)
    return struct.pack("<4sI", magic, len(packed)) + packed + record[PREFIX_BYTES + header_len :]


@dataclass
class Sources:
    """What a case can be built from: the good record and foreign ones."""

    good: bytes
    other_block: bytes  # another block of the same namespace
    other_tenant: bytes  # the same hash under another tenant
    other_layout: bytes  # the same hash under another layout


Mutation = Callable[[Sources], bytes]


def damage_cases() -> list[tuple[str, Mutation]]:
    cases: list[tuple[str, Mutation]] = []
    for offset in range(HEADER_END):  # every byte of the prefix and the header, two bits each
        for bit in sorted({offset % 8, (offset + 4) % 8}):
            cases.append((f"flip byte {offset} bit {bit}",
                          lambda s, o=offset, b=bit: flip(s.good, o, b)))
    rng = random.Random(1234)
    payload = [0, 1, BLOCK_BYTES // 2, BLOCK_BYTES - 1, *rng.sample(range(2, BLOCK_BYTES - 1), 6)]
    for offset in payload:
        cases.append((f"flip payload byte {offset}",
                      lambda s, o=HEADER_END + offset: flip(s.good, o, o % 8)))
    for length in (0, 1, 4, PREFIX_BYTES, HEADER_END, HEADER_END + 1, RECORD_BYTES - 1):
        cases.append((f"truncated to {length}", lambda s, n=length: s.good[:n]))
    cases += [
        ("extended by one byte", lambda s: s.good + b"\x00"),
        ("another block's record", lambda s: s.other_block),
        ("the same hash under another tenant", lambda s: s.other_tenant),
        ("the same hash under another layout", lambda s: s.other_layout),
        ("format version 2", lambda s: with_version(s.good, 2)),
        ("format version 0", lambda s: with_version(s.good, 0)),
    ]
    return cases


def test_the_record_layout_is_what_the_cases_assume(backend: Backend, make_store: StoreFactory,
                                                    tmp_path: Path) -> None:
    """A record in Redis is prefix | header | payload with the sizes used above, and a header
    rebuilt by hand with version 1 still reads: the version case is a miss for its version."""
    salt = f"layout-{backend.kind}"
    namespace = Namespace("records-model", TINY_LAYOUT, tenant="layout")
    hashes, data = keys(3, salt=salt), blocks(3, seed=11)
    writer, reader = open_pair(make_store, tmp_path, backend, 3)
    write_through(writer, namespace, hashes, data)
    record = backend.client.get(rkey(namespace, hashes[1]))
    assert len(record) == RECORD_BYTES
    assert record[:4] == b"TKV1"
    assert struct.unpack_from("<I", record, 4)[0] == HEADER_END - PREFIX_BYTES
    assert record[HEADER_END:] == data[1].contiguous().view(torch.uint8).flatten().numpy().tobytes()
    rebuilt = with_version(record, 1)
    assert rebuilt == record  # msgpack repacks the header byte for byte
    backend.client.set(rkey(namespace, hashes[1]), rebuilt)
    reader.register(namespace)
    got = reader.get(namespace, hashes)
    assert len(got) == 3 and same_bytes(got, data)


def test_a_damaged_record_is_a_counted_miss_and_never_reaches_host(
        backend: Backend, make_store: StoreFactory, tmp_path: Path) -> None:
    salt = f"damage-{backend.kind}"
    cases = damage_cases()
    n = len(cases)
    namespace = Namespace("records-model", TINY_LAYOUT, tenant="t")
    other_tenant = Namespace("records-model", TINY_LAYOUT, tenant="u")
    other_layout = Namespace("records-model", OTHER_LAYOUT, tenant="t")
    # Case i reads the chain [lead_i, target_i, tail_i]; target_i is damaged.
    hashes = keys(3 * n, salt=salt)
    data = blocks(3 * n, seed=21)
    targets = hashes[1::3]
    writer, reader = open_pair(make_store, tmp_path, backend, 5 * n)
    write_through(writer, namespace, hashes, data)
    write_through(writer, other_tenant, targets, blocks(n, seed=22))
    write_through(writer, other_layout, targets, blocks(n, seed=23, layout=OTHER_LAYOUT))
    client = backend.client

    damaged: list[tuple[str, bytes, bytes]] = []  # (label, redis key, good record)
    for i, (label, mutate) in enumerate(cases):
        key = rkey(namespace, targets[i])
        good = client.get(key)
        assert good is not None and len(good) == RECORD_BYTES, label
        sources = Sources(good, client.get(rkey(namespace, hashes[3 * i + 2])),
                          client.get(rkey(other_tenant, targets[i])),
                          client.get(rkey(other_layout, targets[i])))
        bad = mutate(sources)
        assert bad != good, label
        client.set(key, bad)
        damaged.append((label, key, good))

    reader.register(namespace)
    failures: list[str] = []
    for i, (label, _, _) in enumerate(damaged):
        chain = hashes[3 * i : 3 * i + 3]
        before = reader.stats().remote
        assert before is not None
        got = reader.get(namespace, chain)
        after = reader.stats().remote
        assert after is not None
        if len(got) != 1 or not same_bytes(got[0], data[3 * i]):
            failures.append(f"{label}: got {len(got)} blocks (want the 1 before the damaged one)")
        if (after.corrupt - before.corrupt, after.misses - before.misses) != (1, 1):
            failures.append(f"{label}: corrupt +{after.corrupt - before.corrupt}, misses "
                            f"+{after.misses - before.misses} (want +1, +1)")
        where = reader.sidecar.locate(namespace, chain)
        if where[Tier.HOST] != 1 or where[Tier.DISK] or where[Tier.GPU]:
            failures.append(f"{label}: held locally as {where}")
    assert not failures, "\n".join(failures)

    for _, key, good in damaged:  # fixed in Redis: B now reads the right bytes
        client.set(key, good)
    for i, (label, _, _) in enumerate(damaged):
        got = reader.get(namespace, hashes[3 * i : 3 * i + 3])
        if len(got) != 3 or not same_bytes(got, data[3 * i : 3 * i + 3]):
            failures.append(f"{label}: after the fix got {len(got)} blocks, or other bytes")
    assert not failures, "\n".join(failures)
    stats = reader.stats()
    assert stats.remote is not None and stats.remote.hits == 3 * n
    assert stats.remote.corrupt == n
    assert stats.tiers[Tier.HOST].num_blocks == 3 * n


def test_tenants_never_share_remote_blocks(backend: Backend, make_store: StoreFactory,
                                           tmp_path: Path) -> None:
    salt = f"tenants-{backend.kind}"
    as_x = Namespace("shared-model", TINY_LAYOUT, tenant="x")
    as_y = Namespace("shared-model", TINY_LAYOUT, tenant="y")
    hashes = keys(6, salt=salt)
    data_x, data_y = blocks(6, seed=31), blocks(6, seed=32)
    writer, reader = open_pair(make_store, tmp_path, backend, 12)
    write_through(writer, as_x, hashes, data_x)
    client = backend.client
    for block_hash in hashes:
        assert rkey(as_x, block_hash) != rkey(as_y, block_hash)
        assert client.exists(rkey(as_x, block_hash)) == 1
        assert client.exists(rkey(as_y, block_hash)) == 0

    reader.register(as_y)
    assert reader.lookup(as_y, hashes) == 0
    assert len(reader.get(as_y, hashes)) == 0
    assert reader.sidecar.locate(as_y, hashes)[Tier.HOST] == 0

    write_through(writer, as_y, hashes, data_y)  # y's own blocks under the same hashes
    reader.register(as_x)
    assert reader.lookup(as_y, hashes) == 6
    got_y, got_x = reader.get(as_y, hashes), reader.get(as_x, hashes)
    assert len(got_y) == 6 and same_bytes(got_y, data_y)
    assert len(got_x) == 6 and same_bytes(got_x, data_x)


def test_ttl_expires_remote_records(backend: Backend, make_store: StoreFactory,
                                    tmp_path: Path) -> None:
    salt = f"ttl-{backend.kind}"
    namespace = Namespace("ttl-model", TINY_LAYOUT, tenant="ttl")
    hashes, data = keys(3, salt=salt), blocks(3, seed=41)
    writer, reader = open_pair(make_store, tmp_path, backend, 8, ttl_s=2)
    write_through(writer, namespace, hashes, data)
    client = backend.client
    for block_hash in hashes:
        ttl_ms = client.pttl(rkey(namespace, block_hash))
        assert 0 < ttl_ms <= 2000, ttl_ms
        assert 0 < client.ttl(rkey(namespace, block_hash)) <= 2
    reader.register(namespace)
    assert reader.lookup(namespace, hashes) == 3  # there before it expires (lookup fills nothing)

    deadline = time.monotonic() + 10
    while any(client.exists(rkey(namespace, h)) for h in hashes):
        assert time.monotonic() < deadline, "the records did not expire"
        time.sleep(0.1)
    assert reader.lookup(namespace, hashes) == 0
    before = reader.stats().remote
    assert len(reader.get(namespace, hashes)) == 0
    after = reader.stats().remote
    assert before is not None and after is not None and after.misses == before.misses + 1
    assert after.corrupt == before.corrupt

    # Without a TTL a record stays (TTL -1): the expiry above is ttl_s's doing.
    kept, _ = open_pair(make_store, tmp_path / "kept", backend, 8)
    other = keys(1, salt=salt + "-kept")
    write_through(kept, namespace, other, blocks(1, seed=42))
    assert client.ttl(rkey(namespace, other[0])) == -1
