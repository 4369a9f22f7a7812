"""The director: one interpreter of a scenario's timeline, for every world it runs in.

Theory of operation. ``build_timeline`` (``p2pswarm.sim.actions``) turns a scenario
into typed actions at given times. ``Director.run`` walks them in order: it sleeps until
each one's time, decides what the action means now (which fellow a ``"random"`` one is,
whether that fellow is in a state the action applies to, the values a rate-drawn event
draws) and tells the ``World`` what to do. Later consequences (a crashed fellow's
restart, a rate-drawn leave's rejoin, a rate-drawn partition's heal) are tasks in the
run's nursery that sleep and then act the same way.

A ``World`` is where the fellows live, and it tells its oracle what it did. Two
implement it: the virtual world (``p2pswarm.sim.harness.ScenarioRun``: agents on a
MemoryNetwork, virtual time) and the namespace world (``p2pswarm.sim.netns``: agent
processes in network namespaces, real time). Every draw is made here, from the
generator the director is given, in the order the actions happen, so a virtual run is a
function of the scenario and its seed.
"""

from __future__ import annotations

import random
from typing import Protocol

import trio

from p2pswarm.sim.actions import (
    Action,
    CardFill,
    CardFree,
    Crash,
    Fellow,
    Form,
    Heal,
    JoinBurst,
    LeaderKill,
    Leave,
    LinkDown,
    LinkUp,
    Partition,
    RateCardChange,
    RateCrash,
    RateLeaderKill,
    RateLeave,
    RatePartition,
    Rejoin,
    Restart,
    Start,
    TimedAction,
)
from p2pswarm.sim.scenario import Scenario

LEAVE_LINGER_S = 2.0  # a rate-drawn rejoin counts from the end of the leave


class World(Protocol):
    """Where a scenario's fellows run; what the director may ask and order."""

    def now(self) -> float:
        """Seconds since the run began."""
        ...

    async def sleep_until(self, t: float) -> None:
        """Wait until ``now()`` is ``t``."""
        ...

    def running(self, i: int) -> bool:
        """Whether fellow ``i``'s process runs."""
        ...

    def has_started(self, i: int) -> bool:
        """Whether fellow ``i`` was ever started in this run."""
        ...

    def is_cut(self, i: int) -> bool:
        """Whether fellow ``i``'s link is down (``link_down``)."""
        ...

    async def start(self, i: int) -> None:
        """Start fellow ``i`` (first time or again) and tell the oracle."""
        ...

    async def form(self) -> None:
        """Start the first fellows at once, each already knowing the others."""
        ...

    def crash(self, i: int) -> None:
        """Kill fellow ``i``'s process."""
        ...

    async def leave(self, i: int) -> None:
        """Have fellow ``i`` leave gracefully (the director runs this as its own task)."""
        ...

    def link_down(self, i: int) -> None: ...

    def link_up(self, i: int) -> None: ...

    def partition(self, groups: list[list[int]]) -> None: ...

    def heal(self) -> None: ...

    def leader(self) -> int | None:
        """The fellow that leads now, as far as the world can tell (None: none)."""
        ...

    def kill_leader(self, i: int, nursery: trio.Nursery) -> None:
        """Crash the leader ``i`` and follow the failover that should come."""
        ...

    def card_is_free(self, i: int) -> bool:
        """Whether fellow ``i``'s card is all free."""
        ...

    def set_card(self, i: int, free_gb: float | None) -> None:
        """Fill fellow ``i``'s card until ``free_gb`` is left (None: free it all)."""
        ...

    def note(self, text: str) -> None:
        """A line for the run's notes."""
        ...


