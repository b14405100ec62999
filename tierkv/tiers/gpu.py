"""GPU tier: a paged slab in HBM, or a CPU tensor pool standing in for it ("emulated").

Emulation runs the same store code (placement, demotion, promotion, copies through the migration
engine) on machines without CUDA, so that the tests exercise it.
"""

from __future__ import annotations

import torch

from tierkv.config import GpuTierConfig
from tierkv.errors import ConfigError
from tierkv.tiers.paged import PagedSlab


class DeviceSlab(PagedSlab):
    """The GPU tier's slab, allocated once at start."""

    def __init__(self, config: GpuTierConfig) -> None:
        num_pages = config.capacity_bytes // config.page_bytes
        size_bytes = num_pages * config.page_bytes
        self.emulated = config.device == "emulated"
        if self.emulated:
            tensor = torch.zeros(size_bytes, dtype=torch.uint8)
        else:
            if not torch.cuda.is_available():
                raise ConfigError(
                    "gpu: CUDA is not available; set --gpu-bytes 0 to turn the GPU tier off"
                )
            try:
                tensor = torch.empty(size_bytes, dtype=torch.uint8, device=config.device)
            except torch.OutOfMemoryError as exc:
                raise ConfigError(
                    f"gpu capacity_bytes: cannot allocate {size_bytes} bytes on "
                    f"{config.device}; lower --gpu-bytes"
                ) from exc
        super().__init__(tensor, config.page_bytes)
