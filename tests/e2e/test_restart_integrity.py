"""A client that outlives its server: restarts under live clients never cost a wrong byte.

A real ``tierkv serve`` subprocess is SIGKILLed or SIGTERMed and started again on the same disk
and socket while one ``Client`` / ``AsyncClient`` stays open. That client's next puts and gets
must be exact (it remaps the new slab by itself), what it wrote must persist exactly, and the
killed server's shared-memory segments must be gone once the new one is up.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Sequence

import pytest
import torch

from tests.support import child_env, helper_command
from tests.support.harness import Sidecar, SidecarFactory, stream_client
from tests.support.tiny_blocks import TINY_LAYOUT, block_for, key, same_bytes
from tierkv import AsyncClient, Client, Namespace, WritePolicy
from tierkv.errors import ServiceUnavailableError

NAMESPACE = Namespace("restart-model", TINY_LAYOUT)
FLAGS = ("--host-bytes", "1MiB", "--page-bytes", "256", "--disk-bytes", "64MiB")
NUM_BLOCKS = 32


def batch(salt: str) -> tuple[list[bytes], torch.Tensor]:
    hashes = [key(i, salt) for i in range(NUM_BLOCKS)]
    data = torch.stack([block_for(int.from_bytes(h[:4], "little")) for h in hashes])
    return hashes, data


def segments_of(sidecar: Sidecar) -> list[str]:
    """The server's shared-memory segments still under /dev/shm."""
    name = sidecar.ready["host_shm_name"]
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(name))


def restart(sidecar_factory: SidecarFactory, sidecar: Sidecar, how: str) -> Sidecar:
    if how == "sigkill":
        sidecar.kill()
    else:
        sidecar.terminate()
    return sidecar_factory(*FLAGS, disk_path=sidecar.disk_path, socket_dir=sidecar.socket_dir)


def put_then_get(client: Client, salt: str, *, in_place: bool = False) -> torch.Tensor:
    """``in_place``: through ``put_with`` and ``get_with`` (the slab's pages themselves)."""
    hashes, data = batch(salt)
    if not in_place:
        assert client.put(NAMESPACE, hashes, data, write_policy=WritePolicy.WRITE_THROUGH) \
            == NUM_BLOCKS
        return client.get(NAMESPACE, hashes)
    rows = data.view(torch.uint8).reshape(NUM_BLOCKS, -1)

    def fill(indices: Sequence[int], out: torch.Tensor) -> None:
        out.copy_(rows[list(indices)])

    assert client.put_with(NAMESPACE, hashes, fill, write_policy=WritePolicy.WRITE_THROUGH) \
        == NUM_BLOCKS
    got = torch.zeros_like(rows)

    def use(indices: Sequence[int], blocks: torch.Tensor) -> None:
        got[list(indices)] = blocks

    count = client.get_with(NAMESPACE, hashes, use)
    return got[:count].view(data.dtype).reshape(count, *data.shape[1:])


async def aput_then_get(client: AsyncClient, salt: str) -> torch.Tensor:
    hashes, data = batch(salt)
    assert await client.put(NAMESPACE, hashes, data, write_policy=WritePolicy.WRITE_THROUGH) \
        == NUM_BLOCKS
    return await client.get(NAMESPACE, hashes)


