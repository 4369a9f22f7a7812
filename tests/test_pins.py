"""Pins that noise cannot break: ``load --plan-id`` right after ``plan`` on identical idle
fellows whose free memory moves, in virtual time, with real agents and real loads (every
round of prepare, load and start; the stages themselves built on paper, see
``tests.paper_runtime``).

Free memory that moves within the plan's own headroom must never refuse a pinned plan;
a real change (a fellow gone, a card filled past its stage's claim) still must, as
``plan-changed`` with what changed.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import trio

from p2pswarm.agent.world import Services
from p2pswarm.config import InventoryConfig, local
from p2pswarm.errors import PlanChanged
from p2pswarm.sim.virtual import VirtualSwarm, cpu_card, wait_until
from p2pswarm.wire.loads import UnloadAsk, Unloaded
from tests.cpu_swarm import start_cpu_swarm
from tests.paper_runtime import PaperRuntime
from tests.serving_swarm import nothing_held, request

TOTAL_GB = 16.0
IDLE_FREE_GB = 7.0  # an idle laptop: the system, a browser and an editor take the rest
# a request whose KV cache makes free memory matter (rooms are not all capped by what the
# whole model would claim), so that noise does move the plan the leader would make now
HEAVY = {"sequences": 256, "context": 2048}


# every 64 MiB move is gossiped at the next read (the old rule): the leader's view
# then moves with the noise, which is what the pins must survive
NOISY = InventoryConfig(refresh_interval_s=1.0, gossip_step_bytes=64 * 2**20,
                        gossip_step_fraction=0.0, gossip_settle_reads=1)


async def start_swarm(nursery: trio.Nursery, seed: int) -> VirtualSwarm:
    return await start_cpu_swarm(nursery, 4, seed, config=replace(local(), inventory=NOISY),
                                 services=Services(stage_runtime=PaperRuntime()))


def set_free(swarm: VirtualSwarm, i: int, free_gb: float) -> None:
    fellow = swarm.fellows[i]
    fellow.cards.cards = (cpu_card(TOTAL_GB, free_gb=free_gb, name=f"{fellow.name} CPU"),)


def leader_view(swarm: VirtualSwarm) -> dict[str, int]:
    """Free bytes per fellow as the leader sees them."""
    (leader,) = [a for a in swarm.live() if a.leadership.is_leader()]
    return {f.name: c.free_bytes for f in leader.planning.view().fellows for c in f.cards}


async def test_fifty_pins_survive_free_memory_noise(autojump_clock) -> None:
    rng = random.Random(5)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, seed=31)
        free = [IDLE_FREE_GB] * 4
        for i in range(4):
            set_free(swarm, i, free[i])
        asker = swarm.live()[1]
        refusals: list[str] = []
        views_moved = 0
        plans_moved = {"light": 0, "heavy": 0}
        for pair in range(50):
            # light pairs alternate three stages and the planner's choice (one card holds
            # it); heavy ones fill a good part of each card
            kind = ("light", "light", "heavy")[pair % 3]
            message = request(**HEAVY) if kind == "heavy" else \
                request() if pair % 2 else request(stages=None)
            plan = await asker.planning.ask_plan(message)
            before = leader_view(swarm)
            for i in range(4):  # each fellow's free memory moves by up to 1 GB
                free[i] = min(IDLE_FREE_GB + 1.5, max(IDLE_FREE_GB - 1.5,
                                                      free[i] + rng.uniform(-1.0, 1.0)))
                set_free(swarm, i, free[i])
            await trio.sleep(3.0)  # an inventory read, and gossip to the leader
            views_moved += leader_view(swarm) != before
            replanned = await asker.planning.ask_plan(message)
            plans_moved[kind] += replanned["plan_id"] != plan["plan_id"]
            try:
                loaded = await asker.serving.load(message, plan_id=plan["plan_id"])
            except PlanChanged as exc:
                refusals.append(f"pair {pair}: {exc}")
                continue
            assert loaded["plan_id"] == plan["plan_id"]
            await asker.leadership.ask(UnloadAsk(plan["plan_id"]), Unloaded)
            await wait_until(lambda: nothing_held(swarm), timeout_s=10)
        assert refusals == []
        assert views_moved >= 10  # the noise did reach the leader's view
        assert plans_moved["light"] == 0  # equal cards kept their order: the same plan
        # where it did move the plan the leader would make now, the pin still held
        assert plans_moved["heavy"] > 0
        nursery.cancel_scope.cancel()


async def pinned_refusal(swarm: VirtualSwarm, message: dict[str, Any],
                         plan_id: str) -> PlanChanged:
    with pytest.raises(PlanChanged) as refused:
        await swarm.live()[0].serving.load(message, plan_id=plan_id)
    error = refused.value
    assert error.code == 409 and error.expected_plan_id == plan_id
    assert error.new_plan_id != plan_id and error.new_plan["plan_id"] == error.new_plan_id
    assert nothing_held(swarm)
    return error


def used_fellows(plan: dict[str, Any], but: str) -> list[int]:
    return sorted(int(s["fellow"][1:]) for s in plan["stages"] if s["fellow"] != but)


async def test_a_card_filled_past_its_claim_refuses_the_pin(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, seed=32)
        plan = await swarm.live()[0].planning.ask_plan(request())
        i = used_fellows(plan, but=swarm.live()[0].name)[0]
        name = swarm.fellows[i].name
        set_free(swarm, i, 0.2)  # its stage claims about 0.29 GB
        await wait_until(lambda: leader_view(swarm)[name] == 200_000_000, timeout_s=30)
        error = await pinned_refusal(swarm, request(), plan["plan_id"])
        assert f"{name}'s CPU ({name} CPU) now has 0.2 GB free, was 16.0 GB" in error.changes
        nursery.cancel_scope.cancel()


async def test_a_fellow_gone_refuses_the_pin(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, seed=33)
        asker = swarm.live()[0]
        plan = await asker.planning.ask_plan(request())
        leader_name = next(a.name for a in swarm.live() if a.leadership.is_leader())
        i = next(j for j in used_fellows(plan, but=asker.name)
                 if swarm.fellows[j].name != leader_name)
        name = swarm.fellows[i].name
        swarm.crash(i)
        await wait_until(lambda: swarm.states_seen_by_all(i) == {"dead"}, timeout_s=60)
        error = await pinned_refusal(swarm, request(), plan["plan_id"])
        assert f"fellow {name} is not connected" in error.changes
        nursery.cancel_scope.cancel()
