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
    FOLLOWER,
    INF,
    LEADER_ROLE,
)
from p2pswarm.election.electorate import Electorate
from p2pswarm.election.following import Following
from p2pswarm.election.health import Health
from p2pswarm.election.leading import Leading
from p2pswarm.election.proofs import Proofs
from p2pswarm.election.voting import Voting
from p2pswarm.membership.member import Member
from p2pswarm.security.ballots import (
    Signatures,
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
    from p2pswarm.randomness import Rng

# a part's answer to a message: (message, from address, now, effects out)
Answer = Callable[[Any, str, float, list[Effect]], None]


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
        rng: Rng,
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
        self._joined = False
        self._leaving = False
        self._settle_until = INF  # set on joining; -inf once a leader is known
        self._election_at = INF  # when to run (as a follower)
        self._next_query_at = INF  # when to ask who leads (knowing no leader)
        # the parts, leaves first (see the package's docstring)
        self._electorate = Electorate(node_id, config, now, voters)
        self._health = Health(config, rng.randrange(2**32))  # the leader's, as we see it
        self._proofs = Proofs(self._electorate, signatures)
        self._candidacy = Candidacy(self)
        self._voting = Voting(self)
        self._leading = Leading(self)
        self._following = Following(self)
        self.stats: dict[str, int] = {"elections": 0, "terms_won": 0, "checks": 0,
                                      "conflicts": 0}
        # Which messages each role answers, and which part answers them (in the style
        # of h11's _state.py: the table is the protocol). A message that its role's row
        # lacks is dropped unread; each answer still checks the message's term,
        # signature and sender. A leader has no answer to StepDown (only it could step
        # down from its term), nor a follower to VoteReply, LeaderCheck or LeaderAck.
        vote, follow, lead = self._voting, self._following, self._leading
        self._answers: dict[str, dict[type, Answer]] = {
            FOLLOWER: {
                VoteRequest: vote.on_vote_request,
                LeaderIs: follow.on_leader_is, LeaderProof: follow.on_leader_proof,
                LeaderBeat: follow.on_beat, StepDown: follow.on_step_down,
                LeaderQuery: self._on_leader_query,
            },
            CANDIDATE: {
                VoteRequest: vote.on_vote_request, VoteReply: self._candidacy.on_vote_reply,
                LeaderIs: follow.on_leader_is, LeaderProof: follow.on_leader_proof,
                LeaderBeat: follow.on_beat, StepDown: follow.on_step_down,
                LeaderQuery: self._on_leader_query,
            },
            LEADER_ROLE: {
                VoteRequest: vote.on_vote_request, VoteReply: lead.on_vote_reply,
                LeaderIs: follow.on_leader_is, LeaderProof: follow.on_leader_proof,
                LeaderBeat: follow.on_beat, LeaderCheck: lead.on_leader_check,
                LeaderAck: lead.on_leader_ack, LeaderQuery: self._on_leader_query,
            },
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

    def shrinks_at(self) -> float | None:
        """When the next absent fellow leaves the electorate (None: none is absent):
        what a side too small to elect waits for."""
        at = self._electorate.next_expiry()
        return None if at == INF else at

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

    # --- feeding the membership view -----------------------------------------------------

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
                and self._following.gone_reported != self.leader:
            self._following.gone_reported = self.leader  # say it once, when it happens
            m = self._electorate.members.get(self.leader)
            state = m.state if m is not None else "gone"
            name = self._electorate.name(self.leader)
            out.append(Event(NO_LEADER, self.leader, name, f"leader {name} is {state}",
                             term=self.term))
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

    # --- messages (the table in __init__) ------------------------------------------------

    def handle(self, message: Any, sender_addr: str, now: float) -> list[Effect]:
        """Answer ``message`` from ``sender_addr`` at ``now`` as this fellow's role does."""
        out: list[Effect] = []
        answer = self._answers[self.role].get(type(message))
        if answer is not None:
            answer(message, sender_addr, now, out)
        return out

    def _on_leader_query(self, msg: LeaderQuery, addr: str, now: float,
                         out: list[Effect]) -> None:
        """Who leads? Answered by any role that knows a live leader; the leader adds
        its proof (the asker lacks it)."""
        if self.leader is None or self._leader_gone():
            return
        asker = self._electorate.members.get(msg.source)
        if self.role == LEADER_ROLE and asker is not None and asker.addr == addr:
            self._tell_leader(addr, None, out)  # it asks: it lacks the proof
        else:
            out.append(SendDatagram(addr, (self._leader_is(),)))

    def _leader_is(self) -> LeaderIs:
        return LeaderIs(self.term, self.leader or self.node_id, self.electorate())

    def _tell_leader(self, addr: str, node: bytes | None, out: list[Effect],
                     *also: Any) -> None:
        """``LeaderIs`` (and ``also``) to ``addr``; as the leader, with our proof unless
        ``node`` acked it already."""
        out.append(SendDatagram(addr, (self._leader_is(), *also)))
        if self._proofs.sig is not None and self.role == LEADER_ROLE and \
                node not in self._proofs.acked:
            out.extend(SendDatagram(addr, (part,))
                       for part in self._proofs.parts(self.term, self.node_id))

    # --- timers --------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        lead = self._leading
        t = min(self._candidacy.deadline, lead.next_beat_at, lead.next_announce_at,
                lead.announce_due)
        if self.role == CANDIDATE:  # a candidacy under way: tick leaves _election_at alone
            t = min(t, self._candidacy.resend_at)
        else:
            t = min(t, self._election_at)
        if lead.unacked and self.role == LEADER_ROLE:
            t = min(t, lead.retry_at)
        if self.role == LEADER_ROLE and lead.canvass_at != INF:
            t = min(t, lead.canvass_at)
        if lead.better is not None and self.role == LEADER_ROLE:
            t = min(t, lead.better[1] + self.tuning.handover_after_s)
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

    def _leader_gone(self) -> bool:
        if self.leader is None:
            return True
        if self.leader == self.node_id:
            return self.role != LEADER_ROLE
        m = self._electorate.members.get(self.leader)
        return m is None or m.state in ("dead", "left")

    # --- local health (see health) ------------------------------------------------------

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

    # --- deciding to run -----------------------------------------------------------------

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

    # --- transitions between roles -----------------------------------------------------

    def _become_leader(self, now: float, out: list[Effect]) -> None:
        self.role = LEADER_ROLE
        self.leader = self.node_id
        self._election_at = INF
        self._proofs.lead(self._candidacy.won())
        self.stats["terms_won"] += 1
        self._settle_until = -INF
        self._leading.begin(now, out)
        out.append(Event(ELECTED, self.node_id, self.name,
                         f"elected leader of term {self.term} by {self.present()} of "
                         f"{self.electorate()} fellows", term=self.term))
        out.append(Event(LEADER, self.node_id, self.name, f"leader of term {self.term}",
                         term=self.term))

    def _become_follower(self, now: float, out: list[Effect], why: str) -> None:
        was = self.role
        self.role = FOLLOWER
        self._candidacy.stop()
        self._leading.stop()
        if was == LEADER_ROLE:
            out.append(Event(STEPPED_DOWN, self.node_id, self.name,
                             f"stepped down from term {self.term}: {why}", term=self.term))

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


__all__ = [
    "CANDIDATE",
    "FOLLOWER",
    "LEADER_ROLE",
    "Election",
    "ElectionStatus",
]
