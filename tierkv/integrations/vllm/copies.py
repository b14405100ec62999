"""How the vLLM worker copies one KV cache group's blocks between vLLM's paged cache and host
memory: two strategies behind one interface (``Copies``), chosen once when vLLM registers its
caches (``copies_for``). The worker's logic (queues, windows, failures, counters) is written once
over it.

* ``CpuCopies``: straight through the sidecar's leased slab pages. A load's fetch scatters each
  run of blocks out of the pages as they are read (``Client.get_with``: one ``index_copy_`` per
  layer, then the checksums of the pages it read; no staging copy), so every layer is in place
  once the fetch returned. A save can be gathered (one ``index_select`` per layer) later, on the
  saver thread, straight into the pages a put leases (``gathers_in_step`` is False). The index
  operations see each block's page as one row of 16-byte (else 8-byte) elements when the caches'
  layout allows: torch moves those bytes unchanged, and faster than 2-byte elements
  (``index_copy_`` of a 4K-token prompt of the bench model's 8 layers here: 1.7-3.2 ms instead of
  4.0-4.7; see the info rows of ``tierkv bench connector``).
* ``GpuCopies``: through pinned staging and one side CUDA stream. A load is fetched into pinned
  staging (``Client.get_into``, checked there), and each layer's copy into vLLM's blocks is
  issued on the side stream when the model reaches the layer; a save is gathered into pinned
  staging within its step (the side stream waits for the step's writes first). The staging of
  a step's loads, and that of asynchronous loads (one thread), are kept for the next ones and
  grow by doubling: a fresh pinned buffer page-faults once a 4 KiB page, as long as the copy
  itself takes.

A block's bytes in host memory are ``[L, H, N, C]`` in the cache's dtype, as the store holds them
(``as_store_blocks`` views them in the namespace's layout: an fp8 cache's pages are never
converted).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_until_done
from typing import Protocol

import torch

from tierkv.client import Client
from tierkv.integrations.vllm.geometry import BlockGeometry
from tierkv.integrations.vllm.scheduler import BlockOp
from tierkv.keys import Namespace

log = logging.getLogger("tierkv.integrations.vllm")

_WIDE_DTYPES = (torch.complex128, torch.int64)  # element types of a page's row, widest first


class Landing(Protocol):
    """Where one load's blocks (``op``'s) land as they are fetched, and how they reach vLLM's
    blocks from there."""

    def receive(self, client: Client, namespace: Namespace, timeout_s: float) -> int:
        """Fetch the blocks with ``client`` (on a loading thread): how many leading blocks
        arrived. Raises what the client raises."""
        ...

    def scatter_layer(self, index: int, fetched: Future[int]) -> None:
        """On the engine's thread, before its forward reads layer ``index``: that layer of the
        blocks ``fetched`` (the future of ``receive``) counted is in vLLM's blocks by the time
        the engine's work reads it."""
        ...

    def scatter_all(self, count: int) -> None:
        """Every layer of the ``count`` leading blocks received is in vLLM's blocks when this
        returns (an asynchronous load, on its own thread)."""
        ...


class Copies(Protocol):
    """How one KV cache group's blocks move between vLLM's cache and host memory."""

    @property
    def gathers_in_step(self) -> bool:
        """Whether a save is gathered into staging within its step (GPU) rather than by the
        saver thread straight into the sidecar's pages while vLLM keeps its blocks (CPU)."""
        ...

    def staging(self, num_blocks: int) -> torch.Tensor:
        """A new host buffer of ``num_blocks`` blocks: ``[n, L, H, N, C]`` in the cache's dtype
        (pinned on the GPU, so that copies to and from it are asynchronous)."""
        ...

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """vLLM's blocks ``block_ids`` into ``out`` (the bytes of as many blocks, contiguous:
        ``[n, L, H, N, C]`` of the cache's dtype, or uint8 rows); done when this returns."""
        ...

    def step_landings(self, ops: Sequence[BlockOp]) -> list[Landing]:
        """Where each of a step's synchronous loads lands (the engine's thread); valid until
        the next step's."""
        ...

    def async_landing(self, op: BlockOp) -> Landing:
        """Where an asynchronous load lands (the asynchronous loader's thread: one at a time);
        valid until the next one."""
        ...


