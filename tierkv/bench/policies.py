"""Simulated cache policies for ``tierkv bench trace``, replayed on the same request sequence as
the sidecar, with the engine's pattern: a prefix lookup, a read of the hit, then the missing
blocks put a few at a time, head first, each put naming its parent. Capacities are in blocks.

Policies: LRU (each put newest), the chain-aware LRU tierkv runs (a put that continues a stored
chain goes just behind its parent), ARC, S3-FIFO, W-TinyLFU, W-TinyLFU with its admission
switched by miniature simulations, Belady's optimum (which knows
the future), and a bound: the chain-aware LRU told which blocks will ever be used again.
Reference implementations for measurement, not for serving: pure Python, O(1) a block except
Belady (O(log n))."""

from __future__ import annotations

import abc
import heapq
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tierkv.bench.traces import MOONCAKE_BLOCK_TOKENS, Request

NEVER = 1 << 62


class SimulatedCache(abc.ABC):
    """A cache of block ids, as ``simulate`` drives it. ``now`` is the request's index in the
    trace."""

    name = ""

    @abc.abstractmethod
    def holds(self, block: int) -> bool:
        """Whether ``block`` is held now."""

    @abc.abstractmethod
    def read(self, blocks: Sequence[int], now: int) -> None:
        """The hit blocks of a request, head first."""

    @abc.abstractmethod
    def put(self, blocks: Sequence[int], parent: int | None, now: int) -> None:
        """Blocks of one put, head first; ``parent``: the block before the first, if any."""

    @abc.abstractmethod
    def held(self) -> list[int]:
        """Every block held now."""

    def begin(self, blocks: Sequence[int], now: int) -> None:
        """A request's blocks, before its lookup (for a policy that learns from whole requests;
        the others ignore it)."""
        del blocks, now


class _Lru:
    """A doubly linked list of block ids, least recently used first, with insert-before."""

    def __init__(self) -> None:
        self.prev: dict[int, int] = {}
        self.next: dict[int, int] = {}
        self.head = -1  # sentinel id
        self.prev[-1] = self.next[-1] = -1

    def __contains__(self, block: int) -> bool:
        return block in self.prev and block != -1

    def __len__(self) -> int:
        return len(self.prev) - 1

    def remove(self, block: int) -> None:
        prev, nxt = self.prev.pop(block), self.next.pop(block)
        self.next[prev], self.prev[nxt] = nxt, prev

    def insert_before(self, block: int, anchor: int) -> None:
        """Link ``block`` just less recently used than ``anchor`` (-1: most recently used)."""
        prev = self.prev[anchor]
        self.prev[block], self.next[block] = prev, anchor
        self.next[prev] = block
        self.prev[anchor] = block

    def pop_lru(self, spared: set[int]) -> None:
        """Remove the least recently used block not in ``spared``."""
        block = self.next[-1]
        while block in spared:
            block = self.next[block]
        self.remove(block)


class Lru(SimulatedCache):
    """LRU: reads touch tail first; with ``chains``, a put continuing a held block goes just
    behind it (tierkv's order), else each put is the newest. ``admit``: which blocks may be
    stored at all (the bound's oracle)."""

    def __init__(self, capacity: int, chains: bool = True,
                 admit: Callable[[int, int], bool] | None = None) -> None:
        self.capacity, self.chains, self.admit = capacity, chains, admit
        self.lru = _Lru()
        self.name = "chain-aware LRU" if chains else "LRU"

    def holds(self, block: int) -> bool:
        return block in self.lru

    def read(self, blocks: Sequence[int], now: int) -> None:
        for block in reversed(blocks):
            self.lru.remove(block)
            self.lru.insert_before(block, -1)

    def put(self, blocks: Sequence[int], parent: int | None, now: int) -> None:
        # As the store does: room first (never a put's own blocks), then the blocks, tail first.
        wanted = [b for b in blocks if self.admit is None or self.admit(b, now)]
        num_new = sum(1 for block in wanted if block not in self.lru)
        spared = set(wanted)
        while len(self.lru) + num_new > self.capacity:
            self.lru.pop_lru(spared)
        anchor = parent if self.chains and parent is not None and parent in self.lru else -1
        for block in reversed(wanted):
            if block in self.lru:
                self.lru.remove(block)
            self.lru.insert_before(block, anchor)

    def held(self) -> list[int]:
        return [block for block in self.lru.prev if block != -1]


