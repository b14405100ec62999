"""The read path: ``get_into``, promotion on read, and ``prefetch``. Blocks are marked busy under
the lock and copied without it; a get returns the longest leading run copied intact, and
lower-tier hits are promoted in the background. Design: docs/design/data-path.md#the-read-path
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from tierkv.checks import check_out
from tierkv.checksums import block_checksums
from tierkv.config import Tier
from tierkv.store.core import BusyMarks, StoreCore
from tierkv.store.index import Entry, NamespaceState, PagedLedger, leading_run
from tierkv.store.migrate import Mover

log = logging.getLogger(__name__)

# (index in the request, entry, tier it is read from)
Planned = tuple[int, Entry, Tier]


class Reader:
    """Reads for a ``TieredStore``."""

    def __init__(self, core: StoreCore, mover: Mover, executor: ThreadPoolExecutor) -> None:
        self.core = core
        self.mover = mover
        self._executor = executor
        self._background: set[Future[int]] = set()
        self._background_lock = threading.Lock()

    def get_into(self, state: NamespaceState, keys: list[bytes], out: torch.Tensor,
                 missed_after: bool = False, *, served: bool = True) -> int:
        """See ``TieredStore.get_into``. ``served=False``: the store reads for itself (a
        publish's copies for REMOTE): no get, hit or miss is counted, nothing is promoted."""
        flat = check_out(state.namespace.layout, out, len(keys))
        with self.core.busy() as marks:
            plan = self._plan_reads(state, keys, marks, served)
            num_ok = self._copy_out(plan, state.block_bytes, flat)
        if served:
            self.count_served(state, plan[:num_ok], missed_after or num_ok < len(keys))
            if self.core.config.promote_on_read:
                self._promote_later(plan[:num_ok])
        return num_ok

    def _plan_reads(self, state: NamespaceState, keys: list[bytes], marks: BusyMarks,
                    served: bool = True) -> list[Planned]:
        """The leading stored blocks of ``keys`` and the tier each is read from, busy-marked
        in ``marks``; touches the chain tail first."""
        core = self.core
        plan: list[Planned] = []
        with core.lock:
            if served:
                core.count_get_locked(state)
            run = leading_run(state.blocks, keys, readable=True)
            for index, entry in enumerate(run):
                tier = entry.top_tier()
                assert tier is not None  # (readable)
                marks.add_locked(entry)
                plan.append((index, entry, tier))
            core.touch_run_locked(run)
        return plan

    def count_served(self, state: NamespaceState, served: Sequence[Planned],
                     missed: bool) -> None:
        """Count ``served`` (blocks of ``state``) as hits in the tiers they were read from and,
        if ``missed``, the block after them as a miss."""
        with self.core.lock:
            self.core.count_served_locked(state, [tier for _, _, tier in served], missed)

    def _copy_out(self, plan: list[Planned], block_bytes: int, flat: torch.Tensor) -> int:
        core = self.core
        num_ok = len(plan)
        for tier, ledger in core.paged.items():
            batch = [(index, entry) for index, entry, t in plan if t is tier]
            if batch:
                self._copy_from_pages(ledger, batch, block_bytes, flat)
                if tier is Tier.HOST and flat.device.type == "cpu":
                    num_ok = min(num_ok, self._check_copied(ledger, batch, block_bytes, flat))
                elif tier is Tier.HOST:  # into a GPU: the pages, once the copy has landed
                    intact = set(self.mover.intact([entry for _, entry in batch], tier))
                    num_ok = min([num_ok, *(i for i, entry in batch if entry not in intact)])
        return min(num_ok, self._copy_from_disk(plan, block_bytes, flat))

    def _check_copied(
        self, ledger: PagedLedger, batch: list[tuple[int, Entry]], block_bytes: int,
        flat: torch.Tensor,
    ) -> int:
        """Check the copied HOST blocks against their checksums (in the caller's buffer: what
        it gets is what was verified); returns the index of the first bad one, or past the
        end. Bad blocks are counted and deleted."""
        first_bad = len(flat)
        copied = block_checksums(flat, block_bytes, [index for index, _ in batch])
        for (index, entry), actual in zip(batch, copied, strict=True):
            node = entry.residency(Tier.HOST)
            assert node is not None
            if actual != ledger.checksum_of(node.location):
                first_bad = min(first_bad, index)
                with self.core.lock:
                    self.core.damaged_locked(entry, Tier.HOST)
        return first_bad

    def _copy_from_disk(self, plan: list[Planned], block_bytes: int, flat: torch.Tensor) -> int:
        """Disk reads of ``plan``; returns the length of the leading run that is intact."""
        core = self.core
        reads: list[tuple[int, Entry, torch.Tensor, torch.Tensor]] = []
        for index, entry, tier in plan:
            if tier is Tier.DISK:
                target = flat[index * block_bytes : (index + 1) * block_bytes]
                staging = target if target.device.type == "cpu" else torch.empty(
                    block_bytes, dtype=torch.uint8)
                reads.append((index, entry, target, staging))
        if not reads:
            return len(plan)
        read = self.mover.read_disk([(entry, staging.numpy()) for _, entry, _, staging in reads])
        num_ok = len(plan)
        for (index, _, target, staging), value in zip(reads, read, strict=True):
            if value is None:
                num_ok = min(num_ok, index)
            elif staging is not target and index < num_ok:
                core.engine.copy(
                    lambda nb, t=target, s=staging: t.copy_(s, non_blocking=nb),  # type: ignore[misc]
                    target.device, staging.device,
                )
        return num_ok

    def _copy_from_pages(
        self, ledger: PagedLedger, batch: list[tuple[int, Entry]], block_bytes: int,
        flat: torch.Tensor,
    ) -> None:
        slab = ledger.slab
        locations = []
        for _, entry in batch:
            node = entry.residency(ledger.tier)
            assert node is not None
            locations.append(node.location)
        spans = slab.plan(locations, block_bytes, [index for index, _ in batch])
        self.core.engine.copy(lambda nb: slab.read(spans, flat, nb), flat.device, slab.device)

    # --- promotion ------------------------------------------------------------------------

    def _promote_later(self, served: list[Planned]) -> None:
        by_source: dict[Tier, list[Entry]] = {}
        for _, entry, tier in served:
            if self._tier_above(tier) is not None:
                by_source.setdefault(tier, []).append(entry)
        for source, entries in by_source.items():
            destination = self._tier_above(source)
            assert destination is not None
            try:
                # Disk reads run on the disk tier's reader threads, the rest on the store's.
                disk = self.core.disk
                executor = disk.readers if source is Tier.DISK and disk is not None else self._executor
                future = executor.submit(self._promote, entries, destination)
            except RuntimeError:  # the store is closing: promotion is only an optimisation
                return
            with self._background_lock:
                self._background.add(future)
            future.add_done_callback(self._background_done)

    def _background_done(self, future: Future[int]) -> None:
        with self._background_lock:
            self._background.discard(future)

    def wait_for_background(self, timeout_s: float | None) -> bool:
        """Wait until every promotion started so far (and any they start) has finished;
        False if ``timeout_s`` ran out first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._background_lock:
                pending = set(self._background)
            if not pending:
                return True
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            _, not_done = wait(pending, timeout=remaining)
            if not_done:
                return False

    def _tier_above(self, tier: Tier) -> Tier | None:
        for upper in reversed(Tier):
            if upper < tier and upper in self.core.paged:
                return upper
        return None

    def _promote(self, entries: list[Entry], destination: Tier) -> int:
        """``Mover.promote``, for work that has no caller to raise to; returns how many made
        it."""
        try:
            return len(self.mover.promote(entries, destination))
        except Exception:
            # Background work has no caller to raise to; log it with its traceback.
            log.exception("promoting %d blocks to %s failed", len(entries), destination.label)
            return 0

    def prefetch(self, state: NamespaceState, keys: list[bytes], tier: Tier) -> int:
        """See ``TieredStore.prefetch``."""
        core = self.core
        by_source: dict[Tier, list[Entry]] = {}
        with core.lock:
            for entry in leading_run(state.blocks, keys, readable=True):
                top = entry.top_tier()
                if top is not None and top > tier:
                    by_source.setdefault(top, []).append(entry)
        for entries in by_source.values():
            self._promote(entries, tier)
        with core.lock:
            run = leading_run(state.blocks, keys, readable=True)
            tops = [entry.top_tier() for entry in run]
        return next((i for i, top in enumerate(tops) if top is None or top > tier), len(tops))
