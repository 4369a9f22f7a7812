"""Where blocking compute (torch) runs: on a worker thread, or inline in virtual time.

Real agents run a stage's forward pass or a training step on a worker thread so the trio
loop keeps gossiping. Simulations run it inline: virtual time does not pass during it, and
a thread would make the run depend on the real clock.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import trio

T = TypeVar("T")


class Compute:
    def __init__(self, *, inline: bool = False) -> None:
        self.inline = inline

    async def run(self, fn: Callable[[], T], limiter: trio.CapacityLimiter | None = None) -> T:
        """``fn()`` on a worker thread (one at a time under ``limiter``), or inline."""
        if not self.inline:
            return await trio.to_thread.run_sync(fn, limiter=limiter)
        if limiter is None:
            return fn()
        async with limiter:
            return fn()
