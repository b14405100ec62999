"""``tierkv stats`` and ``tierkv clear`` against a real server: tables, JSON, --watch until
Ctrl-C, confirmation, tenants and admin tenants, the counts printed.

Under stress too: a watch across a server restart, wrong tokens, and arguments past what the
wire carries give one line and an exit code, never a traceback, and nothing cleared by mistake.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.support.harness import (
    ALICE_TOKEN,
    BOB_TOKEN,
    BackgroundServer,
    SidecarFactory,
    interruptible_tierkv,
    short_socket_dir,
    stream_client,
)
from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, blocks, keys
from tierkv import Client, KVLayout, Namespace, WritePolicy
from tierkv.cli.clear_cmd import parse_namespace
from tierkv.cli.main import main
from tierkv.errors import InvalidArgumentError
from tierkv.service.servicer import TierKVServicer
from tierkv.wire import tierkv_pb2 as pb

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
    assert "tenant 'alice''s own figures" in out
    assert "sessions 1" in out and "puts 2" in out  # her own, not Bob's
    rows = [line.split() for line in out.splitlines() if line.startswith(("alice", "bob"))]
    share_rows = [row for row in rows if row[1] in ("host", "disk")]
    assert [row[:2] for row in share_rows] == [["alice", "host"], ["alice", "disk"]]
    namespace_rows = [row for row in rows if row[1].startswith("model-")]
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
    assert all(json.loads(line)["tiers"]["host"]["num_blocks"] == 5 for line in lines)  # hers
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


# --- an operator under stress: restarts, wrong tokens, arguments past the wire -----------------


MODEL = Namespace("model-a", TINY_LAYOUT)
ENV = {**os.environ, "TQDM_DISABLE": "1"}


def tierkv(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(interruptible_tierkv(*args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def next_line(process: subprocess.Popen[str], timeout_s: float = 60.0) -> str:
    assert process.stdout is not None
    readable, _, _ = select.select([process.stdout], [], [], timeout_s)
    assert readable, "no line came"
    return process.stdout.readline()


def test_a_stats_watch_outlives_a_server_restart(
        sidecar_factory: SidecarFactory, tmp_path: Path) -> None:
    """The watch said the server was gone (exit 2) at its first refresh after a restart began;
    now it says so once and shows the restarted server's figures."""
    socket_dir = short_socket_dir()
    first = sidecar_factory(socket_dir=socket_dir)
    watch = tierkv("stats", "--target", first.unix_target, "--json", "--watch", "0.05")
    try:
        assert json.loads(next_line(watch))["tiers"]["host"]["num_blocks"] == 0
        first.kill()
        second = sidecar_factory(socket_dir=socket_dir)
        with stream_client(second) as client:
            client.put(MODEL, keys(2), blocks(2))
        while json.loads(next_line(watch))["tiers"]["host"]["num_blocks"] != 2:
            assert watch.poll() is None
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=30)
        assert watch.returncode == 0, err
        assert err.count("asking again every 0.05 s") == 1 and "UNAVAILABLE" in err
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate()
        shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.fixture
def alice_server(tmp_path: Path) -> Iterator[BackgroundServer]:
    background = BackgroundServer(tmp_path / "store")
    try:
        with Client(background.target, token=ALICE_TOKEN, use_shm=False) as client:
            client.put(MODEL, keys(3), blocks(3), write_policy=WritePolicy.WRITE_THROUGH)
            client.save_session(MODEL, "chat", [1, 2, 3])
        yield background
    finally:
        background.close()


def held_by_alice(alice_server: BackgroundServer) -> tuple[int, int]:
    with Client(alice_server.target, token=ALICE_TOKEN, use_shm=False) as client:
        return client.lookup(MODEL, keys(3)), len(client.list_sessions())


