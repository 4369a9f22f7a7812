"""The oracle: what really happened, against what every fellow believed.

Theory of operation. The harness tells the oracle every fault as it injects it (a
process crashed, restarted, left; a fellow's link went down or came back; the network
was partitioned or healed; a card changed) and feeds it every membership and election
event of every agent, with the virtual time it happened. The oracle judges each event
at once, because the truth at that instant is known:

- a ``dead`` verdict about a crashed fellow is a detection (its latency is recorded per
  crash and observer); about a running one it is a false death, "excused" if the two
  were cut apart (roaming outage, link down, partition, or a radio fade that passed
  nothing for ``blackout_min_s`` or longer) within ``excuse_window_s``;
- a ``suspect`` about a running fellow is a false suspicion (counted once per subject
  and incarnation: one episode, however far it spreads; and once per first-hand raise),
  "excused" if the episode began while, or ``suspect_excuse_window_s`` after, the two
  were cut apart: a fellow in a roaming outage really cannot be reached;
- ``alive`` about a running fellow after it was suspected or declared dead is a flap
  (counted once per subject and incarnation);
- ``elected`` and ``leader`` events give, per term, who won and whom fellows followed:
  two in one term is a safety violation;
- ``metadata`` events give how long an update took to reach each fellow.

At the end (``finish``) it turns this into figures and a list of failures: any two
leaders in one term, any crash some observer never saw as dead within
``detect_within_s``, any running and reachable fellow held suspect or dead (or
forgotten) by a running fellow for longer than ``max_suspect_s`` since the two were last
cut apart, or for longer than ``refute_within_s`` of reachable time summed across every
cut (it did not refute: on W3, where each pair is cut apart every few minutes, no single
gap need be long), any plan change no real change explains, and (if the scenario asks)
any unexcused false death. Beliefs still held when the run ends are judged too.
``trace_hash`` is a SHA-256 of every event with its virtual time, observer and subject,
ordered by (time, observer, order at that observer): the same seed must give the same
hash.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from bisect import bisect_left, insort
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.sim.metrics import per_node_hour, summary
from p2pswarm.sim.scenario import Checks

# event kinds (as in p2pswarm.effects)
SUSPECT, ALIVE, DEAD, LEFT, REAPED, METADATA = "suspect", "alive", "dead", "left", \
    "reaped", "metadata"
REFUTED, ELECTED, LEADER, MEMBER_JOINED = "refuted", "elected", "leader", "member-joined"


@dataclass
class Crash:
    subject: int
    at_s: float
    observers: tuple[int, ...]
    until_s: float | None = None  # restarted then
    learned: dict[int, float] = field(default_factory=dict)  # observer -> latency


@dataclass
class Update:
    subject: int
    version: int
    at_s: float
    observers: tuple[int, ...]
    reached: dict[int, float] = field(default_factory=dict)


@dataclass
class Oracle:
    n: int
    checks: Checks
    measure_from_s: float = 0.0
    gossip_interval_s: float = 0.2
    plan_grace_s: float = 60.0  # a plan change this soon after a real change is explained
    # truth
    running: list[bool] = field(init=False)
    run_since: list[float] = field(init=False)
    run_seconds: list[float] = field(init=False)
    stops: list[list[float]] = field(init=False)  # per fellow: when its process stopped
    cuts: list[list[list[float]]] = field(init=False)  # per fellow: [start, end] cut off
    blackouts: list[list[tuple[float, float]]] = field(init=False)  # long radio fades
    partitions: list[tuple[float, float, dict[int, int]]] = field(default_factory=list)
    _partition_open: tuple[float, dict[int, int]] | None = None
    real_changes: list[float] = field(default_factory=list)  # crash/leave/restart/card
    cut_changes: list[float] = field(default_factory=list)
    crashes: list[Crash] = field(default_factory=list)
    _crash_of: dict[int, Crash] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)
    # beliefs and events
    events: list[tuple[float, int, str, int, int, int]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    false_suspicion_episodes: set[tuple[int, int]] = field(default_factory=set)
    excused_suspicion_episodes: set[tuple[int, int]] = field(default_factory=set)
    false_suspicion_times: list[float] = field(default_factory=list)
    false_suspect_first_hand: int = 0
    false_deaths: list[dict[str, Any]] = field(default_factory=list)
    _false_death_episodes: set[tuple[int, int]] = field(default_factory=set)
    _flap_episodes: set[tuple[int, int]] = field(default_factory=set)
    dead_after_leave: int = 0
    elected: dict[int, set[int]] = field(default_factory=dict)
    followed: dict[int, set[int]] = field(default_factory=dict)
    leader_changes: int = 0
    _not_alive: dict[tuple[int, int], float] = field(default_factory=dict)
    long_suspicions: list[dict[str, Any]] = field(default_factory=list)
    unrefuted: list[dict[str, Any]] = field(default_factory=list)
    updates: list[Update] = field(default_factory=list)
    _pending_updates: dict[int, list[Update]] = field(default_factory=dict)
    failovers: list[dict[str, Any]] = field(default_factory=list)
    plan_samples: list[tuple[float, int, str | None]] = field(default_factory=list)
    view_samples: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.running = [False] * self.n
        self.run_since = [0.0] * self.n
        self.run_seconds = [0.0] * self.n
        self.stops = [[] for _ in range(self.n)]
        self.cuts = [[] for _ in range(self.n)]
        self.blackouts = [[] for _ in range(self.n)]

    # --- truth ----------------------------------------------------------------------

    def started(self, i: int, t: float) -> None:
        self.running[i] = True
        self.run_since[i] = t
        self.left.discard(i)
        crash = self._crash_of.pop(i, None)
        if crash is not None:
            crash.until_s = t
        self.real_changes.append(t)
        for key in [k for k in self._not_alive if k[0] == i]:
            del self._not_alive[key]

    def _stopped(self, i: int, t: float) -> None:
        if self.running[i]:
            self.run_seconds[i] += max(0.0, t - max(self.run_since[i], self.measure_from_s))
        self.running[i] = False
        self.stops[i].append(t)
        self.real_changes.append(t)
        self._close_cut(i, t)

    def crashed(self, i: int, t: float) -> None:
        if not self.running[i]:
            return
        self._stopped(i, t)
        observers = tuple(o for o in range(self.n) if self.running[o])
        crash = Crash(i, t, observers)
        self.crashes.append(crash)
        self._crash_of[i] = crash

    def left_swarm(self, i: int, t: float) -> None:
        self._stopped(i, t)
        self.left.add(i)

    def cut(self, i: int, t: float) -> None:
        """Fellow ``i``'s link is down (its process keeps running)."""
        if not self.cuts[i] or self.cuts[i][-1][1] != math.inf:
            self.cuts[i].append([t, math.inf])
            self.cut_changes.append(t)

    def blackout(self, i: int, start: float, end: float) -> None:
        """Fellow ``i``'s radio passes nothing over [start, end]: as good as cut off."""
        insort(self.blackouts[i], (start, end))
        insort(self.cut_changes, start)
        insort(self.cut_changes, end)

    def _cut_spans(self, i: int, min_fade_s: float = 0.0) -> list[Any]:
        fades = [b for b in self.blackouts[i] if b[1] - b[0] >= min_fade_s]
        return [*self.cuts[i], *fades]

    def uncut(self, i: int, t: float) -> None:
        self._close_cut(i, t)

    def _close_cut(self, i: int, t: float) -> None:
        if self.cuts[i] and self.cuts[i][-1][1] == math.inf:
            self.cuts[i][-1][1] = t
            self.cut_changes.append(t)

    def partitioned(self, groups: list[list[int]], t: float) -> None:
        self.healed(t)
        self._partition_open = (t, {i: g for g, members in enumerate(groups) for i in members})
        self.cut_changes.append(t)

    def healed(self, t: float) -> None:
        if self._partition_open is not None:
            start, groups = self._partition_open
            self.partitions.append((start, t, groups))
            self._partition_open = None
            self.cut_changes.append(t)

    def card_changed(self, i: int, t: float) -> None:
        self.real_changes.append(t)

    def _apart(self, a: int, b: int, t: float, window_s: float,
               min_fade_s: float = 0.0) -> bool:
        """Were ``a`` and ``b`` cut apart at some time in [t - window_s, t]? (A radio fade
        counts only if it lasted ``min_fade_s``.)"""
        since = t - window_s
        for i in (a, b):
            for start, end in self._cut_spans(i, min_fade_s):
                if start <= t and end >= since:
                    return True
        spans = list(self.partitions)
        if self._partition_open is not None:
            spans.append((self._partition_open[0], math.inf, self._partition_open[1]))
        for start, end, groups in spans:
            if start <= t and end >= since:
                ga, gb = groups.get(a), groups.get(b)
                if ga is not None and gb is not None and ga != gb:
                    return True
        return False

    # --- events ---------------------------------------------------------------------

    def event(self, t: float, observer: int, kind: str, subject: int, incarnation: int,
              term: int, version: int = 0, by_self: bool = False) -> None:
        self.events.append((t, observer, kind, subject, incarnation, term))
        self.counts[kind] += 1
        if kind == ELECTED:
            self.elected.setdefault(term, set()).add(observer)
            if t >= self.measure_from_s:
                self.leader_changes += 1
            return
        if kind == LEADER:
            if subject >= 0:
                self.followed.setdefault(term, set()).add(subject)
            return
        if kind == METADATA:
            self._metadata(t, observer, subject, version)
            return
        if subject < 0 or subject == observer:
            return
        key = (observer, subject)
        running = self.running[subject]
        measuring = t >= self.measure_from_s
        if kind == SUSPECT:
            self._not_alive.setdefault(key, t)
            if running and measuring:
                episode = (subject, incarnation)
                if episode not in self.false_suspicion_episodes:
                    self.false_suspicion_episodes.add(episode)
                    self.false_suspicion_times.append(t)
                    if self._apart(observer, subject, t, self.checks.suspect_excuse_window_s):
                        self.excused_suspicion_episodes.add(episode)
                if by_self:
                    self.false_suspect_first_hand += 1
            return
        if kind == DEAD:
            self._not_alive.setdefault(key, t)
            crash = self._crash_of.get(subject)
            if crash is not None and not running:
                if observer in crash.observers and observer not in crash.learned:
                    crash.learned[observer] = t - crash.at_s
            elif subject in self.left:
                self.dead_after_leave += 1
            elif running and measuring:
                excused = self._apart(observer, subject, t, self.checks.excuse_window_s)
                self.false_deaths.append({"t": round(t, 3), "observer": observer,
                                          "subject": subject, "incarnation": incarnation,
                                          "excused": excused})
                self._false_death_episodes.add((subject, incarnation))
        elif kind in (ALIVE, MEMBER_JOINED):
            was = self._not_alive.pop(key, None)
            if was is not None:
                self._judge_belief(observer, subject, was, t)
                if kind == ALIVE and running and self.run_since[subject] <= was and measuring:
                    self._flap_episodes.add((subject, incarnation))
        elif kind == LEFT:
            self._not_alive.pop(key, None)

    def false_deaths_judged(self, window_s: float, min_fade_s: float) -> dict[str, int]:
        """The false deaths judged again on stricter terms: a verdict is excused only if
        the two were cut apart within ``window_s`` before it, a radio fade counting as a
        cut only if it lasted ``min_fade_s``. Fades shorter than ``checks.blackout_min_s``
        were never recorded, so the cut can only be raised."""
        if min_fade_s < self.checks.blackout_min_s:
            raise ConfigError(f"min_fade_s must be at least the run's blackout_min_s "
                              f"({self.checks.blackout_min_s:g} s), not {min_fade_s:g}")
        unexcused = [d for d in self.false_deaths
                     if not self._apart(d["observer"], d["subject"], d["t"], window_s,
                                        min_fade_s)]
        return {"verdicts": len(unexcused),
                "episodes": len({(d["subject"], d["incarnation"]) for d in unexcused})}

    def _judge_belief(self, observer: int, subject: int, since: float, until: float) -> None:
        """``observer`` held ``subject`` suspect or dead over [since, until]: a failure if
        the subject was running and reachable for longer than ``max_suspect_s`` after the
        last cut between them, or for over ``refute_within_s`` in all."""
        if not self.running[subject] or subject in self.left:
            return
        start = max(since, self.run_since[subject], self._last_apart(observer, subject,
                                                                     since, until))
        if until - start > self.checks.max_suspect_s:
            self.long_suspicions.append({"observer": observer, "subject": subject,
                                         "since": round(since, 3),
                                         "for_s": round(until - start, 3)})
        # the same belief, its reachable time summed over the gaps between cuts: a fellow
        # that never refutes is held suspect across every outage and fade, so no single
        # gap need be long (W3 cuts each pair apart every few minutes)
        begin = max(since, self.run_since[subject], self.measure_from_s)
        reachable = self._reachable_s(observer, subject, begin, until,
                                      self.checks.refute_grace_s)
        if reachable > self.checks.refute_within_s:
            self.unrefuted.append({"observer": observer, "subject": subject,
                                   "since": round(since, 3), "until": round(until, 3),
                                   "reachable_s": round(reachable, 3)})

    def _last_apart(self, a: int, b: int, t0: float, t1: float) -> float:
        """The latest moment in [t0, t1] at which ``a`` and ``b`` were cut apart (t0 if
        never)."""
        latest = t0
        for i in (a, b):
            for start, end in self._cut_spans(i):
                if start <= t1 and end >= t0:
                    latest = max(latest, min(end, t1))
        spans = list(self.partitions)
        if self._partition_open is not None:
            spans.append((self._partition_open[0], math.inf, self._partition_open[1]))
        for start, end, groups in spans:
            ga, gb = groups.get(a), groups.get(b)
            if ga is not None and gb is not None and ga != gb and start <= t1 and end >= t0:
                latest = max(latest, min(end, t1))
        return latest

    def _reachable_s(self, a: int, b: int, t0: float, t1: float, grace_s: float) -> float:
        """How long, in all, ``a`` and ``b`` could reach each other over [t0, t1]: the
        span less every moment they were cut apart (a cut of either, a partition between
        them) or within ``grace_s`` after such a cut ended."""
        if t1 <= t0:
            return 0.0
        spans: list[tuple[float, float]] = []
        for i in (a, b):
            spans.extend((start, end + grace_s) for start, end in self._cut_spans(i))
        parts = list(self.partitions)
        if self._partition_open is not None:
            parts.append((self._partition_open[0], math.inf, self._partition_open[1]))
        for start, end, groups in parts:
            ga, gb = groups.get(a), groups.get(b)
            if ga is not None and gb is not None and ga != gb:
                spans.append((start, end + grace_s))
        apart = 0.0
        reach = t0  # the union of the spans, clipped to [t0, t1], swept left to right
        for start, end in sorted(spans):
            start, end = max(start, reach), min(end, t1)
            if end > start:
                apart += end - start
                reach = end
        return max(0.0, (t1 - t0) - apart)

    def _metadata(self, t: float, observer: int, subject: int, version: int) -> None:
        if observer == subject:  # published
            if t < self.measure_from_s:
                return
            observers = tuple(o for o in range(self.n) if self.running[o] and o != subject)
            update = Update(subject, version, t, observers)
            self.updates.append(update)
            self._pending_updates.setdefault(subject, []).append(update)
            return
        for update in self._pending_updates.get(subject, ()):
            if update.version <= version and observer not in update.reached:
                update.reached[observer] = t - update.at_s

    # --- measurements the harness takes ---------------------------------------------

    def failover(self, killed_at: float, recovered_at: float | None, old: int,
                 new: int | None) -> None:
        self.failovers.append({"killed_at": round(killed_at, 3), "old": old, "new": new,
                               "failover_s": None if recovered_at is None
                               else round(recovered_at - killed_at, 4)})

    def plan_sample(self, t: float, leader: int, plan_id: str | None) -> None:
        self.plan_samples.append((t, leader, plan_id))

    def view_sample(self, sample: dict[str, Any]) -> None:
        self.view_samples.append(sample)

    # --- the end --------------------------------------------------------------------

    def _stopped_between(self, i: int, t0: float, t1: float) -> bool:
        stops = self.stops[i]
        k = bisect_left(stops, t0)
        return k < len(stops) and stops[k] <= t1

    def finish(self, end_s: float) -> dict[str, Any]:
        # beliefs still held at the end first, while run_since is each fellow's start (the
        # accounting below moves it to the end, which once hid every open belief: a fellow
        # that never refuted, suspected all run long, was never judged)
        for (observer, subject), since in list(self._not_alive.items()):
            if self.running[observer]:
                self._judge_belief(observer, subject, since, end_s)
        for i in range(self.n):
            if self.running[i]:
                self.run_seconds[i] += max(0.0, end_s - max(self.run_since[i],
                                                            self.measure_from_s))
                self.run_since[i] = end_s
        failures: list[str] = []
        node_s = sum(self.run_seconds)

        # detection
        window = self.checks.detect_within_s
        detect: list[float] = []
        missed = []
        for crash in self.crashes:
            if crash.at_s < self.measure_from_s:
                continue
            horizon = min(end_s, crash.until_s if crash.until_s is not None else end_s)
            full = horizon - crash.at_s >= window
            for o in crash.observers:
                if o in crash.learned:
                    detect.append(crash.learned[o])
                elif full and not self._stopped_between(o, crash.at_s, crash.at_s + window):
                    detect.append(math.inf)
                    missed.append((crash.subject, round(crash.at_s, 3), o))
        if missed:
            failures.append(f"{len(missed)} observer(s) never saw a crash as dead within "
                            f"{window:g} s, e.g. fellow {missed[0][0]} crashed at "
                            f"{missed[0][1]} s, observer {missed[0][2]}")

        # safety of the election
        split_terms = {t: sorted(w) for t, w in self.elected.items() if len(w) > 1}
        split_follow = {t: sorted(w) for t, w in self.followed.items() if len(w) > 1}
        if split_terms:
            t = min(split_terms)
            failures.append(f"two leaders in one term: term {t} won by fellows "
                            f"{split_terms[t]}")
        if split_follow:
            t = min(split_follow)
            failures.append(f"fellows followed different leaders in term {t}: "
                            f"{split_follow[t]}")

        # suspicions and deaths
        if self.long_suspicions:
            s = self.long_suspicions[0]
            failures.append(f"{len(self.long_suspicions)} time(s) a running, reachable "
                            f"fellow was held suspect or dead for over "
                            f"{self.checks.max_suspect_s:g} s, e.g. fellow {s['subject']} "
                            f"at observer {s['observer']} from {s['since']} s for "
                            f"{s['for_s']} s")
        if self.unrefuted:
            first = self.unrefuted[0]
            failures.append(f"{len(self.unrefuted)} time(s) a running fellow stayed suspect "
                            f"or dead at a fellow that could reach it for over "
                            f"{self.checks.refute_within_s:g} s in all: it did not refute, "
                            f"e.g. fellow {first['subject']} at observer {first['observer']} "
                            f"from {first['since']} s to {first['until']} s, reachable for "
                            f"{first['reachable_s']} s of it")
        unexcused_suspicions = len(self.false_suspicion_episodes
                                   - self.excused_suspicion_episodes)
        unexcused = [d for d in self.false_deaths if not d["excused"]]
        unexcused_episodes = {(d["subject"], d["incarnation"]) for d in unexcused}
        if self.checks.require_no_false_deaths and unexcused:
            d = unexcused[0]
            failures.append(f"{len(unexcused)} false death verdict(s) about running, "
                            f"reachable fellows, e.g. fellow {d['subject']} by "
                            f"{d['observer']} at {d['t']} s")

        # updates
        rounds: list[float] = []
        for u in self.updates:
            for o in u.observers:
                if o in u.reached:
                    rounds.append(u.reached[o] / self.gossip_interval_s)
                elif not self._stopped_between(o, u.at_s, end_s) and end_s - u.at_s > 60:
                    rounds.append(math.inf)

        # plans
        plan = self._plan_figures()
        if self.checks.require_plan_stable and plan["changes_unexplained"]:
            failures.append(f"{plan['changes_unexplained']} plan change(s) with no real "
                            f"change, first at {plan['first_unexplained_s']} s")
        failover_s = [f["failover_s"] if f["failover_s"] is not None else math.inf
                      for f in self.failovers]
        return {
            "ok": not failures,
            "failures": failures,
            "node_hours": round(node_s / 3600.0, 4),
            "crash_to_dead_s": summary(detect),
            "crashes": len([c for c in self.crashes if c.at_s >= self.measure_from_s]),
            "false_suspicions": len(self.false_suspicion_episodes),
            "false_suspicions_per_node_hour": round(per_node_hour(
                len(self.false_suspicion_episodes), node_s), 5),
            "false_suspicions_unexcused": unexcused_suspicions,
            "false_suspicions_unexcused_per_node_hour": round(per_node_hour(
                unexcused_suspicions, node_s), 5),
            "false_suspicions_first_hand": self.false_suspect_first_hand,
            "false_deaths": len(self._false_death_episodes),
            "false_deaths_unexcused": len(unexcused_episodes),
            "false_deaths_per_node_hour": round(per_node_hour(
                len(self._false_death_episodes), node_s), 5),
            "false_death_verdicts": len(self.false_deaths),
            "false_death_verdicts_unexcused": len(unexcused),
            "flaps": len(self._flap_episodes),
            "flaps_per_node_hour": round(per_node_hour(len(self._flap_episodes), node_s), 5),
            "dead_after_leave": self.dead_after_leave,
            "long_suspicions": len(self.long_suspicions),
            "unrefuted_beliefs": len(self.unrefuted),
            "leader_changes": self.leader_changes,
            "terms_with_two_leaders": len(split_terms),
            "terms_with_two_followed": len(split_follow),
            "leader_failover_s": summary(failover_s),
            "update_rounds": summary(rounds),
            "update_rounds_p9999": (None if not rounds else
                                    round(sorted(rounds)[min(len(rounds) - 1, math.ceil(
                                        0.9999 * len(rounds)) - 1)], 3)),
            "updates": len(self.updates),
            "plan": plan,
            "events": dict(sorted(self.counts.items())),
            "trace_hash": self.trace_hash(),
            "_detect": detect,
            "_false_suspicion_times": list(self.false_suspicion_times),
            "_false_deaths": self.false_deaths[:200],
            "_false_deaths_unexcused": unexcused[:100],
            "_elected": [(round(t, 3), o, term) for t, o, kind, _, _, term in self.events
                         if kind == ELECTED][:1000],
            "_failovers": self.failovers,
            "_unrefuted": self.unrefuted[:100],
        }

    def _plan_figures(self) -> dict[str, Any]:
        samples = [s for s in self.plan_samples if s[2] is not None]
        changes = explained_real = explained_cut = unexplained = 0
        first: float | None = None
        grace = self.plan_grace_s
        for (t0, _, id0), (t1, _, id1) in itertools.pairwise(samples):
            if id0 == id1:
                continue
            changes += 1
            if _any_between(self.real_changes, t0 - grace, t1):
                explained_real += 1
            elif _any_between(self.cut_changes, t0 - grace, t1):
                explained_cut += 1
            else:
                unexplained += 1
                first = t1 if first is None else first
        return {"samples": len(self.plan_samples), "planned": len(samples),
                "no_leader": len(self.plan_samples) - len(samples), "changes": changes,
                "changes_real": explained_real, "changes_cut_off": explained_cut,
                "changes_unexplained": unexplained, "first_unexplained_s":
                None if first is None else round(first, 3),
                "pinned_refused_fraction": round(changes / max(1, len(samples) - 1), 5)}

    def trace_hash(self) -> str:
        h = hashlib.sha256()
        order = sorted(range(len(self.events)),
                       key=lambda k: (self.events[k][0], self.events[k][1], k))
        for k in order:
            t, o, kind, s, inc, term = self.events[k]
            h.update(f"{t:.9f}|{o}|{kind}|{s}|{inc}|{term}\n".encode())
        return h.hexdigest()


def _any_between(times: list[float], t0: float, t1: float) -> bool:
    k = bisect_left(times, t0)
    return k < len(times) and times[k] <= t1


__all__ = ["Crash", "Oracle", "Update"]
