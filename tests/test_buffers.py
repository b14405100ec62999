"""The one buffer pool: the server's Get batches (any size at least asked) and REMOTE records
(exact sizes)."""

from __future__ import annotations

import threading

from tierkv.buffers import BufferPool


def test_a_buffer_given_back_is_handed_out_again_once() -> None:
    pool = BufferPool(1 << 20)
    first = pool.take(1000)
    assert len(first) == 1000
    pool.give(first)
    assert pool.take(900) is first  # at least the size asked for
    assert pool.take(900) is not first  # never to two callers


def test_the_smallest_buffer_that_fits_and_exact_sizes() -> None:
    pool = BufferPool(1 << 20)
    small, large = bytearray(100), bytearray(400)
    pool.give([large, small])
    assert pool.take(50) is small
    pool.give(small)
    assert len(pool.take(200, exact=True)) == 200  # no 200-byte buffer idle: a new one
    assert pool.take(400, exact=True) is large
    assert pool.idle_bytes == 100


def test_a_full_pool_keeps_the_larger_buffers() -> None:
    pool = BufferPool(1000)
    pool.give([bytearray(300), bytearray(300), bytearray(300)])
    pool.give(bytearray(200))  # no room, and only larger ones are idle: dropped
    assert pool.idle_bytes == 900
    pool.give(bytearray(700))  # the small ones make way
    assert pool.idle_bytes == 1000
    pool.give(bytearray(2000))  # larger than the whole pool: never kept
    assert pool.idle_bytes == 1000
    pool.give([b"bytes are not kept"])  # type: ignore[list-item]
    assert pool.idle_bytes == 1000


def test_takes_and_gives_from_many_threads_never_share_a_buffer() -> None:
    pool = BufferPool(1 << 16)
    seen: list[int] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(500):
            buffer = pool.take(64)
            buffer[:8] = threading.get_ident().to_bytes(8, "little")
            assert buffer[:8] == threading.get_ident().to_bytes(8, "little")
            with lock:
                seen.append(id(buffer))
            pool.give(buffer)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 2000
