"""The REMOTE tier end to end: real ``tierkv serve`` sidecars, each with its own disk path (two
nodes), sharing a real three-master Redis Cluster (``tests/redis_cluster.py``).

1. write_through blocks put through sidecar A are hits, bit-exact, through sidecar B (shared
   memory and stream paths); B's lookup sees them before any get.
2. After both sidecars restart (B on a fresh disk), B still serves them, from REMOTE alone.
3. DISK evictions demote to REMOTE: another sidecar serves the evicted blocks.
4. Records tampered with in Redis are misses, never other bytes, and are deleted.
5. A tenant never reads another tenant's blocks, though model, layout and hashes are the same.
A killed Redis node and a remote that never answers: ``test_remote_sidecars_faults.py``.

Each test's first read on B is of a namespace B never saw, as a fresh node's would be: that
lookup or stream get must register it and ask REMOTE.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from tests.support.harness import Sidecar, SidecarFactory, SidecarPool, shm_client, stream_client
from tests.support.redis_cluster import RedisCluster
from tests.support.tiny_blocks import RECORD_BYTES, TINY_LAYOUT, blocks, keys, same_bytes
from tierkv import Client, Namespace, Tier, WritePolicy
from tierkv.store import RemoteStats
from tierkv.tiers.remote_keys import remote_key

pytestmark = pytest.mark.slow

T = TypeVar("T")
WRITE_THROUGH = WritePolicy.WRITE_THROUGH
TOKEN_X, TOKEN_Y = "x" * 32, "y" * 32
TENANT_X, TENANT_Y = "tenant-x", "tenant-y"
DRAIN_TIMEOUT_S = 30.0
CALL_BOUND_S = 5.0  # a hang check, not a benchmark
# Small HOST pages, so tiny blocks are two pages each; a short remote timeout.
# Both tenants are admins here: the REMOTE figures these tests read are the server's, which
# Stats shows an admin tenant only (any other caller sees its own tenant's figures).
ADMINS = ("--admin-tenants", "tenant-x", "--admin-tenants", "tenant-y")
COMMON = ("--host-bytes", "1MiB", "--page-bytes", "256", "--remote-timeout-s", "0.5", *ADMINS)


def namespace(model: str) -> Namespace:
    return Namespace(model, TINY_LAYOUT)


def redis_key(ns: Namespace, tenant: str, block_hash: bytes) -> bytes:
    """The Redis key a server stores ``block_hash`` of ``ns`` under, for ``tenant``."""
    return remote_key(ns.with_tenant(tenant).id + block_hash)


def remote(client: Client) -> RemoteStats:
    stats = client.stats().remote
    assert stats is not None, "the server has no REMOTE tier"
    return stats


def served(client: Client) -> tuple[int, int, int, int]:
    """The server's gets, and its HOST tier's hits, misses and promotions in."""
    stats = client.stats()
    host = stats.tiers[Tier.HOST]
    return stats.gets, host.hits, host.misses, host.promotions_in


def drain(client: Client, *, written: int = 0, demoted: int = 0, settled: int = 0
          ) -> RemoteStats:
    """Poll until the server's REMOTE queue is empty with at least ``written`` / ``demoted``
    records stored, and ``settled`` records stored or failed (totals since its start)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        stats = remote(client)
        if (stats.queued_bytes == 0 and stats.written >= written and stats.demoted >= demoted
                and stats.written + stats.write_failures >= settled):
            return stats
        assert time.monotonic() < deadline, f"REMOTE queue did not drain: {stats}"
        time.sleep(0.02)


def timed(call: Callable[..., T], *args: Any, bound_s: float = CALL_BOUND_S, **kwargs: Any) -> T:
    """``call(*args, **kwargs)``, asserting it returned within ``bound_s``."""
    started = time.monotonic()
    result = call(*args, **kwargs)
    elapsed = time.monotonic() - started
    assert elapsed < bound_s, f"{getattr(call, '__name__', call)} took {elapsed:.1f} s"
    return result


