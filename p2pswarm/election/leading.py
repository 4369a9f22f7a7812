"""Leading: the duties of a leader.

A new leader sends ``LeaderIs`` (with its proof) to every present fellow at once, again a
few times shortly after, and every ``announce_interval_s``; it beats to its deputies
every heartbeat interval and answers voters' checks. It steps down on its own when it
sees no majority present for ``leader_lease_s`` (the lease), at once when the present
fellows that may still follow it are no majority (``deposed``), and on purpose when a
fellow of higher priority has been alive for ``handover_after_s`` (``hand_over``). A
leader short of a proof asks for the votes it lacks (``canvass``), and a proven one shown
a later term it cannot follow stands again above it (``restand``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2pswarm.effects import Effect, SendDatagram
from p2pswarm.election.constants import (
    CHECK_REPLY_RANK,
    INF,
    LEADER_ROLE,
    MAX_TERM_STEP,
    MAX_VOTERS,
)
from p2pswarm.membership.member import Member
from p2pswarm.security.ballots import (
    ballot_statement,
    beat_statement,
    request_statement,
    step_down_statement,
)
from p2pswarm.wire.gossip import (
    LeaderAck,
    LeaderBeat,
    LeaderCheck,
    StepDown,
    VoteReply,
    VoteRequest,
)

if TYPE_CHECKING:  # the machine this role is part of, as the roles see it
    from p2pswarm.election.roles import ElectionPort


class Leading:
    """A leader's duties and their timers: beats, announcements and their retries, the
    lease, the fellows seen in later terms, the handover, canvassing and standing again."""

    def __init__(self, election: ElectionPort) -> None:
        self._election = election
        self.last_announce_s = -INF
        self.announce_due = INF
        self.beat_seq = 0
        self.next_beat_at = INF
        self.unacked: dict[bytes, None] = {}  # fellows yet to ack the new leader's LeaderIs
        self.retry_at = INF
        self.retry_until = INF
        self.next_announce_at = INF
        self.last_announced_electorate = 0
        self.minority_since: float | None = None
        # fellows whose own signed vote requests showed them in a later term than ours
        # (fellow -> that term): they follow no leader of ours, present or not
        self.ahead: dict[bytes, int] = {}
        # fellow -> (later term, when first seen) of its PreVotes from that term
        self.ahead_asks: dict[bytes, tuple[int, float]] = {}
        self.better: tuple[bytes, float] | None = None  # (higher-priority fellow, since)
        self.canvass_at = INF  # as a leader short of a proof: when to ask for votes again
        self.restand_after = -INF  # when we may stand again (see restand)

    def begin(self, now: float, out: list[Effect]) -> None:
        """Just elected: announce at once (with our proof), then again until acked, and
        beat to the deputies."""
        e = self._election
        self.canvass_at = now
        self.minority_since = None
        self.last_announced_electorate = e.electorate()
        self.announce_all(out)
        self.unacked = {m.node_id: None for m in e._electorate.others()}
        self.retry_at = now + e.tuning.announce_retry_s
        self.retry_until = now + e.tuning.announce_retry_for_s
        self.next_announce_at = now + e.tuning.announce_interval_s
        self.next_beat_at = now

    def stop(self) -> None:
        """No longer the leader: no duties are due."""
        self.next_beat_at = INF
        self.next_announce_at = INF
        self.announce_due = INF
        self.unacked = {}
        self.minority_since = None
        self.canvass_at = INF

    def greet(self, arrived: list[Member], now: float, out: list[Effect]) -> None:
        """Tell fellows that just arrived who leads, at once and until they ack: one that
        joined a led swarm must not find itself leaderless, and run, while it settles."""
        e = self._election
        if not arrived:
            return
        for m in arrived:
            e._tell_leader(m.addr, m.node_id, out)
            self.unacked[m.node_id] = None
        self.retry_at = min(self.retry_at, now + e.tuning.announce_retry_s)
        self.retry_until = max(self.retry_until, now + e.tuning.announce_retry_for_s)

    def on_leader_check(self, msg: LeaderCheck, addr: str, now: float,
                        out: list[Effect]) -> None:
        """A voter checks that we are alive before it believes a candidate: answer it
        with a beat of rank ``CHECK_REPLY_RANK``."""
        e = self._election
        if msg.term <= e.term:
            out.append(SendDatagram(addr, (self.beat(msg.seq, CHECK_REPLY_RANK),)))

    def beat(self, seq: int, rank: int) -> LeaderBeat:
        e = self._election
        return LeaderBeat(e.term, e.node_id, seq, e.electorate(), rank,
                          e._proofs.sign(beat_statement(e.term, e.node_id, seq, rank)))

    def step_down(self, electorate: int) -> StepDown:
        e = self._election
        return StepDown(e.term, e.node_id, electorate,
                        e._proofs.sign(step_down_statement(e.term, e.node_id)))

    def on_leader_ack(self, msg: LeaderAck, addr: str, now: float, out: list[Effect]) -> None:
        """A follower acks our ``LeaderIs``; signed, it is a ballot for our proof."""
        e = self._election
        if msg.term != e.term:
            return
        if e._proofs.sig is not None:  # a signed ack is a ballot: the proof grows with it
            if msg.leader != e.node_id or msg.source not in e._electorate.voters or \
                    msg.signature is None or not e._proofs.signed_by(
                        msg.source, msg.signature,
                        ballot_statement(e.term, e.node_id, msg.source), addr, now):
                return
            e._proofs.ballots[msg.source] = msg.signature
            e._proofs.acked[msg.source] = None
        self.unacked.pop(msg.source, None)

    def announce_all(self, out: list[Effect]) -> None:
        e = self._election
        for m in e._electorate.others():
            e._tell_leader(m.addr, m.node_id, out)

    def upkeep(self, now: float, out: list[Effect]) -> None:
        e = self._election
        self.canvass(now, out)  # first: whatever follows may return early
        if self.deposed(now, out):
            return
        sees, total = e.present(), e.electorate()
        if 2 * sees <= total:
            if self.minority_since is None:
                self.minority_since = now
            elif now - self.minority_since >= e.config.leader_lease_s:
                # Tell this side, so it reports "no leader" too.
                msg = self.step_down(total)
                for m in e._electorate.others():
                    out.append(SendDatagram(m.addr, (msg,)))
                e._become_follower(now, out, f"this side sees {sees} of {total} fellows")
                e.leader = None
                e._reconsider(now)
                return
        else:
            self.minority_since = None
        if self.hand_over(now, out):
            return
        changed = total != self.last_announced_electorate
        if changed and now - self.last_announce_s < 1.0:
            self.announce_due = self.last_announce_s + 1.0
            changed = False
        if self.unacked and now >= self.retry_at:
            if now >= self.retry_until:
                self.unacked = {}
            else:
                self.retry_at = now + e.tuning.announce_retry_s
                for m in e._electorate.others():
                    if m.node_id in self.unacked:
                        e._tell_leader(m.addr, m.node_id, out)
        if changed or now >= self.next_announce_at:
            self.last_announce_s = now
            self.announce_due = INF
            self.last_announced_electorate = total
            if now >= self.next_announce_at:
                self.next_announce_at = now + e.tuning.announce_interval_s
            self.announce_all(out)
        if now >= self.next_beat_at:
            self.next_beat_at = now + e.config.heartbeat_interval_s
            self.beat_seq = (self.beat_seq + 1) % 2**32
            for rank, m in enumerate(e._electorate.deputies(e.tuning.deputies)):
                out.append(SendDatagram(m.addr, (self.beat(self.beat_seq, rank),)))

    def note_ahead(self, msg: VoteRequest, now: float, out: list[Effect]) -> None:
        """A fellow's own signed vote request says the term it is in (a PreVote's, one
        below). In a later term than ours, it follows no leader of ours; a leader that
        learns so of enough of its side steps down at once (``deposed``)."""
        e = self._election
        term = msg.term - 1 if msg.pre_vote else msg.term
        if term <= e.term or msg.candidate not in e._electorate.voters:
            return
        if len(self.ahead) >= MAX_VOTERS:  # (only fellows of the electorate get in)
            self.ahead = {node: t for node, t in self.ahead.items()
                          if t > e.term and node in e._electorate.voters}
        if self.ahead.get(msg.candidate, -1) < term:
            self.ahead[msg.candidate] = term
        if e.role == LEADER_ROLE and not self.deposed(now, out) and \
                self.stays_ahead(msg.candidate, term, now) and msg.pre_vote and \
                not self.proof_short() and term < e.term + MAX_TERM_STEP:
            # It can never follow us (our term is behind its own) and finds no leader in
            # its own term either, e.g. its candidacy above us failed while the others
            # followed us. We hold a majority: stand again above it.
            self.restand(term, now, out, f"{e._electorate.name(msg.candidate)} stays in a "
                         f"later term {term} with no leader")

    def stays_ahead(self, node: bytes, term: int, now: float) -> bool:
        """Whether ``node`` asks for votes from ``term`` (later than ours) again, a
        candidacy's time (``vote_timeout_s``) or more after it first did: not a deputy
        of a later leader that just died (its fellows in that term will soon be enough
        to depose us, ``deposed``), but a fellow whose rounds keep failing there."""
        e = self._election
        first = self.ahead_asks.get(node)
        if first is None or first[0] != term:
            if len(self.ahead_asks) >= 64:
                del self.ahead_asks[next(iter(self.ahead_asks))]
            self.ahead_asks[node] = (term, now)
            return False
        return now >= first[1] + e.tuning.vote_timeout_s

    def deposed(self, now: float, out: list[Effect]) -> bool:
        """As the leader: whether the present fellows that may still follow us (those
        not shown to be in a later term, us included) are no majority; then step down.
        A leader frozen (a stopped process, a suspended laptop) while the others elected
        a successor that is dead by the time it wakes hears of that term from no one who
        could prove it, and its lease counts fellows present, not following: it would
        lead on with no follower and refuse every PreVote, and where its vote is needed
        for a majority no one would be elected until the dead left the electorate
        (minutes). Stepping down is always safe; a fellow holding the token can show
        only itself in a later term, so it can depose only a leader whose majority
        needs it, as it could by falling silent (the lease)."""
        e = self._election
        if not self.ahead:
            return False
        sees, total = e.present(), e.electorate()
        ahead = sum(1 for node, term in self.ahead.items()
                    if term > e.term and node in e._electorate.voters
                    and e._electorate.is_present(node))
        if ahead == 0 or 2 * (sees - ahead) > total:
            return False
        msg = self.step_down(total)
        for m in e._electorate.others():
            out.append(SendDatagram(m.addr, (msg,)))
        e._become_follower(now, out, f"{ahead} of the {sees} fellows this side sees "
                           f"are in a later term (of {total})")
        e.leader = None
        e._reconsider(now)
        return True

    def hand_over(self, now: float, out: list[Effect]) -> bool:
        """A fellow with a higher leader priority (the wired machine the user prefers) that
        has stayed alive for ``handover_after_s`` gets the leadership: we step down and it,
        first in the succession, is elected at once. A planned change, not a failure."""
        e = self._election
        better = [m for m in e._electorate.members.values()
                  if m.state == "alive" and m.priority > e.priority]
        if not better:
            self.better = None
            return False
        best = min(better, key=lambda m: (-m.priority, m.node_id))
        if self.better is None or self.better[0] != best.node_id:
            self.better = (best.node_id, now)
            return False
        if now < self.better[1] + e.tuning.handover_after_s:  # as next_deadline sums it
            return False
        msg = self.step_down(e.electorate())
        for m in e._electorate.others():
            out.append(SendDatagram(m.addr, (msg,)))
        e._become_follower(now, out, f"handing over to {best.name} "
                           f"(leader priority {best.priority})")
        e.leader = None
        self.better = None
        e._election_at = now + e.tuning.vote_timeout_s + e._rank_delay()
        return True

    def restand(self, seen: int, now: float, out: list[Effect], why: str) -> None:
        """We lead with a proof, and fellows that just met us (a partition healed after
        the electorate's bound) follow a leader of a later term that cannot prove itself
        to us, while they cannot follow us (our term is behind theirs). Stand again,
        above theirs, straight away (our followers know we are alive, so no PreVote):
        our side's votes give us a proof for everyone. At most once per
        ``electorate_dead_after_s``, so a fellow holding the token can make us do it
        rarely and by at most ``MAX_TERM_STEP``."""
        e = self._election
        if now < self.restand_after:
            return
        self.restand_after = now + e.config.electorate_dead_after_s
        e.stats["restands"] = e.stats.get("restands", 0) + 1
        e._become_follower(now, out, f"{why}; standing again above it")
        e.term = seen  # the candidacy runs for the next one
        e.leader = None
        e._candidacy.start(False, now, out)

    def proof_short(self) -> bool:
        """As the leader: our ballots are not (or no longer) a majority of our electorate,
        e.g. elected alone, then the swarm met us."""
        e = self._election
        if e._proofs.sig is None or e.role != LEADER_ROLE:
            return False
        return e._proofs.ours_short()

    def canvass(self, now: float, out: list[Effect]) -> None:
        """A leader short of a proof asks the fellows whose ballot it lacks for their vote
        in its term (Raft's vote: one per fellow and term, so no other leader gets it)."""
        e = self._election
        if not self.proof_short():
            self.canvass_at = INF
            return
        if now < self.canvass_at != INF:
            return
        self.canvass_at = now + e.tuning.announce_retry_s
        request = VoteRequest(e.term, e.node_id, e.priority, e.electorate(), False,
                              e._proofs.sign(request_statement(e.term, e.node_id, False)))
        for m in e._electorate.others():
            if m.node_id not in e._proofs.ballots:
                out.append(SendDatagram(m.addr, (request,)))

    def on_vote_reply(self, msg: VoteReply, addr: str, now: float,
                      out: list[Effect]) -> None:
        """A vote that came after we won (or that we canvassed): a ballot for our proof."""
        e = self._election
        if e._proofs.sig is None or msg.term != e.term or not msg.granted or msg.pre_vote \
                or msg.candidate != e.node_id or msg.voter not in e._electorate.voters \
                or msg.voter in e._proofs.ballots or msg.signature is None:
            return
        if e._proofs.signed_by(msg.voter, msg.signature,
                               ballot_statement(e.term, e.node_id, msg.voter), addr, now):
            e._proofs.ballots[msg.voter] = msg.signature


__all__ = ["Leading"]
