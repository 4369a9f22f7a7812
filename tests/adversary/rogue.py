"""A rogue fellow: it holds the join token and has its own identity, and says what it likes.

Built from the project's own pieces: it runs a real agent (so it is a member like any
other: it answers probes, is counted in the electorate, votes), and speaks through that
agent's sealer and secure streams, so every datagram it sends passes the swarm key and
every stream its handshake. What it cannot do is sign as another fellow: it signs with
its own identity, or forges with garbage.

Use it in a ``VirtualSwarm`` (virtual time, MemoryNetwork)::

    swarm = VirtualSwarm(5, seed=3, agent_factory=rogue_factory(4))
    ...
    rogue = Rogue(swarm, 4)
    rogue.announce_itself(term=rogue.term + 1)
    reply = await rogue.order(swarm.fellows[0].addr, StageRelease("0" * 16, rogue.term))

``rogue_factory(i)`` builds fellow ``i``'s agent with an election that votes but never
runs (so it never leads honestly and every leadership it claims is a forgery); all other
fellows get plain agents.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from p2pswarm import wire
from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.election import Election
from p2pswarm.security.ballots import (
    ballot_statement,
    beat_statement,
    request_statement,
    step_down_statement,
)
from p2pswarm.sim.virtual import Fellow, VirtualSwarm
from p2pswarm.wire.gossip import (
    Ballot,
    LeaderBeat,
    LeaderIs,
    LeaderProof,
    StepDown,
    VoteReply,
    VoteRequest,
)

MAX_TERM_U64 = 2**64 - 1


class Bystander(Election):
    """An election that votes and follows but never runs for leader."""

    def _may_elect(self) -> bool:
        return False


def rogue_factory(rogue_index: int) -> Any:
    """An ``agent_factory`` for ``VirtualSwarm``: fellow ``rogue_index`` a bystander."""

    def build(fellow: Fellow, world: AgentWorld) -> Agent:
        if fellow.index == rogue_index:
            world = replace(world, election=Bystander, leader_priority=-(2**31))
        return Agent(world)

    return build


class Rogue:
    """Fellow ``index`` of ``swarm``, turned hostile. Methods send at once (datagrams) or
    return the victim's reply (streams)."""

    def __init__(self, swarm: VirtualSwarm, index: int) -> None:
        self.swarm = swarm
        self.index = index

    # --- who we are and whom we attack -------------------------------------------------

    @property
    def agent(self) -> Agent:
        agent = self.swarm.fellows[self.index].agent
        assert agent is not None, "start the rogue's agent first"
        return agent

    @property
    def node_id(self) -> bytes:
        return self.agent.node_id

    @property
    def term(self) -> int:
        """The highest term any honest fellow is at."""
        return max(a.election.term for a in self.honest() if a.election is not None)

    def honest(self) -> list[Agent]:
        return [a for a in self.swarm.live() if a.node_id != self.node_id]

    def honest_ids(self) -> list[bytes]:
        return [a.node_id for a in self.honest()]

    def sign(self, statement: bytes) -> bytes:
        return self.agent.identity.sign(statement)

    # --- sending -----------------------------------------------------------------------

    def send(self, addr: str, *messages: Any) -> None:
        """Sealed datagram(s) under the swarm key, from the rogue's own sender id."""
        for msg in messages:
            self.agent.post(addr, (msg,))

    def to_all(self, *messages: Any) -> None:
        for victim in self.honest():
            self.send(victim.addr, *messages)

    async def order(self, addr: str, message: Any) -> Any:
        """One request over a secure stream (the handshake proves the rogue's identity,
        and only that); the victim's reply."""
        return await self.agent.call(addr, message)

    async def push(self, addr: str, *frames: Any) -> Any:
        """Several messages on one secure stream, then the victim's answer."""
        async with await self.agent.open_secure(addr) as stream:
            for frame in frames:
                await stream.send_frame(wire.encode(frame))
            reply = await stream.receive_frame()
        (answer,) = wire.decode(reply, max_bytes=1 << 20)
        return answer

    # --- attacks on the election --------------------------------------------------------

    def own_ballot(self, term: int) -> Ballot:
        return Ballot(self.node_id, self.sign(ballot_statement(term, self.node_id,
                                                               self.node_id)))

    def announce_itself(self, term: int, electorate: int = 1) -> None:
        """LeaderIs, beats and a 'proof' of its own ballot alone, for ``term``."""
        me = self.node_id
        for rank in range(3):
            beat = LeaderBeat(term, me, rank, electorate, rank,
                              self.sign(beat_statement(term, me, rank, rank)))
            self.to_all(beat)
        self.to_all(LeaderIs(term, me, electorate),
                    LeaderProof(term, me, (self.own_ballot(term),)))

    def forged_ballots(self, term: int, leader: bytes) -> tuple[Ballot, ...]:
        """Ballots 'from' every honest fellow for ``leader``: signed with the rogue's key
        or random bytes, since it has no other."""
        out = []
        for i, voter in enumerate(self.honest_ids()):
            sig = self.sign(ballot_statement(term, leader, voter)) if i % 2 else os.urandom(64)
            out.append(Ballot(voter, sig))
        return tuple(out)

    def claim_with_forged_proof(self, term: int) -> None:
        me = self.node_id
        self.to_all(LeaderIs(term, me, 1),
                    LeaderProof(term, me, (self.own_ballot(term),
                                           *self.forged_ballots(term, me)[:11])))

    def forge_votes_for(self, candidate: Agent, term: int) -> None:
        """Granted votes 'from' every other honest fellow, sent to ``candidate``."""
        for voter, ballot in zip(self.honest_ids(), self.forged_ballots(term,
                                                                       candidate.node_id)):
            if voter == candidate.node_id:
                continue
            for pre in (True, False):
                self.send(candidate.addr, VoteReply(term, voter, True, pre, 1, "",
                                                    candidate.node_id, ballot.signature))

    def push_term(self, term: int, *, pre_vote: bool = False) -> None:
        """A vote request for ``term`` in its own name (validly signed)."""
        me = self.node_id
        self.to_all(VoteRequest(term, me, 2**31 - 1, 1, pre_vote,
                                self.sign(request_statement(term, me, pre_vote))))

    def depose(self, leader: bytes, term: int) -> None:
        """A step-down 'from' the honest leader (signed with the rogue's key)."""
        self.to_all(StepDown(term, leader, 1, self.sign(step_down_statement(term, leader))))


__all__ = ["MAX_TERM_U64", "Bystander", "Rogue", "rogue_factory"]
