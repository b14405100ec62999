"""Copies between devices, on dedicated CUDA streams with events when CUDA is involved.

The store calls ``CopyEngine.copy`` from whatever thread runs a transfer (a caller's thread for a
synchronous put/get, a worker for background promotion and demotion). ``copy`` returns only when
the destination bytes are complete, so that the store can publish a destination copy the moment
it returns, and never before (a missing stream synchronisation garbles restored KV).

Decisions:
1. One stream per direction (host-to-device, device-to-host), so that demotions and promotions
   overlap each other and the caller's compute; copies in one direction run in submission order.
2. Before copying, the stream waits for the caller's current stream, so that a tensor the caller
   just produced is complete before it is read.
3. Waiting is ``event.synchronize()``, which releases the GIL.
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
