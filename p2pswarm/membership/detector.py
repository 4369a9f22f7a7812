"""The failure detector: which fellow to probe, and what a probe that ended says of it.

Theory of operation.

Failure detection. Once per probe interval this node pings one fellow. Two probes in
three go to its first and second successors on a ring ordered by node id, so every
fellow is checked at a steady pace by two fellows that know it well; the third walks a
shuffled round-robin, so every fellow is also checked by everyone now and then. No ack
within the probe timeout: k helpers ping it too (``PingReq``) and a stream ping is tried
in parallel. A helper that gets no answer sends a ``Nack``, which proves that OUR link
works; a probe that heard neither an ack nor a single nack says nothing about the target
(our own radio is out), raises nothing, and is repeated. A helper that failed to reach
the target probes it itself now and then, so a failing fellow soon has several probers;
a helper that knows the target under a newer incarnation (it refuted) says so at once.

Doubt before suspicion. This node keeps an estimate of how many direct pings miss their
ack. On a clean network one failed probe makes the target a suspect. On a lossy one the
target is looked at again at once, and only failures spanning a second (when lossy;
less as the loss is less) raise suspicion: a fellow whose radio dropped out for under a
second is in doubt, not suspected. The span also grows to cover the silences this node
has seen fellows come back from (their 90th percentile, up to 2 s): where fades are
heavy-tailed (bad WiFi) it waits them out; short bursts give it less to grow on, so
crashes are still found fast there. The dead verdict counts from the first failure, or from
one second before the suspicion if the span was longer, so the fellow keeps its time to
refute.

Watching. While a fellow is in doubt or suspected, this node probes it every half
interval, asking ping and helpers at the same time (a short probe), with the suspicion
attached to the ping (the buddy rule: the suspect learns it is suspected and refutes).

Suspicion and the dead verdict. A suspect's timeout starts long and shrinks (Lifeguard,
as memberlist) with each confirmation, down to a floor; confirmations count only if they
are further apart than a radio fade (on a lossy network), and a failed probe of our own,
with nacks from freshly picked helpers, confirms too. On WiFi the loss sits on the
suspect's own radio, so everybody fails at the same moment and a count of confirmations
says little; what matters is for how long. So the floor grows with the measured loss
(under a second when clean, 3 s when lossy) and a verdict needs more than the timer: this
node's own probes of the suspect must have failed, with nacks, without a success and
without looking away for long, over a run of at least the floor, the last one just now
(another watcher's run, reported in its ``Suspect``, extends ours if the two touch).
A live fellow is therefore declared dead only if it stayed unreachable through every
probe of a run longer than the floor: a single fade shorter than the floor cannot do it.
Others adopt a received ``Dead`` at once.

Nobody listens. The stream ping of a failed probe can come back refused (TCP reset: the
fellow's host is up and answered, but no process listens at its address). No radio fade
does that, so there is nothing to wait out: the fellow is suspected at once and its
suspicion runs for the clean network's floor, and the dead verdict still needs this
node's own probes to fail over that floor. A process restarted at the same address
answers those probes and refutes.

Local health (Lifeguard LHM, ``awareness``). Two probes in a row that heard nothing at
all, having to refute a suspicion, and the node's own loop waking later than a probe
timeout (``note_lag``: a starved CPU) raise a score; successful probes lower it; probe
interval and timeout are multiplied by score + 1, and a node with a bad score passes no
verdicts.

The detector sends nothing and changes no fellow's state: a probe that ends gives a
``Verdict`` (healthy, inconclusive, moot, doubt, suspect, confirm, declare) that the machine
applies, and the machine builds the datagrams of the probes the detector plans.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from p2pswarm.config import GossipConfig
from p2pswarm.membership.awareness import Awareness
from p2pswarm.membership.roster import Roster
from p2pswarm.membership.states import ALIVE, INF, PRESENT, SEQ_MOD, SUSPECT
from p2pswarm.membership.suspicion import Suspicion, independence_gap_s, suspicion_bounds
from p2pswarm.membership.timing import lerp_by_loss
from p2pswarm.wire.gossip import Suspect

if TYPE_CHECKING:  # a type only: the driver hands in its generator, seeded or not
    from p2pswarm.randomness import Rng

DIRECT, INDIRECT = 0, 1

VerdictKind = Literal["healthy", "inconclusive", "moot", "doubt", "suspect", "confirm",
                      "declare"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What an ended probe (or a late refusal) says of its target, for the machine to apply.

    - ``healthy``: it answered (the machine notes when it heard it);
    - ``inconclusive``: nobody answered us at all, or we learned nothing: no news;
    - ``moot``: it failed, but the fellow is already gone or unknown;
    - ``doubt``: it failed; look again soon before telling anyone;
    - ``suspect``: raise a suspicion of it, counting from ``start_s``, our first failure at
      ``silent_since_s``; ``nobody_listens``: its host refused us (no fade to wait out);
    - ``confirm``: our own failure confirms a suspicion; ``news`` is our ``Suspect`` to
      gossip if we had not accused it before;
    - ``declare``: as ``confirm``, and the evidence is enough to declare it dead.
    """

    kind: VerdictKind
    target: bytes
    start_s: float = 0.0
    silent_since_s: float = 0.0
    nobody_listens: bool = False
    news: Suspect | None = None


