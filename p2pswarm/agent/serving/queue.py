"""The driver's queue: at most a load's session slots of generations at once, the rest
waiting in order of arrival, and a bounded wait.

A load has the plan's ``--sequences`` session slots (each stage holds that many KV
caches). A generation takes a slot for its whole session; one that finds them all taken
waits, first come first served; one that finds the queue full too is refused at once as
``Busy`` (HTTP 429 with ``Retry-After``). A waiter that goes away (its client
disconnected, Ctrl-C) leaves the queue. The wait it is told to come back after is the
queue ahead of it times the recent length of a session, over the slots.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from p2pswarm.errors import Busy

DEFAULT_QUEUE = 32  # generations that may wait per load on one fellow


@dataclass
class _Waiter:
    admitted: trio.Event = field(default_factory=trio.Event)


@dataclass
class _LoadQueue:
    slots: int
    running: int = 0
    waiting: deque[_Waiter] = field(default_factory=deque)
    session_s: float = 10.0  # a session's recent length (smoothed), for Retry-After


class Admission:
    """Per load (by ``plan_id``): sessions running and waiting on this fellow."""

    def __init__(self, limit: int = DEFAULT_QUEUE) -> None:
        self.limit = limit  # the most generations that wait per load
        self._loads: dict[str, _LoadQueue] = {}

    def waiting(self, plan_id: str) -> int:
        q = self._loads.get(plan_id)
        return len(q.waiting) if q is not None else 0

    def running(self, plan_id: str) -> int:
        q = self._loads.get(plan_id)
        return q.running if q is not None else 0

    @asynccontextmanager
    async def slot(self, plan_id: str, slots: int,
                   on_wait: Callable[[int], None] | None = None) -> AsyncIterator[None]:
        """Hold one of ``plan_id``'s ``slots`` for the block; wait in line for it, or
        raise ``Busy`` when the line is full. ``on_wait(ahead)`` hears the place in line."""
        q = self._loads.setdefault(plan_id, _LoadQueue(max(1, slots)))
        q.slots = max(1, slots)
        if q.running < q.slots and not q.waiting:
            q.running += 1
        else:
            await self._wait(plan_id, q, on_wait)
        began = trio.current_time()
        try:
            yield
        finally:
            q.session_s = 0.7 * q.session_s + 0.3 * (trio.current_time() - began)
            self._release(plan_id, q)

    async def _wait(self, plan_id: str, q: _LoadQueue,
                    on_wait: Callable[[int], None] | None) -> None:
        if len(q.waiting) >= self.limit:
            ahead = q.running + len(q.waiting)
            retry = max(1, math.ceil(q.session_s * ahead / q.slots))
            raise Busy(f"plan {plan_id} is busy: {q.running} generation"
                       f"{'s' if q.running != 1 else ''} running and {len(q.waiting)} "
                       f"waiting, the queue is full; try again in {retry} s",
                       retry_after_s=retry)
        me = _Waiter()
        q.waiting.append(me)
        try:
            while not me.admitted.is_set():
                if on_wait is not None:
                    on_wait(q.waiting.index(me))
                with trio.move_on_after(15.0):  # tell the waiter its place now and then
                    await me.admitted.wait()
        except BaseException:
            if me.admitted.is_set():  # handed a slot just as it went away: pass it on
                self._release(plan_id, q)
            else:
                q.waiting.remove(me)
            raise

    def _release(self, plan_id: str, q: _LoadQueue) -> None:
        if q.waiting:
            q.waiting.popleft().admitted.set()  # the slot passes straight on
            return
        q.running -= 1
        if q.running <= 0:
            self._loads.pop(plan_id, None)


__all__ = ["Admission", "DEFAULT_QUEUE"]
