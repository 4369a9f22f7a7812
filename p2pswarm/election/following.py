"""Following: which leader this fellow follows, and why.

A fellow follows a leader only once it holds a proof for that term and leader (see
``proofs``), asking the leader for it (``LeaderQuery``) when shown a leader without one.
A fellow that follows no live leader and whose own ballot is all a proof lacks gives that
leader its vote in that term, once (``vote_to_follow``). Two leaders in one term (only
after a partition that outlasted the electorate's bound) are settled by the order of
succession, unless ours can no longer prove itself here (``conflict``). A leader that
stepped down never leads that term again here, so a beat in flight cannot bring it
back."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2pswarm.effects import LEADER, NO_LEADER, Effect, Event, SendDatagram
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
from p2pswarm.security.ballots import ballot_statement, beat_statement, step_down_statement
from p2pswarm.wire.gossip import (
    LeaderAck,
    LeaderBeat,
    LeaderIs,
    LeaderProof,
    LeaderQuery,
    StepDown,
)

if TYPE_CHECKING:  # the machine this role is part of, as the roles see it
    from p2pswarm.election.roles import ElectionPort


class Following:
    """Taking, checking and dropping a leader."""

    def __init__(self, election: ElectionPort) -> None:
        self._election = election
        self.gone_reported: bytes | None = None  # the leader whose loss we reported
        # (term, leader) of a step-down we saw: it never leads that term again, so a beat
        # or relayed announcement still in flight must not make us follow it back
        self.stood_down: tuple[int, bytes] | None = None

    def on_step_down(self, msg: StepDown, addr: str, now: float, out: list[Effect]) -> None:
        e = self._election
        if msg.term != e.term or msg.leader != e.leader or msg.leader == e.node_id:
            return
        if not e._proofs.signed_by(msg.leader, msg.signature,
                                   step_down_statement(msg.term, msg.leader), addr, now):
            return
        e.leader = None
        self.stood_down = (msg.term, msg.leader)
        e._health.deputy_term = -1
        e._election_at = now + e._rank_delay() + e.rng.random() * e.tuning.jitter_s
        out.append(Event(NO_LEADER, msg.leader, e._electorate.name(msg.leader),
                         "the leader stepped down", term=e.term))

    def on_leader_is(self, msg: LeaderIs, addr: str, now: float, out: list[Effect]) -> None:
        e = self._election
        if msg.term < e.term:
            if e.leader is not None and not e._leader_gone():
                out.append(SendDatagram(addr, (e._leader_is(),)))  # you are behind
            return
        if msg.leader == e.node_id:
            return  # whether we lead, we know
        if not self.proven(msg.term, msg.leader):
            self.ask_proof(msg.term, msg.leader, now, out)
            return
        self.take_leader(msg, addr, now, out)

    def take_leader(self, msg: LeaderIs, addr: str, now: float, out: list[Effect]) -> None:
        """Follow the leader ``msg`` names (its proof checked, or needless)."""
        e = self._election
        if msg.term < e.term:
            return
        if msg.term == e.term and e.leader not in (None, msg.leader) \
                and e.role != CANDIDATE and self.conflict(msg.leader, addr, out):
            return
        self.follow(msg.term, msg.leader, msg.electorate, now, out)
        leader = e._electorate.members.get(msg.leader)
        if e.leader == msg.leader and leader is not None and leader.addr == addr:
            out.append(SendDatagram(addr, (LeaderAck(
                msg.term, e.node_id, msg.leader,
                e._proofs.sign(ballot_statement(msg.term, msg.leader, e.node_id))),)))

    def on_beat(self, msg: LeaderBeat, addr: str, now: float, out: list[Effect]) -> None:
        e = self._election
        if msg.rank == CHECK_REPLY_RANK:
            waiting = e._health.checks.get(msg.seq)
            if waiting is None or e._proofs.sig is not None and (
                    msg.leader != e.leader or not e._proofs.signed_by(
                        msg.leader, msg.signature,
                        beat_statement(msg.term, msg.leader, msg.seq, msg.rank), addr, now)):
                return
            for req_addr, req in e._health.answered(msg.seq, now):
                out.extend(e._voting.answer_vote(req, req_addr, now, leader_alive=True))
            return
        if msg.leader == e.node_id or not e._proofs.signed_by(
                msg.leader, msg.signature,
                beat_statement(msg.term, msg.leader, msg.seq, msg.rank), addr, now):
            return
        if msg.term < e.term:
            if e.leader is not None and not e._leader_gone():
                out.append(SendDatagram(addr, (e._leader_is(),)))  # it was frozen: behind
            return
        if not self.proven(msg.term, msg.leader):
            self.ask_proof(msg.term, msg.leader, now, out)
            return
        if msg.term == e.term and e.leader not in (None, msg.leader) \
                and e.role != CANDIDATE and self.conflict(msg.leader, addr, out):
            return
        self.follow(msg.term, msg.leader, msg.electorate, now, out)
        if e.leader == msg.leader:
            e._health.note_beat(e.term, msg.rank, now)
            if e._health.beats_lost:
                e._health.beats_lost = False
                e._reconsider(now)

    def follow(self, term: int, leader: bytes, electorate: int, now: float,
               out: list[Effect]) -> None:
        e = self._election
        if leader == e.node_id or self.stood_down == (term, leader):
            return
        new = term > e.term or e.leader != leader
        if term > e.term or e.role != FOLLOWER:
            if e.role != FOLLOWER:
                e._become_follower(now, out, f"{e._electorate.name(leader)} leads term {term}")
            e.term = term
        e._settle_until = -INF  # a leader is known: the swarm is met
        if new:
            e.leader = leader
            e._health.deputy_term = -1
            e._health.beats_lost = False
            self.gone_reported = None
            e._election_at = INF
            name = e._electorate.name(leader)
            out.append(Event(LEADER, leader, name, f"leader {name} (term {term})", term=term))
            others = [m for m in e._electorate.others() if m.node_id != leader]
            k = min(e.tuning.announce_relay, len(others))
            for m in e.rng.sample(others, k) if k else []:
                out.append(SendDatagram(m.addr, (LeaderIs(term, leader, electorate),)))

    def conflict(self, other: bytes, addr: str, out: list[Effect]) -> bool:
        """Two leaders in one term (only after a partition that outlasted the electorate's
        bound): the first in the order of succession stays, everyone follows it. True: we
        keep ours (and tell the sender); False: follow ``other``. Signed, ``other`` comes
        with a proof for our electorate as it is now; a leader of ours that has none (its
        side's ballots, counted before the sides met again, are not a majority of both)
        gives way to it whatever the order: the other side could never follow ours."""
        e = self._election
        e.stats["conflicts"] += 1
        ours = e.leader
        assert ours is not None
        if e._proofs.sig is not None and not self.still_proven(ours):
            return False
        key = e._electorate.succession_key
        if key(ours, e.priority) <= key(other, e.priority):
            if e.role == LEADER_ROLE or not e._leader_gone():
                e._tell_leader(addr, other, out)
            return True
        return False

    def follows(self, term: int, leader: bytes) -> bool:
        e = self._election
        return term == e.term and e.leader == leader

    def proven(self, term: int, leader: bytes) -> bool:
        """Ballots for (term, leader) from more than half of our own electorate."""
        e = self._election
        if e._proofs.sig is None or self.follows(term, leader):
            return True
        return e._proofs.majority(term, leader)

    def on_leader_proof(self, msg: LeaderProof, addr: str, now: float,
                        out: list[Effect]) -> None:
        e = self._election
        if e._proofs.sig is None or msg.term < e.term or msg.term > MAX_TERM or \
                msg.leader == e.node_id or self.follows(msg.term, msg.leader):
            return
        checked: list[bytes] = []
        whole = True
        for ballot in msg.ballots:
            voter = ballot.voter
            if voter not in e._electorate.voters or voter in checked or \
                    e._proofs.tally.has(msg.term, msg.leader, voter):
                continue  # counted already, or not ours to count: no signature check
            if not e._proofs.may_check(addr, now):
                whole = False
                break
            if e._proofs.signed_by(voter, ballot.signature,
                                   ballot_statement(msg.term, msg.leader, voter), addr, now):
                checked.append(voter)
        if checked:
            e._proofs.tally.add(msg.term, msg.leader, checked)
        if not self.proven(msg.term, msg.leader) and \
                self.our_vote_completes(msg.term, msg.leader):
            self.vote_to_follow(msg.term, msg.leader, now, out)
        if self.proven(msg.term, msg.leader):
            e._proofs.short = None
            leader = e._electorate.members.get(msg.leader)
            self.take_leader(LeaderIs(msg.term, msg.leader, e.electorate()),
                             leader.addr if leader is not None else addr, now, out)
        elif e.role == LEADER_ROLE and e.term < msg.term < e.term + MAX_TERM_STEP \
                and e._proofs.tally.count(msg.term, msg.leader, e._electorate.voters) > 0:
            if whole and e._proofs.short_for_long(msg.term, msg.leader, now):
                e._leading.restand(msg.term, now, out, "fellows follow a leader of term "
                                   f"{msg.term} that cannot prove itself here")
            else:
                self.ask_proof(msg.term, msg.leader, now, out)

    def our_vote_completes(self, term: int, leader: bytes) -> bool:
        """Whether (term, leader)'s checked ballots, another fellow's among them, fall
        short of a majority of our electorate by our own ballot alone, and we may still
        give it: we follow no live leader, the term is not behind ours nor more than
        ``MAX_TERM_STEP`` ahead, and our vote in it is free or already its. A fellow
        restarted from its record counts fellows that left (or expired) while it was
        down, of whom the live swarm holds no ballot any more (its membership does not
        tell a newcomer of a leave); its own vote is the one ballot it can add."""
        e = self._election
        if e.role == LEADER_ROLE or leader == e.node_id or \
                leader not in e._electorate.voters or self.stood_down == (term, leader):
            return False
        if not e.term <= term <= min(e.term + MAX_TERM_STEP, MAX_TERM):
            return False
        if e.leader is not None and not e._leader_gone():
            return False  # a live leader's followers move only with a whole proof
        if e.voted_term == term and e.voted_for not in (None, leader):
            return False
        count = e._proofs.tally.count(term, leader, e._electorate.voters)
        others = count - e._proofs.tally.has(term, leader, leader)
        return others >= 1 and 2 * (count + 1) > len(e._electorate.voters)

    def vote_to_follow(self, term: int, leader: bytes, now: float,
                       out: list[Effect]) -> None:
        """Give ``leader`` our vote in ``term``, as if it had asked for it (Raft's vote:
        once per term, on disk before anything leaves), and count our own ballot."""
        e = self._election
        e._adopt_term(term, now, out)
        e.voted_term, e.voted_for = term, leader
        e._proofs.tally.add(term, leader, (e.node_id,))
        e.stats["votes_to_follow"] = e.stats.get("votes_to_follow", 0) + 1

    def ask_proof(self, term: int, leader: bytes, now: float, out: list[Effect]) -> None:
        """We were told of a leader without its proof: ask it (now and then)."""
        e = self._election
        e._proofs.refuse("unproven-leader")
        e._proofs.shown = (term, leader)
        m = e._electorate.members.get(leader)
        if m is None or m.state not in PRESENT or term < e.term:
            return
        if not e._proofs.may_ask(term, leader, now):
            return
        out.append(SendDatagram(m.addr, (LeaderQuery(e.term, e.node_id),)))

    def still_proven(self, leader: bytes) -> bool:
        """Whether the leader we follow (or we, leading) holds a proof for our electorate
        as it is now, not only as it was when we followed."""
        e = self._election
        if leader == e.node_id:
            return not e._leading.proof_short()
        return e._proofs.majority(e.term, leader)


__all__ = ["Following"]
