"""The committed stubs in tierkv/wire/ are exactly what scripts/gen-proto makes from the .proto."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run([str(REPO / "scripts" / "gen-proto"), str(tmp_path)], check=True, env=env)
    for name in ("tierkv_pb2.py", "tierkv_pb2.pyi", "tierkv_pb2_grpc.py"):
        fresh = (tmp_path / name).read_text()
        committed = (REPO / "tierkv" / "wire" / name).read_text()
        assert fresh == committed, f"tierkv/wire/{name} is stale: run scripts/gen-proto"


def test_the_stubs_import_and_describe_the_service() -> None:
    from tierkv.wire import tierkv_pb2, tierkv_pb2_grpc

    service = tierkv_pb2.DESCRIPTOR.services_by_name["TierKV"]
    assert {m.name for m in service.methods} >= {
        "Lookup", "Put", "Get", "Pin", "Unpin", "Delete", "Stats", "Acquire", "Release",
        "Allocate", "Commit", "Abort", "SaveSession", "ResumeSession", "DeleteSession",
        "ListSessions", "Describe",
    }
    assert tierkv_pb2.DESCRIPTOR.package == "tierkv.v1"
    assert hasattr(tierkv_pb2_grpc, "TierKVStub")
