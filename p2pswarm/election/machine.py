"""The election machine: candidacy, leading and following, and the table of which
messages each role answers (the theory of operation is the package's docstring)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2pswarm.config import ElectionConfig
from p2pswarm.effects import (
    ELECTED,
    LEADER,
    NO_LEADER,
    STEPPED_DOWN,
    Effect,
    Event,
    SendDatagram,
)
from p2pswarm.election.candidacy import Candidacy
from p2pswarm.election.constants import (
    CANDIDATE,
    CHECK_REPLY_RANK,
    FOLLOWER,
    INF,
    LEADER_ROLE,
    MAX_TERM,
    MAX_TERM_STEP,
    PRESENT,
)
from p2pswarm.election.electorate import Electorate
from p2pswarm.election.health import Health
from p2pswarm.election.leading import Leading
from p2pswarm.election.proofs import Proofs
from p2pswarm.election.voting import Voting
from p2pswarm.membership.member import Member
from p2pswarm.security.ballots import (
    Signatures,
    ballot_statement,
    beat_statement,
    step_down_statement,
)
from p2pswarm.wire.gossip import (
    LeaderAck,
    LeaderBeat,
    LeaderCheck,
    LeaderIs,
    LeaderProof,
    LeaderQuery,
    StepDown,
    VoteReply,
    VoteRequest,
)

if TYPE_CHECKING:  # a type only: the driver hands in its generator, seeded or not
    from random import Random



@dataclass(frozen=True, slots=True)
class ElectionStatus:
    leader_id: bytes | None
    leader_name: str | None
    term: int
    role: str  # follower, candidate or leader
    sees: int  # fellows present on this side (alive or suspect), this node included
    electorate: int  # the denominator of a majority
    sentence: str  # "leader fxserver (term 3)" / "no leader: this side sees 2 of 5 fellows"


class Election:
    """One node's part in electing and following a leader."""

    def __init__(
        self,
        node_id: bytes,
        name: str,
        config: ElectionConfig,
        rng: Random,
        *,
        leader_priority: int = 0,
        now: float = 0.0,
        term: int = 0,
        voted_for: bytes | None = None,
        voters: Iterable[bytes] = (),
        signatures: Signatures | None = None,
    ) -> None:
        self.node_id = node_id
        self.name = name
        self.config = config
        self.rng = rng
        self.priority = leader_priority
        self.tuning = config.tuning
        self.term = term
        self.voted_term = term if voted_for is not None else -1
        self.voted_for = voted_for
        self.role = FOLLOWER
        self.leader: bytes | None = None
        self._electorate = Electorate(node_id, config, now, voters)
        self._joined = False
        self._leaving = False
        self._settle_until = INF  # set on joining; -inf once a leader is known
        self._election_at = INF
        self._gone_reported: bytes | None = None
        # (term, leader) of a step-down we saw: it never leads that term again, so a beat
        # or relayed announcement still in flight must not make us follow it back
        self._stood_down: tuple[int, bytes] | None = None
        self._candidacy = Candidacy(self)
        self._leading = Leading(self)
        self._voting = Voting(self)
        self._health = Health(config, rng.randrange(2**32))  # the leader's, as we see it
        self._next_query_at = INF
        self._proofs = Proofs(self._electorate, signatures)
        self.stats: dict[str, int] = {"elections": 0, "terms_won": 0, "checks": 0,
                                      "conflicts": 0}
        self._dispatch: dict[type, Callable[[Any, str, float, list[Effect]], None]] = {
            VoteRequest: self._voting.on_vote_request, VoteReply: self._candidacy.on_vote_reply,
            LeaderBeat: self._on_beat, LeaderCheck: self._leading.on_leader_check,
            LeaderIs: self._on_leader_is, LeaderQuery: self._on_leader_query,
            StepDown: self._on_step_down, LeaderAck: self._leading.on_leader_ack,
            LeaderProof: self._on_leader_proof,
        }

    @property
    def refused(self) -> dict[str, int]:
        """What fellows sent that was refused, by reason (agent status shows them)."""
        return self._proofs.refused

    # --- views -------------------------------------------------------------------------

    def accepts_term(self, term: int) -> bool:
        """Whether an order stamped with ``term`` may be obeyed (it is not stale)."""
        return term >= self.term

    def persistent_state(self) -> tuple[int, bytes | None, tuple[bytes, ...]]:
        """(term, voted_for, electorate): keep these across restarts. A fellow that forgot
        the electorate would, restarted alone, be a majority of one."""
        return (self.term, self.voted_for if self.voted_term == self.term else None,
                self._electorate.kept())

    def electorate(self) -> int:
        return self._electorate.size()

    def present(self) -> int:
        return self._electorate.present()

    def settled(self, now: float) -> bool:
        """Past the settling time after joining, or following a leader already."""
        return now >= self._settle_until

    def status(self) -> ElectionStatus:
        sees, total = self.present(), self.electorate()
        name = None
        if self.leader is not None and 2 * sees <= total and self.role != LEADER_ROLE:
            # A leader cannot hold its lease on a side that is a minority: whatever it
            # last said, this side has no leader (it steps down, and says so, too).
            sentence = f"no leader: this side sees {sees} of {total} fellows"
            return ElectionStatus(None, None, self.term, self.role, sees, total, sentence)
        if self.leader is not None:
            m = self._electorate.members.get(self.leader)
            name = m.name if m is not None else self.leader.hex()[:8]
            if self._leader_gone():
                sentence = f"no leader: {name} is gone; electing"
                return ElectionStatus(None, None, self.term, self.role, sees, total, sentence)
            sentence = f"leader {name} (term {self.term})"
            return ElectionStatus(self.leader, name, self.term, self.role, sees, total,
                                  sentence)
        if 2 * sees <= total:
            sentence = f"no leader: this side sees {sees} of {total} fellows"
        else:
            sentence = "no leader yet: electing"
        return ElectionStatus(None, None, self.term, self.role, sees, total, sentence)

    # --- driving -----------------------------------------------------------------------

    def update_members(self, members: Iterable[Member], now: float, *,
                       joined: bool = True) -> list[Effect]:
        """Feed the current membership view (this node included) after every change."""
        self._electorate.feed(members, now)
        return self._members_changed(now, joined)

    def update_changed(self, changed: Iterable[Member], gone: Iterable[bytes], now: float,
                       *, joined: bool = True) -> list[Effect]:
        """Feed only what changed in the membership view since the last feed
        (``Membership.roster_changes``): new views, and ids no longer known."""
        self._electorate.feed_changes(changed, gone, now)
        return self._members_changed(now, joined)

    def _members_changed(self, now: float, joined: bool) -> list[Effect]:
        out: list[Effect] = []
        self._electorate.expire(now)
        if joined and not self._joined:
            self._joined = True
            self._next_query_at = now
            if self.leader is None:
                self._settle_until = now + self.tuning.settle_s
        if self.leader is not None and self._leader_gone() and self.role != LEADER_ROLE \
                and self._gone_reported != self.leader:
            self._gone_reported = self.leader  # say it once, when it happens
            m = self._electorate.members.get(self.leader)
            state = m.state if m is not None else "gone"
            out.append(Event(NO_LEADER, self.leader, self._electorate.name(self.leader),
                             f"leader {self._electorate.name(self.leader)} is {state}", term=self.term))
        if self.role == LEADER_ROLE:
            self._leading.greet(self._electorate.arrived, now, out)
            self._leading.upkeep(now, out)
        self._electorate.arrived = []
        self._reconsider(now)
        return out

    def leave(self, now: float) -> list[Effect]:
        """Leaving: a leader hands over at once (``StepDown``)."""
        out: list[Effect] = []
        self._leaving = True
        if self.role == LEADER_ROLE:
            msg = self._leading.step_down(max(1, self.electorate() - 1))
            for m in self._electorate.others():
                out.append(SendDatagram(m.addr, (msg,)))
            self._become_follower(now, out, "left the swarm")
            self.leader = None
        self._election_at = INF
        return out

    def handle(self, message: Any, sender_addr: str, now: float) -> list[Effect]:
        out: list[Effect] = []
        handler = self._dispatch.get(type(message))
        if handler is not None:
            handler(message, sender_addr, now, out)
        return out

    def _on_leader_query(self, msg: LeaderQuery, addr: str, now: float,
                         out: list[Effect]) -> None:
        if self.leader is None or self._leader_gone():
            return
        asker = self._electorate.members.get(msg.source)
        if self.role == LEADER_ROLE and asker is not None and asker.addr == addr:
            self._tell_leader(addr, None, out)  # it asks: it lacks the proof
        else:
            out.append(SendDatagram(addr, (self._leader_is(),)))

    def _on_step_down(self, msg: StepDown, addr: str, now: float, out: list[Effect]) -> None:
        if msg.term != self.term or msg.leader != self.leader or msg.leader == self.node_id:
            return
        if not self._proofs.signed_by(msg.leader, msg.signature,
                               step_down_statement(msg.term, msg.leader), addr, now):
            return
        self.leader = None
        self._stood_down = (msg.term, msg.leader)
        self._health.deputy_term = -1
        self._election_at = now + self._rank_delay() + self.rng.random() * self.tuning.jitter_s
        out.append(Event(NO_LEADER, msg.leader, self._electorate.name(msg.leader),
                         "the leader stepped down", term=self.term))

    def next_deadline(self) -> float | None:
        t = min(self._candidacy.deadline, self._leading.next_beat_at, self._leading.next_announce_at,
                self._leading.announce_due)
        if self.role == CANDIDATE:  # a candidacy under way: tick leaves _election_at alone
            t = min(t, self._candidacy.resend_at)
        else:
            t = min(t, self._election_at)
        if self._leading.unacked and self.role == LEADER_ROLE:
            t = min(t, self._leading.retry_at)
        if self.role == LEADER_ROLE and self._leading.canvass_at != INF:
            t = min(t, self._leading.canvass_at)
        if self._leading.better is not None and self.role == LEADER_ROLE:
            t = min(t, self._leading.better[1] + self.tuning.handover_after_s)
        t = self._health.next_check_at(t)
        if self.leader is None and self._joined and not self._leaving:
            t = min(t, self._next_query_at)
        t = min(t, self._electorate.next_expiry())
        if self.role == FOLLOWER and self._health.deputy_term == self.term and \
                self.leader is not None:
            t = min(t, self._health.beat_timeout_at())
        return None if t == INF else t

    def tick(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        if self._electorate.next_expiry() <= now:
            self._electorate.expire(now)
            self._reconsider(now)  # a smaller electorate: this side may be a majority now
        for waiting in self._health.lapsed(now):
            for addr, req in waiting:  # the leader did not answer us either
                out.extend(self._voting.answer_vote(req, addr, now, leader_alive=False))
        if self.role == CANDIDATE and now >= self._candidacy.deadline:
            self._candidacy.failed(now)
        elif self.role == CANDIDATE and now >= self._candidacy.resend_at:
            self._candidacy.resend_at = now + self.tuning.vote_resend_s
            self._candidacy.ask_votes(out)
        if self.role == LEADER_ROLE:
            self._leading.upkeep(now, out)
        elif self._health.deputy_term == self.term and self.leader is not None and \
                now >= self._health.beat_timeout_at():
            self._health.deputy_term = -1  # no beats: a deputy no more until the next one
            self._health.beats_lost = True
            self._election_at = min(self._election_at, now)
        if now >= self._election_at and self.role != CANDIDATE:
            self._election_at = INF
            if self._may_elect() and self.settled(now):
                self._candidacy.start(True, now, out)
            else:
                self._reconsider(now)
        if self.leader is None and self._joined and not self._leaving and \
                now >= self._next_query_at:
            self._next_query_at = now + self.tuning.query_interval_s
            others = self._electorate.others()
            if others:
                target = others[self.rng.randrange(len(others))]
                out.append(SendDatagram(target.addr, (LeaderQuery(self.term, self.node_id),)))
        return out

    # --- deciding to run ---------------------------------------------------------------

    def _leader_gone(self) -> bool:
        if self.leader is None:
            return True
        if self.leader == self.node_id:
            return self.role != LEADER_ROLE
        m = self._electorate.members.get(self.leader)
        return m is None or m.state in ("dead", "left")

    # --- local health ------------------------------------------------------------------

    def note_lag(self, lag_s: float, now: float) -> None:
        """This fellow's own loop woke ``lag_s`` late at ``now`` (a timer against its
        deadline). A starved fellow (training on every core, a busy Pi) reads the beats
        waiting in its socket only after its timers fire: it must not blame the leader
        for its own lateness, so its timeouts that judge the leader stretch (``stretch``)."""
        self._health.note_lag(lag_s, now)

    def stretch(self) -> float:
        """How much longer than configured this fellow waits for its leader's beats and
        for the leader's answer to its own check: the lag mult times the larger of its
        own loop's recent lag and its leader's beats' recent lateness, at most
        ``lag_stretch_max_s`` (a crashed leader is still replaced within seconds). 0 on
        a healthy fellow, and always in virtual time."""
        return self._health.stretch()

    def _may_elect(self) -> bool:
        if not self._joined or self._leaving or self.role == LEADER_ROLE:
            return False
        if 2 * self.present() <= self.electorate():
            return False
        if self._leader_gone():
            return True
        return self._health.beats_lost  # a deputy that missed the leader's beats

    def _rank_delay(self) -> float:
        rank = self._electorate.succession_rank(self.leader)
        return min(rank * self.tuning.rank_spacing_s, 60.0)

    def _reconsider(self, now: float) -> None:
        if self.role != FOLLOWER:
            return
        # the leader is gone, or (as a deputy) we missed its beats: run once we may,
        # e.g. when the fellows we need for a majority are back
        if self._may_elect():
            if self._election_at == INF:
                lo, hi = self.config.election_timeout_min_s, self.config.election_timeout_max_s
                start = max(now, self._settle_until)  # not before the fellows are in
                self._election_at = (start + lo + self.rng.random() * max(0.0, hi - lo) * 0.25
                                     + self._rank_delay())
        elif not self._health.beats_lost:
            self._election_at = INF

    # --- candidacy ---------------------------------------------------------------------

    # --- leading -----------------------------------------------------------------------

    def _become_leader(self, now: float, out: list[Effect]) -> None:
        self.role = LEADER_ROLE
        self.leader = self.node_id
        self._candidacy.deadline = INF
        self._candidacy.resend_at = INF
        self._election_at = INF
        self._candidacy.grants = {}
        self._proofs.lead(self._candidacy.ballots)
        self._candidacy.ballots = {}
        self._leading.canvass_at = now
        self._leading.minority_since = None
        self.stats["terms_won"] += 1
        self._settle_until = -INF
        self._leading.last_announced_electorate = self.electorate()
        self._leading.announce_all(out)
        self._leading.unacked = {m.node_id: None for m in self._electorate.others()}
        self._leading.retry_at = now + self.tuning.announce_retry_s
        self._leading.retry_until = now + self.tuning.announce_retry_for_s
        self._leading.next_announce_at = now + self.tuning.announce_interval_s
        self._leading.next_beat_at = now
        out.append(Event(ELECTED, self.node_id, self.name,
                         f"elected leader of term {self.term} by {self.present()} of "
                         f"{self.electorate()} fellows", term=self.term))
        out.append(Event(LEADER, self.node_id, self.name, f"leader of term {self.term}",
                         term=self.term))

    def _leader_is(self) -> LeaderIs:
        return LeaderIs(self.term, self.leader or self.node_id, self.electorate())


    def _become_follower(self, now: float, out: list[Effect], why: str) -> None:
        was = self.role
        self.role = FOLLOWER
        self._candidacy.deadline = INF
        self._candidacy.resend_at = INF
        self._leading.next_beat_at = INF
        self._leading.next_announce_at = INF
        self._leading.announce_due = INF
        self._leading.unacked = {}
        self._leading.minority_since = None
        self._leading.canvass_at = INF
        if was == LEADER_ROLE:
            out.append(Event(STEPPED_DOWN, self.node_id, self.name,
                             f"stepped down from term {self.term}: {why}", term=self.term))

    # --- following ---------------------------------------------------------------------

    def _adopt_term(self, term: int, now: float, out: list[Effect]) -> None:
        if term <= self.term:
            return
        if self.role != FOLLOWER:
            self._become_follower(now, out, f"a newer term {term} exists")
        self.term = term
        self.leader = None
        self._health.deputy_term = -1
        self._health.beats_lost = False
        self._reconsider(now)

    def _on_leader_is(self, msg: LeaderIs, addr: str, now: float, out: list[Effect]) -> None:
        if msg.term < self.term:
            if self.leader is not None and not self._leader_gone():
                out.append(SendDatagram(addr, (self._leader_is(),)))  # you are behind
            return
        if msg.leader == self.node_id:
            return  # whether we lead, we know
        if not self._proven(msg.term, msg.leader):
            self._ask_proof(msg.term, msg.leader, now, out)
            return
        self._take_leader(msg, addr, now, out)

    def _take_leader(self, msg: LeaderIs, addr: str, now: float, out: list[Effect]) -> None:
        """Follow the leader ``msg`` names (its proof checked, or needless)."""
        if msg.term < self.term:
            return
        if msg.term == self.term and self.leader not in (None, msg.leader) \
                and self.role != CANDIDATE and self._conflict(msg.leader, addr, out):
            return
        self._follow(msg.term, msg.leader, msg.electorate, now, out)
        leader = self._electorate.members.get(msg.leader)
        if self.leader == msg.leader and leader is not None and leader.addr == addr:
            out.append(SendDatagram(addr, (LeaderAck(
                msg.term, self.node_id, msg.leader,
                self._proofs.sign(ballot_statement(msg.term, msg.leader, self.node_id))),)))

    def _on_beat(self, msg: LeaderBeat, addr: str, now: float, out: list[Effect]) -> None:
        if msg.rank == CHECK_REPLY_RANK:
            waiting = self._health.checks.get(msg.seq)
            if waiting is None or self._proofs.sig is not None and (
                    msg.leader != self.leader or not self._proofs.signed_by(
                        msg.leader, msg.signature,
                        beat_statement(msg.term, msg.leader, msg.seq, msg.rank), addr, now)):
                return
            for req_addr, req in self._health.answered(msg.seq, now):
                out.extend(self._voting.answer_vote(req, req_addr, now, leader_alive=True))
            return
        if msg.leader == self.node_id or not self._proofs.signed_by(
                msg.leader, msg.signature,
                beat_statement(msg.term, msg.leader, msg.seq, msg.rank), addr, now):
            return
        if msg.term < self.term:
            if self.leader is not None and not self._leader_gone():
                out.append(SendDatagram(addr, (self._leader_is(),)))  # it was frozen: behind
            return
        if not self._proven(msg.term, msg.leader):
            self._ask_proof(msg.term, msg.leader, now, out)
            return
        if msg.term == self.term and self.leader not in (None, msg.leader) \
                and self.role != CANDIDATE and self._conflict(msg.leader, addr, out):
            return
        self._follow(msg.term, msg.leader, msg.electorate, now, out)
        if self.leader == msg.leader:
            self._health.note_beat(self.term, msg.rank, now)
            if self._health.beats_lost:
                self._health.beats_lost = False
                self._reconsider(now)

    def _follow(self, term: int, leader: bytes, electorate: int, now: float,
                out: list[Effect]) -> None:
        if leader == self.node_id or self._stood_down == (term, leader):
            return
        new = term > self.term or self.leader != leader
        if term > self.term or self.role != FOLLOWER:
            if self.role != FOLLOWER:
                self._become_follower(now, out, f"{self._electorate.name(leader)} leads term {term}")
            self.term = term
        self._settle_until = -INF  # a leader is known: the swarm is met
        if new:
            self.leader = leader
            self._health.deputy_term = -1
            self._health.beats_lost = False
            self._gone_reported = None
            self._election_at = INF
            name = self._electorate.name(leader)
            out.append(Event(LEADER, leader, name, f"leader {name} (term {term})", term=term))
            others = [m for m in self._electorate.others() if m.node_id != leader]
            k = min(self.tuning.announce_relay, len(others))
            for m in self.rng.sample(others, k) if k else []:
                out.append(SendDatagram(m.addr, (LeaderIs(term, leader, electorate),)))

    def _conflict(self, other: bytes, addr: str, out: list[Effect]) -> bool:
        """Two leaders in one term (only after a partition that outlasted the electorate's
        bound): the first in the order of succession stays, everyone follows it. True: we
        keep ours (and tell the sender); False: follow ``other``. Signed, ``other`` comes
        with a proof for our electorate as it is now; a leader of ours that has none (its
        side's ballots, counted before the sides met again, are not a majority of both)
        gives way to it whatever the order: the other side could never follow ours."""
        self.stats["conflicts"] += 1
        ours = self.leader
        assert ours is not None
        if self._proofs.sig is not None and not self._still_proven(ours):
            return False
        if self._electorate.succession_key(ours, self.priority) <= self._electorate.succession_key(other, self.priority):
            if self.role == LEADER_ROLE or not self._leader_gone():
                self._tell_leader(addr, other, out)
            return True
        return False

    # --- proofs ------------------------------------------------------------------------

    def _follows(self, term: int, leader: bytes) -> bool:
        return term == self.term and self.leader == leader

    def _proven(self, term: int, leader: bytes) -> bool:
        """Ballots for (term, leader) from more than half of our own electorate."""
        if self._proofs.sig is None or self._follows(term, leader):
            return True
        return self._proofs.majority(term, leader)

    def _on_leader_proof(self, msg: LeaderProof, addr: str, now: float,
                         out: list[Effect]) -> None:
        if self._proofs.sig is None or msg.term < self.term or msg.term > MAX_TERM or \
                msg.leader == self.node_id or self._follows(msg.term, msg.leader):
            return
        checked: list[bytes] = []
        whole = True
        for ballot in msg.ballots:
            voter = ballot.voter
            if voter not in self._electorate.voters or voter in checked or \
                    self._proofs.tally.has(msg.term, msg.leader, voter):
                continue  # counted already, or not ours to count: no signature check
            if not self._proofs.may_check(addr, now):
                whole = False
                break
            if self._proofs.signed_by(voter, ballot.signature,
                               ballot_statement(msg.term, msg.leader, voter), addr, now):
                checked.append(voter)
        if checked:
            self._proofs.tally.add(msg.term, msg.leader, checked)
        if not self._proven(msg.term, msg.leader) and \
                self._our_vote_completes(msg.term, msg.leader):
            self._vote_to_follow(msg.term, msg.leader, now, out)
        if self._proven(msg.term, msg.leader):
            self._proofs.short = None
            leader = self._electorate.members.get(msg.leader)
            self._take_leader(LeaderIs(msg.term, msg.leader, self.electorate()),
                              leader.addr if leader is not None else addr, now, out)
        elif self.role == LEADER_ROLE and self.term < msg.term < self.term + MAX_TERM_STEP \
                and self._proofs.tally.count(msg.term, msg.leader, self._electorate.voters) > 0:
            if whole and self._proofs.short_for_long(msg.term, msg.leader, now):
                self._leading.restand(msg.term, now, out, "fellows follow a leader of term "
                              f"{msg.term} that cannot prove itself here")
            else:
                self._ask_proof(msg.term, msg.leader, now, out)

    def _our_vote_completes(self, term: int, leader: bytes) -> bool:
        """Whether (term, leader)'s checked ballots, another fellow's among them, fall
        short of a majority of our electorate by our own ballot alone, and we may still
        give it: we follow no live leader, the term is not behind ours nor more than
        ``MAX_TERM_STEP`` ahead, and our vote in it is free or already its. A fellow
        restarted from its record counts fellows that left (or expired) while it was
        down, of whom the live swarm holds no ballot any more (its membership does not
        tell a newcomer of a leave); its own vote is the one ballot it can add."""
        if self.role == LEADER_ROLE or leader == self.node_id or \
                leader not in self._electorate.voters or self._stood_down == (term, leader):
            return False
        if not self.term <= term <= min(self.term + MAX_TERM_STEP, MAX_TERM):
            return False
        if self.leader is not None and not self._leader_gone():
            return False  # a live leader's followers move only with a whole proof
        if self.voted_term == term and self.voted_for not in (None, leader):
            return False
        count = self._proofs.tally.count(term, leader, self._electorate.voters)
        others = count - self._proofs.tally.has(term, leader, leader)
        return others >= 1 and 2 * (count + 1) > len(self._electorate.voters)

    def _vote_to_follow(self, term: int, leader: bytes, now: float,
                        out: list[Effect]) -> None:
        """Give ``leader`` our vote in ``term``, as if it had asked for it (Raft's vote:
        once per term, on disk before anything leaves), and count our own ballot."""
        self._adopt_term(term, now, out)
        self.voted_term, self.voted_for = term, leader
        self._proofs.tally.add(term, leader, (self.node_id,))
        self.stats["votes_to_follow"] = self.stats.get("votes_to_follow", 0) + 1

    def _ask_proof(self, term: int, leader: bytes, now: float, out: list[Effect]) -> None:
        """We were told of a leader without its proof: ask it (now and then)."""
        self._proofs.refuse("unproven-leader")
        self._proofs.shown = (term, leader)
        m = self._electorate.members.get(leader)
        if m is None or m.state not in PRESENT or term < self.term:
            return
        if not self._proofs.may_ask(term, leader, now):
            return
        out.append(SendDatagram(m.addr, (LeaderQuery(self.term, self.node_id),)))

    def _still_proven(self, leader: bytes) -> bool:
        """Whether the leader we follow (or we, leading) holds a proof for our electorate
        as it is now, not only as it was when we followed."""
        if leader == self.node_id:
            return not self._leading.proof_short()
        return self._proofs.majority(self.term, leader)

    def _tell_leader(self, addr: str, node: bytes | None, out: list[Effect],
                     *also: Any) -> None:
        """``LeaderIs`` (and ``also``) to ``addr``; as the leader, with our proof unless
        ``node`` acked it already."""
        out.append(SendDatagram(addr, (self._leader_is(), *also)))
        if self._proofs.sig is not None and self.role == LEADER_ROLE and node not in self._proofs.acked:
            out.extend(SendDatagram(addr, (part,)) for part in self._proofs.parts(self.term, self.node_id))


__all__ = [
    "CANDIDATE",
    "FOLLOWER",
    "LEADER_ROLE",
    "Election",
    "ElectionStatus",
]
