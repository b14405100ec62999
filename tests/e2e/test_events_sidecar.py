"""KV events of a real ``tierkv serve`` sidecar, written through the SDK (shared memory and
stream), read by a subscriber that decodes with vLLM's own classes (``tests/support/kv_events``):

1. Two tenants storing the same hashes of the same model get two topics, each naming its
   tenant; one tenant's delete leaves the other's topic as it was; ``tierkv clear --all`` by an
   admin is an ``AllBlocksCleared`` on every topic; the metrics count what was published.
2. The sidecar SIGKILLed and started again on its disk: the subscriber that stayed sees the
   jump in the sequence (a heartbeat, at the latest), resyncs, and holds exactly the blocks
   the new sidecar serves (those written through).
3. ``--events-token-ids off``: no token id leaves the sidecar, though the writer gave them; a
   clean stop ends every topic with an ``AllBlocksCleared``.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.harness import Sidecar, SidecarPool, free_port, shm_client, stream_client
from tests.support.kv_events import EventIndex
from tests.support.tiny_blocks import TINY_LAYOUT, blocks, keys
from tierkv import Namespace, PutDetail, WritePolicy

pytestmark = pytest.mark.slow

ALICE, BOB = "a" * 32, "b" * 32
NAMESPACE = Namespace("model-e", TINY_LAYOUT)


@pytest.fixture
def pool(tmp_path: Path) -> SidecarPool:
    (tmp_path / "tokens").write_text(f"{ALICE} alice\n{BOB} bob\n")
    sidecars = SidecarPool(tmp_path)
    yield sidecars  # type: ignore[misc]
    sidecars.close()


def start(pool: SidecarPool, root: Path, *flags: str) -> Sidecar:
    return pool.start("--host-bytes", "1MiB", "--page-bytes", "256", "--tokens-file",
                      str(root / "tokens"), "--admin-tenants", "alice", "--events-endpoint",
                      f"ipc://{root}/events", "--events-heartbeat-s", "0.2", "--events-mode",
                      "tierkv", *flags,
                      disk_path=root / "disk")


def subscriber(sidecar: Sidecar) -> EventIndex:
    index = EventIndex(sidecar.ready["events_endpoint"], sidecar.ready["events_replay_endpoint"])
    index.resync()
    return index


def topic_of_tenant(index: EventIndex, tenant: str) -> bytes:
    names = [name for name in index.index if f":{tenant}:".encode() in name]
    assert len(names) == 1, names
    return names[0]


def hashes_of(index: EventIndex, name: bytes) -> set[int]:
    return set().union(*index.holding(name).values()) if index.holding(name) else set()


def external(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("tierkv_events_")}


def test_tenants_get_topics_of_their_own(pool: SidecarPool, tmp_path: Path) -> None:
    metrics_port = free_port()
    sidecar = start(pool, tmp_path, "--metrics-port", str(metrics_port))
    index = subscriber(sidecar)
    chain = keys(3)
    detail = PutDetail(tuple(range(12)))
    with shm_client(sidecar, token=ALICE) as alice, stream_client(sidecar, token=BOB) as bob:
        alice.put(NAMESPACE, chain, blocks(3), detail=detail)
        bob.put(NAMESPACE, chain, blocks(3), detail=detail)
        index.poll()
        mine, theirs = topic_of_tenant(index, "alice"), topic_of_tenant(index, "bob")
        assert hashes_of(index, mine) == hashes_of(index, theirs) == {external(h) for h in chain}
        expected = {external(h): list(range(4 * i, 4 * i + 4)) for i, h in enumerate(chain)}
        # Every block as it happened, each chain in one event, parent first.
        assert index.num_resyncs == 1
        assert sorted(len(event.block_hashes) for _, event in index.stored) == [3, 3]
        for name, event in index.stored:
            assert event.token_ids == [token for h in event.block_hashes for token in expected[h]]
            assert name in (mine, theirs)
        bob.delete(NAMESPACE, chain[1:])
        index.poll()
        assert hashes_of(index, theirs) == {external(chain[0])}
        assert hashes_of(index, mine) == {external(h) for h in chain}
    cleared = subprocess.run(
        [sys.executable, "-m", "tierkv", "clear", "--all", "--yes", "--target",
         sidecar.unix_target, "--token", ALICE], capture_output=True, text=True, timeout=60,
        check=False)
    assert cleared.returncode == 0, cleared.stderr
    index.poll()
    assert hashes_of(index, mine) == hashes_of(index, theirs) == set()
    figures = scrape(metrics_port)
    assert figures["tierkv_events_published_total"] >= 8
    assert figures["tierkv_events_resyncs_total"] >= 1
    assert figures["tierkv_events_dropped_total"] == 0
    index.close()


def test_a_subscriber_outlives_a_sigkilled_sidecar(pool: SidecarPool, tmp_path: Path) -> None:
    sidecar = start(pool, tmp_path)
    index = subscriber(sidecar)
    kept, lost = keys(2), keys(2, start=10)
    with shm_client(sidecar, token=ALICE) as alice:
        alice.put(NAMESPACE, kept, blocks(2), write_policy=WritePolicy.WRITE_THROUGH)
        alice.put(NAMESPACE, lost, blocks(2))  # HOST only: gone with the process
    index.poll()
    name = topic_of_tenant(index, "alice")
    assert hashes_of(index, name) == {external(h) for h in kept + lost}
    sidecar.kill()
    again = start(pool, tmp_path)
    index.poll(1.5)  # a heartbeat of the new sidecar shows the jump
    assert index.num_resyncs >= 2 or index.num_replays >= 1
    assert hashes_of(index, name) == {external(h) for h in kept}
    assert index.holding(name) == {("STORAGE", "LOCAL"): {external(h) for h in kept}}
    with shm_client(again, token=ALICE) as alice:
        assert [alice.lookup(NAMESPACE, [h]) for h in kept + lost] == [1, 1, 0, 0]
    index.close()


def test_token_ids_off_publishes_none(pool: SidecarPool, tmp_path: Path) -> None:
    sidecar = start(pool, tmp_path, "--events-token-ids", "off")
    index = subscriber(sidecar)
    with shm_client(sidecar, token=ALICE) as alice:
        alice.put(NAMESPACE, keys(2), blocks(2), detail=PutDetail(tuple(range(8))))
    index.poll()
    assert sum(len(event.block_hashes) for _, event in index.stored) == 2
    assert all(event.token_ids == [] for _, event in index.stored)
    # A clean stop flushes HOST to DISK, then says nothing is served here any more.
    sidecar.terminate()
    index.poll(0.5)
    name = topic_of_tenant(index, "alice")
    assert index.holding(name) == {}
    assert any(event.medium == "STORAGE" for _, event in index.stored)
    index.close()


def test_a_restart_without_a_disk_clears_what_the_subscriber_held(pool: SidecarPool,
                                                                   tmp_path: Path) -> None:
    """Without a disk nothing survives a SIGKILL, and no namespace comes back to be restated:
    the node's own topic shows the restart, and the subscriber resyncs everything."""
    sidecar = start(pool, tmp_path, "--no-disk")
    index = subscriber(sidecar)
    with shm_client(sidecar, token=ALICE) as alice:
        alice.put(NAMESPACE, keys(2), blocks(2))
    index.poll()
    name = topic_of_tenant(index, "alice")
    assert hashes_of(index, name) == {external(h) for h in keys(2)}
    sidecar.kill()
    start(pool, tmp_path, "--no-disk")
    index.poll(1.5)
    assert index.holding(name) == {}
    assert index.num_resyncs >= 2
    index.close()


def test_a_detail_that_does_not_fit_its_put_is_refused_and_stores_nothing(
        pool: SidecarPool, tmp_path: Path) -> None:
    from tierkv import InvalidArgumentError

    sidecar = start(pool, tmp_path)
    index = subscriber(sidecar)
    bad = [PutDetail(tuple(range(7))),  # 7 tokens for 2 blocks of 4
           PutDetail(extra_keys=((1,),)),  # one entry for 2 blocks
           PutDetail(parent_hash=b"short"),
           PutDetail(parent_hashes=(None,))]
    with shm_client(sidecar, token=ALICE) as shm, stream_client(sidecar, token=ALICE) as stream:
        for client in (shm, stream):
            for detail in bad:
                with pytest.raises(InvalidArgumentError):
                    client.put(NAMESPACE, keys(2), blocks(2), detail=detail)
            assert client.lookup(NAMESPACE, keys(2)) == 0
        index.poll(0.5)
        assert index.stored == []
        assert shm.put(NAMESPACE, keys(2), blocks(2), detail=PutDetail(tuple(range(8)))) == 2
    index.close()
