"""``tierkv stats`` and ``tierkv clear`` against a real server: tables, JSON, --watch until
Ctrl-C, confirmation, tenants and admin tenants, the counts printed."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.harness import ALICE_TOKEN, BOB_TOKEN, BackgroundServer, interruptible_tierkv
from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, blocks, keys
from tierkv import Client, KVLayout, Namespace, WritePolicy
from tierkv.cli.clear_cmd import parse_namespace
from tierkv.cli.main import main

ADMIN_TOKEN = "v" * 32
TOKENS = {ALICE_TOKEN: "alice", BOB_TOKEN: "bob", ADMIN_TOKEN: "ops"}
MODEL_A = Namespace("model-a", TINY_LAYOUT)
MODEL_B = Namespace("model-b", KVLayout(2, 2, 8, 8))  # blocks of 1 KiB


class Terminal(io.StringIO):
    """A stdin that is a terminal, with the operator's answer typed in."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BackgroundServer]:
    background = BackgroundServer(tmp_path / "store", tokens=TOKENS, admin_tenants=("ops",))
    try:
        for token, seed in ((ALICE_TOKEN, 0), (BOB_TOKEN, 10)):
            with Client(background.target, token=token, use_shm=False) as client:
                client.put(MODEL_A, keys(3), blocks(3, seed=seed),
                           write_policy=WritePolicy.WRITE_THROUGH)
                client.put(MODEL_B, keys(2), blocks(2, seed=seed, layout=MODEL_B.layout))
                client.save_session(MODEL_A, "chat", [1, 2, 3])
        yield background
    finally:
        background.close()


def held(server: BackgroundServer, token: str) -> list[int]:
    with Client(server.target, token=token, use_shm=False) as client:
        return [client.lookup(ns, keys(3)) for ns in (MODEL_A, MODEL_B)]


def test_stats_prints_tiers_counters_and_the_callers_namespaces(
        server: BackgroundServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", server.target, "--token", ALICE_TOKEN]) == 0
    out = capsys.readouterr().out
    assert "host" in out and "disk" in out and "hit ratio" in out and "evictions" in out
    assert "sessions 2" in out  # every tenant's
    namespace_rows = [line.split() for line in out.splitlines()
                      if line.startswith(("alice", "bob"))]
    assert [row[:3] for row in namespace_rows] == [["alice", "model-b", "2x2x8/8/fp16"],
                                                    ["alice", "model-a", "2x2x8/4/fp16"]]
    assert namespace_rows[1][4] == "3" and namespace_rows[1][-1] == "1"


def test_stats_json_and_an_admin_sees_every_tenant(
        server: BackgroundServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", server.target, "--token", ADMIN_TOKEN, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_sessions"] == 2 and data["tiers"]["host"]["num_blocks"] == 10
    assert {(n["tenant"], n["model_id"]) for n in data["namespaces"]} == {
        (t, m) for t in ("alice", "bob") for m in ("model-a", "model-b")}
    by_name = {(n["tenant"], n["model_id"]): n for n in data["namespaces"]}
    assert by_name[("bob", "model-b")]["stored_bytes"] == 2 * MODEL_B.layout.bytes_per_block
    assert data["namespaces"][0]["stored_bytes"] == 2048  # largest first


def test_stats_watch_refreshes_until_ctrl_c(server: BackgroundServer) -> None:
    process = subprocess.Popen(
        interruptible_tierkv("stats", "--target", server.target, "--token", ALICE_TOKEN,
                             "--json", "--watch", "0.05"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    assert process.stdout is not None
    lines = [process.stdout.readline() for _ in range(3)]  # three refreshes
    assert all(json.loads(line)["tiers"]["host"]["num_blocks"] == 10 for line in lines)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0, process.stderr.read() if process.stderr else ""
    process.stdout.close()
    if process.stderr is not None:
        process.stderr.close()


def test_stats_of_no_server_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", f"unix://{tmp_path}/none.sock"]) == 2
    assert "tierkv stats:" in capsys.readouterr().err


def test_clear_refuses_without_a_terminal_unless_yes(
        server: BackgroundServer, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # not a terminal
    args = ["clear", "--target", server.target, "--token", ALICE_TOKEN, "--all"]
    assert main(args) == 1
    assert "--yes" in capsys.readouterr().err
    assert held(server, ALICE_TOKEN) == [3, 2]
    assert main([*args, "--yes"]) == 0
    out = capsys.readouterr().out
    cleared_kib = (3 * BLOCK_BYTES + 2 * 1024) / 1024
    assert f"cleared 5 blocks ({cleared_kib:.1f} KiB) and 1 sessions of 2 namespaces" in out
    assert held(server, ALICE_TOKEN) == [0, 0] and held(server, BOB_TOKEN) == [3, 2]


def test_clear_asks_on_a_terminal(server: BackgroundServer, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["clear", "--target", server.target, "--token", ALICE_TOKEN, "--model", "model-b"]
    monkeypatch.setattr(sys, "stdin", Terminal("n\n"))
    assert main(args) == 1
    assert "model 'model-b'" in capsys.readouterr().out
    assert held(server, ALICE_TOKEN) == [3, 2]
    monkeypatch.setattr(sys, "stdin", Terminal("yes\n"))
    assert main(args) == 0
    assert held(server, ALICE_TOKEN) == [3, 0]


def test_clear_of_another_tenant_needs_an_admin(
        server: BackgroundServer, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["clear", "--target", server.target, "--yes", "--tenant", "bob"]
    assert main([*base, "--token", ALICE_TOKEN]) == 2
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert held(server, BOB_TOKEN) == [3, 2]
    assert main([*base, "--token", ADMIN_TOKEN, "--namespace", "model-a:2x2x8/4/fp16"]) == 0
    assert "cleared 3 blocks" in capsys.readouterr().out
    assert held(server, BOB_TOKEN) == [0, 2] and held(server, ALICE_TOKEN) == [3, 2]


def test_clear_checks_its_scope_before_it_calls(
        server: BackgroundServer, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["clear", "--target", server.target, "--token", ALICE_TOKEN, "--yes"]
    assert main(base) == 1
    assert main([*base, "--all", "--model", "model-a"]) == 1
    assert main([*base, "--namespace", "model-a"]) == 2
    assert "MODEL:LAYOUT" in capsys.readouterr().err
    assert held(server, ALICE_TOKEN) == [3, 2]


def test_namespaces_parse_with_colons_in_the_model_and_tensor_parallel_shards() -> None:
    assert parse_namespace("org/m:v2:32x8x128/16/bf16:1/4") == Namespace(
        "org/m:v2", KVLayout(32, 8, 128, 16, "bf16"), 1, 4)
    assert parse_namespace("m:2x2x8/4/fp16") == Namespace("m", TINY_LAYOUT)
