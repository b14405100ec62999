"""``tierkv size``: the KV-size calculator prints the design's numbers and rejects bad input."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.support import REPO
from tierkv.cli import size_cmd
from tierkv.config import HostTierConfig, StoreConfig, Tier
from tierkv.errors import TierKVError
from tierkv.keys import Namespace
from tierkv.layout import PRESETS, KVLayout
from tierkv.paging import blocks_that_fit
from tierkv.store import TieredStore

GIB = 1024**3

Runner = Callable[..., tuple[int, str, str]]


@pytest.fixture
def size(capsys: pytest.CaptureFixture[str]) -> Runner:
    """Run ``tierkv size ARGS`` through a parser that mirrors ``tierkv.cli.main``.

    Only ``size`` is registered, so these tests do not depend on the other sub-commands;
    errors are handled as ``main`` handles them. Returns ``(exit code, stdout, stderr)``.
    """
    parser = argparse.ArgumentParser(prog="tierkv")
    subparsers = parser.add_subparsers(dest="command", required=True)
    size_cmd.register(subparsers)

    def run(*argv: str) -> tuple[int, str, str]:
        args = parser.parse_args(["size", *argv])
        try:
            code: int = args.func(args)
        except TierKVError as exc:
            print(f"tierkv {args.command}: {exc}", file=sys.stderr)
            code = 2
        out, err = capsys.readouterr()
        return code, out, err

    return run


def size_json(size: Runner, *argv: str) -> dict[str, Any]:
    code, out, err = size(*argv, "--json")
    assert code == 0, err
    report: dict[str, Any] = json.loads(out)
    return report


def line(out: str, label: str) -> str:
    """The one output line that starts with ``label``."""
    found = [row for row in out.splitlines() if row.startswith(label)]
    assert len(found) == 1, out
    return found[0]


def test_llama3_8b_table(size: Runner) -> None:
    code, out, err = size("--model", "llama-3-8b")
    assert code == 0
    assert err == ""
    assert "Llama-3-8B" in line(out, "model:")
    assert "131,072 B (128.0 KiB)" in line(out, "per token:")
    assert "2,097,152 B (2.0 MiB)" in line(out, "per block:")
    request = line(out, "per request:")
    assert "1,073,741,824 B (1.0 GiB)" in request
    assert "8,192 tokens" in request
    assert "1,073,741,824 B" in line(out, "per batch:")
    assert "fit" not in out  # no --memory, no capacity lines


def test_llama3_8b_json_and_defaults(size: Runner) -> None:
    report = size_json(size, "--model", "llama-3-8b")
    assert report == {
        "model": "Llama-3-8B",
        "num_layers": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "head_dim_v": 128,
        "block_size": 16,
        "dtype": "fp16",
        "fingerprint": PRESETS["llama-3-8b"].layout().fingerprint,
        "seq_len": 8192,
        "batch": 1,
        "bytes_per_token": 131_072,
        "bytes_per_block": 2_097_152,
        "bytes_per_request": GIB,
        "bytes_per_batch": GIB,
    }


def test_model_name_is_case_insensitive(size: Runner) -> None:
    assert size_json(size, "--model", "LLAMA-3-8B") == size_json(size, "--model", "llama-3-8b")


def test_explicit_geometry_batch_of_16(size: Runner) -> None:
    # 2 x 80 x 16 x 16384 x 8 x 128 x 2 bytes = 85,899,345,920 (80 GiB).
    geometry = ("--layers", "80", "--kv-heads", "8", "--head-dim", "128")
    argv = (*geometry, "--seq-len", "16384", "--batch", "16")
    report = size_json(size, *argv)
    assert report["model"] is None
    assert report["bytes_per_token"] == 327_680
    assert report["bytes_per_request"] == 327_680 * 16384
    assert report["bytes_per_batch"] == 2 * 80 * 16 * 16384 * 8 * 128 * 2 == 85_899_345_920
    code, out, _ = size(*argv)
    assert code == 0
    assert "85,899,345,920 B (80.0 GiB)" in line(out, "per batch:")
    assert "16 x 16,384 tokens" in line(out, "per batch:")


def test_flags_override_the_preset(size: Runner) -> None:
    report = size_json(size, "--model", "llama-3-70b", "--kv-heads", "64")
    assert (report["num_layers"], report["num_kv_heads"], report["head_dim"]) == (80, 64, 128)
    assert report["bytes_per_token"] == 2_621_440


def test_memory_budget(size: Runner) -> None:
    report = size_json(size, "--model", "llama-3-8b", "--memory", "80GiB")
    assert report["memory_bytes"] == 80 * GIB
    assert report["tokens_that_fit"] == 80 * GIB // 131_072 == 655_360
    assert report["requests_that_fit"] == 80
    assert report["blocks_that_fit"] == 40_960
    code, out, _ = size("--model", "llama-3-8b", "--memory", "80GiB")
    assert code == 0
    assert "85,899,345,920 B (80.0 GiB)" in line(out, "memory:")
    assert "655,360" in line(out, "tokens that fit:")
    assert "80" in line(out, "requests that fit:")
    assert "40,960" in line(out, "blocks that fit:")


def test_memory_budget_rounds_down(size: Runner) -> None:
    # 1 GB (decimal) is not a whole number of tokens, blocks or requests.
    report = size_json(size, "--model", "llama-3-8b", "--memory", "1GB", "--seq-len", "1000")
    assert report["tokens_that_fit"] == 10**9 // 131_072 == 7629
    assert report["blocks_that_fit"] == 10**9 // 2_097_152 == 476
    assert report["requests_that_fit"] == 7


@pytest.mark.parametrize(
    ("page_flags", "pages_per_block", "blocks", "utilisation"),
    [
        ((), 48, 8 * GIB // 196_608, 1.0),  # the server's default 4 KiB pages
        (("--page-bytes", "256KiB"), 1, 8 * GIB // (256 * 1024), 0.75),
        (("--page-bytes", "5000"), 40, (8 * GIB // 5000) // 40, 196_608 / 200_000),
    ],
)
def test_blocks_that_fit_take_whole_pages(
    size: Runner, page_flags: tuple[str, ...], pages_per_block: int, blocks: int,
    utilisation: float,
) -> None:
    # A Qwen2.5-0.5B-shaped block (24 x 2 x 64, fp16): 196,608 bytes, 48 pages of 4 KiB.
    argv = ("--layers", "24", "--kv-heads", "2", "--head-dim", "64", "--memory", "8GiB")
    report = size_json(size, *argv, *page_flags)
    assert report["pages_per_block"] == pages_per_block
    assert report["blocks_that_fit"] == blocks
    assert report["page_utilisation"] == pytest.approx(utilisation)
    code, out, _ = size(*argv, *page_flags)
    assert code == 0 and f"{blocks:,}" in line(out, "blocks that fit:")


def test_blocks_that_fit_is_what_a_host_tier_holds() -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=40, block_size=16)  # 7,680 B
    capacity = 1_000_000
    expected = blocks_that_fit(capacity, 4096, layout.bytes_per_block)
    with TieredStore(StoreConfig(host=HostTierConfig(capacity), presence_slots=0)) as store:
        namespace = Namespace("size-check", layout)
        store.register(namespace)
        for i in range(expected + 5):
            store.put(namespace, [i.to_bytes(32, "big")],
                      torch.zeros((1, *layout.block_shape), dtype=layout.torch_dtype))
        assert store.stats().tiers[Tier.HOST].num_blocks == expected


@pytest.mark.parametrize(
    ("dtype", "per_token", "per_block"),
    [
        ("fp32", 262_144, 4_194_304),
        ("bf16", 131_072, 2_097_152),
        ("int8", 65_536, 1_048_576),
        ("fp8", 65_536, 1_048_576),
        ("int4", 32_768, 524_288),
    ],
)
def test_dtypes(size: Runner, dtype: str, per_token: int, per_block: int) -> None:
    report = size_json(size, "--model", "llama-3-8b", "--dtype", dtype)
    assert report["dtype"] == dtype
    assert report["bytes_per_token"] == per_token
    assert report["bytes_per_block"] == per_block
    assert report["bytes_per_request"] == per_token * 8192


def test_int4_with_memory_and_block_size(size: Runner) -> None:
    argv = ("--model", "llama-3-8b", "--dtype", "int4", "--block-size", "32", "--memory", "1GiB")
    report = size_json(size, *argv)
    assert report["bytes_per_block"] == 32_768 * 32
    assert report["tokens_that_fit"] == GIB // 32_768 == 32_768
    assert report["requests_that_fit"] == 4
    assert report["blocks_that_fit"] == 1024


def test_list_models(size: Runner) -> None:
    code, out, _ = size("--list-models")
    assert code == 0
    for preset in PRESETS.values():
        row = line(out, preset.name + " ")
        numbers = row.split()[1:]
        assert numbers[:4] == [str(preset.num_layers), str(preset.num_kv_heads),
                               str(preset.head_dim), str(preset.layout().value_head_dim)]
        assert numbers[4] == f"{preset.layout().bytes_per_token:,}"
    rows = json.loads(size("--list-models", "--json")[1])
    assert [r["name"] for r in rows] == [p.name for p in PRESETS.values()]
    assert (
        rows[0]["fp16_bytes_per_token"] == PRESETS[rows[0]["name"].lower()].layout().bytes_per_token
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--kv-heads", "8", "--head-dim", "128"), "--layers is required"),
        (("--layers", "32", "--head-dim", "128"), "--kv-heads is required"),
        (("--layers", "32", "--kv-heads", "8"), "--head-dim is required"),
        (("--model", "llama-3-8b", "--seq-len", "0"), "--seq-len must be a positive integer"),
        (("--model", "llama-3-8b", "--batch", "-1"), "--batch must be a positive integer"),
        (("--model", "llama-3-8b", "--layers", "0"), "--layers must be a positive integer"),
        (("--model", "llama-3-8b", "--kv-heads", "-8"), "--kv-heads must be a positive integer"),
        (("--model", "llama-3-8b", "--block-size", "0"), "--block-size must be a positive"),
        (("--model", "llama-9"), "unknown model 'llama-9'"),
        (("--model", "llama-3-8b", "--memory", "lots"), "--memory: cannot read 'lots'"),
        (("--model", "llama-3-8b", "--memory", "0"), "--memory must be more than 0"),
        (("--model", "llama-3-8b", "--memory", "1GiB", "--page-bytes", "0"),
         "--page-bytes must be more than 0"),
        (("--model", "llama-3-8b", "--memory", "1GiB", "--page-bytes", "big"),
         "--page-bytes: cannot read 'big'"),
        (("--model", "llama-3-8b", "--dtype", "fp64"), "unknown dtype 'fp64'"),
        (("--model", "llama-3-8b", "--dtype", "int4", "--head-dim", "127"), "head_dim"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    size: Runner, argv: tuple[str, ...], message: str
) -> None:
    code, out, err = size(*argv)
    assert code == 2
    assert out == ""
    assert err.startswith("tierkv size: ")
    assert message in err


def test_unknown_model_lists_the_presets(size: Runner) -> None:
    _, _, err = size("--model", "gpt-2")
    assert all(p.name in err for p in PRESETS.values())


def test_through_main(capsys: pytest.CaptureFixture[str]) -> None:
    from tierkv.cli.main import main  # imports every sub-command module

    assert main(["size", "--model", "Llama-3-8B", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_request"] == GIB
    assert main(["size", "--model", "llama-3-8b", "--seq-len", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "tierkv size: --seq-len must be a positive integer" in captured.err


def test_console_script_in_a_subprocess() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tierkv", "size", "--model", "llama-3-8b", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["bytes_per_token"] == 131_072
    assert report["bytes_per_request"] == GIB


def test_an_mla_latent_is_one_head_without_v(size: Runner) -> None:
    """DeepSeek-V3 as vLLM caches it: one latent of 576 (512 + 64 rope) per token and layer."""
    report = size_json(size, "--model", "deepseek-v3", "--dtype", "bf16", "--seq-len", "1000")
    assert (report["num_kv_heads"], report["head_dim"], report["head_dim_v"]) == (1, 576, 0)
    assert report["bytes_per_token"] == 61 * 576 * 2
    assert report["bytes_per_request"] == 61 * 576 * 2 * 1000
    custom = size_json(size, "--layers", "4", "--kv-heads", "2", "--head-dim", "192",
                       "--head-dim-v", "128")
    assert custom["bytes_per_token"] == 4 * 2 * (192 + 128) * 2
    code, _, err = size("--model", "llama-3-8b", "--head-dim-v", "-1")
    assert code != 0 and "--head-dim-v" in err
