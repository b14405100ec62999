"""The one fake clock of the tests: time that only the test moves."""

from __future__ import annotations


class FakeClock:
    """A clock the test moves by hand: ``clock()`` is ``now_s``; set or add to it.

    Stands in for ``time.monotonic`` wherever a store, pin table or lease table takes a clock."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s
