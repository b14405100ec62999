"""``tierkv bench gpu``: CUDA copies through the store against raw pinned and pageable copies.

Needs CUDA. Rows: HOST get into a CUDA buffer (host-to-device from the pinned slab), HOST put of
a CUDA tensor (device-to-host), GPU tier put/get (device-to-device), each beside the same copy
done directly with torch on pinned memory; pageable memory is shown for contrast.
"""

from __future__ import annotations

import torch

from tierkv.bench.report import GB, Row, fresh_hashes, median_of, random_blocks
from tierkv.bench.store_bench import Progress
from tierkv.config import GpuTierConfig, HostTierConfig, StoreConfig, Tier
from tierkv.keys import Namespace
from tierkv.layout import PRESETS
from tierkv.store import TieredStore


def _cuda_seconds(fn: object, repeats: int = 1) -> float:
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()  # type: ignore[operator]
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / repeats


def bench_gpu(repeats: int, progress: Progress) -> list[Row]:
    """All GPU rows (batches of 32 Llama-3-8B blocks, 64 MiB)."""
    layout = PRESETS["llama-3-8b"].layout()
    num_blocks = 32
    batch_bytes = num_blocks * layout.bytes_per_block
    cpu_blocks = random_blocks(layout, num_blocks)
    device_blocks = cpu_blocks.cuda()
    pinned = cpu_blocks.pin_memory()
    pageable = cpu_blocks.clone()
    device_out = torch.empty_like(device_blocks)

    def gbs(fn: object) -> tuple[float, list[float]]:
        return median_of(lambda: batch_bytes / _cuda_seconds(fn) / GB, repeats)

    raw_h2d, _ = gbs(lambda: device_out.copy_(pinned, non_blocking=True))
    raw_h2d_pageable, _ = gbs(lambda: device_out.copy_(pageable))
    raw_d2h, _ = gbs(lambda: pinned.copy_(device_blocks, non_blocking=True))
    raw_d2d, _ = gbs(lambda: device_out.copy_(device_blocks))
    progress("raw copies")
    namespace = Namespace("bench-gpu", layout)
    config = StoreConfig(
        host=HostTierConfig(batch_bytes * (repeats + 2)),
        gpu=GpuTierConfig(batch_bytes * (repeats + 2)),
        promote_on_read=False,
    )
    with TieredStore(config) as store:
        store.register(namespace)
        on_host = fresh_hashes(num_blocks)
        store.put(namespace, on_host, cpu_blocks, tier=Tier.HOST)
        host_get, host_get_s = gbs(lambda: store.get_into(namespace, on_host, device_out))
        assert torch.equal(device_out.view(torch.uint8), device_blocks.view(torch.uint8))
        host_put, host_put_s = gbs(
            lambda: store.put(namespace, fresh_hashes(num_blocks), device_blocks, tier=Tier.HOST)
        )
        on_gpu = fresh_hashes(num_blocks)
        gpu_put, gpu_put_s = gbs(lambda: store.put(namespace, fresh_hashes(num_blocks),
                                                   device_blocks, tier=Tier.GPU))
        store.put(namespace, on_gpu, device_blocks, tier=Tier.GPU)
        gpu_get, gpu_get_s = gbs(lambda: store.get_into(namespace, on_gpu, device_out))
        pinned_ok = store.sidecar.host_pinned
    progress("store copies")
    return [
        Row("HOST get into CUDA buffer (H2D)", "GB/s", host_get, raw_h2d, "pinned copy_",
            "(info)", pinned_ok, host_get_s),
        Row("raw pageable H2D (contrast)", "GB/s", raw_h2d_pageable, raw_h2d, "pinned copy_",
            "(info)", True, []),
        Row("HOST put of CUDA tensor (D2H)", "GB/s", host_put, raw_d2h, "pinned copy_",
            "(info)", pinned_ok, host_put_s),
        Row("GPU tier put (D2D)", "GB/s", gpu_put, raw_d2d, "torch copy_", "(info)", True,
            gpu_put_s),
        Row("GPU tier get_into (D2D)", "GB/s", gpu_get, raw_d2d, "torch copy_", "(info)", True,
            gpu_get_s),
    ]
