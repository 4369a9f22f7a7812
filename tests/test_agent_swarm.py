"""Membership and leadership through real agents on MemoryNetwork, in virtual time."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2pswarm.sim.election_churn import one_leader
from p2pswarm.sim.virtual import VirtualSwarm, cpu_card, wait_until
from tests.swarm_start import formed


async def test_five_fellows_form_elect_and_survive_a_crash(autojump_clock) -> None:
    swarm = VirtualSwarm(5, seed=7)
    async with trio.open_nursery() as nursery:
        formed_s = await formed(nursery, swarm, timeout_s=20)
        assert formed_s < 10
        await wait_until(lambda: one_leader(swarm), timeout_s=20)
        ((leader_id, term),) = swarm.leaders()

        # a follower crashes: every live fellow declares it dead; the leader stays
        victim = next(i for i, f in enumerate(swarm.fellows)
                      if f.identity.node_id != leader_id)
        swarm.crash(victim)
        dead_s = await wait_until(lambda: swarm.states_seen_by_all(victim) == {"dead"},
                                  timeout_s=30)
        assert dead_s < 10
        assert swarm.leaders() == {(leader_id, term)}
        await trio.sleep(2.0)  # status rows say how long ago (real mode dates changes so)
        victim_id = swarm.fellows[victim].identity.node_id.hex()
        for agent in swarm.live():
            (row,) = [r for r in agent.status()["members"] if r["id"] == victim_id]
            assert row["state"] == "dead" and 2.0 <= row["in_state_s"] <= 2.0 + dead_s

        # the leader crashes: the others agree on a new one, in a later term
        old = next(i for i, f in enumerate(swarm.fellows) if f.identity.node_id == leader_id)
        swarm.crash(old)
        failover_s = await wait_until(
            lambda: len(swarm.leaders()) == 1
            and next(iter(swarm.leaders()))[0] not in (None, leader_id), timeout_s=30)
        assert failover_s < 10
        ((_, new_term),) = swarm.leaders()
        assert new_term > term

        # the first victim restarts: it rejoins with a higher incarnation
        alive_seed = swarm.live()[0].addr
        agent = await swarm.start(victim, seeds=(alive_seed,))
        await wait_until(lambda: swarm.states_seen_by_all(victim) == {"alive"}, timeout_s=30)
        seen = swarm.live()[0].membership.member(agent.node_id)
        assert seen is not None and seen.incarnation > 0
        nursery.cancel_scope.cancel()


async def test_leaving_is_left_not_dead(autojump_clock) -> None:
    swarm = VirtualSwarm(4, seed=8)
    async with trio.open_nursery() as nursery:
        await formed(nursery, swarm, timeout_s=20)
        await swarm.leave(3)
        await wait_until(lambda: swarm.states_seen_by_all(3) == {"left"}, timeout_s=10)
        await trio.sleep(30)
        assert swarm.states_seen_by_all(3) <= {"left", "unknown"}  # reaped later, never dead
        nursery.cancel_scope.cancel()


async def test_minority_side_of_a_partition_elects_no_leader(autojump_clock) -> None:
    swarm = VirtualSwarm(5, seed=9)
    async with trio.open_nursery() as nursery:
        await formed(nursery, swarm, timeout_s=20)
        await wait_until(lambda: one_leader(swarm), timeout_s=20)
        ((leader_id, _),) = swarm.leaders()
        leader = next(i for i, f in enumerate(swarm.fellows) if f.identity.node_id == leader_id)
        minority = [leader, (leader + 1) % 5]  # the leader lands on the small side
        majority = [i for i in range(5) if i not in minority]
        swarm.net.partition([swarm.fellows[i].addr for i in minority],
                            [swarm.fellows[i].addr for i in majority])
        await trio.sleep(60)
        small = [swarm.fellows[i].agent for i in minority]
        big = [swarm.fellows[i].agent for i in majority]
        assert all(a.election.status().leader_id is None for a in small)
        assert "no leader: this side sees 2 of 5 fellows" in {
            a.status()["leader_note"] for a in small}
        big_leaders = {(a.election.status().leader_id, a.election.status().term) for a in big}
        assert len(big_leaders) == 1 and None not in {lid for lid, _ in big_leaders}
        swarm.net.heal()
        await wait_until(lambda: swarm.converged() and len(swarm.leaders()) == 1, timeout_s=60)
        nursery.cancel_scope.cancel()


async def test_a_changed_inventory_reaches_every_fellow(autojump_clock) -> None:
    swarm = VirtualSwarm(4, seed=10)
    async with trio.open_nursery() as nursery:
        await formed(nursery, swarm, timeout_s=20)
        target = swarm.fellows[2]
        target.cards.cards = (cpu_card(16.0, free_gb=3.0),)

        def everyone_sees_it() -> bool:
            for agent in swarm.live():
                member = agent.membership.member(target.identity.node_id)
                cards = agent.fellow_says(member).cards if member else ()
                if not cards or cards[0].free_bytes != 3_000_000_000:
                    return False
            return True

        await wait_until(everyone_sees_it, timeout_s=30)
        nursery.cancel_scope.cancel()


async def test_any_fellow_plans_through_the_leader(autojump_clock) -> None:
    from p2pswarm.planner import REFERENCE_CONFIGS

    swarm = VirtualSwarm(3, seed=11)
    for fellow in swarm.fellows:  # 16 GB of weights on 8 GB machines: all three are needed
        fellow.cards.cards = (cpu_card(8.0, name=f"{fellow.name} CPU"),)
    async with trio.open_nursery() as nursery:
        await formed(nursery, swarm, timeout_s=30,
                     until=lambda: swarm.converged() and one_leader(swarm))
        ((leader_id, _),) = swarm.leaders()
        follower = next(a for a in swarm.live() if a.node_id != leader_id)
        request = {"model": {"name": "llama-3-8b", "config": REFERENCE_CONFIGS["llama-3-8b"]},
                   "context": 2048, "sequences": 1, "weights_dtype": "f16"}
        plan = await follower.planning.ask_plan(request)
        same = await swarm.live()[0].planning.ask_plan(request)
        assert plan["plan_id"] == same["plan_id"]
        assert {c["fellow"] for c in plan["cards"] if c["used"]} == {"f000", "f001", "f002"}
        # a dead fellow's cards are left out with the reason
        swarm.crash(2)
        await wait_until(lambda: swarm.states_seen_by_all(2) == {"dead"}, timeout_s=30)
        again = await follower.planning.ask_plan(request)
        left_out = [c for c in again["cards"] if c["fellow"] == "f002"]
        assert left_out and left_out[0]["reason"] == "fellow not connected"
        assert again["plan_id"] != plan["plan_id"] and not again["fits"]
        nursery.cancel_scope.cancel()


async def test_a_restarted_fellow_keeps_its_term_and_vote(autojump_clock) -> None:
    # one vote per term holds across a crash only if the vote is remembered
    swarm = VirtualSwarm(5, seed=11)
    async with trio.open_nursery() as nursery:
        await formed(nursery, swarm, timeout_s=30, until=lambda: one_leader(swarm))
        ((leader_id, term),) = swarm.leaders()
        voter = next(i for i, f in enumerate(swarm.fellows)
                     if f.identity.node_id != leader_id
                     and f.agent.election.persistent_state()[:2] == (term, leader_id))
        swarm.crash(voter)
        await trio.sleep(1)
        agent = await swarm.start(voter, seeds=(swarm.live()[0].addr,))
        fellows = tuple(sorted(f.identity.node_id for f in swarm.fellows))
        assert agent.election.persistent_state() == (term, leader_id, fellows)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("found_dead", [True, False])
async def test_a_restarted_fellow_s_fresh_metadata_replaces_its_old(autojump_clock,
                                                                    found_dead: bool) -> None:
    # it starts again at a low metadata version: what its fellows hold from its last life,
    # at a version as high, must not keep winning (the planner would plan with old cards)
    swarm = VirtualSwarm(4, seed=12)
    async with trio.open_nursery() as nursery:
        await formed(nursery, swarm, timeout_s=20)
        victim = swarm.fellows[3]
        victim_id = victim.identity.node_id

        def cards_seen() -> set[float]:
            seen = set()
            for agent in swarm.live():
                m = agent.membership.member(victim_id) if agent.node_id != victim_id \
                    and agent.membership is not None else None
                if m is not None:
                    cards = agent.fellow_says(m).cards
                    seen.add(cards[0].total_bytes / 1e9 if cards else 0.0)
            return seen

        await wait_until(lambda: cards_seen() == {16.0}, timeout_s=20)
        assert victim.agent is not None and victim.agent.membership is not None
        assert victim.agent.membership.meta_version == 1  # all it published in its life
        swarm.crash(3)
        if found_dead:  # else it is back before anybody noticed it was gone
            await wait_until(lambda: swarm.states_seen_by_all(3) == {"dead"}, timeout_s=30)
        victim.cards.cards = (cpu_card(8.0),)  # its host lost half its memory meanwhile
        await swarm.start(3, seeds=(swarm.fellows[0].addr,))
        fresh_s = await wait_until(lambda: cards_seen() == {8.0}, timeout_s=30)
        assert fresh_s < 5
        nursery.cancel_scope.cancel()