def through_one_client(first: Sidecar, restarted: object, flavour: str, kind: str
                       ) -> dict[str, torch.Tensor]:
    """Put and get batch "before" on ``first``, call ``restarted()``, then put and get batch
    "after" and get "before" again, all through one client; what each read gave."""
    got: dict[str, torch.Tensor] = {}
    shm = kind == "shm"
    settings = {"timeout_s": 20, "retries": 6, "use_shm": shm}
    if flavour == "sync":
        with Client(first.unix_target, **settings) as client:
            assert client.uses_shared_memory == shm
            got["before"] = put_then_get(client, "before")
            restarted()  # type: ignore[operator]
            got["after"] = put_then_get(client, "after", in_place=True)  # a stale mapping
            got["before again"] = client.get(NAMESPACE, batch("before")[0])
            assert client.uses_shared_memory == shm  # remapped, not fallen back to streams
        return got

    async def run() -> None:
        async with AsyncClient(first.unix_target, **settings) as client:
            assert await client.uses_shared_memory() == shm
            got["before"] = await aput_then_get(client, "before")
            await asyncio.to_thread(restarted)  # type: ignore[arg-type]
            got["after"] = await aput_then_get(client, "after")
            got["before again"] = await client.get(NAMESPACE, batch("before")[0])
            assert await client.uses_shared_memory() == shm

    asyncio.run(run())
    return got


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "flavour", "how"), [
    ("shm", "sync", "sigkill"), ("shm", "async", "sigkill"), ("shm", "sync", "sigterm"),
    ("shm", "async", "sigterm"), ("stream", "sync", "sigkill"), ("stream", "async", "sigterm"),
])
def test_a_client_kept_across_a_server_restart_reads_and_writes_exact_bytes(
    sidecar_factory: SidecarFactory, kind: str, flavour: str, how: str
) -> None:
    first = sidecar_factory(*FLAGS)
    servers = [first]

    def restarted() -> None:
        servers.append(restart(sidecar_factory, first, how))

    got = through_one_client(first, restarted, flavour, kind)
    second = servers[1]
    assert same_bytes(got["before"], batch("before")[1])
    assert same_bytes(got["after"], batch("after")[1]), "wrong bytes after the restart"
    # write_through blocks of the first server survived it (SIGKILL included), exactly.
    assert same_bytes(got["before again"], batch("before")[1])
    # The first server's segments are gone: removed at its exit, or by the second at start.
    assert segments_of(first) == []
    # Another client, and a third server on the same disk, see exactly the same bytes.
    with stream_client(second) as other:
        for salt in ("before", "after"):
            hashes, data = batch(salt)
            assert same_bytes(other.get(NAMESPACE, hashes), data)
        assert other.stats().checksum_failures == 0
    third = restart(sidecar_factory, second, "sigkill")
    with Client(third.unix_target) as fresh:
        for salt in ("before", "after"):
            hashes, data = batch(salt)
            assert same_bytes(fresh.get(NAMESPACE, hashes), data)


@pytest.mark.slow
def test_a_client_whose_server_is_down_gets_a_clear_error_then_carries_on(
    sidecar_factory: SidecarFactory
) -> None:
    first = sidecar_factory(*FLAGS)
    hashes, data = batch("down")
    with Client(first.unix_target, timeout_s=5, retries=5, backoff_s=0.05) as client:
        assert client.uses_shared_memory
        first.kill()
        with pytest.raises(ServiceUnavailableError):
            client.put(NAMESPACE, hashes, data)
        second = sidecar_factory(*FLAGS, disk_path=first.disk_path, socket_dir=first.socket_dir)
        assert client.put(NAMESPACE, hashes, data) == NUM_BLOCKS
        assert same_bytes(client.get(NAMESPACE, hashes), data)
    assert segments_of(first) == [] and segments_of(second) != []


# --- a client that dies holding write leases ---------------------------------------------------


def hold_leases(target: str, num_blocks: int) -> subprocess.Popen[str]:
    """A client process that takes a write lease on ``num_blocks`` blocks, says so, and hangs."""
    process = subprocess.Popen(
        helper_command("lease_holder", target, str(num_blocks)),
        stdout=subprocess.PIPE, text=True, env=child_env(),
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.strip() == "leased", f"the lease holder did not start: {line!r}"
    return process


@pytest.mark.slow
def test_the_leases_of_a_client_that_died_are_taken_back_at_once(
    sidecar_factory: SidecarFactory
) -> None:
    # 8 MiB of HOST, held by two clients' write leases (default TTL: 30 s).
    sidecar = sidecar_factory("--host-bytes", "8MiB", "--page-bytes", "512",
                              "--disk-bytes", "64MiB")
    holders = [hold_leases(sidecar.unix_target, 8192) for _ in range(2)]
    hashes = [key(i, "after-the-dead") for i in range(200 * 16)]
    data = torch.stack([block_for(i % 97) for i in range(len(hashes))])
    with Client(sidecar.unix_target, timeout_s=20) as client:
        assert client.stats().num_leases == 2
        for holder in holders:
            holder.kill()
            holder.wait()
        # Their leases would hold the room for 30 s more (a put waits 5 s at most for room).
        assert client.put(NAMESPACE, hashes, data) == len(hashes)
        assert client.stats().num_leases == 0
        assert same_bytes(client.get(NAMESPACE, hashes), data)
