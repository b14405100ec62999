"""``tierkv serve``: run the store as a long-lived process on this node.

Embedded defaults: a HOST tier in shared memory, a DISK tier under the user's cache directory,
and a GPU tier when CUDA is present. The process recovers the disk index, reports readiness and
then serves until SIGINT/SIGTERM, when it flushes HOST-only blocks to disk and exits.
The gRPC listeners (Unix socket, 127.0.0.1:50051) are added by the service layer; until then this
process holds the store (its shared-memory slab is named in the readiness line).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from tierkv.config import (
    DiskTierConfig,
    GiB,
    GpuTierConfig,
    HostTierConfig,
    StoreConfig,
    WritePolicy,
    default_disk_bytes,
    default_disk_path,
)
from tierkv.sizes import format_size, parse_size

log = logging.getLogger("tierkv.serve")


def register(subparsers: Any) -> None:
    """Add ``serve`` to the command line."""
    parser = subparsers.add_parser(
        "serve", help="run the KV-cache store on this node",
        description="Run the tiered KV-cache store until interrupted.",
    )
    parser.add_argument("--host-bytes", default="1GiB", help="HOST tier budget (default 1GiB)")
    parser.add_argument("--gpu-bytes", default=None,
                        help="GPU tier budget (default 2GiB when CUDA is present, else 0: off)")
    parser.add_argument("--gpu-device", default="cuda", help="cuda[:N] or 'emulated'")
    parser.add_argument("--disk-path", default=None, help="LMDB directory (default: user cache)")
    parser.add_argument("--disk-bytes", default=None,
                        help="DISK tier budget (default: half the free space, at most 16GiB)")
    parser.add_argument("--no-disk", action="store_true", help="run without a DISK tier")
    parser.add_argument("--page-bytes", default="256KiB", help="page size of GPU/HOST slabs")
    parser.add_argument("--write-policy", choices=[p.value for p in WritePolicy],
                        default=WritePolicy.WRITE_BACK.value)
    parser.add_argument("--stats-interval-s", type=float, default=60.0,
                        help="log tier stats this often (0: never)")
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> StoreConfig:
    """The store configuration the flags describe (validated; errors name the flag)."""
    import torch

    page_bytes = parse_size(args.page_bytes, "--page-bytes")
    host = HostTierConfig(parse_size(args.host_bytes, "--host-bytes"), page_bytes)
    if args.gpu_bytes is None:
        gpu_bytes = 2 * GiB if torch.cuda.is_available() else 0
    else:
        gpu_bytes = parse_size(args.gpu_bytes, "--gpu-bytes")
    gpu = GpuTierConfig(gpu_bytes, page_bytes, args.gpu_device)
    disk = None
    if not args.no_disk:
        path = Path(args.disk_path) if args.disk_path else default_disk_path()
        disk_bytes = (
            parse_size(args.disk_bytes, "--disk-bytes") if args.disk_bytes
            else default_disk_bytes(path)
        )
        disk = DiskTierConfig(path, disk_bytes)
    return StoreConfig(host=host, gpu=gpu, disk=disk, write_policy=WritePolicy(args.write_policy))


def run(args: argparse.Namespace) -> int:
    """Open the store and hold it until SIGINT or SIGTERM."""
    from tierkv.store import TieredStore

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    config = build_config(args)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with TieredStore(config, show_progress=True) as store:
        tiers = {t.label: format_size(s.capacity_bytes) for t, s in store.stats().tiers.items()}
        ready = {
            "ready": True,
            "tiers": tiers,
            "disk_path": str(config.disk.path) if config.disk else None,
            "recovered_blocks": store.num_recovered_blocks,
            "host_shm_name": store.host_shm_name,
            "page_bytes": config.host.page_bytes,
        }
        print(json.dumps(ready), flush=True)
        interval = args.stats_interval_s
        while not stop.wait(interval if interval > 0 else None):
            log.info("stats %s", json.dumps(store.stats().as_dict()))
        log.info("stopping: flushing host blocks to disk")
    log.info("stopped")
    return 0