def copies_for(groups: Sequence[tuple[BlockGeometry, Sequence[torch.Tensor]]]) -> list[Copies]:
    """Each registered group's copies (its geometry, and vLLM's cache of each of its layers),
    one strategy for all, chosen by where the caches are: ``GpuCopies`` on a CUDA device (one
    side stream, on the first layer's device), else ``CpuCopies``."""
    if groups and groups[0][1][0].device.type == "cuda":
        stream = torch.cuda.Stream(device=groups[0][1][0].device)  # type: ignore[no-untyped-call]
        return [GpuCopies(geometry, layers, stream) for geometry, layers in groups]
    return [CpuCopies(geometry, layers) for geometry, layers in groups]


def as_store_blocks(staging: torch.Tensor, namespace: Namespace, num_blocks: int) -> torch.Tensor:
    """``staging``'s first ``num_blocks`` as the store's blocks: the same bytes, viewed in the
    layout's dtype (an fp8 cache's ``uint8`` pages as ``float8``, never converted)."""
    layout = namespace.layout
    return staging.view(layout.torch_dtype).view((num_blocks, *layout.block_shape))


def _staging(geometry: BlockGeometry, num_blocks: int, *, pinned: bool) -> torch.Tensor:
    shape = (num_blocks, geometry.layout.num_layers, *geometry.page_shape)
    return torch.empty(shape, dtype=geometry.cache_dtype, pin_memory=pinned)


def _pages(blocks: torch.Tensor, geometry: BlockGeometry, num_blocks: int) -> torch.Tensor:
    """The bytes of ``num_blocks`` blocks as ``[n, L, H, N, C]`` of the cache's dtype (a view)."""
    return blocks.view(geometry.cache_dtype).view(
        (num_blocks, geometry.layout.num_layers, *geometry.page_shape))


def _rows_of(blocks: torch.Tensor, wide: torch.dtype) -> torch.Tensor | None:
    """``blocks`` ([n, ...], each block's page contiguous) viewed as [n, page] of ``wide``
    elements, or None when its strides or offset do not allow it."""
    try:
        return blocks.view(blocks.shape[0], -1).view(wide)
    except RuntimeError:
        return None


