"""Review attacks on ``tierkv stats`` and ``tierkv clear`` as an operator under stress runs
them: a watch across a server restart, wrong tokens, and arguments past what the wire
carries: one line and an exit code, never a traceback, and nothing cleared by mistake."""

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
    BackgroundServer,
    SidecarFactory,
    interruptible_tierkv,
    short_socket_dir,
    stream_client,
)
from tests.support.tiny_blocks import TINY_LAYOUT, blocks, keys
from tierkv import Client, Namespace, WritePolicy
from tierkv.cli.clear_cmd import parse_namespace
from tierkv.cli.main import main
from tierkv.errors import InvalidArgumentError
from tierkv.service.servicer import TierKVServicer
from tierkv.wire import tierkv_pb2 as pb

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
def server(tmp_path: Path) -> Iterator[BackgroundServer]:
    background = BackgroundServer(tmp_path / "store")
    try:
        with Client(background.target, token=ALICE_TOKEN, use_shm=False) as client:
            client.put(MODEL, keys(3), blocks(3), write_policy=WritePolicy.WRITE_THROUGH)
            client.save_session(MODEL, "chat", [1, 2, 3])
        yield background
    finally:
        background.close()


def held(server: BackgroundServer) -> tuple[int, int]:
    with Client(server.target, token=ALICE_TOKEN, use_shm=False) as client:
        return client.lookup(MODEL, keys(3)), len(client.list_sessions())


def test_a_wrong_token_ends_a_watch_and_clears_nothing(server: BackgroundServer) -> None:
    """A refusal that waiting cannot change ends a watch (it is not taken for a restart)."""
    watch = tierkv("stats", "--target", server.target, "--token", "w" * 32, "--watch", "0.05")
    _, err = watch.communicate(timeout=60)
    assert watch.returncode == 2 and "UNAUTHENTICATED" in err and "Traceback" not in err
    clear = tierkv("clear", "--target", server.target, "--token", "w" * 32, "--all", "--yes")
    _, err = clear.communicate(timeout=60)
    assert clear.returncode == 2 and "UNAUTHENTICATED" in err and "Traceback" not in err
    assert held(server) == (3, 1)


@pytest.mark.parametrize("argv", [
    ["stats", "--max-namespaces", "-1"],
    ["stats", "--max-namespaces", str(2**32)],
    ["stats", "--watch", "inf"],
    ["stats", "--watch", "nan"],
    ["stats", "--watch", "0"],
])
def test_stats_arguments_out_of_range_are_usage_errors(
        server: BackgroundServer, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """They were a protobuf ValueError traceback (the count), an OverflowError from
    ``time.sleep`` after the first refresh (an infinite watch)."""
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--target", server.target, "--token", ALICE_TOKEN])
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
        server: BackgroundServer, capsys: pytest.CaptureFixture[str], text: str, why: str) -> None:
    """``--namespace`` values with a second shard slash or fields past 32 bits were ValueError
    tracebacks; past the server's bounds, a call that could only be refused."""
    with pytest.raises(InvalidArgumentError, match=r"\S"):
        parse_namespace(text)
    argv = ["clear", "--target", server.target, "--token", ALICE_TOKEN, "--yes",
            "--namespace", text]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierkv clear: ") and why in err
    assert held(server) == (3, 1)
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
    server = BackgroundServer(tmp_path / "store", servicer=HeldClear)
    try:
        with Client(server.target, token=ALICE_TOKEN, use_shm=False) as client:
            client.put(MODEL, keys(3), blocks(3), write_policy=WritePolicy.WRITE_THROUGH)
        clear = tierkv("clear", "--target", server.target, "--token", ALICE_TOKEN, "--all",
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
        with Client(server.target, token=ALICE_TOKEN, use_shm=False) as client:
            for _ in range(6000):  # the abandoned clear runs to its end (in well under 60 s)
                if not client.lookup(MODEL, keys(3)):
                    break
                threading.Event().wait(0.01)
            assert client.lookup(MODEL, keys(3)) == 0
    finally:
        server.close()


class Interrupted(io.StringIO):
    """A terminal whose operator presses Ctrl-C at the question."""

    def isatty(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:
        raise KeyboardInterrupt


def test_ctrl_c_at_the_confirmation_clears_nothing(
        server: BackgroundServer, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", Interrupted())
    assert main(["clear", "--target", server.target, "--token", ALICE_TOKEN, "--all"]) == 130
    assert "interrupted: nothing cleared" in capsys.readouterr().err
    assert held(server) == (3, 1)


class Answer(io.StringIO):
    """A terminal where the operator answers the question."""

    def isatty(self) -> bool:
        return True


def test_the_question_names_the_tenant_a_namespace_clear_reaches(
        server: BackgroundServer, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--namespace`` without ``--tenant`` clears the token's own tenant's namespace (for an
    admin too), but the question said "every tenant this token reaches": an admin confirmed a
    clear of every tenant's namespace and got his own (nothing)."""
    monkeypatch.setattr(sys, "stdin", Answer("n\n"))
    argv = ["clear", "--target", server.target, "--token", ALICE_TOKEN,
            "--namespace", "model-a:2x2x8/4/fp16"]
    assert main(argv) == 1
    question = capsys.readouterr().out
    assert "this token's own tenant, namespace 'model-a:2x2x8/4/fp16'" in question
    assert "every tenant" not in question
    monkeypatch.setattr(sys, "stdin", Answer("n\n"))
    assert main([*argv, "--tenant", "alice"]) == 1
    assert "tenant 'alice', namespace" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", Answer("n\n"))
    assert main(["clear", "--target", server.target, "--token", ALICE_TOKEN,
                 "--model", "model-a"]) == 1
    assert "every tenant this token reaches, model 'model-a'" in capsys.readouterr().out
    assert held(server) == (3, 1)


EVIL_MODEL = "evil\x1b[2J\x1b[H\nalice    model-a    2x2x8/4/fp16    0/1    999\u200b"


def test_a_tenants_model_id_cannot_redraw_or_forge_an_operators_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Model ids are the clients' choice: one with a terminal escape and a newline was printed
    raw by the admin's ``tierkv stats`` (a cleared screen and a forged row); so was a disk
    record's, by ``tierkv inspect``. Every cell is now printed escaped (JSON was safe)."""
    evil = Namespace(EVIL_MODEL, TINY_LAYOUT)
    server = BackgroundServer(tmp_path / "store", tokens={ALICE_TOKEN: "alice", "a" * 32: "ops"},
                              admin_tenants=("ops",))
    try:
        with Client(server.target, token=ALICE_TOKEN, use_shm=False) as client:
            client.put(evil, keys(1), blocks(1), write_policy=WritePolicy.WRITE_THROUGH)
        assert main(["stats", "--target", server.target, "--token", "a" * 32]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\u200b" not in out
        assert r"evil\x1b[2J\x1b[H\nalice" in out
        assert out.count("model-a") == 1  # the forged row is inside the one escaped cell
        assert main(["stats", "--target", server.target, "--token", "a" * 32, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["namespaces"][0]["model_id"] == EVIL_MODEL
    finally:
        server.close()
    assert main(["inspect", "--disk-path", str(tmp_path / "store" / "disk")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and r"evil\x1b[2J" in out and out.count("model-a") == 1
