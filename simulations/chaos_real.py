"""Churn on real `p2pswarm join` processes: random leaves, crashes, restarts, freezes
(SIGSTOP/SIGCONT) and leader kills on loopback, for as long as asked.

Every few seconds one event hits one fellow, drawn from the seed:

- leave (`p2pswarm leave`), crash (SIGKILL), freeze (SIGSTOP for 1-20 s, then SIGCONT),
  leader kill (SIGKILL of whoever leads now); a fellow that is down comes back after
  5-60 s from its own state directory, on its own address.

Measured, from the fellows' status and their own logs:

- leaders per term: every term's leaders as the fellows followed them (target: 1);
- leader availability: over the moments when more than half of the fellows that ran in
  the last 5 minutes are up, how long until every running fellow names one leader
  (p50 / p99 / max; target p99 <= 10 s); a fellow still booting (its agent has not
  answered since it was started) is not counted as running;
- agents crashed: fellows that exited without being told to (target: 0).

    python simulations/chaos_real.py [--fellows 8] [--minutes 20] [--seed 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from p2pswarm.errors import ControlError
from p2pswarm.sim.field import followed_per_term, free_address, two_leaders
from p2pswarm.sim.processes import LocalSwarm, local_swarm

RECENT_S = 300.0  # "the fellows that ran in the last 5 minutes"


@dataclass
class Chaos:
    swarm: LocalSwarm
    names: list[str]
    rng: random.Random
    addresses: dict[str, str] = field(default_factory=dict)
    up: dict[str, bool] = field(default_factory=dict)
    frozen: dict[str, float] = field(default_factory=dict)  # name -> thaw at
    back_at: dict[str, float] = field(default_factory=dict)  # name -> restart at
    last_up: dict[str, float] = field(default_factory=dict)
    told_to_stop: set[str] = field(default_factory=set)
    answered: set[str] = field(default_factory=set)  # agents that answered since their start
    unexpected_exits: list[str] = field(default_factory=list)
    events: list[tuple[float, str, str]] = field(default_factory=list)

    def start(self, name: str) -> None:
        seeds = tuple(self.addresses[n] for n in self.names if n != name)
        self.swarm.launch(name, seeds=seeds, listen=self.addresses[name])
        self.up[name] = True
        self.told_to_stop.discard(name)
        self.answered.discard(name)

    def running(self) -> list[str]:
        return [n for n in self.names if self.up[n] and n not in self.frozen]

    def leader_now(self) -> str | None:
        """The leader every running fellow names; a fellow whose agent has not answered
        since it was (re)started is still booting and is not asked."""
        seen = set()
        for name in self.running():
            try:
                leader = self.swarm.status(name).get("leader")
            except ControlError:
                if name in self.answered:
                    return None
                continue
            self.answered.add(name)
            if not leader:
                return None
            seen.add((leader["name"], leader["term"]))
        return seen.pop()[0] if len(seen) == 1 else None

    def hit(self, now: float) -> None:
        live = [n for n in self.names if self.up[n] and n not in self.frozen]
        if len(live) <= 1:
            return
        kind = self.rng.choice(["leave", "crash", "freeze", "leader"])
        name = self.rng.choice(live)
        if kind == "leader":
            name = self.leader_now() or name
            kind = "leader-kill"
        self.events.append((now, kind, name))
        process = self.swarm.processes[name]
        if kind == "freeze":
            process.send_signal(signal.SIGSTOP)
            self.frozen[name] = now + self.rng.uniform(1, 20)
            return
        self.told_to_stop.add(name)
        if kind == "leave":
            subprocess.run([sys.executable, "-m", "p2pswarm.cli", "leave", "--home",
                            str(self.swarm.homes[name])], capture_output=True, timeout=30)
        else:
            process.send_signal(signal.SIGKILL)
        self.up[name] = False
        self.back_at[name] = now + self.rng.uniform(5, 60)

    def upkeep(self, now: float) -> None:
        for name, thaw in list(self.frozen.items()):
            if now >= thaw:
                self.swarm.processes[name].send_signal(signal.SIGCONT)
                del self.frozen[name]
        for name, at in list(self.back_at.items()):
            if now >= at:
                process = self.swarm.processes[name]
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                del self.back_at[name]
                self.start(name)
        for name in self.names:
            if self.up[name]:
                self.last_up[name] = now
                if self.swarm.processes[name].poll() is not None and \
                        name not in self.told_to_stop:
                    self.unexpected_exits.append(name)
                    self.up[name] = False
                    self.back_at[name] = now + 5

    def majority_up(self, now: float) -> bool:
        recent = [n for n in self.names if now - self.last_up.get(n, -1e9) <= RECENT_S]
        return 2 * len(self.running()) > len(recent)


def run(fellows: int, minutes: float, seed: int, say: Any) -> dict[str, Any]:
    rng = random.Random(seed)
    names = [f"f{i}" for i in range(fellows)]
    with local_swarm(say, start_timeout_s=120) as swarm:
        chaos = Chaos(swarm, names, rng, {n: free_address() for n in names},
                      {n: False for n in names})
        for name in names:
            chaos.start(name)
        for name in names:
            swarm.address(name)
        begin = time.monotonic()
        end = begin + minutes * 60
        next_hit = begin + 20  # let it form first
        leaderless_since: float | None = None
        waits: list[float] = []
        while time.monotonic() < end:
            now = time.monotonic()
            chaos.upkeep(now)
            if now >= next_hit:
                chaos.hit(now)
                next_hit = now + rng.uniform(5, 20)
            if chaos.majority_up(now) and chaos.leader_now() is None:
                leaderless_since = leaderless_since or now
            elif leaderless_since is not None:
                waits.append(now - leaderless_since)
                leaderless_since = None
            time.sleep(0.5)
        terms = followed_per_term(swarm)
    waits_sorted = sorted(waits) or [0.0]
    return {
        "fellows": fellows, "minutes": minutes, "seed": seed,
        "events": len(chaos.events),
        "events_by_kind": {k: sum(1 for _, kind, _ in chaos.events if kind == k)
                           for k in ("leave", "crash", "freeze", "leader-kill")},
        "terms": len(terms), "terms_with_two_leaders": two_leaders(terms),
        "leaderless_spells": len(waits),
        "leader_within_s": {
            "p50": round(statistics.median(waits_sorted), 2),
            "p99": round(waits_sorted[min(len(waits_sorted) - 1,
                                          int(0.99 * len(waits_sorted)))], 2),
            "max": round(waits_sorted[-1], 2)},
        "agents_crashed": chaos.unexpected_exits,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fellows", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(args.fellows, args.minutes, args.seed,
                 (lambda m: None) if args.json else print)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        w = report["leader_within_s"]
        print(f"{report['fellows']} fellows, {report['minutes']:g} min, "
              f"{report['events']} events {report['events_by_kind']}")
        print(f"terms: {report['terms']}, with two leaders: "
              f"{report['terms_with_two_leaders'] or 'none'}")
        print(f"leaderless spells with a majority up: {report['leaderless_spells']}; "
              f"leader within p50 {w['p50']} s, p99 {w['p99']} s, max {w['max']} s")
        print(f"agents crashed: {report['agents_crashed'] or 'none'}")
    bad = report["terms_with_two_leaders"] or report["agents_crashed"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
