"""Stand-ins the tracer tests hand to a ``Tracer``."""

from __future__ import annotations


class FakeClock:
    """A ns clock that moves 10 ns per read, from 1,000: every timestamp distinct and ordered."""

    def __init__(self) -> None:
        self.t = 1_000

    def __call__(self) -> int:
        self.t += 10
        return self.t
