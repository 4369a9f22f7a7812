"""What happens to a simulated swarm, as values: one frozen type per kind of action.

A scenario file names its events with strings (``"crash"``, ``"partition"``, ...; see
``p2pswarm.sim.scenario``); ``build_timeline`` turns the scenario into one ordered list
of ``TimedAction``s, each holding one of the types below: the starts, the scripted
events, the events drawn at the scenario's rates, the roaming outages of each fellow's
profile. ``p2pswarm.sim.director`` walks that list and dispatches on the type.

``fellow`` is an index, or ``"random"`` for a running fellow the director draws when it
acts. The ``Rate*`` actions are the events drawn at rates: what they need beyond the
time (a fellow, how long until it comes back, how the swarm splits) is drawn when they
happen, from the director's generator, so a run is a function of the scenario's seed.
Each type's ``kind`` is the name it has in files, reports and notes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from p2pswarm.errors import ConfigError
from p2pswarm.sim.profiles import Profile
from p2pswarm.sim.scenario import Scenario, ScriptedEvent

Fellow = int | str  # an index, or "random"


@dataclass(frozen=True, slots=True)
class Form:
    """Start the first fellows at once, each already knowing all the others."""

    kind: ClassVar[str] = "form"


@dataclass(frozen=True, slots=True)
class Start:
    """Start fellow ``fellow`` for the first time (it joins through those running)."""

    fellow: int
    kind: ClassVar[str] = "start"


@dataclass(frozen=True, slots=True)
class Crash:
    """Kill a fellow's process; start it again ``restart_after_s`` later (None: never)."""

    fellow: Fellow
    restart_after_s: float | None = None
    kind: ClassVar[str] = "crash"


@dataclass(frozen=True, slots=True)
class Restart:
    """Start a stopped fellow again, same identity."""

    fellow: Fellow
    kind: ClassVar[str] = "restart"


@dataclass(frozen=True, slots=True)
class Rejoin(Restart):
    """Start a fellow that left again (the same as a restart)."""

    kind: ClassVar[str] = "rejoin"


@dataclass(frozen=True, slots=True)
class Leave:
    """A fellow leaves the swarm gracefully."""

    fellow: Fellow
    kind: ClassVar[str] = "leave"


@dataclass(frozen=True, slots=True)
class CardFill:
    """Something else takes a fellow's card until ``free_gb`` is left (None: 1 GB)."""

    fellow: Fellow
    free_gb: float | None = None
    kind: ClassVar[str] = "card_fill"


@dataclass(frozen=True, slots=True)
class CardFree:
    """A fellow's card is all free again."""

    fellow: Fellow
    kind: ClassVar[str] = "card_free"


@dataclass(frozen=True, slots=True)
class LeaderKill:
    """Kill the current leader's process; start it again ``restart_after_s`` later."""

    restart_after_s: float | None = None
    kind: ClassVar[str] = "leader_kill"


@dataclass(frozen=True, slots=True)
class Partition:
    """Cut the swarm into ``groups`` of fellow indices, or, without groups, cut off a
    random ``split`` fraction of it."""

    groups: tuple[tuple[int, ...], ...] = ()
    split: float | None = None
    kind: ClassVar[str] = "partition"


@dataclass(frozen=True, slots=True)
class Heal:
    """Undo the partition."""

    kind: ClassVar[str] = "heal"


@dataclass(frozen=True, slots=True)
class JoinBurst:
    """Start ``count`` fellows not started yet, one after another."""

    count: int
    kind: ClassVar[str] = "join_burst"


@dataclass(frozen=True, slots=True)
class LinkDown:
    """Take a fellow's whole link down, without stopping its process."""

    fellow: int
    kind: ClassVar[str] = "link_down"


@dataclass(frozen=True, slots=True)
class LinkUp:
    """Bring a fellow's link back."""

    fellow: int
    kind: ClassVar[str] = "link_up"


@dataclass(frozen=True, slots=True)
class OutageBegin(LinkDown):
    """A roaming outage of the fellow's profile begins (its link goes down)."""

    kind: ClassVar[str] = "outage_begin"


@dataclass(frozen=True, slots=True)
class OutageEnd(LinkUp):
    """The roaming outage ends (its link comes back)."""

    kind: ClassVar[str] = "outage_end"


@dataclass(frozen=True, slots=True)
class RateCrash:
    """A crash drawn at the scenario's rate: a random running fellow, restarted after a
    time drawn from ``rates.crash_restart_after_s``."""

    kind: ClassVar[str] = "rate_crash"


@dataclass(frozen=True, slots=True)
class RateLeave:
    """A leave drawn at the rate; the fellow rejoins after ``rates.leave_rejoin_after_s``."""

    kind: ClassVar[str] = "rate_leave"


@dataclass(frozen=True, slots=True)
class RateCardChange:
    """A random fellow's card fills (to ``rates.card_fill_free_gb``) or frees again."""

    kind: ClassVar[str] = "rate_card_change"