def assert_exact(got: torch.Tensor, expected: torch.Tensor) -> None:
    """``got`` holds exactly the blocks of ``expected``, bit for bit (as uint8)."""
    assert got.shape[0] == expected.shape[0], f"{got.shape[0]} of {expected.shape[0]} blocks"
    assert same_bytes(got, expected)
    assert torch.equal(got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))


def put_through(client: Client, ns: Namespace, hashes: list[bytes], data: torch.Tensor) -> None:
    """write_through put, then wait until every record of it left the REMOTE queue."""
    before = remote(client).written
    assert client.put(ns, hashes, data, write_policy=WRITE_THROUGH) == len(hashes)
    drain(client, written=before + len(hashes))


# --- fixtures: one cluster and one pair of sidecars (tokens for two tenants) per module --------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    with RedisCluster(tmp_path_factory.mktemp("redis")) as started:
        yield started


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    path.write_text(f"{TOKEN_X} {TENANT_X}\n{TOKEN_Y} {TENANT_Y}\n")
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, cluster: RedisCluster, tokens_file: Path
         ) -> Iterator[tuple[Sidecar, Sidecar]]:
    """Sidecars A and B on two disk paths, one cluster, one tokens file."""
    root = tmp_path_factory.mktemp("pair")
    pool = SidecarPool(root)
    try:
        flags = (*COMMON, "--disk-bytes", "16MiB", "--remote", cluster.url,
                 "--tokens-file", str(tokens_file))
        yield pool.start(*flags, disk_path=root / "disk-a"), pool.start(*flags, disk_path=root / "disk-b")
    finally:
        pool.close()


def check_served_by_b(b: Sidecar, ns: Namespace, hashes: list[bytes], data: torch.Tensor) -> None:
    """Through B (HOST without these blocks): lookup sees them all before any get (both paths);
    the stream path gets the first half, the shared-memory path the second, each from REMOTE
    (B's remote hits grow by exactly their number), bit-exact; then both get them all."""
    half = len(hashes) // 2
    with stream_client(b, token=TOKEN_X) as stream, shm_client(b, token=TOKEN_X) as shm:
        hits_before = remote(stream).hits
        assert timed(stream.lookup, ns, hashes) == len(hashes)
        assert timed(shm.lookup, ns, hashes) == len(hashes)
        assert_exact(timed(stream.get, ns, hashes[:half]), data[:half])
        assert_exact(timed(shm.get, ns, hashes[half:]), data[half:])
        assert remote(stream).hits - hits_before == len(hashes)
        for client in (stream, shm):
            assert_exact(client.get(ns, hashes), data)


def test_write_through_blocks_put_on_a_are_exact_hits_on_b(
    pair: tuple[Sidecar, Sidecar], cluster: RedisCluster
) -> None:
    a, b = pair
    ns, hashes, data = namespace("shared"), keys(16, salt="shared"), blocks(16, seed=1)
    with stream_client(a, token=TOKEN_X) as client_a:
        written_before = remote(client_a).written
        put_through(client_a, ns, hashes, data)
        stats_a = remote(client_a)
        assert stats_a.connected and stats_a.written - written_before == 16
        assert stats_a.bytes_written >= 16 * RECORD_BYTES and stats_a.queue_drops == 0
    with cluster.client() as redis_client:  # in Redis, under the tenant's keys
        assert all(redis_client.exists(redis_key(ns, TENANT_X, h)) for h in hashes)
    check_served_by_b(b, ns, hashes, data)


def test_blocks_survive_a_restart_of_both_sidecars_in_remote_alone(
    pair: tuple[Sidecar, Sidecar], tmp_path: Path
) -> None:
    a, b = pair
    ns, hashes, data = namespace("restart"), keys(16, salt="restart"), blocks(16, seed=2)
    with stream_client(a, token=TOKEN_X) as client_a:
        put_through(client_a, ns, hashes, data)
    for sidecar in (a, b):
        sidecar.stop()
    b.disk_path = tmp_path / "fresh-disk-b"  # B's DISK cannot have them: only REMOTE can
    for sidecar in (a, b):
        sidecar.start()
    with stream_client(b, token=TOKEN_X) as client_b:
        assert remote(client_b).hits == 0  # a new process
    check_served_by_b(b, ns, hashes, data)


