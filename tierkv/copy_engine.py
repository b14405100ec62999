"""Copies between devices, on dedicated CUDA streams with events when CUDA is involved.
``CopyEngine.copy`` may be called from any thread and returns only when the destination bytes are
complete, so the store may publish the copy the moment it returns (one stream per direction).
Design: docs/design/data-path.md#copies-between-devices
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

CopyFn = Callable[[bool], None]
"""Issues the copies; its argument is ``non_blocking``."""


class CopyEngine:
    """Runs copy functions; CPU-only copies inline, CUDA copies on the direction's stream."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[tuple[int, str], torch.cuda.Stream] = {}

    def copy(self, fn: CopyFn, destination: torch.device, source: torch.device) -> None:
        """Run ``fn`` and return once every byte it copied has landed."""
        cuda_device = _cuda_device(destination, source)
        if cuda_device is None:
            fn(False)
            return
        direction = "h2d" if destination.type == "cuda" else "d2h"
        stream = self._stream(cuda_device, direction)
        with torch.cuda.device(cuda_device):
            stream.wait_stream(torch.cuda.current_stream(cuda_device))
            with torch.cuda.stream(stream):
                fn(True)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
        done.synchronize()

    def _stream(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        key = (device.index or 0, direction)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
                self._streams[key] = stream
            return stream


def _cuda_device(destination: torch.device, source: torch.device) -> torch.device | None:
    for device in (destination, source):
        if device.type == "cuda":
            return device if device.index is not None else torch.device("cuda", 0)
    return None
