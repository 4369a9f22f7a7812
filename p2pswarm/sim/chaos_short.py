"""The chaos run's short version: a few real `join` fellows, one event of each kind, no
model and no job, in well under a minute (``p2pswarm.sim.chaos`` is the long run).

Four fellows on loopback, each on an address of its own that it keeps across restarts.
Once they have one leader, a fixed script hits them, each event as soon as the running
fellows name one leader again (a fellow started again boots meanwhile: process starts
are most of a short run's time, so they overlap the next events):

1. leader kill: whoever leads is killed (SIGKILL) while the other three run; once a new
   leader is named it starts again from its state directory, on its address;
2. freeze: a fellow that does not lead is stopped (SIGSTOP) for ``freeze_s``, then
   continued;
3. leave: another leaves (SIGTERM: `join` leaves gracefully) and starts again;
4. crash: a fellow that does not lead is killed (SIGKILL) and starts again.

Then every fellow must answer and name one leader. Measured, as in the long run
(``verdict`` says which miss their target): leaders per term from every fellow's log
(target: 1 in every term); how long the running fellows went without naming one leader
while more than half of the fellows ran (target: ``bound_s`` at most, each time; a
fellow started again counts once it names a leader, and how long that took is kept:
``joined_s``); fellows that exited without being told to (target: none); one leader
for all at the end.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from p2pswarm.errors import ControlError
from p2pswarm.sim.chaos import Field
from p2pswarm.sim.field import followed_per_term, free_address, two_leaders
from p2pswarm.sim.processes import Say, local_swarm

POLL_S = 0.2
LEADER_BOUND_S = 10.0  # the bound: a leader within 10 s while a majority is up
EVENTS = ("leader-kill", "freeze", "leave", "crash")


class Watch:
    """The run's clock: polls the swarm between events, keeps the leaderless spells.

    A fellow (re)started counts once it has named a leader: until then it is still
    joining (booting, then asking who leads), and how long that took is kept apart
    (``joined_s``); the final check waits for every fellow to name the leader."""

    def __init__(self, field: Field) -> None:
        self.field = field
        self.began = time.monotonic()
        self.leaderless_since: float | None = None
        self.spells: list[float] = []  # leaderless seconds with a majority running
        self.known: set[str] = set()  # fellows that named a leader since their start
        self.started: dict[str, float] = {}  # fellow -> when it was (re)started
        self.joined_s: list[float] = []  # (re)start to naming a leader, per restart

    def start(self, name: str) -> None:
        self.field.start(name)
        self.known.discard(name)
        self.started[name] = time.monotonic()

    def leader_now(self) -> str | None:
        """The leader every running fellow that has named one since its start names."""
        seen = set()
        for name in self.field.running():
            try:
                leader = self.field.swarm.status(name).get("leader")
            except ControlError:
                leader = None
            if not leader:
                if name in self.known:
                    return None
                continue
            if name not in self.known:
                self.known.add(name)
                self.joined_s.append(time.monotonic() - self.started.get(name, self.began))
            seen.add((leader["name"], leader["term"]))
        return seen.pop()[0] if len(seen) == 1 else None

    def poll(self) -> str | None:
        now = time.monotonic()
        self.field.upkeep(now)
        leader = self.leader_now()
        if self.field.majority_up(now) and leader is None:
            self.leaderless_since = self.leaderless_since or now
        elif self.leaderless_since is not None:
            self.spells.append(now - self.leaderless_since)
            self.leaderless_since = None
        return leader

    def until(self, done: Callable[[str | None], bool], timeout_s: float) -> bool:
        """Poll until ``done(leader now)``; False when ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while True:
            if done(self.poll()):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)

    def settled(self, timeout_s: float) -> str | None:
        """The leader once every running fellow names it."""
        def ready(leader: str | None) -> bool:
            return leader is not None and set(self.field.running()) <= self.known

        return self.leader_now() if self.until(ready, timeout_s) else None

    def at(self) -> float:
        return round(time.monotonic() - self.began, 2)


