"""Election churn scenarios: whole agents in virtual time, driven through the episodes
that stalled or split the electorate, each returning the figure its test and its
simulation read.

Each builds a ``VirtualSwarm`` (the real agent on the in-memory network, under trio's
mock clock), walks one episode and returns a ``FollowLog`` or the virtual seconds until
the fellows that matter follow one leader. ``tests/test_election_churn.py`` bounds
those seconds; ``simulations/thawed_leader.py`` and ``simulations/fellow_ahead.py`` print
them over many seeds. They live in the package so that a simulation never imports the
tests.

- ``seed_last``: two fellows point at a seed that boots ``delay_s`` after them (the
  field scenario of ``sim/field.py``, in virtual time): no term may have two leaders.
- ``thawed_stale_leader``: the chaos run's stall at 10:02 (issue 20). A leader frozen
  (SIGSTOP) and cut off until the others elect its successor, thawed as that successor
  is killed, one fellow of five already dead: three are up, a majority only with the
  thawed leader's vote.
- ``fellow_a_term_ahead``: the chaos run's stuck fellow at 11:02:56 (issue 20). A fellow
  back from its record of a candidacy it lost a term above the live leader's can follow
  no leader of an earlier term.
- ``fellow_back_after_a_leave``: the short chaos run's slow rejoin (issue 20). The killed
  leader, restarted after a fellow left while it was down, still counts the leaver, so
  the new leader's proof is two of its four.

``formed``, ``led_by`` and ``one_leader_of`` are the prologue and the checks they share:
a swarm following its first leader, and who leads which fellows in which term.
"""

from __future__ import annotations

from dataclasses import replace

import trio

from p2pswarm import effects as fx
from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.sim.virtual import Fellow, VirtualSwarm, wait_until


class FollowLog:
    """Per term, whom the fellows followed (their ``leader`` events)."""

    def __init__(self) -> None:
        self.terms: dict[int, set[bytes]] = {}

    def factory(self, fellow: Fellow, world: AgentWorld) -> Agent:
        return Agent(replace(world, on_event=self.note))

    def note(self, event: fx.Event) -> None:
        if event.kind == fx.LEADER and event.term is not None:
            self.terms.setdefault(event.term, set()).add(event.node_id)

    def two_leaders(self) -> dict[int, set[bytes]]:
        return {t: ids for t, ids in self.terms.items() if len(ids) > 1}


def one_leader(swarm: VirtualSwarm) -> bool:
    """Every live fellow follows one leader, in one term."""
    leaders = swarm.leaders()
    return len(leaders) == 1 and None not in {lid for lid, _ in leaders}


async def seed_last(seed: int, delay_s: float) -> FollowLog:
    """Three fellows: the two that name the seed start first, the seed ``delay_s`` later;
    then one leader for all three, held 20 s. Returns whom each term was followed to."""
    log = FollowLog()
    swarm = VirtualSwarm(3, seed=seed, agent_factory=log.factory)
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        seed_addr = swarm.fellows[0].addr
        await swarm.start(1, seeds=(seed_addr,))
        await swarm.start(2, seeds=(seed_addr,))
        await trio.sleep(delay_s)  # the seed boots last
        await swarm.start(0, seeds=())
        await wait_until(lambda: one_leader(swarm), timeout_s=60)
        await trio.sleep(20)  # and it stays that way
        assert one_leader(swarm)
        nursery.cancel_scope.cancel()
    return log


def led_by(swarm: VirtualSwarm, fellows: list[int]) -> set[tuple[bytes | None, int]]:
    """(leader id, term) as each of ``fellows`` sees it."""
    out = set()
    for i in fellows:
        agent = swarm.fellows[i].agent
        assert agent is not None and agent.election is not None
        status = agent.election.status()
        out.add((status.leader_id, status.term))
    return out


def one_leader_of(swarm: VirtualSwarm, fellows: list[int], above: int = -1) -> bool:
    seen = led_by(swarm, fellows)
    return len(seen) == 1 and all(lid is not None and term > above for lid, term in seen)


async def formed(swarm: VirtualSwarm) -> tuple[list[int], list[bytes], tuple[bytes, int]]:
    """Every fellow of ``swarm`` started and following one leader: their indexes, their
    node ids, and (the leader's id, its term)."""
    await swarm.start_all()
    everyone = list(range(len(swarm.fellows)))
    await wait_until(lambda: one_leader_of(swarm, everyone), timeout_s=60)
    ((leader, term),) = led_by(swarm, everyone)
    assert leader is not None  # one_leader_of saw one
    return everyone, [f.identity.node_id for f in swarm.fellows], (leader, term)


