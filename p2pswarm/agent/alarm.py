"""The agent's one alarm: when both machines tick next, and how late it rang.

``set`` moves the alarm sooner (never later: a ring that finds nothing due costs one
tick, a late one costs a deadline). A transport that runs its own event loop
(``MemoryNetwork``) rings it (``call_at``); otherwise one timer task (``run``) sleeps in
a cancel scope whose deadline ``set`` moves. How late each ring came is this fellow's own
loop lag (``LoopLag``, shown by ``status``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import trio

from p2pswarm.transport.base import RingsAlarms, Transport


@dataclass(frozen=True, slots=True)
class LoopLag:
    """How late the alarm rang: the most, and how often past 0.1 s and past 1 s."""

    max_s: float = 0.0
    over_0_1_s: int = 0
    over_1_s: int = 0

    def noted(self, lag_s: float) -> LoopLag:
        """This lag, with one more ring ``lag_s`` late."""
        return LoopLag(round(max(self.max_s, lag_s), 3), self.over_0_1_s + (lag_s > 0.1),
                       self.over_1_s + (lag_s > 1.0))

    def to_dict(self) -> dict[str, float]:
        return {"max_s": self.max_s, "over_0_1_s": self.over_0_1_s, "over_1_s": self.over_1_s}


class Alarm:
    """Rings ``ring(deadline)`` at the earliest deadline ``set`` was given."""

    def __init__(self, transport: Transport, ring: Callable[[float], None]) -> None:
        self.at = math.inf  # when both machines tick next
        self.set_at = 0.0  # when it was set: a deadline already past then is no lag
        self.lag = LoopLag()
        self._ring = ring
        self._scope = trio.CancelScope()  # the timer task sleeps in it until ``at``
        # ... unless a transport that runs its own loop rings it
        self._call_at: Callable[[float, Callable[[], None]], None] | None = \
            transport.call_at if isinstance(transport, RingsAlarms) else None

    @property
    def needs_timer(self) -> bool:
        """Whether ``run`` must sleep until the alarm (no transport rings it)."""
        return self._call_at is None

    def set(self, deadline: float, now: float) -> None:
        """Ring at ``deadline`` if that is sooner than the alarm is set for."""
        if deadline < self.at:  # the alarm would ring too late for new work
            self.at = deadline
            self.set_at = now
            if self._call_at is not None:
                self._call_at(deadline, lambda: self._ring(deadline))
            else:
                self._scope.deadline = deadline

    def take(self, deadline: float) -> bool:
        """Whether a ring for ``deadline`` is the alarm's (not one since moved); it is
        then unset until the next ``set``."""
        if deadline != self.at:
            return False
        self.at = math.inf
        return True

    def lateness(self, deadline: float, now: float) -> float:
        """How late a ring at ``now`` for ``deadline`` is: past the deadline, or past the
        moment it was set if that came after (work a machine asks for now is due at
        once)."""
        return now - max(deadline, self.set_at)

    async def run(self) -> None:
        """The timer task, for a transport that does not ring the alarm itself."""
        while True:
            self._scope = trio.CancelScope(deadline=self.at)
            with self._scope:  # ``set`` moves its deadline sooner: no wakeup to recompute
                await trio.sleep_forever()
            self._ring(self.at)


__all__ = ["Alarm", "LoopLag"]