class CpuCopies:
    """A CPU worker's copies: index operations straight between vLLM's blocks and the slab's
    pages (or a staging buffer), each page moved as one row of wide elements when it can be."""

    gathers_in_step = False  # the saver gathers into the sidecar's pages, while vLLM keeps them

    def __init__(self, geometry: BlockGeometry, layers: Sequence[torch.Tensor]) -> None:
        self.geometry = geometry
        page_bytes = geometry.layout.bytes_per_block // max(1, len(layers))
        self._wide = next((wide for wide in _WIDE_DTYPES
                           if page_bytes % wide.itemsize == 0
                           and all(_rows_of(t, wide) is not None for t in layers)), None)
        self._rows = [self._as_rows(t) for t in layers]  # each layer as [B, page]
        log.debug("tierkv: vLLM's pages of group %d %s", geometry.group_index,
                  f"move as rows of {self._wide}" if self._wide
                  else "are moved through their own strides (no row view of them)")

    def _as_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """``blocks`` ([n, H, N, C], each page contiguous) as [n, page] of the wide elements
        (itself when the layout allows none); a view: the same bytes."""
        rows = None if self._wide is None else _rows_of(blocks, self._wide)
        return blocks if rows is None else rows

    def staging(self, num_blocks: int) -> torch.Tensor:
        return _staging(self.geometry, num_blocks, pinned=False)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        pages = _pages(out, self.geometry, len(block_ids))
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        for index, rows in enumerate(self._rows):
            torch.index_select(rows, 0, ids, out=self._as_rows(pages[:, index]))

    def scatter(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """``blocks`` (the bytes of as many blocks, contiguous, as ``gather``'s ``out``) into
        vLLM's blocks ``block_ids``, every layer."""
        source = _pages(blocks, self.geometry, len(block_ids))
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        for index, rows in enumerate(self._rows):
            rows.index_copy_(0, ids, self._as_rows(source[:, index]))

    def step_landings(self, ops: Sequence[BlockOp]) -> list[Landing]:
        return [_SlabLanding(self, op) for op in ops]

    def async_landing(self, op: BlockOp) -> Landing:
        return _SlabLanding(self, op)


class _SlabLanding:
    """A CPU load: scattered out of the slab's pages into vLLM's blocks as they are read."""

    def __init__(self, copies: CpuCopies, op: BlockOp) -> None:
        self._copies, self._op = copies, op

    def receive(self, client: Client, namespace: Namespace, timeout_s: float) -> int:
        return client.get_with(namespace, list(self._op.hashes), self._scatter,
                               timeout_s=timeout_s)

    def _scatter(self, indices: Sequence[int], blocks: torch.Tensor) -> None:
        self._copies.scatter([self._op.block_ids[i] for i in indices], blocks)

    def scatter_layer(self, index: int, fetched: Future[int]) -> None:
        wait_until_done([fetched])  # the fetch scattered every layer, then checked them

    def scatter_all(self, count: int) -> None:
        return  # the fetch scattered every layer


class GpuCopies:
    """A GPU worker's copies: through pinned staging, on a side stream that waits for the
    engine's work before reading vLLM's blocks and that the engine's work waits for after
    writing them."""

    gathers_in_step = True  # into pinned staging before the step ends

    def __init__(self, geometry: BlockGeometry, layers: Sequence[torch.Tensor],
                 stream: torch.cuda.Stream) -> None:
        self.geometry = geometry
        self._layers = list(layers)
        self._stream = stream
        self._load_buffer: torch.Tensor | None = None  # a step's synchronous loads'
        self._async_buffer: torch.Tensor | None = None  # asynchronous loads' (one thread)

    def staging(self, num_blocks: int) -> torch.Tensor:
        return _staging(self.geometry, num_blocks, pinned=True)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        pages = _pages(out, self.geometry, len(block_ids))
        device = self._layers[0].device
        self._stream.wait_stream(torch.cuda.current_stream(device))  # after the step's writes
        with torch.cuda.stream(self._stream):
            ids = torch.tensor(list(block_ids), dtype=torch.long, device=device)
            for index, layer in enumerate(self._layers):
                pages[:, index].copy_(layer.index_select(0, ids), non_blocking=True)
        self._stream.synchronize()

    def step_landings(self, ops: Sequence[BlockOp]) -> list[Landing]:
        self._load_buffer = self._reused(self._load_buffer, sum(len(op.hashes) for op in ops))
        landings: list[Landing] = []
        first = 0
        for op in ops:
            staging = self._load_buffer[first : first + len(op.hashes)]
            first += len(op.hashes)
            landings.append(_StagedLanding(self._layers, self._stream, op, staging))
        return landings

    def async_landing(self, op: BlockOp) -> Landing:
        self._async_buffer = self._reused(self._async_buffer, len(op.hashes))
        return _StagedLanding(self._layers, self._stream, op,
                              self._async_buffer[: len(op.hashes)])

    def _reused(self, buffer: torch.Tensor | None, num_blocks: int) -> torch.Tensor:
        """``buffer``, or a new one when it holds fewer than ``num_blocks`` blocks (at least
        twice its size: a few growths, then none)."""
        if buffer is not None and buffer.shape[0] >= num_blocks:
            return buffer
        return self.staging(max(num_blocks, 0 if buffer is None else 2 * int(buffer.shape[0])))


class _StagedLanding:
    """A GPU load: fetched into pinned ``staging``, copied into vLLM's blocks a layer at a time
    on the side stream."""

    def __init__(self, layers: list[torch.Tensor], stream: torch.cuda.Stream, op: BlockOp,
                 staging: torch.Tensor) -> None:
        self._layers, self._stream, self._op, self._staging = layers, stream, op, staging

    def receive(self, client: Client, namespace: Namespace, timeout_s: float) -> int:
        num_blocks = len(self._op.hashes)
        return client.get_into(namespace, list(self._op.hashes),
                               as_store_blocks(self._staging, namespace, num_blocks),
                               timeout_s=timeout_s)

    def scatter_layer(self, index: int, fetched: Future[int]) -> None:
        self._scatter(fetched.result(), index, wait=False)
        device = self._layers[index].device  # the forward pass reads it next
        torch.cuda.current_stream(device).wait_stream(self._stream)

    def scatter_all(self, count: int) -> None:
        for index in range(len(self._layers)):
            self._scatter(count, index, wait=True)

    def _scatter(self, count: int, index: int, *, wait: bool) -> None:
        """Layer ``index`` of the ``count`` leading blocks in staging into vLLM's blocks, on
        the side stream; ``wait`` for the copy to finish (an asynchronous load is done only
        when its bytes are)."""
        if count == 0:
            return
        layer = self._layers[index]
        source = self._staging[:count, index]
        with torch.cuda.stream(self._stream):  # the index tensor is made (and freed) on it too
            ids = torch.tensor(self._op.block_ids[:count], dtype=torch.long, device=layer.device)
            layer.index_copy_(0, ids, source.to(layer.device, non_blocking=True))
        if wait:
            self._stream.synchronize()