def test_a_wrong_token_ends_a_watch_and_clears_nothing(alice_server: BackgroundServer) -> None:
    """A refusal that waiting cannot change ends a watch (it is not taken for a restart)."""
    watch = tierkv("stats", "--target", alice_server.target, "--token", "w" * 32, "--watch", "0.05")
    _, err = watch.communicate(timeout=60)
    assert watch.returncode == 2 and "UNAUTHENTICATED" in err and "Traceback" not in err
    clear = tierkv("clear", "--target", alice_server.target, "--token", "w" * 32, "--all", "--yes")
    _, err = clear.communicate(timeout=60)
    assert clear.returncode == 2 and "UNAUTHENTICATED" in err and "Traceback" not in err
    assert held_by_alice(alice_server) == (3, 1)


@pytest.mark.parametrize("argv", [
    ["stats", "--max-namespaces", "-1"],
    ["stats", "--max-namespaces", str(2**32)],
    ["stats", "--watch", "inf"],
    ["stats", "--watch", "nan"],
    ["stats", "--watch", "0"],
])
def test_stats_arguments_out_of_range_are_usage_errors(
        alice_server: BackgroundServer, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """They were a protobuf ValueError traceback (the count), an OverflowError from
    ``time.sleep`` after the first refresh (an infinite watch)."""
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--target", alice_server.target, "--token", ALICE_TOKEN])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[1]}: must be in" in err or "needs a positive" in err


@pytest.mark.parametrize(("text", "why"), [
    ("model-a:2x2x8/4/fp16:1/2/3", "expected LAYERSxKV_HEADS"),
    ("model-a:2x2x8/99999999999/fp16", "out of range"),
    ("model-a:2x2x8/4/fp16:0/4294967296", "out of range"),
    ("model-a:2000x2x8/4/fp16", "num_layers must be in [1, 1024]"),
])
def test_a_namespace_the_wire_cannot_carry_is_one_line_and_clears_nothing(
        alice_server: BackgroundServer, capsys: pytest.CaptureFixture[str], text: str, why: str) -> None:
    """``--namespace`` values with a second shard slash or fields past 32 bits were ValueError
    tracebacks; past the server's bounds, a call that could only be refused."""
    with pytest.raises(InvalidArgumentError, match=r"\S"):
        parse_namespace(text)
    argv = ["clear", "--target", alice_server.target, "--token", ALICE_TOKEN, "--yes",
            "--namespace", text]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierkv clear: ") and why in err
    assert held_by_alice(alice_server) == (3, 1)
    assert parse_namespace("org/m:v2:2x2x8/4/fp16:1/4").tp_size == 4  # still parsed


class HeldClear(TierKVServicer):
    """The real servicer, whose Clear holds its first message (the store's clear has begun)
    until ``go`` is set, without blocking the loop: a clear under way when its caller is
    interrupted."""

    arrived = threading.Event()
    go = threading.Event()

    async def Clear(self, request: pb.ClearRequest, context: object
                    ) -> AsyncIterator[pb.ClearProgress]:
        async for message in super().Clear(request, context):
            HeldClear.arrived.set()
            while not HeldClear.go.is_set():
                await asyncio.sleep(0.01)
            yield message


def test_ctrl_c_during_a_clear_is_one_line_and_the_server_finishes_it(tmp_path: Path) -> None:
    """Ctrl-C while the server clears was a KeyboardInterrupt traceback (exit -2); now one line
    saying the server finishes what it began (exit 130), and it does."""
    HeldClear.arrived.clear()
    HeldClear.go.clear()
    alice_server = BackgroundServer(tmp_path / "store", servicer=HeldClear)
    try:
        with Client(alice_server.target, token=ALICE_TOKEN, use_shm=False) as client:
            client.put(MODEL, keys(3), blocks(3), write_policy=WritePolicy.WRITE_THROUGH)
        clear = tierkv("clear", "--target", alice_server.target, "--token", ALICE_TOKEN, "--all",
                       "--yes")
        try:
            assert HeldClear.arrived.wait(60)
            clear.send_signal(signal.SIGINT)
            _, err = clear.communicate(timeout=60)
        finally:
            HeldClear.go.set()
            if clear.poll() is None:
                clear.kill()
                clear.communicate()
        assert clear.returncode == 130 and "Traceback" not in err
        assert "interrupted: a clear the server had begun runs to its end" in err
        with Client(alice_server.target, token=ALICE_TOKEN, use_shm=False) as client:
            for _ in range(6000):  # the abandoned clear runs to its end (in well under 60 s)
                if not client.lookup(MODEL, keys(3)):
                    break
                threading.Event().wait(0.01)
            assert client.lookup(MODEL, keys(3)) == 0
    finally:
        alice_server.close()


class Interrupted(io.StringIO):
    """A terminal whose operator presses Ctrl-C at the question."""

    def isatty(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:
        raise KeyboardInterrupt


def test_ctrl_c_at_the_confirmation_clears_nothing(
        alice_server: BackgroundServer, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", Interrupted())
    assert main(["clear", "--target", alice_server.target, "--token", ALICE_TOKEN, "--all"]) == 130
    assert "interrupted: nothing cleared" in capsys.readouterr().err
    assert held_by_alice(alice_server) == (3, 1)


class Answer(io.StringIO):
    """A terminal where the operator answers the question."""

    def isatty(self) -> bool:
        return True


def test_the_question_names_the_tenant_a_namespace_clear_reaches(
        alice_server: BackgroundServer, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--namespace`` without ``--tenant`` clears the token's own tenant's namespace (for an
    admin too), but the question said "every tenant this token reaches": an admin confirmed a
    clear of every tenant's namespace and got his own (nothing)."""
    monkeypatch.setattr(sys, "stdin", Answer("n\n"))
    argv = ["clear", "--target", alice_server.target, "--token", ALICE_TOKEN,
            "--namespace", "model-a:2x2x8/4/fp16"]
    assert main(argv) == 1
    question = capsys.readouterr().out
    assert "this token's own tenant, namespace 'model-a:2x2x8/4/fp16'" in question
    assert "every tenant" not in question
    monkeypatch.setattr(sys, "stdin", Answer("n\n"))
    assert main([*argv, "--tenant", "alice"]) == 1
    assert "tenant 'alice', namespace" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", Answer("n\n"))
    assert main(["clear", "--target", alice_server.target, "--token", ALICE_TOKEN,
                 "--model", "model-a"]) == 1
    assert "every tenant this token reaches, model 'model-a'" in capsys.readouterr().out
    assert held_by_alice(alice_server) == (3, 1)


EVIL_MODEL = "evil\x1b[2J\x1b[H\nalice    model-a    2x2x8/4/fp16    0/1    999\u200b"


def test_a_tenants_model_id_cannot_redraw_or_forge_an_operators_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Model ids are the clients' choice: one with a terminal escape and a newline was printed
    raw by the admin's ``tierkv stats`` (a cleared screen and a forged row); so was a disk
    record's, by ``tierkv inspect``. Every cell is now printed escaped (JSON was safe)."""
    evil = Namespace(EVIL_MODEL, TINY_LAYOUT)
    alice_server = BackgroundServer(tmp_path / "store", tokens={ALICE_TOKEN: "alice", "a" * 32: "ops"},
                              admin_tenants=("ops",))
    try:
        with Client(alice_server.target, token=ALICE_TOKEN, use_shm=False) as client:
            client.put(evil, keys(1), blocks(1), write_policy=WritePolicy.WRITE_THROUGH)
        assert main(["stats", "--target", alice_server.target, "--token", "a" * 32]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\u200b" not in out
        assert r"evil\x1b[2J\x1b[H\nalice" in out
        assert out.count("model-a") == 1  # the forged row is inside the one escaped cell
        assert main(["stats", "--target", alice_server.target, "--token", "a" * 32, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["namespaces"][0]["model_id"] == EVIL_MODEL
    finally:
        alice_server.close()
    assert main(["inspect", "--disk-path", str(tmp_path / "store" / "disk")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and r"evil\x1b[2J" in out and out.count("model-a") == 1
