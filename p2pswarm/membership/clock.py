"""The machine's clock: the latest ``now`` it was given.

Time comes in as ``now`` on every entry point; the clock keeps the latest one, so that
the parts that act outside a call's own ``now`` (what rides on a datagram, whether our
Alive still carries our metadata) read one time, which only moves forward. The machine
moves it once per entry point; the parts share the one object and only read it.
"""

from __future__ import annotations


class Clock:
    __slots__ = ("now",)

    def __init__(self, now: float) -> None:
        self.now = now

    def advance(self, now: float) -> None:
        if now > self.now:
            self.now = now


__all__ = ["Clock"]