def test_disk_evictions_demote_to_remote(
    sidecar_factory: SidecarFactory, pair: tuple[Sidecar, Sidecar], cluster: RedisCluster,
    tokens_file: Path, tmp_path: Path,
) -> None:
    _, b = pair
    # HOST of 8 blocks, DISK of 8 records: 48 write_back blocks push the first ones out of both.
    small = sidecar_factory("--host-bytes", "4KiB", "--page-bytes", "256", "--disk-bytes",
                            str(8 * RECORD_BYTES), "--write-policy", "write_back", "--remote",
                            cluster.url, "--tokens-file", str(tokens_file), *ADMINS,
                            disk_path=tmp_path / "disk-small")
    ns, hashes, data = namespace("demote"), keys(48, salt="demote"), blocks(48, seed=3)
    with stream_client(small, token=TOKEN_X) as client:
        for start in range(0, 48, 4):
            assert client.put(ns, hashes[start : start + 4], data[start : start + 4]) == 4
        stats = drain(client, demoted=16)
        assert stats.written == 0  # write_back: whatever reached REMOTE was demoted
    with cluster.client() as redis_client:
        assert all(redis_client.exists(redis_key(ns, TENANT_X, h)) for h in hashes[:16])
    with stream_client(b, token=TOKEN_X) as stream, shm_client(b, token=TOKEN_X) as shm:
        assert timed(stream.lookup, ns, hashes[:16]) == 16
        assert_exact(timed(stream.get, ns, hashes[:8]), data[:8])
        assert_exact(timed(shm.get, ns, hashes[8:16]), data[8:16])


def test_tampered_records_in_redis_are_misses_never_other_bytes(
    pair: tuple[Sidecar, Sidecar], cluster: RedisCluster
) -> None:
    a, b = pair
    ns, hashes, data = namespace("tampered"), keys(6, salt="tampered"), blocks(6, seed=5)
    with stream_client(a, token=TOKEN_X) as client_a:
        put_through(client_a, ns, hashes, data)
    raw_keys = [ns.with_tenant(TENANT_X).id + h for h in hashes]
    names = [remote_key(raw) for raw in raw_keys]
    with cluster.client() as redis_client:
        records = [redis_client.get(name) for name in names]
        assert all(isinstance(r, bytes) and len(r) == RECORD_BYTES for r in records)
        payload_flipped = bytearray(records[3])
        payload_flipped[-1] ^= 0x01
        header_flipped = bytearray(records[4])
        at = header_flipped.find(raw_keys[4])  # the key in the header: its last byte
        assert 8 <= at < RECORD_BYTES - TINY_LAYOUT.bytes_per_block
        header_flipped[at + len(raw_keys[4]) - 1] ^= 0x80
        redis_client.set(names[0], b"garbage")
        redis_client.set(names[1], records[1][:-1])  # truncated
        redis_client.set(names[2], records[5])  # another block's record
        redis_client.set(names[3], bytes(payload_flipped))
        redis_client.set(names[4], bytes(header_flipped))
    with stream_client(b, token=TOKEN_X) as stream, shm_client(b, token=TOKEN_X) as shm:
        before = remote(stream)
        for i in range(5):  # one block a call: each outcome is visible
            for client in (stream, shm):
                got = timed(client.get, ns, [hashes[i]])
                assert got.shape[0] == 0, f"tampered record {i} was served"
        after = remote(stream)
        # Each counted once: the first read deletes what failed, the second finds nothing.
        assert after.corrupt - before.corrupt == 5
        with cluster.client() as check:
            assert [check.exists(name) for name in names[:5]] == [0] * 5
        assert after.hits == before.hits
        # The untouched block is served; a chain stops before a tampered block.
        assert_exact(timed(shm.get, ns, [hashes[5], hashes[3]]), data[5:6])
        assert_exact(timed(stream.get, ns, [hashes[5], hashes[2], hashes[4]]), data[5:6])
        assert remote(stream).hits == after.hits + 1