class Director:
    """Runs a timeline in a world; see the module docstring."""

    def __init__(self, world: World, scenario: Scenario, nodes: int, starters: int,
                 rng: random.Random) -> None:
        self.world = world
        self.scenario = scenario
        self.n = nodes
        self.rng = rng
        self.next_join = starters  # the next fellow a join burst starts
        self.partition_active = False

    async def run(self, timeline: list[TimedAction], nursery: trio.Nursery) -> None:
        """Every action at its time, then on to the end of the scenario."""
        for timed in timeline:
            await self.world.sleep_until(timed.at_s)
            await self.perform(timed.action, nursery)
        await self.world.sleep_until(self.scenario.duration_s)

    # choosing ---------------------------------------------------------------------------

    def pick(self, fellow: Fellow, *, want_running: bool = True) -> int | None:
        """The fellow an action names, or for ``"random"`` one drawn among those started,
        not cut off, and running (or not)."""
        if isinstance(fellow, int):
            return fellow
        w = self.world
        pool = [i for i in range(self.n) if w.running(i) == want_running
                and w.has_started(i) and not w.is_cut(i)]
        return self.rng.choice(pool) if pool else None

    def _range(self, pair: tuple[float, float] | None) -> float | None:
        return None if pair is None else self.rng.uniform(*pair)

    def later(self, nursery: trio.Nursery, after_s: float, action: Action) -> None:
        """Perform ``action`` ``after_s`` from now (not past the end of the scenario)."""
        nursery.start_soon(self._later, after_s, action, nursery)

    async def _later(self, after_s: float, action: Action, nursery: trio.Nursery) -> None:
        await self.world.sleep_until(self.world.now() + after_s)
        if self.world.now() >= self.scenario.duration_s:
            return
        await self.perform(action, nursery)

    # acting -----------------------------------------------------------------------------

    async def perform(self, action: Action, nursery: trio.Nursery) -> None:
        """One action, now. Dispatches on its type."""
        w = self.world
        match action:
            case Start(fellow=i):
                await w.start(i)
            case Form():
                await w.form()
            case Crash() | RateCrash():
                self._crash(action, nursery)
            case Restart(fellow=fellow):
                who = self.pick(fellow, want_running=False)
                if who is not None and not w.running(who):
                    await w.start(who)
            case Leave() | RateLeave():
                self._leave(action, nursery)
            case CardFill() | CardFree() | RateCardChange():
                self._card(action)
            case LeaderKill() | RateLeaderKill():
                self._kill_leader(action, nursery)
            case Partition() | RatePartition():
                self._partition(action, nursery)
            case Heal():
                w.heal()
                self.partition_active = False
            case JoinBurst(count=count):
                for _ in range(count):
                    if self.next_join >= self.n:
                        break
                    await w.start(self.next_join)
                    self.next_join += 1
            case LinkDown(fellow=i):  # and a roaming outage's beginning
                if w.running(i) and not w.is_cut(i):
                    w.link_down(i)
            case LinkUp(fellow=i):  # and its end
                if w.is_cut(i):
                    w.link_up(i)

    def _crash(self, action: Crash | RateCrash, nursery: trio.Nursery) -> None:
        who = self.pick(action.fellow if isinstance(action, Crash) else "random")
        if who is None or not self.world.running(who):
            return
        self.world.crash(who)
        after = action.restart_after_s if isinstance(action, Crash) else \
            self._range(self.scenario.rates.crash_restart_after_s)
        if after is not None:
            self.later(nursery, after, Restart(who))

    def _leave(self, action: Leave | RateLeave, nursery: trio.Nursery) -> None:
        who = self.pick(action.fellow if isinstance(action, Leave) else "random")
        if who is None or not self.world.running(who):
            return
        nursery.start_soon(self.world.leave, who)
        if isinstance(action, RateLeave):
            after = self._range(self.scenario.rates.leave_rejoin_after_s)
            if after is not None:
                self.later(nursery, after + LEAVE_LINGER_S, Rejoin(who))

    def _card(self, action: CardFill | CardFree | RateCardChange) -> None:
        who = self.pick("random" if isinstance(action, RateCardChange) else action.fellow)
        if who is None:
            return
        if isinstance(action, RateCardChange):
            filling = self.world.card_is_free(who)
            free_gb = self.rng.uniform(*self.scenario.rates.card_fill_free_gb)
        else:
            filling = isinstance(action, CardFill)
            free_gb = (action.free_gb if isinstance(action, CardFill) else None) or 1.0
        self.world.set_card(who, free_gb if filling else None)

    def _kill_leader(self, action: LeaderKill | RateLeaderKill, nursery: trio.Nursery) -> None:
        w = self.world
        leader = w.leader()
        if leader is None:
            w.note(f"{w.now():.1f} s: no leader to kill")
            return
        w.kill_leader(leader, nursery)
        after = action.restart_after_s if isinstance(action, LeaderKill) else \
            self._range(self.scenario.rates.leader_restart_after_s)
        if after is not None:
            self.later(nursery, after, Restart(leader))

    def _partition(self, action: Partition | RatePartition, nursery: trio.Nursery) -> None:
        rates = self.scenario.rates
        if isinstance(action, RatePartition):
            if self.partition_active:
                return
            groups: list[list[int]] = []
            split = 0.5
        else:
            groups = [list(g) for g in action.groups]
            split = float(action.split or 0.5)
        if not groups:
            if isinstance(action, RatePartition):
                split = self.rng.uniform(*rates.partition_split)
            order = list(range(self.n))
            self.rng.shuffle(order)
            k = max(1, round(split * self.n))
            groups = [sorted(order[:k]), sorted(order[k:])]
        self.world.partition(groups)
        self.partition_active = True
        if isinstance(action, RatePartition):
            self.later(nursery, self.rng.uniform(*rates.partition_heal_after_s), Heal())


__all__ = ["LEAVE_LINGER_S", "Director", "World"]
