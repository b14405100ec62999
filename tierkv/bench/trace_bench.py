"""``tierkv bench trace``: a request trace replayed through a real sidecar the way an engine uses
it, at several HOST sizes, beside simulations of other policies and of Belady's optimum on the
same request sequence (``tierkv.bench.policies``).

Each request: a lookup of its chain, a same-host ``get_into`` of the hit (a read lease, as the
vLLM connector loads), then the missing blocks put ``put_blocks`` at a time, head first, each
put naming its parent (as the connector saves a chunked prefill). HOST sizes are shares of the
trace's distinct blocks; with ``disk_factor``, a DISK tier of that many times HOST sits below.
Design and figures: docs/design/eviction.md#measured-hit-ratios."""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tierkv.bench.policies import Replay, TraceFacts, simulate, simulated_policies
from tierkv.bench.report import Row, save_figure
from tierkv.bench.servers import tierkv_server
from tierkv.bench.traces import MOONCAKE_BLOCK_TOKENS, Request
from tierkv.client import Client
from tierkv.config import Eviction, Tier
from tierkv.keys import Namespace
from tierkv.layout import KVLayout
from tierkv.tiers.records import block_record_bytes
from tierkv.types import PutDetail

Progress = Callable[[str], None]
# 8 KiB blocks (two pages): the policy, not the bytes, is measured.
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=128, block_size=16)
NAMESPACE = Namespace("trace-bench", LAYOUT)
TARGET_SHARE_OF_OPTIMUM = 0.8


@dataclass(frozen=True, slots=True)
class TraceBenchConfig:
    """``host_shares``: HOST sizes as shares of the trace's distinct blocks; ``disk_factor``:
    a DISK tier of that many times HOST below it (0: none); ``simulate``: also run the
    simulated policies; ``evictions``: the sidecar's ``--eviction`` policies, one replay each;
    ``extra_flags``: more ``tierkv serve`` flags."""

    work_dir: Path
    host_shares: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2)
    disk_factor: float = 0.0
    put_blocks: int = 4
    simulate: bool = True
    evictions: tuple[Eviction, ...] = (Eviction.LRU,)
    extra_flags: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SidecarReplay:
    """What the sidecar got: the replay's figures, hit blocks per tier they were found in, and
    the bytes its DISK tier was written."""

    replay: Replay
    hits_by_tier: dict[str, int]
    disk_written_bytes: int


@dataclass(frozen=True, slots=True)
class SizeResult:
    """One HOST size: the sidecar's replays (one per eviction policy) and each simulated
    policy's."""

    host_share: float
    host_blocks: int
    sidecars: list[SidecarReplay]
    simulated: list[Replay]


def block_key(block_id: int) -> bytes:
    """The 32-byte key of a trace's block id."""
    return hashlib.sha256(b"trace-block-%d" % block_id).digest()