def test_a_tenant_never_gets_another_tenants_blocks(
    pair: tuple[Sidecar, Sidecar], cluster: RedisCluster
) -> None:
    a, b = pair
    ns, hashes, data = namespace("tenants"), keys(8, salt="tenants"), blocks(8, seed=6)
    with stream_client(a, token=TOKEN_X) as client_a:
        put_through(client_a, ns, hashes, data)
    with cluster.client() as redis_client:
        assert all(redis_client.exists(redis_key(ns, TENANT_X, h)) for h in hashes)
        assert not any(redis_client.exists(redis_key(ns, TENANT_Y, h)) for h in hashes)

    def tenant_y_sees_nothing(sidecar: Sidecar) -> None:
        with stream_client(sidecar, token=TOKEN_Y) as stream, \
                shm_client(sidecar, token=TOKEN_Y) as shm:
            hits = remote(stream).hits
            for client in (stream, shm):
                assert timed(client.lookup, ns, hashes) == 0
                assert timed(client.get, ns, hashes).shape[0] == 0
                assert timed(client.get, ns, hashes[:1]).shape[0] == 0
            assert remote(stream).hits == hits

    tenant_y_sees_nothing(b)  # B holds nothing locally: only REMOTE could answer
    check_served_by_b(b, ns, hashes, data)  # tenant X on B: all of them
    tenant_y_sees_nothing(b)  # now X's blocks are in B's HOST
    tenant_y_sees_nothing(a)  # and in A's


def test_publish_sends_write_back_blocks_to_remote_before_answering(
    pair: tuple[Sidecar, Sidecar], cluster: RedisCluster
) -> None:
    """A write_back put stays in A's HOST; Publish sends it to REMOTE and answers once Redis
    holds it, so that B serves it at once. A chain with a block A lacks publishes up to it."""
    a, b = pair
    ns, hashes, data = namespace("published"), keys(12, salt="published"), blocks(12, seed=6)
    with stream_client(a, token=TOKEN_X) as client_a, shm_client(b, token=TOKEN_X) as client_b:
        assert client_a.put(ns, hashes[:8], data[:8]) == 8  # write_back: HOST only
        assert timed(client_b.lookup, ns, hashes) == 0
        served_before = served(client_a)
        assert timed(client_a.publish, ns, hashes, wait_s=3.0) == 8
        assert served(client_a) == served_before  # A's copies read for REMOTE are nobody's hit
        with cluster.client() as redis_client:
            assert all(redis_client.exists(redis_key(ns, TENANT_X, h)) for h in hashes[:8])
        assert timed(client_b.lookup, ns, hashes) == 8
        assert_exact(client_b.get(ns, hashes), data[:8])
        assert timed(client_a.publish, ns, hashes[:8], wait_s=3.0) == 8  # again: nothing sent
    with stream_client(b, token=TOKEN_Y) as other:  # another tenant: its own namespace
        assert other.publish(ns, hashes, wait_s=1.0) == 0
        assert other.lookup(ns, hashes) == 0


def test_publish_without_remote_counts_what_the_sidecar_holds(
    sidecar_factory: SidecarFactory,
) -> None:
    sidecar = sidecar_factory("--host-bytes", "1MiB", "--page-bytes", "256")
    ns, hashes, data = namespace("alone"), keys(6, salt="alone"), blocks(6, seed=7)
    with stream_client(sidecar) as client:
        client.put(ns, hashes[:4], data[:4])
        assert client.publish(ns, hashes, wait_s=0.0) == 4
        assert client.publish(namespace("never-written"), hashes) == 0
