"""``tierkv bench store``: run the benchmarks, print a table, write JSON (and a PNG plot)."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tierkv.bench.report import Row, format_table, save_json, save_plot


def register(subparsers: Any) -> None:
    """Add ``bench`` to the command line."""
    parser = subparsers.add_parser("bench", help="measure tierkv against its baselines")
    targets = parser.add_subparsers(dest="target", required=True)
    store = targets.add_parser(
        "store", help="the embedded store vs memcpy, write+fsync, file reads and cbor2"
    )
    _add_common(store, "store", ["host", "disk", "lookup", "hashing", "index"],
                "where disk benchmarks write (default: a temp dir)")
    store.set_defaults(func=run_store)
    service = targets.add_parser(
        "service", help="the sidecar through the client SDK vs memcpy and a real Redis"
    )
    _add_common(service, "service", ["local", "remote", "lookup", "calls"],
                "where the servers keep sockets, logs and disk (default: a temp dir)")
    service.set_defaults(func=run_service)
    gpu = targets.add_parser("gpu", help="CUDA copies through the store vs raw pinned copies")
    gpu.add_argument("--repeats", type=int, default=5)
    gpu.add_argument("--json", type=Path, default=Path("bench-out/gpu.json"))
    gpu.set_defaults(func=run_gpu)


def _add_common(parser: argparse.ArgumentParser, name: str, groups: list[str],
                work_dir_help: str) -> None:
    """The flags every ``bench`` target with a table, JSON and plot takes."""
    parser.add_argument("--only", nargs="*", default=[], choices=groups)
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--quick", action="store_true",
                        help="smaller runs (for a smoke test; figures are noisier)")
    parser.add_argument("--work-dir", type=Path, default=None, help=work_dir_help)
    parser.add_argument("--json", type=Path, default=Path(f"bench-out/{name}.json"))
    parser.add_argument("--plot", type=Path, nargs="?", const=Path(f"bench-out/{name}.png"),
                        default=None, help="also write a PNG bar chart")


@contextlib.contextmanager
def _progress(total: int, desc: str) -> Iterator[Callable[[str], None]]:
    """A progress callback: each call is one step, its message the bar's postfix."""
    with tqdm(total=total, desc=desc, unit="step") as bar:
        def progress(message: str) -> None:
            bar.set_postfix_str(message)
            bar.update(1)

        yield progress


def _report(rows: list[Row], args: argparse.Namespace, extra: dict[str, Any],
            title: str | None) -> int:
    """Print the table, write the JSON (and, with ``--plot``, the chart titled ``title``)."""
    print(format_table(rows))
    save_json(rows, args.json, extra)
    print(f"wrote {args.json}")
    if title is not None and args.plot is not None:
        save_plot(rows, args.plot, title)
        print(f"wrote {args.plot}")
    return 0


def run_gpu(args: argparse.Namespace) -> int:
    """Run ``bench gpu`` (needs CUDA)."""
    import torch

    from tierkv.bench.gpu_bench import bench_gpu
    from tierkv.errors import ConfigError

    if not torch.cuda.is_available():
        raise ConfigError("bench gpu: CUDA is not available on this machine")
    rows = bench_gpu(args.repeats, lambda message: print(message, flush=True))
    return _report(rows, args, {"repeats": args.repeats, "device": torch.cuda.get_device_name()},
                   None)


def run_store(args: argparse.Namespace) -> int:
    """Run ``bench store``."""
    from tierkv.bench.store_bench import StoreBenchConfig, run_store_bench

    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=args.work_dir) as work:
        cfg = StoreBenchConfig(Path(work), repeats=args.repeats)
        if args.quick:
            cfg = StoreBenchConfig(Path(work), num_batches=2, num_disk_batches=2,
                                   repeats=min(args.repeats, 3), index_blocks=100_000)
        with _progress(4 * cfg.repeats + 9, "bench store") as progress:
            rows = run_store_bench(cfg, args.only, progress)
    extra = {"repeats": cfg.repeats, "batch_blocks": cfg.batch_blocks, "quick": args.quick}
    return _report(rows, args, extra, "tierkv bench store")


def run_service(args: argparse.Namespace) -> int:
    """Run ``bench service`` (starts a ``tierkv serve`` and a ``redis-server`` of its own)."""
    from tierkv.bench.servers import ServiceBenchConfig, redis_parser
    from tierkv.bench.service_bench import num_steps, run_service_bench

    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=args.work_dir) as work:
        cfg = ServiceBenchConfig(Path(work), repeats=args.repeats)
        if args.quick:
            cfg = ServiceBenchConfig(Path(work), num_batches=2, num_stream_batches=1,
                                     repeats=min(args.repeats, 3), lookup_calls=50,
                                     small_calls=500)
        with _progress(num_steps(cfg, args.only), "bench service") as progress:
            rows = run_service_bench(cfg, args.only, progress)
    extra = {"repeats": cfg.repeats, "batch_blocks": cfg.batch_blocks, "quick": args.quick,
             "redis_parser": redis_parser()}
    return _report(rows, args, extra, "tierkv bench service")
