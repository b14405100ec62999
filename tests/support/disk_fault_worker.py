"""Fault injection on the DISK tier's files, run in its own process so that a SIGBUS (or any
crash) fails the test that started it instead of killing pytest.

A trial copies a store written through the public API (write_through blocks of two namespaces,
three sessions of two tenants), damages the copy's files one way, reopens it and checks the
first rule: every hit is bit-exact, every session resumes with exactly its token ids and
namespace or is absent, the store opens (an unreadable one is moved aside) and takes new puts.

Run directly to get the figures of RELIABILITY.md::

    python tests/disk_fault_worker.py <work dir> <seed> <trials per kind> [kind ...]

It prints one JSON line per trial (``"phase": "open"`` before the store is opened, so a crash
names its trial) and a last ``"summary"`` line. ``python tests/disk_fault_worker.py check
<store dir>`` checks one store (already damaged) and prints its result as one JSON line.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from tests.support import child_env, helper_command
from tests.support.tiny_blocks import TINY_LAYOUT, blocks, keys, same_bytes
from tierkv import (
    DiskTierConfig,
    HostTierConfig,
    KVLayout,
    Namespace,
    Priority,
    StoreConfig,
    TieredStore,
    WritePolicy,
)
from tierkv.errors import SessionNotFoundError

# 8 KiB blocks: their records live in LMDB overflow pages, the tiny ones inside leaf pages.
OTHER_LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=32, block_size=4)
NS_A = Namespace("model-a", TINY_LAYOUT)
NS_B = Namespace("model-b", OTHER_LAYOUT)
NS_BOB = Namespace("model-a", TINY_LAYOUT, tenant="bob")
# (namespace, number of blocks, seed of their content)
BLOCK_SETS = ((NS_A, 24, 1), (NS_B, 12, 2), (NS_BOB, 6, 3))
# (namespace, session id, token ids)
SESSIONS = (
    (NS_A, "chat-a", list(range(1000, 1000 + 4 * 24))),
    (NS_B, "chat-b", [7, 2**32 - 1, 0, 65536] * 5),
    (NS_BOB, "chat-bob", list(range(10, 34))),
)
PAGE_BYTES = 4096
_SLAB_NUMBERS = itertools.count()


def store_config(path: Path) -> StoreConfig:
    """A small store at ``path`` (no presence table: it costs time on every open)."""
    disk = DiskTierConfig(path, 1 << 20, map_slack_bytes=8 << 20)
    host = HostTierConfig(256 * 1024, 256, prefault=False,
                          shm_name=f"tkv-faults-{os.getpid()}-{next(_SLAB_NUMBERS)}")
    return StoreConfig(host=host, disk=disk, presence_slots=0)


def build(path: Path) -> None:
    """Write the original store at ``path`` through the public API and close it."""
    store = TieredStore(store_config(path))
    try:
        for namespace, num_blocks, seed in BLOCK_SETS:
            store.register(namespace)
            store.put(namespace, keys(num_blocks, salt=namespace.model_id + namespace.tenant),
                           blocks(num_blocks, seed, namespace.layout), priority=Priority.SESSION,
                           write_policy=WritePolicy.WRITE_THROUGH)
        for namespace, session_id, token_ids in SESSIONS:
            store.save_session(namespace, session_id, token_ids)
    finally:
        store.close()


# --- damage ------------------------------------------------------------------------------------


def _flip(data_file: Path, offsets: list[int], rng: random.Random) -> list[int]:
    data = bytearray(data_file.read_bytes())
    offsets = [offset % len(data) for offset in offsets]
    for offset in offsets:
        data[offset] ^= rng.randrange(1, 256)
    data_file.write_bytes(data)
    return offsets


def _near(data_file: Path, needles: list[bytes], rng: random.Random, reach: int) -> list[int]:
    """A few offsets within ``reach`` bytes after (or 64 before) a copy of one of ``needles``
    in the file (LMDB's copy-on-write leaves stale copies too: each is a fair target)."""
    content = data_file.read_bytes()
    hits = [i for needle in needles for i in _find_all(content, needle)]
    if not hits:
        return [rng.randrange(len(content))]
    return [rng.choice(hits) + rng.randrange(-64, reach) for _ in range(rng.randint(1, 4))]


def _find_all(content: bytes, needle: bytes) -> list[int]:
    found, start = [], content.find(needle)
    while start != -1:
        found.append(start)
        start = content.find(needle, start + 1)
    return found


def flip_random(path: Path, rng: random.Random) -> Any:
    data_file = path / "data.mdb"
    size = used_bytes(data_file)
    return _flip(data_file, [rng.randrange(size) for _ in range(rng.randint(1, 8))], rng)


def flip_blocks(path: Path, rng: random.Random) -> Any:
    data_file = path / "data.mdb"
    return _flip(data_file, _near(data_file, [b"TKV1"], rng, 700), rng)


def flip_sessions(path: Path, rng: random.Random) -> Any:
    data_file = path / "data.mdb"
    needles = [b"chat-a", b"chat-b", b"chat-bob", b"default\x00chat", b"bob\x00chat"]
    return _flip(data_file, _near(data_file, needles, rng, 420), rng)


def flip_namespaces(path: Path, rng: random.Random) -> Any:
    data_file = path / "data.mdb"
    needles = [b"TKS1", bytes(NS_A.id), bytes(NS_B.id), bytes(NS_BOB.id)]
    return _flip(data_file, _near(data_file, needles, rng, 120), rng)


def flip_page_headers(path: Path, rng: random.Random) -> Any:
    """Bytes of page headers (and of the two meta pages): what LMDB walks the tree by."""
    data_file = path / "data.mdb"
    num_pages = -(-used_bytes(data_file) // PAGE_BYTES)
    offsets = [rng.randrange(num_pages) * PAGE_BYTES + rng.randrange(24) for _ in range(3)]
    return _flip(data_file, offsets, rng)


def used_bytes(data_file: Path) -> int:
    """Where the file's data ends: past it, the file is a sparse run of zeros (the store
    extends ``data.mdb`` to its map size)."""
    return len(data_file.read_bytes().rstrip(b"\0"))


def truncate(path: Path, rng: random.Random) -> Any:
    data_file = path / "data.mdb"
    size = used_bytes(data_file)
    new_size = rng.choice([
        0, rng.randrange(size), rng.randrange(size // PAGE_BYTES) * PAGE_BYTES,
        rng.randrange(1, 2 * PAGE_BYTES), size - rng.randrange(1, PAGE_BYTES),
    ])
    with data_file.open("r+b") as f:
        f.truncate(new_size)
    return new_size


def append_garbage(path: Path, rng: random.Random) -> Any:
    num_bytes = rng.randint(1, 1 << 16)
    data_file = path / "data.mdb"
    with data_file.open("r+b") as f:  # right after the data, and past the end of the file
        f.seek(rng.choice([used_bytes(data_file), data_file.stat().st_size]))
        f.write(rng.randbytes(num_bytes))
    return num_bytes


def lock_garbage(path: Path, rng: random.Random) -> Any:
    lock_file = path / "lock.mdb"
    num_bytes = rng.choice([0, rng.randint(1, 64), rng.randint(64, 16384)])
    lock_file.write_bytes(rng.randbytes(num_bytes))
    return num_bytes


def foreign_file(path: Path, rng: random.Random) -> Any:
    """``data.mdb`` replaced by something else: random bytes, text, or another LMDB store."""
    data_file = path / "data.mdb"
    choice = rng.choice(["random", "text", "lmdb"])
    if choice == "random":
        data_file.write_bytes(rng.randbytes(rng.randint(1, 5 * PAGE_BYTES)))
    elif choice == "text":
        data_file.write_text("not an LMDB file\n" * rng.randint(1, 500))
    else:
        with tempfile.TemporaryDirectory() as other:
            env = lmdb.open(other, max_dbs=4, map_size=1 << 22)
            with env.begin(write=True, db=env.open_db(b"sessions")) as txn:
                txn.put(b"default\x00chat-a", rng.randbytes(64))
            env.close()
            shutil.copy(Path(other) / "data.mdb", data_file)
        (path / "lock.mdb").unlink(missing_ok=True)
    return choice


DAMAGES: dict[str, Callable[[Path, random.Random], Any]] = {
    fn.__name__: fn for fn in (
        flip_random, flip_blocks, flip_sessions, flip_namespaces, flip_page_headers, truncate,
        append_garbage, lock_garbage, foreign_file,
    )
}


# --- checks ------------------------------------------------------------------------------------


def check(path: Path) -> dict[str, Any]:
    """Reopen the store at ``path`` and compare everything it serves with the originals."""
    result: dict[str, Any] = {"hits": 0, "misses": 0, "wrong_blocks": 0, "sessions": 0,
                              "lost_sessions": 0, "wrong_sessions": 0, "error": None}
    store = TieredStore(store_config(path))
    try:
        for namespace, num_blocks, seed in BLOCK_SETS:
            store.register(namespace)
            hashes = keys(num_blocks, salt=namespace.model_id + namespace.tenant)
            originals = blocks(num_blocks, seed, namespace.layout)
            for block_hash, original in zip(hashes, originals, strict=True):
                got = store.get(namespace, [block_hash])
                if not len(got):
                    result["misses"] += 1
                elif same_bytes(got[0], original):
                    result["hits"] += 1
                else:
                    result["wrong_blocks"] += 1
        for namespace, session_id, token_ids in SESSIONS:
            try:
                resumed = store.resume_session(session_id, tenant=namespace.tenant)
            except SessionNotFoundError:
                result["lost_sessions"] += 1
                continue
            exact = resumed.namespace == namespace and list(resumed.token_ids) == token_ids
            result["sessions" if exact else "wrong_sessions"] += 1
        fresh = blocks(1, 99)
        store.put(NS_A, keys(1, salt="fresh"), fresh, write_policy=WritePolicy.WRITE_THROUGH)
        result["usable"] = same_bytes(store.get(NS_A, keys(1, salt="fresh"))[0], fresh[0])
        result["checksum_failures"] = store.stats().checksum_failures
    finally:
        store.close()
    TieredStore(store_config(path)).close()  # and it opens again, as it is now
    result["moved_aside"] = any(path.glob("corrupt-*"))
    return result


# --- the parent's side (pytest) ----------------------------------------------------------------


def run_in_subprocess(*args: str, timeout_s: float = 300) -> list[dict[str, Any]]:
    """Run this worker in its own process; its JSON lines. Raises ``AssertionError`` naming the
    last trial if it died (a signal such as SIGBUS, or an exit code)."""
    done = subprocess.run(helper_command("disk_fault_worker", *args), capture_output=True, text=True,
                          timeout=timeout_s, env=child_env(), check=False)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode:
        how = (f"signal {signal.Signals(-done.returncode).name}" if done.returncode < 0
               else f"exit {done.returncode}")
        last = lines[-1] if lines else None
        raise AssertionError(f"the worker died ({how}) after {last}; stderr: {done.stderr[-2000:]}")
    return lines


def start_serve(disk_path: Path, socket_path: Path) -> subprocess.Popen[str]:
    """``tierkv serve`` on ``disk_path`` as a user starts it (read its ready line next)."""
    command = [
        sys.executable, "-m", "tierkv", "serve", "--host-bytes", "4MiB", "--page-bytes", "4KiB",
        "--gpu-bytes", "0", "--disk-path", str(disk_path), "--disk-bytes", "1MiB",
        "--stats-interval-s", "0", "--listen", f"unix://{socket_path}",
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def main(root: Path, seed: int, trials_per_kind: int, kinds: list[str]) -> int:
    original, work = root / "original", root / "trial"
    build(original)
    totals = {"trials": 0, "wrong_blocks": 0, "wrong_sessions": 0, "errors": 0, "hits": 0,
              "misses": 0, "moved_aside": 0}
    for kind in kinds:
        for number in range(trials_per_kind):
            rng = random.Random(f"{seed}-{kind}-{number}")
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(original, work)
            detail = DAMAGES[kind](work, rng)
            emit({"phase": "open", "kind": kind, "trial": number, "detail": detail})
            try:
                result = check(work)
            except Exception as exc:  # any exception at all is a finding: report it, go on
                result = {"error": f"{type(exc).__name__}: {exc}"}
            emit({"phase": "done", "kind": kind, "trial": number, **result})
            totals["trials"] += 1
            totals["errors"] += result.get("error") is not None or not result.get("usable")
            for name in ("wrong_blocks", "wrong_sessions", "hits", "misses", "moved_aside"):
                totals[name] += int(result.get(name, 0))
    emit({"phase": "summary", **totals})
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "check":
        emit(check(Path(sys.argv[2])))
        sys.exit(0)
    chosen = sys.argv[4:] or list(DAMAGES)
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), chosen))