class Arc(SimulatedCache):
    """ARC (Megiddo & Modha, 2003): recency (T1) and frequency (T2) lists sized by ghost hits."""

    name = "ARC"

    def __init__(self, capacity: int) -> None:
        self.c, self.p = capacity, 0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def holds(self, block: int) -> bool:
        return block in self.t1 or block in self.t2

    def read(self, blocks: Sequence[int], now: int) -> None:
        for block in reversed(blocks):
            self.t1.pop(block, 0)
            self.t2[block] = None
            self.t2.move_to_end(block)

    def _replace(self, in_b2: bool) -> None:
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            self.b1[self.t1.popitem(last=False)[0]] = None
        elif self.t2:
            self.b2[self.t2.popitem(last=False)[0]] = None
        else:
            self.b1[self.t1.popitem(last=False)[0]] = None

    def put(self, blocks: Sequence[int], parent: int | None, now: int) -> None:
        for block in reversed(blocks):
            if self.holds(block):
                continue
            if block in self.b1 or block in self.b2:
                if block in self.b1:
                    self.p = min(self.c, self.p + max(1, len(self.b2) // max(1, len(self.b1))))
                    del self.b1[block]
                else:
                    self.p = max(0, self.p - max(1, len(self.b1) // max(1, len(self.b2))))
                    del self.b2[block]
                if len(self.t1) + len(self.t2) >= self.c:
                    self._replace(block in self.b2)
                self.t2[block] = None
                continue
            if len(self.t1) + len(self.b1) >= self.c:
                if len(self.t1) < self.c:
                    self.b1.popitem(last=False)
                    self._replace(False)
                else:
                    self.t1.popitem(last=False)
            elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= self.c:
                if len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * self.c:
                    self.b2.popitem(last=False)
                if len(self.t1) + len(self.t2) >= self.c:
                    self._replace(False)
            self.t1[block] = None

    def held(self) -> list[int]:
        return [*self.t1, *self.t2]


class S3Fifo(SimulatedCache):
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO (10 %) for new blocks, a main FIFO with
    reinsertion for blocks read while small, a ghost FIFO of what left small unread."""

    name = "S3-FIFO"

    def __init__(self, capacity: int, small_share: float = 0.1) -> None:
        self.capacity = capacity
        self.small_capacity = max(1, int(capacity * small_share))
        self.small: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}

    def holds(self, block: int) -> bool:
        return block in self.small or block in self.main

    def read(self, blocks: Sequence[int], now: int) -> None:
        for block in blocks:
            self.freq[block] = min(3, self.freq.get(block, 0) + 1)

    def _evict(self) -> None:
        while True:
            if len(self.small) >= self.small_capacity or not self.main:
                block = self.small.popitem(last=False)[0]
                if self.freq.get(block, 0) >= 1:
                    self.freq[block] = 0
                    self.main[block] = None
                    continue
                self.ghost[block] = None
                if len(self.ghost) > self.capacity - self.small_capacity:
                    self.ghost.popitem(last=False)
                self.freq.pop(block, None)
                return
            block = self.main.popitem(last=False)[0]
            if self.freq.get(block, 0) > 0:
                self.freq[block] -= 1
                self.main[block] = None
                continue
            self.freq.pop(block, None)
            return

    def put(self, blocks: Sequence[int], parent: int | None, now: int) -> None:
        for block in blocks:
            if self.holds(block):
                continue
            while len(self.small) + len(self.main) >= self.capacity:
                self._evict()
            if block in self.ghost:  # it left small unread lately: straight to main
                del self.ghost[block]
                self.main[block] = None
            else:
                self.small[block] = None
            self.freq[block] = 0

    def held(self) -> list[int]:
        return [*self.small, *self.main]


class WTinyLfu(SimulatedCache):
    """W-TinyLFU (Einziger et al., 2017): a 1 % LRU window; a block leaving it enters the main
    LRU only if it was used more often than main's victim. Exact counts, halved every ten
    capacities of uses (the sketch's reset)."""

    name = "W-TinyLFU"

    def __init__(self, capacity: int, window_share: float = 0.01) -> None:
        self.capacity = capacity
        self.window_capacity = max(1, int(capacity * window_share))
        self.window: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()
        self.freq: Counter[int] = Counter()
        self.num_uses = 0
        self.admission = True  # off: whatever leaves the window enters main (an LRU)

    def holds(self, block: int) -> bool:
        return block in self.window or block in self.main

    def _use(self, block: int) -> None:
        self.freq[block] += 1
        self.num_uses += 1
        if self.num_uses >= 10 * self.capacity:
            self.num_uses = 0
            self.freq = Counter({b: n // 2 for b, n in self.freq.items() if n > 1})

    def read(self, blocks: Sequence[int], now: int) -> None:
        for block in reversed(blocks):
            self._use(block)
            (self.window if block in self.window else self.main).move_to_end(block)

    def put(self, blocks: Sequence[int], parent: int | None, now: int) -> None:
        for block in reversed(blocks):
            self._use(block)
            if self.holds(block):
                continue
            self.window[block] = None
            if len(self.window) <= self.window_capacity:
                continue
            candidate = self.window.popitem(last=False)[0]
            if len(self.main) < self.capacity - self.window_capacity:
                self.main[candidate] = None
                continue
            victim = next(iter(self.main))
            if not self.admission or self.freq[candidate] > self.freq[victim]:
                del self.main[victim]
                self.main[candidate] = None

    def held(self) -> list[int]:
        return [*self.window, *self.main]


class AdaptiveTinyLfu(WTinyLfu):
    """W-TinyLFU whose admission filter is on or off as two miniature simulations say
    (Waldspurger et al., ATC 2017): the same policy with and without admission (without, it is
    an LRU in two segments), each fed the blocks whose id falls in 1/``sample`` of the space at
    1/``sample`` of the capacity; the filter follows whichever had more hits lately (counts
    decayed by ``decay`` a request)."""

    name = "adaptive W-TinyLFU"

    def __init__(self, capacity: int, sample: int = 16, decay: float = 0.999) -> None:
        super().__init__(capacity)
        self.sample, self.decay = sample, decay
        mini = max(4, capacity // sample)
        self.miniatures = (WTinyLfu(mini), WTinyLfu(mini))
        self.miniatures[0].admission = False
        self.mini_hits = [0.0, 0.0]

    def begin(self, blocks: Sequence[int], now: int) -> None:
        sampled = [b for b in blocks if (b * 0x9E3779B97F4A7C15 >> 32) % self.sample == 0]
        if not sampled:
            return
        for which, mini in enumerate(self.miniatures):
            found = 0
            while found < len(sampled) and mini.holds(sampled[found]):
                found += 1
            if found:
                mini.read(sampled[:found], now)
            if found < len(sampled):
                mini.put(sampled[found:], None, now)
            self.mini_hits[which] = self.mini_hits[which] * self.decay + found
        self.admission = self.mini_hits[1] > self.mini_hits[0]


class Belady(SimulatedCache):
    """Belady's MIN: evicts the block used again farthest in the future (a chain's deeper
    block first on a tie), and stores nothing used later than everything it holds."""

    name = "Belady (optimum)"

    def __init__(self, capacity: int, next_use: dict[tuple[int, int], int],
                 depth: dict[int, int]) -> None:
        self.capacity, self.next_use, self.depth = capacity, next_use, depth
        self.when: dict[int, int] = {}
        self.heap: list[tuple[int, int, int]] = []

    def holds(self, block: int) -> bool:
        return block in self.when

    def _set(self, block: int, when: int) -> None:
        self.when[block] = when
        heapq.heappush(self.heap, (-when, -self.depth[block], block))

    def _farthest(self) -> tuple[int, int]:
        while True:
            when, _, block = self.heap[0]
            if self.when.get(block) == -when:
                return block, -when
            heapq.heappop(self.heap)

    def read(self, blocks: Sequence[int], now: int) -> None:
        for block in blocks:
            self._set(block, self.next_use[now, block])

    def put(self, blocks: Sequence[int], parent: int | None, now: int) -> None:
        for block in blocks:
            when = self.next_use[now, block]
            if block in self.when:
                self._set(block, when)
                continue
            if len(self.when) >= self.capacity:
                victim, victim_when = self._farthest()
                if victim_when <= when:
                    continue  # used later than anything held: not worth storing
                del self.when[victim]
            self._set(block, when)

    def held(self) -> list[int]:
        return list(self.when)


@dataclass(frozen=True, slots=True)
class Replay:
    """What one policy got on a trace: hit and asked-for blocks and tokens, and blocks held at
    the end that no prefix lookup can reach (``num_stranded``: an ancestor is gone)."""

    name: str
    num_hit_blocks: int
    num_blocks: int
    num_hit_tokens: int
    num_tokens: int
    num_stranded: int

    @property
    def hit_ratio(self) -> float:
        return self.num_hit_blocks / self.num_blocks if self.num_blocks else 0.0


class TraceFacts:
    """What the simulations need to know of a trace in advance: each block's parent and depth,
    and (for Belady and the bound) when each block is used next."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.parent: dict[int, int | None] = {}
        self.depth: dict[int, int] = {}
        for request in requests:
            for position, block in enumerate(request.block_ids):
                self.parent.setdefault(block, request.block_ids[position - 1] if position else None)
                self.depth.setdefault(block, position)
        self.next_use: dict[tuple[int, int], int] = {}
        last: dict[int, int] = {}
        for now in range(len(requests) - 1, -1, -1):
            for block in requests[now].block_ids:
                self.next_use[now, block] = last.get(block, NEVER)
            for block in requests[now].block_ids:
                last[block] = now

    @property
    def num_distinct(self) -> int:
        return len(self.parent)

    def stranded(self, held: Sequence[int]) -> int:
        """Held blocks whose chain from its head is not all held."""
        holding = set(held)
        reachable: dict[int, bool] = {}

        def reaches(block: int) -> bool:
            path = []
            current: int | None = block
            while current is not None and current not in reachable:
                path.append(current)
                current = self.parent[current]
            ok = reachable[current] if current is not None else True
            for step in reversed(path):
                ok = ok and step in holding
                reachable[step] = ok
            return reachable[block]

        return sum(1 for block in holding if not reaches(block))


def simulate(requests: Sequence[Request], cache: SimulatedCache, facts: TraceFacts,
             put_blocks: int = 4) -> Replay:
    """Replay ``requests`` through ``cache`` as an engine uses a prefix cache."""
    num_hit = num_hit_tokens = num_tokens = num_blocks = 0
    for now, request in enumerate(requests):
        blocks = request.block_ids
        cache.begin(blocks, now)
        found = 0
        while found < len(blocks) and cache.holds(blocks[found]):
            found += 1
        if found:
            cache.read(blocks[:found], now)
        for start in range(found, len(blocks), put_blocks):
            cache.put(blocks[start : start + put_blocks], blocks[start - 1] if start else None, now)
        num_hit += found
        num_blocks += len(blocks)
        num_hit_tokens += min(found * MOONCAKE_BLOCK_TOKENS, request.num_tokens)
        num_tokens += request.num_tokens
    return Replay(cache.name, num_hit, num_blocks, num_hit_tokens, num_tokens,
                  facts.stranded(cache.held()))


def simulated_policies(capacity: int, facts: TraceFacts) -> list[SimulatedCache]:
    """Every simulated policy at ``capacity`` blocks, the optimum and the bound last."""
    bound = Lru(capacity, admit=lambda block, now: facts.next_use[now, block] != NEVER)
    bound.name = "bound: chain-aware LRU storing only blocks used again"
    return [Lru(capacity, chains=False), Lru(capacity), Arc(capacity), S3Fifo(capacity),
            WTinyLfu(capacity), AdaptiveTinyLfu(capacity),
            Belady(capacity, facts.next_use, facts.depth), bound]
