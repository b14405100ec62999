"""Fault injection on the DISK tier's files: byte flips (anywhere, in block records, in session
and namespace records, in page headers), truncation, appended garbage, a garbage ``lock.mdb``
and a foreign ``data.mdb``, over 108 seeded trials, then four damaged stores served by a real
``tierkv serve``.

The first rule under test: a reopened store never crashes, every hit is bit-exact, every
session resumes with exactly its token ids and namespace or is absent. The trials run in
``disk_fault_worker.py``, in a process of their own: a SIGBUS fails the test instead of killing
pytest. RELIABILITY.md ("Disk faults") records the figures of the same run.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from tests.support import disk_fault_worker as worker
from tests.support.tiny_blocks import blocks, keys, same_bytes
from tierkv import Client
from tierkv.errors import NotFoundError

WORKER = Path(worker.__file__)
SEED = 7
TRIALS_PER_KIND = 12


def test_damaged_files_never_crash_the_store_nor_serve_a_wrong_byte(tmp_path: Path) -> None:
    lines = worker.run_in_subprocess(str(tmp_path), str(SEED), str(TRIALS_PER_KIND))
    trials = [line for line in lines if line["phase"] == "done"]
    summary = lines[-1]
    assert summary["phase"] == "summary"
    assert summary["trials"] == len(trials) == TRIALS_PER_KIND * len(worker.DAMAGES) >= 100
    failures = [t for t in trials if t.get("error") or not t.get("usable")
                or t.get("wrong_blocks") or t.get("wrong_sessions")]
    assert not failures, failures
    assert summary["wrong_blocks"] == summary["wrong_sessions"] == summary["errors"] == 0
    by_kind = {kind: [t for t in trials if t["kind"] == kind] for kind in worker.DAMAGES}
    # Each mechanism was exercised: damaged records are counted misses, unreadable stores are
    # moved aside, and most of what was stored still hits.
    assert all(t["moved_aside"] for t in by_kind["foreign_file"])
    assert any(t["moved_aside"] for t in by_kind["truncate"])
    assert any(t["lost_sessions"] and t["checksum_failures"] for t in by_kind["flip_sessions"])
    assert any(t["misses"] and t["checksum_failures"] for t in by_kind["flip_blocks"])
    assert summary["hits"] > summary["misses"]


def ready_line(process: subprocess.Popen[str]) -> dict[str, Any]:
    """The JSON line ``tierkv serve`` prints once it serves; fails if it exited instead."""
    assert process.stdout is not None and process.stderr is not None
    line = process.stdout.readline()
    if not line:
        process.wait(30)
        raise AssertionError(f"serve exited with {process.returncode}: {process.stderr.read()}")
    ready: dict[str, Any] = json.loads(line)
    return ready


def test_tierkv_serve_starts_on_damaged_files_and_serves_only_exact_bytes(tmp_path: Path) -> None:
    original = tmp_path / "original"
    worker.build(original)
    damages = ["truncate", "flip_page_headers", "foreign_file", "flip_sessions"]
    for number, kind in enumerate(damages):
        disk_path = tmp_path / f"served-{kind}"
        shutil.copytree(original, disk_path)
        rng = random.Random(f"{SEED}-serve-{number}")
        if kind == "truncate":  # mid-page, inside what the last commit uses
            size = worker.used_bytes(disk_path / "data.mdb")
            with (disk_path / "data.mdb").open("r+b") as f:
                f.truncate(rng.randrange(size // 2, size - worker.PAGE_BYTES) | 1)
        else:
            worker.DAMAGES[kind](disk_path, rng)
        socket_path = tmp_path / f"s{number}.sock"
        process = worker.start_serve(disk_path, socket_path)
        try:
            assert ready_line(process)["ready"] is True
            check_served(f"unix://{socket_path}", kind)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0, process.stderr.read() if process.stderr else ""
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        if kind in ("truncate", "foreign_file"):
            assert any(disk_path.glob("corrupt-*/data.mdb")), f"{kind}: not moved aside"


def check_served(target: str, kind: str) -> None:
    """Every block a served store gives back is exact; every session is exact or absent."""
    with Client(target) as client:
        for namespace, num_blocks, seed in worker.BLOCK_SETS[:2]:  # the default tenant's
            hashes = keys(num_blocks, salt=namespace.model_id + namespace.tenant)
            for block_hash, original in zip(hashes, blocks(num_blocks, seed, namespace.layout),
                                            strict=True):
                got = client.get(namespace, [block_hash])
                assert not len(got) or same_bytes(got[0], original), f"{kind}: a wrong byte"
        for namespace, session_id, token_ids in worker.SESSIONS[:2]:
            try:
                resumed = client.resume_session(session_id)
                resumed_namespace, resumed_tokens = resumed.namespace, list(resumed.token_ids)
            except NotFoundError:  # absent is allowed, wrong is not
                continue
            assert resumed_tokens == token_ids, f"{kind}: session {session_id} resumed wrong"
            assert resumed_namespace.model_id == namespace.model_id
            assert resumed_namespace.layout == namespace.layout
