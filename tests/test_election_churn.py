"""The electorate under churn, on whole agents in virtual time: the seed started last, a
leave then a leader crash, a swarm restarted from its election records. The scenarios
that stalled the chaos runs (issue 20) are built in ``p2pswarm.sim.election_churn``."""

from __future__ import annotations

import trio

from p2pswarm.sim.election_churn import (
    fellow_a_term_ahead,
    fellow_back_after_a_leave,
    one_leader,
    seed_last,
    thawed_stale_leader,
)
from p2pswarm.sim.virtual import VirtualSwarm, wait_until
from tests.swarm_start import formed


async def test_a_seed_started_last_never_gives_a_term_two_leaders(autojump_clock) -> None:
    for seed in range(1, 21):
        log = await seed_last(seed, delay_s=0.5 + seed)
        assert log.two_leaders() == {}, seed


async def test_a_leave_then_a_leader_crash_elects_and_a_restart_elects_again(
        autojump_clock) -> None:
    swarm = VirtualSwarm(4, seed=5)
    async with trio.open_nursery() as nursery:
        await formed(nursery, swarm, timeout_s=60, until=lambda: one_leader(swarm))
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
        await formed(nursery, swarm, timeout_s=60, until=lambda: one_leader(swarm))
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


async def test_a_leader_thawed_after_its_successor_died_gives_way_within_seconds(
        autojump_clock) -> None:
    """Nobody could prove the later term to the thawed leader (its winner is dead), and
    its vote was needed: it refused every PreVote as the leader, and no one was elected
    until the dead fellows left the electorate, 240 s later. The candidates' own signed
    requests show it that the fellows of its side are in a later term: it steps down."""
    for seed in (1, 2, 3):
        took = await thawed_stale_leader(seed)
        assert took < 5.0, (seed, took)


async def test_a_fellow_in_a_later_term_than_the_live_leader_follows_it_within_seconds(
        autojump_clock) -> None:
    """Its PreVotes, round after round, show the leader its later term: the leader,
    followed by the others, stands again above it, and all five follow it (before:
    never, while the leader lived)."""
    for seed in (1, 2, 3):
        took = await fellow_a_term_ahead(seed)
        assert took < 20.0, (seed, took)


async def test_a_fellow_restarted_after_a_leave_it_missed_follows_the_leader_at_once(
        autojump_clock) -> None:
    """Before, it followed no one until the leaver left its electorate, 240 s later (or
    came back): its own vote now completes the proof it checks."""
    for seed in (1, 2, 3):
        took = await fellow_back_after_a_leave(seed)
        assert took < 2.0, (seed, took)