def _stop(field: Field, name: str, sig: signal.Signals) -> None:
    """Stop ``name`` with ``sig`` (SIGTERM: it leaves) and wait for its process."""
    field.told_to_stop.add(name)
    process = field.swarm.processes[name]
    process.send_signal(sig)
    field.up[name] = False
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _target(field: Field, known: set[str], leader: str, hit: list[str]) -> str | None:
    """A running fellow that has named the leader and does not lead; one not hit yet first."""
    ready = [n for n in field.running() if n != leader and n in known]
    fresh = [n for n in ready if n not in hit]
    return (fresh or ready)[0] if ready else None


def run(*, fellows: int = 4, seed: int = 1, say: Say, freeze_s: float = 2.0,
        settle_timeout_s: float = 60.0, keep: bool = False) -> dict[str, Any]:
    """Form ``fellows`` fellows, hit them with ``EVENTS`` in turn; what was seen."""
    names = [f"f{i}" for i in range(fellows)]
    rng = random.Random(seed)
    began = time.monotonic()
    with local_swarm(say, keep=keep, start_timeout_s=120) as swarm:
        field = Field(swarm, names, rng, {n: free_address() for n in names},
                      {n: False for n in names}, extra=("--log-level", "info"))
        watch = Watch(field)
        for fellow in names:
            watch.start(fellow)
        leader: str | None = watch.settled(settle_timeout_s)
        watch.spells.clear()  # forming is not an outage
        watch.joined_s.clear()
        formed_s = round(time.monotonic() - began, 2)
        say(f"{fellows} fellows formed in {formed_s} s; {leader} leads")
        events: list[dict[str, Any]] = []
        hit: list[str] = []
        for kind in EVENTS:
            if leader is None:
                break
            name: str | None = leader if kind == "leader-kill" else _target(
                field, watch.known, leader, hit)
            if name is None:
                break
            hit.append(name)
            event: dict[str, Any] = {"kind": kind, "fellow": name, "at_s": watch.at()}
            if kind == "freeze":
                swarm.processes[name].send_signal(signal.SIGSTOP)
                field.frozen[name] = time.monotonic() + freeze_s
                watch.until(lambda _: name not in field.frozen, freeze_s + 5)
            else:
                _stop(field, name, signal.SIGTERM if kind == "leave" else signal.SIGKILL)
                if kind == "leader-kill":
                    started = time.monotonic()
                    new = watch.until(lambda ld: ld is not None and ld != name,
                                      settle_timeout_s)
                    event["new_leader_s"] = round(time.monotonic() - started, 2) if new \
                        else None
                watch.start(name)  # back from its own state directory, on its address
            found = watch.until(lambda ld: ld is not None, settle_timeout_s)
            leader = watch.leader_now() if found else None
            event["leader_after"] = leader
            events.append(event)
            say(f"{kind} {name} at {event['at_s']} s; then {leader} leads")
        leader = watch.settled(settle_timeout_s)
        if watch.leaderless_since is not None:  # still without a leader at the end
            watch.spells.append(time.monotonic() - watch.leaderless_since)
        terms = followed_per_term(swarm)
        return {"fellows": fellows, "seed": seed, "formed_s": formed_s, "events": events,
                "run_s": round(time.monotonic() - began, 2), "terms": len(terms),
                "terms_with_two_leaders": two_leaders(terms),
                "leaderless_s": [round(s, 2) for s in watch.spells],
                "joined_s": [round(s, 2) for s in watch.joined_s],
                "agents_crashed": list(field.unexpected_exits), "leader_at_end": leader}


def verdict(report: dict[str, Any], bound_s: float = LEADER_BOUND_S) -> list[str]:
    """Each target the run missed, in one line (empty: every target met)."""
    misses = []
    if [e["kind"] for e in report["events"]] != list(EVENTS):
        misses.append(f"events run: {[e['kind'] for e in report['events']]}, not {EVENTS}")
    if report["terms_with_two_leaders"]:
        misses.append(f"terms with two leaders: {report['terms_with_two_leaders']}")
    longest = max(report["leaderless_s"], default=0.0)
    if longest > bound_s:
        misses.append(f"without a leader for {longest} s with a majority up (> {bound_s:g} s)")
    if report["agents_crashed"]:
        misses.append(f"agents crashed: {report['agents_crashed']}")
    if report["leader_at_end"] is None:
        misses.append("no leader for all at the end")
    return misses


__all__ = ["EVENTS", "LEADER_BOUND_S", "run", "verdict"]