async def thawed_stale_leader(seed: int, timeout_s: float = 60.0) -> float:
    """The chaos run's stall (10:02, issue 20), in virtual time. Five fellows, one of them
    dead (it still counts in the electorate). The leader is frozen (SIGSTOP) and, cut off
    meanwhile, hears nothing of the others declaring it dead and electing a successor of
    the next term; it thaws still leading its own term just as that successor is killed.
    Three of five are up, a majority, but only with the thawed fellow's vote. Returns
    the virtual seconds from the kill until all three follow one leader of a later term."""
    swarm = VirtualSwarm(5, seed=seed)
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        everyone, ids, (first_id, first_term) = await formed(swarm)
        stale = ids.index(first_id)
        dead = next(i for i in everyone if i != stale)
        swarm.crash(dead)
        await wait_until(lambda: swarm.states_seen_by_all(dead) == {"dead"}, timeout_s=60)
        others = [i for i in everyone if i not in (stale, dead)]
        swarm.freeze(stale)
        swarm.net.partition([swarm.fellows[stale].addr],
                            [swarm.fellows[i].addr for i in others])
        await wait_until(lambda: one_leader_of(swarm, others, above=first_term)
                         and swarm.states_seen_by_all(stale) == {"dead"}, timeout_s=60)
        ((next_id, next_term),) = led_by(swarm, others)
        assert next_id is not None  # one_leader_of saw one
        swarm.net.heal()
        swarm.thaw(stale)
        swarm.crash(ids.index(next_id))
        thawed = swarm.fellows[stale].agent
        assert thawed is not None and thawed.election is not None
        assert thawed.election.role == "leader" and thawed.election.term == first_term
        up = [i for i in everyone if i not in (dead, ids.index(next_id))]
        took = await wait_until(lambda: one_leader_of(swarm, up, above=next_term),
                                timeout_s=timeout_s)
        nursery.cancel_scope.cancel()
    return took


async def fellow_a_term_ahead(seed: int, timeout_s: float = 60.0) -> float:
    """The chaos run's stuck fellow (11:02:56, issue 20): f7 stood for term 9 above f5's
    term 8 and lost (the others followed f5, alive, and refused it); at term 9 it could
    follow no one, f5's beats and proofs being of an earlier term, for two minutes. Here
    a fellow of five comes back from its record of such a lost candidacy (a term above
    the leader's, its vote its own): the same state. Returns the virtual seconds from
    its restart until all five follow one leader; checks that it is the same leader, in
    a term above the lost candidacy's, for which the fellow voted."""
    swarm = VirtualSwarm(5, seed=seed)
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        everyone, ids, (leader, term) = await formed(swarm)
        ahead = next(i for i in everyone if ids[i] != leader)
        agent = swarm.fellows[ahead].agent
        assert agent is not None and agent.election is not None
        electorate = agent.election.persistent_state()[2]
        swarm.crash(ahead)
        swarm.fellows[ahead].votes.keep(term + 1, ids[ahead], electorate)
        restarted = await swarm.start(ahead, seeds=tuple(
            f.addr for f in swarm.fellows if f.index != ahead))
        took = await wait_until(lambda: one_leader_of(swarm, everyone), timeout_s=timeout_s)
        assert led_by(swarm, everyone) == {(leader, term + 2)}
        assert restarted.election is not None  # it voted for the leader, in a new term
        assert (restarted.election.voted_term, restarted.election.voted_for) == \
            (term + 2, leader)
        nursery.cancel_scope.cancel()
    return took


async def fellow_back_after_a_leave(seed: int, timeout_s: float = 60.0) -> float:
    """The short chaos run's slow rejoin (issue 20): the leader of four is killed, the
    other three elect one of them, and one of those leaves while the killed fellow is
    down. Restarted from its record, it still counts the leaver (its membership is not
    told of the leave: a newcomer hears only of live fellows), so the leader's proof, the
    ballots of the two fellows still here, is two of its four. Returns the virtual
    seconds from its restart until it follows that leader."""
    swarm = VirtualSwarm(4, seed=seed)
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        everyone, ids, (first, term) = await formed(swarm)
        killed = ids.index(first)
        swarm.crash(killed)
        others = [i for i in everyone if i != killed]
        await wait_until(lambda: one_leader_of(swarm, others, above=term), timeout_s=60)
        ((leader, _),) = led_by(swarm, others)
        leaver = next(i for i in others if ids[i] != leader)
        await swarm.leave(leaver)
        await wait_until(lambda: swarm.states_seen_by_all(leaver) == {"left"}, timeout_s=30)
        up = [i for i in others if i != leaver]
        restarted = await swarm.start(killed, seeds=tuple(swarm.fellows[i].addr for i in up))
        took = await wait_until(lambda: one_leader_of(swarm, [*up, killed]),
                                timeout_s=timeout_s)
        assert restarted.election is not None and restarted.election.electorate() == 4
        nursery.cancel_scope.cancel()
    return took