def replay_sidecar(requests: Sequence[Request], facts: TraceFacts, host_blocks: int,
                   cfg: TraceBenchConfig, progress: Progress | None = None,
                   eviction: Eviction = Eviction.LRU) -> SidecarReplay:
    """Replay ``requests`` through a ``tierkv serve --eviction EVICTION`` of ``host_blocks``
    HOST blocks."""
    block_bytes = LAYOUT.bytes_per_block
    flags = [*cfg.extra_flags, "--eviction", eviction.value]
    disk_bytes = int(cfg.disk_factor * host_blocks) * block_record_bytes(LAYOUT)
    if not disk_bytes:
        flags.append("--no-disk")
    keys = {block: block_key(block) for block in facts.parent}
    data = torch.zeros((cfg.put_blocks, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)
    out = torch.empty((max(len(r.block_ids) for r in requests), *LAYOUT.block_shape),
                      dtype=LAYOUT.torch_dtype)
    hits_by_tier = {tier.name: 0 for tier in (Tier.HOST, Tier.DISK)}
    num_hit = num_hit_tokens = 0
    with tempfile.TemporaryDirectory(prefix="trace-", dir=cfg.work_dir) as work, \
            tierkv_server(Path(work), host_blocks * block_bytes,
                          disk_bytes=max(disk_bytes, 1), extra_flags=flags) as (unix, _), \
            Client(unix) as client:
        for number, request in enumerate(requests):
            hashes = [keys[block] for block in request.block_ids]
            if disk_bytes:
                detail = client.lookup_detail(NAMESPACE, hashes)
                found = detail.num_cached
                hits_by_tier["HOST"] += detail.num_host
                hits_by_tier["DISK"] += found - detail.num_host
            else:
                found = client.lookup(NAMESPACE, hashes)
                hits_by_tier["HOST"] += found
            if found:
                found = client.get_into(NAMESPACE, hashes[:found], out[:found])
            for start in range(found, len(hashes), cfg.put_blocks):
                chunk = hashes[start : start + cfg.put_blocks]
                client.put(NAMESPACE, chunk, data[: len(chunk)],
                           detail=PutDetail(parent_hash=hashes[start - 1] if start else None))
            num_hit += found
            num_hit_tokens += min(found * MOONCAKE_BLOCK_TOKENS, request.num_tokens)
            if progress is not None and number % 500 == 499:
                progress(f"{number + 1} requests")
        held = [block for block, key in keys.items() if client.lookup(NAMESPACE, [key])]
        stats = client.stats()
        disk_written = stats.bytes_moved.get((Tier.HOST, Tier.DISK), 0)
    replay = Replay(f"tierkv ({eviction.value})", num_hit,
                    sum(len(r.block_ids) for r in requests), num_hit_tokens,
                    sum(r.num_tokens for r in requests), facts.stranded(held))
    return SidecarReplay(replay, hits_by_tier, disk_written)


def run_trace_bench(requests: Sequence[Request], cfg: TraceBenchConfig,
                    progress: Progress) -> list[SizeResult]:
    """Replay ``requests`` at each HOST size of ``cfg``, through the sidecar and simulated."""
    facts = TraceFacts(requests)
    results = []
    for share in cfg.host_shares:
        host_blocks = max(cfg.put_blocks, int(share * facts.num_distinct))
        sidecars = []
        for eviction in cfg.evictions:
            progress(f"sidecar ({eviction.value}) at {share:.0%} HOST")
            sidecars.append(replay_sidecar(requests, facts, host_blocks, cfg, progress,
                                           eviction))
        simulated = []
        if cfg.simulate:
            for policy in simulated_policies(host_blocks, facts):
                progress(f"{policy.name} at {share:.0%} HOST")
                simulated.append(simulate(requests, policy, facts, cfg.put_blocks))
        results.append(SizeResult(share, host_blocks, sidecars, simulated))
    return results


def rows_of(results: Sequence[SizeResult]) -> list[Row]:
    """Each HOST size's block hit ratios, against Belady's optimum where it was simulated."""
    rows = []
    for result in results:
        optimum = next((r.hit_ratio for r in result.simulated if r.name.startswith("Belady")),
                       None)
        for replay in [*(sidecar.replay for sidecar in result.sidecars), *result.simulated]:
            met = optimum is not None and replay.hit_ratio >= TARGET_SHARE_OF_OPTIMUM * optimum
            rows.append(Row(f"{result.host_share:.0%} HOST: {replay.name} "
                            f"({replay.num_stranded} stranded)", "hit ratio",
                            round(replay.hit_ratio, 4), optimum, "Belady",
                            f">= {TARGET_SHARE_OF_OPTIMUM} x optimum", met))
    return rows


def format_results(results: Sequence[SizeResult]) -> str:
    """A Markdown table: one row per HOST size, one column per policy (hit ratio, and the
    stranded blocks at the end where there are any), then for each sidecar policy the tokens it
    saved, its hits per tier and the DISK bytes written per hit."""
    if not results:
        return ""
    sidecar_names = [sidecar.replay.name for sidecar in results[0].sidecars]
    names = [*sidecar_names, *(r.name for r in results[0].simulated)]
    extra = [f"{name} {column}" for name in sidecar_names
             for column in ("tokens saved", "hits HOST / DISK", "DISK bytes written per hit")]
    lines = ["| HOST (share of distinct blocks) | " + " | ".join([*names, *extra]) + " |",
             "|" + "---|" * (len(names) + len(extra) + 1)]
    for result in results:
        cells = []
        for replay in [*(sidecar.replay for sidecar in result.sidecars), *result.simulated]:
            cell = f"{replay.hit_ratio:.3f}"
            cells.append(cell + (f" ({replay.num_stranded} stranded)"
                                 if replay.num_stranded else ""))
        for sidecar in result.sidecars:
            hits = sidecar.replay.num_hit_blocks
            cells.append(
                f"{sidecar.replay.num_hit_tokens / max(1, sidecar.replay.num_tokens):.3f}")
            cells.append(f"{sidecar.hits_by_tier['HOST']} / {sidecar.hits_by_tier['DISK']}")
            cells.append(f"{sidecar.disk_written_bytes / hits:,.0f}" if hits else "-")
        lines.append(f"| {result.host_share:.0%} ({result.host_blocks} blocks) | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def save_plot(results: Sequence[SizeResult], path: Path, title: str) -> None:
    """Block hit ratio against HOST size, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    series: dict[str, list[tuple[float, float]]] = {}
    for result in results:
        for replay in [*(sidecar.replay for sidecar in result.sidecars), *result.simulated]:
            series.setdefault(replay.name, []).append((100 * result.host_share, replay.hit_ratio))
    for name, points in series.items():
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name,
                linewidth=2.5 if name.startswith("tierkv") else 1.2)
    ax.set_xlabel("HOST size, % of the trace's distinct blocks")
    ax.grid(True, alpha=0.3)
    save_figure(fig, ax, path, title, "block hit ratio", legend_beside=True)
