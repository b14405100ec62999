"""Deletes racing demotions to disk: a deleted block never comes back, not even after a restart."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.support.tiny_blocks import StoreFactory, block_for, key
from tierkv import Namespace


def test_blocks_deleted_while_being_demoted_stay_deleted_after_a_restart(
    make_store: StoreFactory, namespace: Namespace, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    store = make_store(host_blocks=2, disk_blocks=400, disk_path=disk, promote_on_read=False)
    store.register(namespace)
    num_keys = 300
    put_done = [threading.Event() for _ in range(num_keys)]
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(num_keys):  # each put demotes the previous blocks to disk
                store.put(namespace, [key(i, "race")], block_for(i)[None])
                put_done[i].set()
        except BaseException as exc:
            errors.append(exc)
            for event in put_done:
                event.set()

    def deleter() -> None:
        try:
            for i in range(0, num_keys, 2):  # delete every other block right after its put
                put_done[i].wait(timeout=60)
                store.delete(namespace, [key(i, "race")])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=deleter)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    deleted = [key(i, "race") for i in range(0, num_keys, 2)]
    assert all(store.lookup(namespace, [h]) == 0 for h in deleted)
    store.close(flush=False)

    reopened = make_store(host_blocks=2, disk_blocks=400, disk_path=disk)
    reopened.register(namespace)
    back = [h for h in deleted if reopened.lookup(namespace, [h])]
    assert not back, f"{len(back)} deleted blocks came back after a restart"
    kept = [key(i, "race") for i in range(1, num_keys - 4, 2)]  # the last ones may be HOST-only
    lost = [i for i, h in enumerate(kept) if reopened.lookup(namespace, [h]) != 1]
    assert not lost, (lost, reopened.stats())
