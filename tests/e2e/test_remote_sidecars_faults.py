"""The REMOTE tier end to end when Redis fails (see ``test_remote_sidecars.py``): a killed node of
a real three-master cluster fails its own blocks only, and comes back; a remote that never
answers leaves each sidecar a local-only cache. No call raises, and none takes long."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.e2e.test_remote_sidecars import (
    COMMON,
    WRITE_THROUGH,
    assert_exact,
    drain,
    namespace,
    put_through,
    redis_key,
    remote,
    timed,
)
from tests.support.harness import SidecarFactory, shm_client, stream_client
from tests.support.redis_cluster import RedisCluster, StallingListener
from tests.support.tiny_blocks import block_for, key, keys

pytestmark = pytest.mark.slow
TENANT = "default"  # no tokens file
BACK_DEADLINE_S = 15.0


def test_a_killed_redis_node_fails_only_its_own_blocks_until_it_is_back(
    sidecar_factory: SidecarFactory, tmp_path: Path
) -> None:
    ns = namespace("node-kill")
    with RedisCluster(tmp_path / "redis") as cluster:
        a = sidecar_factory(*COMMON, "--disk-bytes", "16MiB", "--remote", cluster.url,
                            disk_path=tmp_path / "disk-a")
        b = sidecar_factory(*COMMON, "--no-disk", "--remote", cluster.url,
                            disk_path=tmp_path / "disk-b")
        dead = 1
        by_node: dict[int, list[bytes]] = {0: [], 1: [], 2: []}
        for i in range(1000):
            block_hash = key(i, salt="node-kill")
            by_node[cluster.node_of_key(redis_key(ns, TENANT, block_hash))].append(block_hash)
            if min(len(found) for found in by_node.values()) >= 5 and len(by_node[dead]) >= 40:
                break
        # Four blocks per node now; one more per node while the node is dead; the dead node's
        # others for after its restart.
        stored = [h for node in by_node for h in by_node[node][:4]]
        late = [by_node[node][4] for node in by_node]
        spares = by_node[dead][5:]
        content = {h: block_for(int.from_bytes(h[:4], "little")) for found in by_node.values()
                   for h in found}
        with stream_client(a) as client_a:
            put_through(client_a, ns, stored, torch_stack(content, stored))
            cluster.kill_node(dead)
            before = remote(client_a)
            assert timed(client_a.put, ns, late, torch_stack(content, late),
                         write_policy=WRITE_THROUGH) == 3
            # The live nodes store theirs; the dead node's record is a counted failure.
            after = drain(client_a, settled=before.written + before.write_failures + 3)
            assert after.written >= before.written + 2
            assert after.write_failures > before.write_failures
            assert after.errors + after.skipped > before.errors + before.skipped

        with stream_client(b) as stream, shm_client(b) as shm:
            for number, block_hash in enumerate(stored + late):
                on_dead = block_hash in by_node[dead]
                assert timed(stream.lookup, ns, [block_hash]) == (0 if on_dead else 1)
                got = timed((stream, shm)[number % 2].get, ns, [block_hash])
                if on_dead:
                    assert got.shape[0] == 0
                else:
                    assert_exact(got, content[block_hash][None])
            stats = remote(stream)
            assert stats.errors + stats.skipped > 0 and stats.hits == 10

            cluster.restart_node(dead)
            deadline = time.monotonic() + BACK_DEADLINE_S
            with stream_client(a) as client_a:
                for block_hash in spares:  # written again until the node takes writes again
                    put_through(client_a, ns, [block_hash], content[block_hash][None])
                    if timed(stream.lookup, ns, [block_hash]) == 1:
                        break
                    assert time.monotonic() < deadline, "the restarted node never came back"
                    time.sleep(0.5)
                else:
                    pytest.fail("the restarted node never came back")
            assert_exact(timed(shm.get, ns, [block_hash]), content[block_hash][None])
            for old in by_node[dead][:4]:  # it came back empty: they are gone
                assert timed(stream.get, ns, [old]).shape[0] == 0


def torch_stack(content: dict[bytes, torch.Tensor], hashes: list[bytes]) -> torch.Tensor:
    return torch.stack([content[h] for h in hashes])


def test_a_remote_that_never_answers_leaves_a_local_only_cache(
    sidecar_factory: SidecarFactory, tmp_path: Path
) -> None:
    ns, hashes, absent = namespace("stalled"), keys(8, salt="stalled"), keys(4, salt="absent")
    data = torch_stack({h: block_for(i) for i, h in enumerate(hashes)}, hashes)
    with StallingListener() as listener:
        started = time.monotonic()
        sidecar = sidecar_factory(*COMMON, "--disk-bytes", "16MiB", "--write-policy",
                                  "write_through", "--remote", listener.url,
                                  disk_path=tmp_path / "disk")
        assert time.monotonic() - started < 20, "the sidecar waited for the remote to start"
        with stream_client(sidecar) as stream, shm_client(sidecar) as shm:
            assert timed(stream.put, ns, hashes[:4], data[:4]) == 4
            assert timed(shm.put, ns, hashes[4:], data[4:]) == 4
            for client in (stream, shm):
                assert timed(client.lookup, ns, hashes) == 8
                assert timed(client.lookup, ns, absent) == 0
                assert timed(client.lookup, ns, hashes + absent) == 8
                assert_exact(timed(client.get, ns, hashes + absent), data)
                assert timed(client.get, ns, absent).shape[0] == 0
            deadline = time.monotonic() + 10
            while listener.num_accepted == 0:  # it did try the remote
                assert time.monotonic() < deadline, "the sidecar never connected to the remote"
                time.sleep(0.05)
            stats = remote(stream)
            assert not stats.connected or stats.errors > 0, stats
            assert stats.hits == 0
