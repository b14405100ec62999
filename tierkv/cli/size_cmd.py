"""``tierkv size``: how many bytes of KV cache a model needs, and how many tokens fit.

KV bytes = num_layers x num_kv_heads x (head_dim + V head dim) x bytes per element x seq_len x
batch (V's head dim is head_dim unless ``--head-dim-v`` says otherwise; 0 for an MLA latent); the
arithmetic is :class:`tierkv.layout.KVLayout`'s. With ``--memory``, the blocks that fit are
counted as the HOST and GPU tiers count them (``tierkv.paging.blocks_that_fit``): a slab of
``--page-bytes`` pages (the server's default unless given), each block taking whole pages.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tierkv.config import DEFAULT_PAGE_BYTES
from tierkv.errors import ConfigError
from tierkv.layout import PRESETS, DType, KVLayout, ModelPreset
from tierkv.paging import blocks_that_fit, pages_for
from tierkv.sizes import format_size, parse_size


def register(subparsers: Any) -> None:
    """Add the ``size`` sub-command to ``subparsers`` (from ``add_subparsers``)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "size",
        help="compute KV-cache sizes for a model",
        description="Compute KV-cache bytes per token, block, request and batch, and how many "
        "tokens fit in a memory budget. "
        "KV bytes = layers x kv_heads x (head_dim + head_dim_v) x bytes/element x seq_len x "
        "batch; head_dim_v is head_dim unless given (0: an MLA latent, one 'head').",
    )
    parser.add_argument("--model", help="a preset (case-insensitive; see --list-models)")
    parser.add_argument("--list-models", action="store_true", help="list the presets and exit")
    parser.add_argument("--layers", type=int, help="number of layers (overrides the preset)")
    parser.add_argument("--kv-heads", type=int, help="number of KV heads (overrides the preset)")
    parser.add_argument("--head-dim", type=int, help="head dimension (overrides the preset)")
    parser.add_argument("--head-dim-v", type=int,
                        help="V's head dimension where it differs from K's (0: no V, an MLA "
                        "latent of --head-dim per token; overrides the preset)")
    parser.add_argument(
        "--dtype",
        default=DType.FP16.value,
        help=f"element type: {', '.join(d.value for d in DType)} (default: fp16)",
    )
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per request (8192)")
    parser.add_argument("--batch", type=int, default=1, help="requests in the batch (1)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    parser.add_argument("--memory", help="memory budget, e.g. 80GiB: report what fits in it")
    parser.add_argument("--page-bytes", default=str(DEFAULT_PAGE_BYTES),
                        help="the server's --page-bytes, for the blocks that fit in --memory "
                        f"(default: {format_size(DEFAULT_PAGE_BYTES)}, the server's default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Execute ``tierkv size``; bad settings raise :class:`ConfigError`. Returns 0."""
    if args.list_models:
        _print_models(json_output=args.json)
        return 0
    report = size_report(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_format_report(report))
    return 0


def size_report(args: argparse.Namespace) -> dict[str, Any]:
    """The numbers ``tierkv size`` prints, as a JSON-able dict (see the module docstring)."""
    for flag in ("layers", "kv_heads", "head_dim", "seq_len", "batch", "block_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    preset = _find_preset(args.model) if args.model else None
    geometry: dict[str, int] = {}
    fields = (("layers", "num_layers"), ("kv_heads", "num_kv_heads"), ("head_dim", "head_dim"))
    for flag, field in fields:
        value = getattr(args, flag)
        if value is None and preset is not None:
            value = getattr(preset, field)
        if value is None:
            raise ConfigError(f"--{flag.replace('_', '-')} is required without --model")
        geometry[field] = value
    head_dim_v = args.head_dim_v
    if head_dim_v is None and preset is not None:
        head_dim_v = preset.head_dim_v
    if head_dim_v is not None and head_dim_v < 0:
        raise ConfigError(f"--head-dim-v must be 0 or more, got {head_dim_v}")
    layout = KVLayout(**geometry, block_size=args.block_size, dtype=DType.parse(args.dtype),
                      head_dim_v=head_dim_v)
    report: dict[str, Any] = {
        "model": preset.name if preset else None,
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "head_dim_v": layout.value_head_dim,
        "block_size": layout.block_size,
        "dtype": layout.dtype.value,
        "fingerprint": layout.fingerprint,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "bytes_per_token": layout.bytes_per_token,
        "bytes_per_block": layout.bytes_per_block,
        "bytes_per_request": layout.bytes_for(args.seq_len),
        "bytes_per_batch": layout.bytes_for(args.seq_len, args.batch),
    }
    if args.memory is not None:
        memory = parse_size(args.memory, "--memory")
        if memory < 1:
            raise ConfigError(f"--memory must be more than 0 bytes, got {args.memory!r}")
        report["memory_bytes"] = memory
        report["tokens_that_fit"] = memory // layout.bytes_per_token
        report["requests_that_fit"] = memory // report["bytes_per_request"]
        page_bytes = parse_size(args.page_bytes, "--page-bytes")
        if page_bytes < 1:
            raise ConfigError(f"--page-bytes must be more than 0 bytes, got {args.page_bytes!r}")
        num_pages = pages_for(layout.bytes_per_block, page_bytes)
        report["page_bytes"] = page_bytes
        report["pages_per_block"] = num_pages
        report["blocks_that_fit"] = blocks_that_fit(memory, page_bytes, layout.bytes_per_block)
        report["page_utilisation"] = layout.bytes_per_block / (num_pages * page_bytes)
    return report


def _find_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        names = ", ".join(p.name for p in PRESETS.values())
        raise ConfigError(f"--model: unknown model {name!r}; choose one of {names}") from None


def _print_models(json_output: bool) -> None:
    presets = list(PRESETS.values())
    if json_output:
        rows = [
            {
                "name": p.name,
                "num_layers": p.num_layers,
                "num_kv_heads": p.num_kv_heads,
                "head_dim": p.head_dim,
                "head_dim_v": p.layout().value_head_dim,
                "fp16_bytes_per_token": p.layout().bytes_per_token,
            }
            for p in presets
        ]
        print(json.dumps(rows, indent=2))
        return
    print(f"{'model':<16} {'layers':>6} {'kv_heads':>8} {'head_dim':>8} {'V dim':>6} "
          f"{'fp16 B/token':>13}")
    for p in presets:
        print(
            f"{p.name:<16} {p.num_layers:>6} {p.num_kv_heads:>8} {p.head_dim:>8} "
            f"{p.layout().value_head_dim:>6} {p.layout().bytes_per_token:>13,}"
        )


def _bytes(num_bytes: int) -> str:
    return f"{num_bytes:,} B ({format_size(num_bytes)})"


def _format_report(r: dict[str, Any]) -> str:
    lines = [
        f"model:             {r['model'] or '(custom)'}",
        f"layout:            {r['num_layers']} layers x {r['num_kv_heads']} KV heads x "
        f"head_dim {r['head_dim']}"
        + (f" (V {r['head_dim_v']})" if r["head_dim_v"] != r["head_dim"] else "")
        + f", {r['dtype']}, block_size {r['block_size']}",
        f"per token:         {_bytes(r['bytes_per_token'])}",
        f"per block:         {_bytes(r['bytes_per_block'])}  [{r['block_size']:,} tokens]",
        f"per request:       {_bytes(r['bytes_per_request'])}  [{r['seq_len']:,} tokens]",
        f"per batch:         {_bytes(r['bytes_per_batch'])}  "
        f"[{r['batch']:,} x {r['seq_len']:,} tokens]",
    ]
    if "memory_bytes" in r:
        lines += [
            f"memory:            {_bytes(r['memory_bytes'])}",
            f"tokens that fit:   {r['tokens_that_fit']:,}",
            f"requests that fit: {r['requests_that_fit']:,}  [of {r['seq_len']:,} tokens]",
            f"blocks that fit:   {r['blocks_that_fit']:,}  [{r['pages_per_block']:,} page(s) of "
            f"{format_size(r['page_bytes'])} a block: {r['page_utilisation']:.1%} of them KV]",
        ]
    return "\n".join(lines)