class Probe:
    __slots__ = (
        "addr",
        "direct_deadline",
        "direct_ok",
        "expected_nacks",
        "final_deadline",
        "gone",
        "nacks",
        "phase",
        "seq",
        "started",
        "target",
        "watch",
    )

    def __init__(self, target: bytes, addr: str, seq: int, started: float,
                 direct_deadline: float, final_deadline: float) -> None:
        self.target = target
        self.addr = addr
        self.seq = seq
        self.started = started
        self.direct_deadline = direct_deadline
        self.final_deadline = final_deadline
        self.phase = DIRECT
        self.direct_ok = False
        self.gone = False  # its host refused our stream ping: nothing listens there
        self.expected_nacks = 0
        self.nacks = 0
        self.watch = False

    def deadline(self) -> float:
        return self.direct_deadline if self.phase == DIRECT else self.final_deadline


class Relay:
    """A ping this node sends for a fellow that asked (``PingReq``)."""

    __slots__ = ("nack_at", "req_seq", "requester_addr", "target")

    def __init__(self, requester_addr: str, req_seq: int, nack_at: float, target: bytes) -> None:
        self.requester_addr = requester_addr
        self.req_seq = req_seq
        self.nack_at = nack_at
        self.target = target


class FailureDetector:
    """Probing, doubt, watching, suspicions and local health (see the module docstring)."""

    def __init__(self, node_id: bytes, config: GossipConfig, rng: Rng, roster: Roster,
                 stats: dict[str, int], *, next_probe_at: float, seq: int,
                 now: float) -> None:
        self.node_id = node_id
        self.config = config
        self.tuning = config.tuning
        self.rng = rng
        self.roster = roster
        self.stats = stats  # the machine's counters, shared
        self.probe: Probe | None = None
        self._probe_count = 0
        self._ring_turn = 0
        self.next_probe_at = next_probe_at
        self._recheck: bytes | None = None
        self._inconclusive: bytes | None = None  # the last target a probe said nothing of
        self.doubt: dict[bytes, tuple[float, int]] = {}
        self._fades: deque[float] = deque(maxlen=self.tuning.fade_samples)  # silences
        # of fellows that came back, first failed probe to the probe that reached them
        self.watch: dict[bytes, float] = {}
        self._confirm: list[bytes] = []
        self._own_fail: dict[bytes, float] = {}  # our latest failed probe of a fellow
        # our unbroken run of failed probes of a fellow: (first start, latest start)
        self.streak: dict[bytes, tuple[float, float]] = {}
        self._last_rx = now
        self._deaf = False
        self.suspicions: dict[bytes, Suspicion] = {}
        self.relays: dict[int, Relay] = {}
        self.awareness = Awareness(config.awareness_max_multiplier)
        self._silent_probes = 0
        self.loss = self.tuning.loss_prior
        self._seq = seq

    # --- small things ------------------------------------------------------------------

    def next_seq(self) -> int:
        self._seq = (self._seq + 1) % SEQ_MOD
        return self._seq

    def scale(self) -> int:
        return self.awareness.score + 1

    def heard_datagram(self, now: float) -> bool:
        """A datagram got through to us; True if it ends a long deafness (a probe of ours
        heard nothing at all, and nothing else came for a while: our own radio was out)."""
        deaf_s = now - self._last_rx
        self._last_rx = now
        long_deaf = self._deaf and deaf_s >= self.tuning.deaf_refute_s
        self._deaf = False
        return long_deaf

    def forget(self, node: bytes) -> None:
        """``node`` is proven alive at a new incarnation, dead or gone: whatever failed
        probes we held against it do not carry over."""
        self.suspicions.pop(node, None)
        self.watch.pop(node, None)
        self.doubt.pop(node, None)
        self._own_fail.pop(node, None)
        self.streak.pop(node, None)

    def deadline(self, t: float, *, probing: bool) -> float:
        """The earliest of ``t`` and what the detector waits for (its probes if
        ``probing``, relays' nacks, suspicion timers)."""
        if probing:
            p = self.probe
            if p is None:
                if self.roster.live:
                    t = min(t, self.next_probe_at)
            else:
                t = min(t, p.deadline())
        for r in self.relays.values():
            t = min(t, r.nack_at)
        for s in self.suspicions.values():
            if not s.expired and s.deadline < t:
                t = s.deadline
        return t

    def note_lag(self, now: float) -> None:
        """This node's own loop woke late (past a probe timeout): see ``Membership``."""
        self.awareness.apply(1)
        self.stats["late_wakes"] += 1
        p = self.probe
        if p is not None:
            wait = self.config.probe_timeout_s * self.scale()
            if p.phase == DIRECT:
                p.direct_deadline = max(p.direct_deadline, now + wait)
            p.final_deadline = max(p.final_deadline, now + wait)

    def probe_sooner(self, now: float) -> None:
        if self.probe is None:
            self.next_probe_at = min(self.next_probe_at, now)

    # --- probing -----------------------------------------------------------------------

    def start_probe(self, now: float) -> Probe | None:
        """Schedule the next probe and start this one (the machine sends its ping)."""
        interval = self.config.probe_interval_s * self.scale()
        self.next_probe_at = now + (interval * self.tuning.watch_fraction if self.watch
                                    else interval)
        target = self._pick_target(now)
        if target is None:
            return None
        e = self.roster.members[target]
        seq = self.next_seq()
        scale = self.scale()
        timeout = self.config.probe_timeout_s * scale
        if target in self.watch:  # a suspect: ask the helpers at once, expect an answer soon
            self.watch[target] = now
            probe = Probe(target, e.addr, seq, now, now, now + timeout * 1.2)
            probe.watch = True
        else:
            final = max(interval, timeout + self.config.probe_timeout_s * 1.2)
            probe = Probe(target, e.addr, seq, now, now + timeout, now + final)
        self.probe = probe
        self.stats["probes"] += 1
        return probe

    def _pick_target(self, now: float) -> bytes | None:
        roster = self.roster
        live = roster.live_pos
        if self._recheck is not None:
            target, self._recheck = self._recheck, None
            if target in live:
                return target
        if self.watch:
            interval = self.config.probe_interval_s * self.scale() * self.tuning.watch_fraction
            best, best_at = None, INF
            for node, last in list(self.watch.items()):
                e = roster.members.get(node)
                if e is None or not (e.state == SUSPECT or
                                     e.state == ALIVE and node in self.doubt):
                    del self.watch[node]
                    continue
                if now - last >= interval and last < best_at:
                    best, best_at = node, last
            if best is not None:
                return best
        while self._confirm:
            node = self._confirm.pop(0)
            if node in live:
                return node
        if not roster.live:
            return None
        self._probe_count += 1
        every = self.tuning.random_probe_every
        if every > 1 and self._probe_count % every != 0:
            self._ring_turn += 1
            successor = roster.successor(1 + self._ring_turn % self.tuning.ring_depth)
            if successor is not None:
                return successor
        return roster.round_robin()

    def go_indirect(self, p: Probe) -> list[bytes]:
        """The direct ping went unanswered: the helpers to ask (``PingReq``)."""
        p.phase = INDIRECT
        k = self.config.indirect_checks
        helpers = [n for n in self.roster.sample_live(k + 1) if n != p.target][:k]
        p.expected_nacks = len(helpers)
        return helpers

    def finish_probe(self, ok: bool, now: float) -> Verdict:
        """The probe in flight ended (``ok``: acknowledged): its verdict."""
        p = self.probe
        assert p is not None
        self.probe = None
        t = self.tuning
        loss_before = self.loss  # judge this probe by the link as it was before it
        if not p.watch:
            self.loss += t.loss_alpha * ((0.0 if p.direct_ok else 1.0) - self.loss)
        target = p.target
        e = self.roster.get(target)
        if ok:
            self.awareness.apply(-1)
            self._silent_probes = 0
            doubt = self.doubt.pop(target, None)
            if doubt is not None:
                self.watch.pop(target, None)
                self._fades.append(p.started - doubt[0])
            elif e is not None and e.state == SUSPECT:
                s = self.suspicions.get(target)
                if s is not None and s.first_source == self.node_id and not s.heard_back:
                    s.heard_back = True
                    self._fades.append(p.started - s.silent_since)
            self._own_fail.pop(target, None)
            self.streak.pop(target, None)
            return Verdict("healthy", target)
        self.stats["probes_failed"] += 1
        if p.gone:  # its host answered for it: our link works, and nothing listens there
            self._silent_probes = 0
            self.stats["probes_refused"] += 1
        elif p.expected_nacks == 0 or p.nacks == 0:
            # nobody answered us: our own link, most likely. Twice in a row: we are in
            # trouble, slow down (Lifeguard); once is a fade like any other.
            self._silent_probes += 1
            self._deaf = True
            if self._silent_probes >= 2:
                self.awareness.apply(1)
        else:
            self._silent_probes = 0
        if p.expected_nacks > 0 and p.nacks == 0 and not p.gone:
            self.stats["probes_inconclusive"] += 1
            if self._inconclusive != target:  # we learned nothing about it: ask once more
                self._inconclusive = target
                self._recheck = target
                self.next_probe_at = now
            else:
                self._inconclusive = None
            return Verdict("inconclusive", target)
        self._inconclusive = None
        if e is None or e.state not in PRESENT:
            return Verdict("moot", target)
        self._own_fail[target] = now
        first, latest = self.streak.get(target, (p.started, p.started))
        if p.started - latest > t.streak_max_gap_s:  # we looked away too long: start over
            first = p.started
        self.streak[target] = (first, p.started)
        if e.state == SUSPECT:
            return self._confirm_by_probe(p, e.incarnation, now)
        first, count = self.doubt.get(target, (p.started, 0))
        if now - first > 6 * self.config.probe_interval_s * self.scale():
            first, count = p.started, 0
        count += 1
        needed, base, span = 1, 0.0, 0.0
        if loss_before > t.recheck_above_loss:  # lossy: a second failure, across a fade
            needed = 2
            base = lerp_by_loss(0.0, t.doubt_span_lossy_s, loss_before, t.lossy_reference)
            span = max(base, self._fade_span())
        if p.gone:  # no fade to wait out: suspect it now, from the first failure
            self.doubt.pop(target, None)
            return Verdict("suspect", target, first, first, nobody_listens=True)
        if count >= needed and p.started - first >= span:
            self.doubt.pop(target, None)
            # the suspicion counts from the first failure, but waiting out a longer fade
            # must not shorten the time it leaves the fellow to refute
            return Verdict("suspect", target, max(first, p.started - base), first)
        # look again soon, quickly, before telling anyone
        self.doubt[target] = (first, count)
        self.watch[target] = -INF
        self.next_probe_at = now
        return Verdict("doubt", target)

    def _confirm_by_probe(self, p: Probe, incarnation: int, now: float) -> Verdict:
        target = p.target
        s = self.suspicions.get(target)
        if s is None:
            return Verdict("moot", target)
        if p.gone:
            s.nobody_listens(self.tuning.suspicion_floor_clean_s)
        self.watch[target] = p.started
        # our own failure, with nacks from helpers picked afresh, confirms too
        s.confirm(now, independence_gap_s(self.tuning, self.loss))
        news = None
        if s.add_source(self.node_id):
            news = Suspect(target, incarnation, self.node_id, self.silent_ms(target, now))
            self.stats["confirmations_sent"] += 1
        declare = s.expired and self._may_declare(target, s, now)
        return Verdict("declare" if declare else "confirm", target, news=news)

    def refused_late(self, addr: str) -> Verdict | None:
        """A refusal that came back after its probe ended (every helper's nack was in
        first): it still tells on the fellow at ``addr`` we doubt or suspect."""
        for node in (*self.doubt, *self.suspicions):
            e = self.roster.get(node)
            if e is None or e.addr != addr:
                continue
            self.stats["probes_refused"] += 1
            if node in self.doubt and e.state == ALIVE:
                first, _ = self.doubt.pop(node)
                return Verdict("suspect", node, first, first, nobody_listens=True)
            s = self.suspicions.get(node)
            if s is not None:
                s.nobody_listens(self.tuning.suspicion_floor_clean_s)
            return None
        return None

    def _fade_span(self) -> float:
        """How long the fades this node has seen fellows come back from last (a high
        quantile), capped; 0 until it has seen a few."""
        if len(self._fades) < 8:
            return 0.0
        ordered = sorted(self._fades)
        q = ordered[int(self.tuning.fade_quantile * (len(ordered) - 1))]
        return min(self.tuning.doubt_span_max_s, q)

    def silent_ms(self, node: bytes, now: float) -> int:
        run = self.streak.get(node)
        return 0 if run is None else min(2**32 - 1, int((now - run[0]) * 1000))

    # --- relaying ----------------------------------------------------------------------

    def relay(self, requester_addr: str, req_seq: int, target: bytes, now: float) -> int:
        """Ping ``target`` for a fellow that asked; the seq of our ping."""
        seq = self.next_seq()
        nack_at = now + self.config.probe_timeout_s * self.tuning.nack_after_fraction
        self.relays[seq] = Relay(requester_addr, req_seq, nack_at, target)
        return seq

    def due_relays(self, now: float) -> list[Relay]:
        """Relays whose target did not answer in time: each owes its asker a nack."""
        if not self.relays:
            return []
        return [self.relays.pop(seq) for seq in
                [s for s, r in self.relays.items() if r.nack_at <= now]]

    def relay_failed(self, target: bytes, now: float) -> None:
        """We could not reach a fellow for someone else. One helper in k looks into it
        itself, so a failing fellow soon has several independent probers."""
        e = self.roster.get(target)
        if e is None or e.state not in PRESENT or target in self._confirm:
            return
        if self.rng.random() * max(1, self.config.indirect_checks) < 1.0:
            self._confirm.append(target)
            self.probe_sooner(now)

    # --- suspicion ---------------------------------------------------------------------

    def suspect(self, node: bytes, incarnation: int, source: bytes, start: float,
                now: float, msg: Suspect | None, silent_since: float | None) -> Suspect:
        """Hold ``node`` suspected (by ``source``, counting from ``start``); the
        ``Suspect`` to gossip."""
        lo, hi, expected = suspicion_bounds(self.config, len(self.roster) + 1, self.loss)
        self.suspicions[node] = susp = Suspicion(incarnation, start, source, lo, hi, expected)
        if silent_since is not None:
            susp.silent_since = silent_since
        if msg is None:
            msg = Suspect(node, incarnation, source, self.silent_ms(node, now))
        else:
            susp.report(msg.silent_ms, now)
        if source == self.node_id:
            self.stats["suspicions_raised"] += 1
            self.watch[node] = -INF  # keep watching it from now on
        elif self.roster.live and \
                self.rng.random() < self.tuning.confirm_fanout / len(self.roster.live):
            self._confirm.append(node)
            self.probe_sooner(now)
        return msg

    def confirm(self, node: bytes, source: bytes, now: float, msg: Suspect) -> bool:
        """A fellow confirms our suspicion of ``node``; True if the confirmation counted."""
        s = self.suspicions.get(node)
        if s is None or not s.add_source(source):
            return False
        s.report(msg.silent_ms, now)
        return s.confirm(now, independence_gap_s(self.tuning, self.loss))

    def nobody_listens(self, node: bytes) -> None:
        """Nothing listens at a suspect's address (its host refused our stream): its
        process is gone, so no radio fade needs waiting out. Its suspicion runs for the
        clean network's floor; the dead verdict still needs our own probes to fail over
        that span, so a restarted process at the same address refutes in time."""
        self.suspicions[node].nobody_listens(self.tuning.suspicion_floor_clean_s)

    def expire(self, now: float) -> list[bytes]:
        """Suspicions whose timer ran out: those with the evidence to declare dead (the
        others are watched, to be checked by ourselves first)."""
        declare: list[bytes] = []
        for node, s in list(self.suspicions.items()):
            if not s.due(now):
                continue
            s.expired = True
            if self._may_declare(node, s, now):
                declare.append(node)
            else:
                self.watch[node] = -INF  # check it ourselves first
                self.probe_sooner(now)
        return declare

    def _may_declare(self, node: bytes, s: Suspicion, now: float) -> bool:
        """A dead verdict needs: our own probes of it have failed (with nacks) without a
        break for at least the suspicion floor, the last one just now, and our own
        health is good."""
        if self._own_fail.get(node, -INF) < now - self.tuning.evidence_fresh_s:
            return False
        first, latest = self.streak.get(node, (now, now))
        first = s.joined_run(first, self.tuning.streak_max_gap_s)
        if latest - first < s.min_s:  # unreachable at probes at least the floor apart
            return False
        return self.awareness.score <= self.tuning.declare_max_score


__all__ = ["DIRECT", "INDIRECT", "FailureDetector", "Probe", "Relay", "Verdict"]
