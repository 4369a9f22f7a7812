"""Candidacy: running for leader, PreVote first.

A would-be candidate first asks "would you vote for me in t + 1?" (PreVote: nothing
changes at a voter); with more than half of its electorate yes, it raises its term, votes
for itself and asks for real votes, signed ballots that become its proof. A round that
can no longer be won ends at once; a lost one is tried again later in the order of
succession, a rank apart, so rounds do not keep splitting."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2pswarm.effects import Effect, SendDatagram
from p2pswarm.election.constants import CANDIDATE, FOLLOWER, INF
from p2pswarm.security.ballots import ballot_statement, reply_statement, request_statement
from p2pswarm.wire.gossip import VoteReply, VoteRequest

if TYPE_CHECKING:  # the machine this role is part of, as the roles see it
    from p2pswarm.election.roles import ElectionPort


class Candidacy:
    """This fellow's candidacy: its term, whether a PreVote, the grants and signed
    ballots it has, who answered, and when to ask again or give up."""

    def __init__(self, election: ElectionPort) -> None:
        self._election = election
        self.term = 0
        self.pre = False
        self.grants: dict[bytes, None] = {}
        self.electorate = 0
        self.deadline = INF
        self.answered: dict[bytes, None] = {}
        self.resend_at = INF
        self.ballots: dict[bytes, bytes] = {}  # our candidacy's signed grants
        self.request: VoteRequest | None = None  # our candidacy's signed request

    def stop(self) -> None:
        """No candidacy under way (or its timers are no longer ours: we lead or follow)."""
        self.deadline = INF
        self.resend_at = INF

    def won(self) -> dict[bytes, bytes]:
        """Elected: the candidacy ends, and its signed grants become the leader's proof."""
        self.stop()
        self.grants = {}
        ballots, self.ballots = self.ballots, {}
        return ballots

    def start(self, pre: bool, now: float, out: list[Effect]) -> None:
        """Run: a PreVote for the next term (``pre``), or the real vote, raising our
        term and voting for ourselves."""
        e = self._election
        e.role = CANDIDATE
        self.pre = pre
        self.term = e.term + 1
        if not pre:
            e.term = self.term
            e.voted_term, e.voted_for = e.term, e.node_id
            e.leader = None
            e.stats["elections"] += 1
        self.grants = {e.node_id: None}
        self.ballots = {}
        if not pre and e._proofs.sig is not None:
            self.ballots[e.node_id] = e._proofs.sig.sign(
                ballot_statement(e.term, e.node_id, e.node_id))
        self.request = None
        self.answered = {e.node_id: None}
        self.electorate = e.electorate()
        self.deadline = now + e.tuning.vote_timeout_s
        self.resend_at = now + e.tuning.vote_resend_s
        self.ask_votes(out)
        self.count_votes(now, out)

    def ask_votes(self, out: list[Effect]) -> None:
        """(Re)send the vote request to every present fellow that has not answered."""
        e = self._election
        msg = self.request
        if msg is None or (msg.term, msg.pre_vote) != (self.term, self.pre):
            msg = self.request = VoteRequest(
                self.term, e.node_id, e.priority, self.electorate,
                self.pre, e._proofs.sign(request_statement(self.term, e.node_id, self.pre)))
        for m in e._electorate.others():
            if m.node_id not in self.answered:
                out.append(SendDatagram(m.addr, (msg,)))

    def count_votes(self, now: float, out: list[Effect]) -> None:
        """A majority of grants: from a PreVote to the real vote, from the vote to lead."""
        e = self._election
        if 2 * len(self.grants) <= self.electorate:
            return
        if self.pre:
            self.start(False, now, out)
        else:
            e._become_leader(now, out)

    def failed(self, now: float) -> None:
        """Lost (a split vote, a leader that still answers, our own radio): try again
        later, in the order of succession so that the next round does not split."""
        e = self._election
        e.role = FOLLOWER
        self.stop()
        self.grants = {}
        e._election_at = (now + e.tuning.rank_spacing_s * 0.5 + e._rank_delay()
                          + e.rng.random() * e.tuning.jitter_s)

    def on_vote_reply(self, msg: VoteReply, addr: str, now: float, out: list[Effect]) -> None:
        """A voter's answer to our candidacy (a candidate's row of the machine's table)."""
        e = self._election
        if msg.term != self.term or msg.pre_vote != self.pre or msg.voter == e.node_id:
            return
        real_grant = msg.granted and not msg.pre_vote
        if e._proofs.sig is not None and (msg.candidate != e.node_id or not e._proofs.signed_by(
                msg.voter, msg.signature,
                ballot_statement(msg.term, e.node_id, msg.voter) if real_grant else
                reply_statement(msg.term, e.node_id, msg.voter, msg.pre_vote,
                                msg.granted), addr, now)):
            return  # forged or for someone else: a vote counts only from its voter
        # a voter that counts more fellows raises the bar, up to the fellows we know of
        # (not to whatever a fellow claims)
        self.electorate = max(self.electorate,
                              min(msg.electorate, len(e._electorate.members)))
        self.answered[msg.voter] = None
        if msg.granted:
            self.grants[msg.voter] = None
            if real_grant and msg.signature is not None:
                self.ballots[msg.voter] = msg.signature
            self.count_votes(now, out)
        elif e.role == CANDIDATE:
            unanswered = sum(1 for m in e._electorate.others()
                             if m.node_id not in self.answered)
            if 2 * (len(self.grants) + unanswered) <= self.electorate:
                self.failed(now)  # cannot win any more: do not wait it out


__all__ = ["Candidacy"]
