"""A same-host client that takes a write lease and then hangs, for the dead-client tests.

``python lease_holder.py TARGET NUM_BLOCKS``: describes the server, holds its client lock file
the way the SDK does (``tierkv.shm.liveness.ClientLock``), allocates ``NUM_BLOCKS`` tiny
blocks, prints ``leased`` and sleeps until it is killed.
"""

from __future__ import annotations

import sys
import time

import grpc

from tests.support.tiny_blocks import TINY_LAYOUT, key
from tierkv.keys import Namespace
from tierkv.shm.liveness import ClientLock
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc
from tierkv.wire.namespaces import namespace_to


def main() -> None:
    target, num_blocks = sys.argv[1], int(sys.argv[2])
    client_id = f"holder{time.monotonic_ns()}"
    metadata = (("x-tierkv-client", client_id),)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.TierKVStub(channel)  # type: ignore[no-untyped-call]
        describe = stub.Describe(pb.DescribeRequest(), metadata=metadata)
        lock = ClientLock(describe.client_lock_prefix, client_id)
        hashes = [key(i, client_id) for i in range(num_blocks)]
        stub.Allocate(pb.AllocateRequest(
            namespace=namespace_to(Namespace("restart-model", TINY_LAYOUT)), hashes=hashes,
            slab_id=describe.slab_id,
        ), metadata=metadata)
        print("leased", flush=True)
        time.sleep(3600)
        lock.close()


if __name__ == "__main__":
    main()
