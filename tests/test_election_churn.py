"""The electorate under churn, on whole agents in virtual time: the seed started last, a
leave then a leader crash, a swarm restarted from its election records."""

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
    leaders = swarm.leaders()
    return len(leaders) == 1 and None not in {lid for lid, _ in leaders}


async def seed_last(seed: int, delay_s: float) -> FollowLog:
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


async def test_a_seed_started_last_never_gives_a_term_two_leaders(autojump_clock) -> None:
    for seed in range(1, 21):
        log = await seed_last(seed, delay_s=0.5 + seed)
        assert log.two_leaders() == {}, seed


async def test_a_leave_then_a_leader_crash_elects_and_a_restart_elects_again(
        autojump_clock) -> None:
    swarm = VirtualSwarm(4, seed=5)
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        await swarm.start_all()
        await wait_until(lambda: one_leader(swarm), timeout_s=60)
        ((leader_id, term),) = swarm.leaders()
        ids = [f.identity.node_id for f in swarm.fellows]
        leaver = next(i for i, node in enumerate(ids) if node != leader_id)
        await swarm.leave(leaver)
        swarm.crash(ids.index(leader_id))
        took = await wait_until(lambda: one_leader(swarm) and
                                next(iter(swarm.leaders()))[1] > term, timeout_s=30)
        assert took <= 10.0
        for agent in swarm.live():
            assert agent.election is not None and agent.election.electorate() == 3
        for i in range(4):  # a power cut: everyone down, then back from its records
            if swarm.fellows[i].agent is not None:
                swarm.crash(i)
        await trio.sleep(5)
        for i in range(4):
            await swarm.start(i, seeds=tuple(f.addr for f in swarm.fellows if f.index != i))
        await wait_until(lambda: one_leader(swarm), timeout_s=30)
        nursery.cancel_scope.cancel()


async def test_a_partition_longer_than_the_bound_heals_to_one_proven_leader(
        autojump_clock) -> None:
    """The leader's side keeps its term; the other side, having dropped it after 240 s,
    elects one of a later term whose proof (2 of 5 once they meet) the leader's side
    cannot follow. The leader stands again above it, and everyone follows."""
    swarm = VirtualSwarm(5, seed=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.run)
        await swarm.start_all()
        await wait_until(lambda: one_leader(swarm), timeout_s=60)
        ((leader, term),) = swarm.leaders()
        ids = [f.identity.node_id for f in swarm.fellows]
        small = [i for i in range(5) if ids[i] != leader][:2]
        swarm.net.partition([swarm.fellows[i].addr for i in small],
                            [f.addr for f in swarm.fellows if f.index not in small])
        await trio.sleep(300)
        assert len(swarm.leaders()) == 2  # each side its own, the small one later
        swarm.net.heal()
        took = await wait_until(lambda: one_leader(swarm), timeout_s=60)
        assert took < 10.0
        ((now_leader, now_term),) = swarm.leaders()
        assert now_term > term + 1
        nursery.cancel_scope.cancel()
