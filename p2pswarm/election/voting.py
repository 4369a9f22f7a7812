"""Voting: this fellow's answers to vote requests.

A PreVote changes nothing at a voter, and a voter grants it only if it has no live
leader itself: one that still sees its leader in membership does not take the
candidate's word for it, it checks the leader (``LeaderCheck``, see ``health``) and
grants only if no answer comes in time. A real vote is given once per term (Raft), and a
real request for a higher term moves this fellow's term only if it follows no live
leader, granted that candidate's PreVote, or hears its own leader standing again; a
request more than ``MAX_TERM_STEP`` ahead is refused. A granted real vote is a signed
ballot for the candidate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2pswarm.effects import Effect, SendDatagram
from p2pswarm.election.constants import FOLLOWER, INF, LEADER_ROLE, MAX_TERM, MAX_TERM_STEP
from p2pswarm.security.ballots import ballot_statement, reply_statement, request_statement
from p2pswarm.wire.gossip import LeaderCheck, VoteReply, VoteRequest

if TYPE_CHECKING:  # the machine this role is part of, as the roles see it
    from p2pswarm.election.roles import ElectionPort


class Voting:
    """The voter's side of an election, and its PreVote answers (kept a little while, so
    that a candidate asking again gets the same answer)."""

    def __init__(self, election: ElectionPort) -> None:
        self._election = election
        # (candidate, term) -> (granted, when)
        self.prevote_answers: dict[tuple[bytes, int], tuple[bool, float]] = {}

    def on_vote_request(self, msg: VoteRequest, addr: str, now: float,
                        out: list[Effect]) -> None:
        e = self._election
        if msg.candidate == e.node_id or not e._proofs.signed_by(
                msg.candidate, msg.signature,
                request_statement(msg.term, msg.candidate, msg.pre_vote), addr, now):
            return
        e._leading.note_ahead(msg, now, out)
        if msg.term > min(e.term + MAX_TERM_STEP, MAX_TERM):
            e._proofs.refuse("term-too-far")
            out.append(self.reply(msg, addr, False, "term too far ahead"))
            return
        if not e.settled(now) and (msg.pre_vote or
                                   e._proofs.shown != (msg.term, msg.candidate)):
            # (a leader we were told of, asking for the votes its proof lacks, is heard)
            out.append(self.reply(msg, addr, False, "just joined: still meeting the swarm"))
            return
        if not msg.pre_vote and msg.term > e.term:
            if not self.may_adopt(msg):
                e._proofs.refuse("vote-while-led")
                self.deny_naming_leader(msg, addr, "the leader answers me", out)
                return
            e._adopt_term(msg.term, now, out)
        if msg.term <= e.term and msg.pre_vote or msg.term < e.term:
            self.deny_naming_leader(msg, addr, "stale term", out)
            return
        if e.role == LEADER_ROLE and msg.pre_vote:
            self.deny_naming_leader(msg, addr, "I am the leader", out)
            return
        if msg.pre_vote:  # asked again (our answer was lost): the same answer
            cached = self.prevote_answers.get((msg.candidate, msg.term))
            if cached is not None and now - cached[1] < 2.0:
                out.extend(self.answer_vote(msg, addr, now, leader_alive=not cached[0]))
                return
            if e._health.checking(msg.candidate):
                return  # its answer is on the way
        if msg.pre_vote and not e._leader_gone():
            if e._health.beats(e.term, now):
                out.append(self.reply(msg, addr, False, "the leader beats"))
                return
            when, answered = e._health.check_result
            if now - when < e.tuning.check_timeout_s:
                out.extend(self.answer_vote(msg, addr, now, leader_alive=answered))
                return
            self.check_leader(msg, addr, now, out)
            return
        out.extend(self.answer_vote(msg, addr, now, leader_alive=False))

    def may_adopt(self, msg: VoteRequest) -> bool:
        """Whether a real vote request may raise our term: not while we lead, nor while
        we follow a live leader, unless we granted this candidate's PreVote for that term
        (a majority, us among it, found the leader gone)."""
        e = self._election
        if e.role == LEADER_ROLE:
            return False
        if e._leader_gone() or e._health.beats_lost or msg.candidate == e.leader:
            return True  # (our own leader standing again: see Leading.restand)
        cached = self.prevote_answers.get((msg.candidate, msg.term))
        return cached is not None and cached[0]

    def check_leader(self, msg: VoteRequest, addr: str, now: float,
                     out: list[Effect]) -> None:
        e = self._election
        if e._health.join_check(addr, msg):
            return
        leader = e._electorate.members.get(e.leader) if e.leader is not None else None
        if leader is None:
            out.extend(self.answer_vote(msg, addr, now, leader_alive=False))
            return
        seq = e._health.open_check(addr, msg, now)
        e.stats["checks"] += 1
        out.append(SendDatagram(leader.addr, (LeaderCheck(e.term, seq, e.node_id),)))

    def answer_vote(self, msg: VoteRequest, addr: str, now: float, *,
                    leader_alive: bool) -> list[Effect]:
        e = self._election
        if msg.pre_vote:
            self.prevote_answers[(msg.candidate, msg.term)] = (not leader_alive, now)
            if len(self.prevote_answers) > 64:
                for key in list(self.prevote_answers)[:32]:
                    del self.prevote_answers[key]
        if leader_alive:
            return [self.reply(msg, addr, False, "the leader answers me")]
        if msg.pre_vote:
            if msg.term <= e.term:
                return [self.reply(msg, addr, False, "stale term")]
            # give the candidate time before running ourselves (if we were about to)
            if e.role == FOLLOWER and e._election_at != INF:
                e._election_at = max(e._election_at, now + e.tuning.vote_timeout_s)
            return [self.reply(msg, addr, True, "")]
        if msg.term != e.term:
            return [self.reply(msg, addr, False, "stale term")]
        if e.voted_term == e.term and e.voted_for not in (None, msg.candidate):
            return [self.reply(msg, addr, False, "already voted in this term")]
        e.voted_term, e.voted_for = e.term, msg.candidate
        e._proofs.tally.add(e.term, msg.candidate, (e.node_id,))  # our own ballot
        return [self.reply(msg, addr, True, "")]

    def deny_naming_leader(self, msg: VoteRequest, addr: str, reason: str,
                           out: list[Effect]) -> None:
        """A refusal that, when we know a live leader, also names it: a candidate that
        missed the leader (it has just joined) follows it rather than running on."""
        e = self._election
        refusal = self.reply(msg, addr, False, reason)
        if e.leader is None or e._leader_gone():
            out.append(refusal)
        else:
            e._tell_leader(addr, msg.candidate, out, *refusal.messages)

    def reply(self, msg: VoteRequest, addr: str, granted: bool, reason: str) -> SendDatagram:
        e = self._election
        if granted and not msg.pre_vote:  # a granted vote is a ballot for the candidate
            statement = ballot_statement(msg.term, msg.candidate, e.node_id)
        else:
            statement = reply_statement(msg.term, msg.candidate, e.node_id, msg.pre_vote,
                                        granted)
        return SendDatagram(addr, (VoteReply(msg.term, e.node_id, granted, msg.pre_vote,
                                             e.electorate(), reason, msg.candidate,
                                             e._proofs.sign(statement)),))


__all__ = ["Voting"]
