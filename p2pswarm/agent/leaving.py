"""Leaving the swarm gracefully: say goodbye, wait until it spread, say how it went.

The agent gossips its leave (``Membership.leave``, after ``Election.leave``) once, and
waits, ``gossip.leave_timeout_s`` at most from that moment, until fellows have
acknowledged it or it has spread (``Membership.leave_spread``) and the datagrams saying
it have left the outbox. What the leaver then knows is a ``Goodbye``.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio


@dataclass(frozen=True, slots=True)
class Goodbye:
    """How a leave went: fellows that acknowledged it, of how many asked, and whether it
    spread."""

    acknowledged: int
    fellows: int
    spread: bool

    def to_dict(self) -> dict[str, int | bool]:
        return {"acknowledged": self.acknowledged, "fellows": self.fellows,
                "spread": self.spread}


class Leaving:
    """Whether this fellow said goodbye, and the wait for it to spread."""

    def __init__(self) -> None:
        self.left = False  # said goodbye (it may still be waiting for it to spread)
        self._spread = trio.Event()
        self._deadline = math.inf

    def begin(self, now: float, timeout_s: float) -> bool:
        """Mark the leave begun at ``now`` (the wait ends ``timeout_s`` later); False
        when it had begun already."""
        if self.left:
            return False
        self.left = True
        self._deadline = now + timeout_s
        return True

    def spread(self) -> None:
        """The goodbye has spread (``Membership.leave_spread``): the wait is over."""
        self._spread.set()

    async def wait(self, flush: Callable[[], Awaitable[None]]) -> None:
        """Until the goodbye spread and ``flush`` returned, or the deadline."""
        with trio.move_on_at(self._deadline):
            await self._spread.wait()
            await flush()


__all__ = ["Goodbye", "Leaving"]
