"""Memory of a real ``tierkv serve`` before and after 10,000 refused or malformed calls.

The fault-injection suite's memory part (issue 7): a server in its own process (the
``sidecar_factory`` harness), its resident set read from ``/proc/<pid>/status`` after a warm-up
of every kind of call, then again after ``NUM_CALLS`` more of them sent concurrently. Refused
Puts used to stay alive in reference cycles (1,500 grew a server from 151 to 543 MiB) and
pinned lookups grew its deadline heap without bound (3,000: 152 to 554 MiB).

The figures go to RELIABILITY.md ("Refused and malformed calls").
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from tests.support.harness import CHANNEL_OPTIONS, SidecarFactory
from tests.support.service_fixtures import wire_namespace
from tierkv import KVLayout
from tierkv.config import MiB
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

Code = grpc.StatusCode

NUM_CALLS = 10_000
NUM_WARMUP_CALLS = 3_000
CONCURRENCY = 32
# The bound the test holds the server to; measured here: see RELIABILITY.md.
MAX_GROWTH_BYTES = 64 * MiB
# 64 KiB blocks; the server's HOST holds 128 of them.
LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)
BLOCK_BYTES = LAYOUT.bytes_per_block
NS = wire_namespace(LAYOUT, "resources")
FLAGS = ["--host-bytes", "8MiB", "--page-bytes", "64KiB", "--disk-bytes", "64MiB",
         "--put-idle-timeout-s", "5"]


def hashes(n: int, salt: int) -> list[bytes]:
    return [salt.to_bytes(8, "little") + i.to_bytes(8, "little") + bytes(16) for i in range(n)]


def rss_bytes(pid: int) -> int:
    """The process's resident set (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class Caller:
    """Every kind of refused or malformed call, over one channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = pb_grpc.TierKVStub(channel)
        raw = {"request_serializer": None, "response_deserializer": None}
        self.raw_lookup = channel.unary_unary("/tierkv.v1.TierKV/Lookup", **raw)
        self.raw_put = channel.stream_unary("/tierkv.v1.TierKV/Put", **raw)
        self.salt = itertools.count()
        # Built once: building 70,000 hashes per call would make the client the bottleneck.
        over_host = pb.PutChunk(header=pb.PutHeader(namespace=NS, hashes=hashes(200, 2)),
                                data=bytes(256 * 1024))
        over_put = pb.PutChunk(header=pb.PutHeader(namespace=NS, hashes=hashes(20_000, 3)))
        too_many = pb.PutChunk(header=pb.PutHeader(namespace=NS, hashes=hashes(70_000, 4)))
        self.kinds: dict[str, Callable[[], Awaitable[object]]] = {
            # 200 blocks of 64 KiB: more than the whole 8 MiB HOST (refused at allocation).
            "Put over HOST": lambda: self.put([over_host]),
            # 20,000 blocks of 64 KiB: over the 1 GiB a Put may carry (refused at the header).
            "Put over max put bytes": lambda: self.put([over_put]),
            # 70,000 hashes: over the 65,536 a call may name.
            "Put header with too many hashes": lambda: self.put([too_many]),
            "Put of garbage bytes": lambda: self.raw_put(iter([b"\xff" * 4096])),
            "Lookup of garbage bytes": lambda: self.raw_lookup(b"\x0a\xff\xff\xff\x0f"),
            "Commit of an unknown lease": lambda: self.stub.Commit(
                pb.LeaseRequest(lease_id=next(self.salt).to_bytes(16, "little"))),
            "Release of an unknown lease": lambda: self.stub.Release(
                pb.LeaseRequest(lease_id=next(self.salt).to_bytes(16, "little"))),
            # Pins on stored blocks (the heap), and on a namespace nobody stored into.
            "Lookup with a pin TTL": lambda: self.stub.Lookup(
                pb.LookupRequest(namespace=NS, hashes=hashes(64, 1 << 40), pin_ttl_s=1.0)),
            "Lookup with a pin TTL, unknown model": lambda: self.stub.Lookup(pb.LookupRequest(
                namespace=wire_namespace(LAYOUT, f"never-{next(self.salt)}"),
                hashes=hashes(64, 1), pin_ttl_s=600.0)),
        }

    async def put(self, messages: list[pb.PutChunk]) -> pb.CountResponse:
        async def stream() -> AsyncIterator[pb.PutChunk]:
            for message in messages:
                yield message

        response: pb.CountResponse = await self.stub.Put(stream())
        return response

    async def store_pinned_blocks(self) -> None:
        data = bytes(64 * BLOCK_BYTES)
        chunks = [pb.PutChunk(header=pb.PutHeader(namespace=NS, hashes=hashes(64, 1 << 40)))]
        chunks += [pb.PutChunk(data=data[i : i + MiB]) for i in range(0, len(data), MiB)]
        assert (await self.put(chunks)).count == 64

    async def run(self, num_calls: int) -> Counter[tuple[str, str]]:
        """``num_calls`` calls, the kinds in turn, ``CONCURRENCY`` at a time; their codes."""
        codes: Counter[tuple[str, str]] = Counter()
        order = itertools.cycle(self.kinds.items())
        lock = asyncio.Lock()
        remaining = [num_calls]

        async def worker() -> None:
            while True:
                async with lock:
                    if remaining[0] == 0:
                        return
                    remaining[0] -= 1
                    kind, call = next(order)
                try:
                    await call()
                    code = Code.OK
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                codes[kind, code.name] += 1

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        return codes


EXPECTED = {
    "Put over HOST": "RESOURCE_EXHAUSTED",
    "Put over max put bytes": "RESOURCE_EXHAUSTED",
    "Put header with too many hashes": "INVALID_ARGUMENT",
    "Put of garbage bytes": "INVALID_ARGUMENT",
    "Lookup of garbage bytes": "INVALID_ARGUMENT",
    "Commit of an unknown lease": "NOT_FOUND",
    "Release of an unknown lease": "NOT_FOUND",
    "Lookup with a pin TTL": "OK",
    "Lookup with a pin TTL, unknown model": "OK",
}


@pytest.mark.slow
def test_refused_and_malformed_calls_do_not_grow_the_server(
    sidecar_factory: SidecarFactory,
) -> None:
    sidecar = sidecar_factory(*FLAGS)
    assert sidecar.process is not None
    pid = sidecar.process.pid

    async def scenario() -> tuple[int, int, float, Counter[tuple[str, str]]]:
        async with grpc.aio.insecure_channel(sidecar.unix_target, options=CHANNEL_OPTIONS) as ch:
            caller = Caller(ch)
            await caller.store_pinned_blocks()
            await caller.run(NUM_WARMUP_CALLS)
            await asyncio.sleep(1.0)
            before = rss_bytes(pid)
            started = time.monotonic()
            codes = await caller.run(NUM_CALLS)
            elapsed_s = time.monotonic() - started
            await asyncio.sleep(2.0)  # pins of 1 s expire; the handlers finish
            after = rss_bytes(pid)
            stats = await caller.stub.Stats(pb.StatsRequest())
            assert stats.num_namespaces == 1, "a lookup registered a namespace"
            assert stats.num_pinned == 0, "expired pins are still counted"
            assert stats.num_leases == 0
            return before, after, elapsed_s, codes

    before, after, elapsed_s, codes = asyncio.run(scenario())
    print(f"\n{NUM_CALLS} calls in {elapsed_s:.1f} s; RSS {before / MiB:.1f} MiB -> "
          f"{after / MiB:.1f} MiB (+{(after - before) / MiB:.1f} MiB, bound "
          f"{MAX_GROWTH_BYTES / MiB:.0f} MiB)")
    for (kind, code), count in sorted(codes.items()):
        print(f"  {kind}: {code} x{count}")
    assert sidecar.alive
    assert {kind: code for kind, code in codes} == EXPECTED, codes
    assert after - before <= MAX_GROWTH_BYTES, (before, after)