@dataclass(frozen=True, slots=True)
class RateLeaderKill:
    """A leader kill drawn at the rate, restarted after ``rates.leader_restart_after_s``."""

    kind: ClassVar[str] = "rate_leader_kill"


@dataclass(frozen=True, slots=True)
class RatePartition:
    """A partition drawn at the rate (none while one is on): a ``rates.partition_split``
    fraction cut off, healed after ``rates.partition_heal_after_s``."""

    kind: ClassVar[str] = "rate_partition"


Action = (Form | Start | Crash | Restart | Leave | CardFill | CardFree | LeaderKill
          | Partition | Heal | JoinBurst | LinkDown | LinkUp | RateCrash | RateLeave
          | RateCardChange | RateLeaderKill | RatePartition)


@dataclass(frozen=True, slots=True, order=True)
class TimedAction:
    """One action at its time; ``seq`` keeps actions at one instant in timeline order."""

    at_s: float
    seq: int  # unique in a timeline: actions themselves are never compared for order
    action: Action

    @property
    def kind(self) -> str:
        return self.action.kind


def _fellow(e: ScriptedEvent) -> Fellow:
    if e.fellow is None:  # scenario.py refuses these for the kinds that need a fellow
        raise ConfigError(f"a {e.kind} event at {e.at_s} s needs a fellow")
    return e.fellow


def _index(e: ScriptedEvent) -> int:
    if not isinstance(e.fellow, int):
        raise ConfigError(f"a {e.kind} event at {e.at_s} s needs a fellow's index, "
                          f"not {e.fellow!r}")
    return e.fellow


def action_of(e: ScriptedEvent) -> Action:
    """The typed action of one scripted event of a scenario file."""
    kind = e.kind
    if kind == "crash":
        return Crash(_fellow(e), e.restart_after_s)
    if kind == "restart":
        return Restart(_fellow(e))
    if kind == "rejoin":
        return Rejoin(_fellow(e))
    if kind == "leave":
        return Leave(_fellow(e))
    if kind == "partition":
        return Partition(e.groups, e.split)
    if kind == "heal":
        return Heal()
    if kind == "card_fill":
        return CardFill(_fellow(e), e.free_gb)
    if kind == "card_free":
        return CardFree(_fellow(e))
    if kind == "leader_kill":
        return LeaderKill(e.restart_after_s)
    if kind == "join_burst":
        return JoinBurst(e.count)
    if kind == "link_down":
        return LinkDown(_index(e))
    if kind == "link_up":
        return LinkUp(_index(e))
    raise ConfigError(f"unknown event kind {kind!r}")


_RATE_ACTIONS: tuple[tuple[str, Action], ...] = (
    ("crash", RateCrash()), ("leave", RateLeave()), ("card_change", RateCardChange()),
    ("leader_kill", RateLeaderKill()), ("partition", RatePartition()))


def build_timeline(s: Scenario, profiles: list[Profile], starters: int) -> list[TimedAction]:
    """Every action of a run, in order: starts, scripted events, events drawn at the
    scenario's rates, roaming outages. Drawn from generators seeded by the scenario."""
    actions: list[TimedAction] = []

    def add(at: float, action: Action) -> None:
        if at <= s.duration_s:
            actions.append(TimedAction(at, len(actions) + 1, action))

    if s.formed:
        add(0.0, Form())
    else:
        for i in range(starters):
            add(i * s.stagger_s, Start(i))
    for e in s.events:
        add(e.at_s, action_of(e))
    rates = s.rates
    per_hour = {"crash": rates.crash_per_hour, "leave": rates.leave_per_hour,
                "card_change": rates.card_change_per_hour,
                "leader_kill": rates.leader_kill_per_hour,
                "partition": rates.partition_per_hour}
    gen = random.Random(f"rates:{s.seed}")
    for name, action in _RATE_ACTIONS:
        if per_hour[name] <= 0:
            continue
        t = s.warmup_s
        while True:
            t += gen.expovariate(per_hour[name] / 3600.0)
            if t >= s.duration_s:
                break
            add(t, action)
    outages = random.Random(f"outages:{s.seed}")
    for i, p in enumerate(profiles):
        for begin, end in p.outages(outages, s.warmup_s, s.duration_s):
            add(begin, OutageBegin(i))
            add(min(end, s.duration_s), OutageEnd(i))
    actions.sort()
    return actions


__all__ = [
    "Action",
    "CardFill",
    "CardFree",
    "Crash",
    "Form",
    "Heal",
    "JoinBurst",
    "LeaderKill",
    "Leave",
    "LinkDown",
    "LinkUp",
    "OutageBegin",
    "OutageEnd",
    "Partition",
    "RateCardChange",
    "RateCrash",
    "RateLeaderKill",
    "RateLeave",
    "RatePartition",
    "Rejoin",
    "Restart",
    "Start",
    "TimedAction",
    "action_of",
    "build_timeline",
]
