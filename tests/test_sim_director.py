"""The director: typed actions performed on a World, whatever world it is.

A recording world stands in for agents or namespaces; under trio's autojump MockClock
the director's sleeps are virtual, so the calls and their times are exact.
"""

from __future__ import annotations

import random

import trio
import trio.testing

from p2pswarm.sim.actions import (
    CardFill,
    Crash,
    Heal,
    JoinBurst,
    LeaderKill,
    Leave,
    LinkDown,
    LinkUp,
    OutageBegin,
    Partition,
    RatePartition,
    Rejoin,
    Restart,
    Start,
    TimedAction,
    action_of,
    build_timeline,
)
from p2pswarm.sim.director import Director
from p2pswarm.sim.profiles import profile
from p2pswarm.sim.scenario import ScriptedEvent, scenario_from_dict


class RecordingWorld:
    """A World that keeps fellows as flags and writes down every order."""

    def __init__(self, n: int) -> None:
        self.up = [False] * n
        self.started = [False] * n
        self.cut = [False] * n
        self.calls: list[tuple[float, str, object]] = []
        self.notes: list[str] = []

    def _log(self, what: str, arg: object = None) -> None:
        self.calls.append((round(trio.current_time(), 6), what, arg))

    def now(self) -> float:
        return trio.current_time()

    async def sleep_until(self, t: float) -> None:
        await trio.sleep_until(t)

    def running(self, i: int) -> bool:
        return self.up[i]

    def has_started(self, i: int) -> bool:
        return self.started[i]

    def is_cut(self, i: int) -> bool:
        return self.cut[i]

    async def start(self, i: int) -> None:
        self.up[i] = self.started[i] = True
        self._log("start", i)

    async def form(self) -> None:
        self._log("form")

    def crash(self, i: int) -> None:
        self.up[i] = False
        self._log("crash", i)

    async def leave(self, i: int) -> None:
        self.up[i] = False
        self._log("leave", i)

    def link_down(self, i: int) -> None:
        self.cut[i] = True
        self._log("link_down", i)

    def link_up(self, i: int) -> None:
        self.cut[i] = False
        self._log("link_up", i)

    def partition(self, groups: list[list[int]]) -> None:
        self._log("partition", groups)

    def heal(self) -> None:
        self._log("heal")

    def leader(self) -> int | None:
        return next((i for i, up in enumerate(self.up) if up), None)

    def kill_leader(self, i: int, nursery: trio.Nursery) -> None:
        self.crash(i)

    def card_is_free(self, i: int) -> bool:
        return True

    def set_card(self, i: int, free_gb: float | None) -> None:
        self._log("card", (i, free_gb))

    def note(self, text: str) -> None:
        self.notes.append(text)


SCENARIO = scenario_from_dict({"name": "d", "nodes": 5, "duration_s": 100, "warmup_s": 10})


def perform(timeline: list[TimedAction], n: int = 5, starters: int = 3,
            seed: int = 1) -> RecordingWorld:
    world = RecordingWorld(n)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await Director(world, SCENARIO, n, starters, random.Random(seed)).run(
                timeline, nursery)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return world


def timed(*actions: tuple[float, object]) -> list[TimedAction]:
    return [TimedAction(at, k, a) for k, (at, a) in enumerate(actions)]  # type: ignore[arg-type]


def test_actions_are_performed_at_their_times_with_their_consequences() -> None:
    world = perform(timed((0.0, Start(0)), (0.0, Start(1)), (0.5, Start(2)),
                          (10.0, Crash(1, restart_after_s=5.0)),
                          (11.0, LinkDown(2)), (11.5, LinkDown(2)), (12.0, LinkUp(2)),
                          (20.0, Partition(((0,), (1, 2)))), (25.0, Heal()),
                          (30.0, JoinBurst(5)), (40.0, LeaderKill(restart_after_s=None)),
                          (50.0, CardFill(2, free_gb=3.0)), (60.0, Leave(4)),
                          (61.0, Rejoin(4))))
    assert world.calls == [
        (0.0, "start", 0), (0.0, "start", 1), (0.5, "start", 2), (10.0, "crash", 1),
        (11.0, "link_down", 2), (12.0, "link_up", 2), (15.0, "start", 1),
        (20.0, "partition", [[0], [1, 2]]), (25.0, "heal", None),
        (30.0, "start", 3), (30.0, "start", 4),  # a burst starts only those not started
        (40.0, "crash", 0), (50.0, "card", (2, 3.0)), (60.0, "leave", 4),
        (61.0, "start", 4)]


def test_actions_that_do_not_apply_now_do_nothing() -> None:
    world = perform(timed((0.0, Start(0)), (1.0, Crash(3)), (2.0, Restart(0)),
                          (3.0, LinkUp(0)), (4.0, LinkDown(3)), (5.0, Leave(2)),
                          (6.0, LeaderKill()), (6.0, LeaderKill())))
    assert world.calls == [(0.0, "start", 0), (6.0, "crash", 0)]
    assert world.notes == ["6.0 s: no leader to kill"]


def test_random_choices_come_from_the_directors_generator() -> None:
    line = timed(*[(float(i), Start(i)) for i in range(5)],
                 (10.0, Crash("random", 1.0)), (20.0, RatePartition()),
                 (21.0, RatePartition()), (22.0, OutageBegin(0)))
    a, b, c = perform(line), perform(line), perform(line, seed=2)
    assert a.calls == b.calls and a.calls != c.calls
    kinds = [what for _, what, _ in a.calls]
    assert kinds.count("partition") == 1  # no drawn partition while one is on
    assert kinds.count("heal") <= 1 and "link_down" in kinds


def test_scenario_events_become_typed_actions() -> None:
    assert action_of(ScriptedEvent(5.0, "crash", 2, restart_after_s=30.0)) == Crash(2, 30.0)
    assert action_of(ScriptedEvent(5.0, "rejoin", "random")) == Rejoin("random")
    assert isinstance(Rejoin(1), Restart) and Rejoin(1) != Restart(1)
    assert action_of(ScriptedEvent(5.0, "partition", groups=((0,), (1,)))) == \
        Partition(((0,), (1,)))
    s = scenario_from_dict({"name": "t", "nodes": 4, "duration_s": 3600, "warmup_s": 60,
                            "fellows": [{"profile": "W3"}],
                            "events": [{"at_s": 100, "kind": "link_down", "fellow": 1}],
                            "rates": {"partition_per_hour": 5}})
    line = build_timeline(s, [profile(p) for p, _, _ in s.profiles()], 4)
    assert [t.kind for t in line[:4]] == ["start"] * 4
    assert {t.kind for t in line} >= {"link_down", "rate_partition", "outage_begin",
                                      "outage_end"}
    assert line == sorted(line) and len({t.seq for t in line}) == len(line)
