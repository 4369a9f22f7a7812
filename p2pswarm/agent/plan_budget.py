"""The budget on plans made for fellows: off the loop, one at a time per asker, timed.

Theory of operation. A plan is pure Python work that grows with the model's layers, the
cards and the stages (bounded where the request is read, but still up to seconds). Made
on the event loop, one ``PlanAsk`` would freeze the leader: no heartbeats, no probes
answered, and the swarm would think it dead. So the leader makes each plan on a thread of
its own (at a lower priority, as compute threads run), and the loop goes on.

Per asker (the fellow whose stream carried the ask; None is this agent's own user) at
most one plan runs at a time: a second ask while the first runs is refused at once. At
most ``plans_at_once`` plans run together, and a plan that has not finished within
``plan_budget_s`` (waiting for a turn included) is refused with a line saying so. A
thread cannot be stopped midway, so an abandoned plan keeps its asker's turn, and its
place among ``plans_at_once``, until it really ends: asking again cannot pile threads up.

Simulations run compute inline (virtual time does not pass during it), so there the plan
runs on the loop, as before, and the budget never trips.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Hashable
from typing import TYPE_CHECKING, Callable, TypeVar

import outcome
import trio

from p2pswarm.agent.compute import lower_priority
from p2pswarm.errors import PlacementError

if TYPE_CHECKING:
    from p2pswarm.agent.compute import Compute
    from p2pswarm.agent.counters import Counters

T = TypeVar("T")
log = logging.getLogger("p2pswarm.agent")


class PlanBusy(PlacementError):
    """A plan refused for its budget: one already running for this asker, or too slow."""


class PlanBudget:
    def __init__(self, compute: Compute, counters: Counters, *, budget_s: float,
                 at_once: int) -> None:
        self.compute = compute
        self.counters = counters
        self.budget_s = budget_s
        self._slots = trio.CapacityLimiter(max(1, at_once))
        self._running: set[Hashable] = set()  # askers with a plan on a thread now
        self.refused: Counter[str] = Counter()  # reason -> plans refused
        self.slowest_s = 0.0  # the longest a plan has taken (as the loop saw it)

    def running(self) -> int:
        return len(self._running)

    async def run(self, asker: Hashable, fn: Callable[[], T], who: str) -> T:
        """``fn()`` (a plan for ``asker``, named ``who`` in refusals: a fellow's id, None
        for this agent's user, a fresh ``object()`` for the leader's own) off the loop
        within the budget; PlanBusy when ``asker`` has one running or the budget runs
        out."""
        if self.compute.inline:
            return fn()
        if asker in self._running:
            self._refuse("plan-asker-busy", f"a plan for {who} is still being made; ask again "
                         "when it is done")
        self._running.add(asker)
        holder = object()  # the thread, not this task, holds the slot
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list[outcome.Outcome[T]] = []
        started = trio.current_time()

        def finish() -> None:
            self._running.discard(asker)
            self._slots.release_on_behalf_of(holder)
            self.slowest_s = max(self.slowest_s, trio.current_time() - started)
            done.set()

        def job() -> None:
            lower_priority(self.compute.nice)
            result.append(outcome.capture(fn))
            try:
                token.run_sync_soon(finish)
            except trio.RunFinishedError:
                pass

        with trio.move_on_after(self.budget_s) as waiting:
            try:
                await self._slots.acquire_on_behalf_of(holder)
            except BaseException:
                self._running.discard(asker)
                raise
        if waiting.cancelled_caught:
            self._running.discard(asker)
            self._refuse("plan-budget", f"the leader is busy making other plans; none "
                         f"started for {who} within {self.budget_s:g} s")
        # started here, so the thread is sure to exist and to hand the slot back
        threading.Thread(target=job, name="p2pswarm-plan", daemon=True).start()
        with trio.move_on_at(started + self.budget_s):
            await done.wait()
        if not done.is_set():
            log.warning("a plan for %s ran past its %g s budget: refused (its thread ends "
                        "on its own; until then %s cannot ask for another)",
                        who, self.budget_s, who)
            self._refuse("plan-budget", f"the plan for {who} took longer than the "
                         f"{self.budget_s:g} s a plan may take: ask for fewer stages or "
                         "cards, or a smaller model")
        return result[0].unwrap()

    def _refuse(self, reason: str, why: str) -> None:
        self.refused[reason] += 1
        self.counters.refuse(reason)
        raise PlanBusy(why)


__all__ = ["PlanBudget", "PlanBusy"]
