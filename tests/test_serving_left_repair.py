"""A stage's fellow that leaves gracefully (SIGTERM: an upgrade's restart) in virtual
time: membership marks it ``left`` at once, and a generation through its stage waits for
the leader to move the stage, as for a dead fellow, then resumes with the undisturbed
run's greedy tokens; a new generation asked while the stage is still on the departed
fellow waits for the move too, rather than failing at once. A leader that leaves while
hosting a stage gives way to a new one that adopts the load before it heals it: the
driver asks again while it is refused."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from p2pswarm.runtime import Sampler
from p2pswarm.sim.virtual import VirtualSwarm
from tests.serving_swarm import MODEL, PROMPT, reference, request, short_grace, start_swarm

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def _sigterm(swarm: VirtualSwarm, i: int) -> None:
    """Fellow ``i`` stops as on SIGTERM: it leaves gracefully, then its process ends."""
    await swarm.leave(i)
    swarm.crash(i)


def _index(swarm: VirtualSwarm, name: str) -> int:
    return next(i for i, f in enumerate(swarm.fellows) if f.name == name)


async def test_a_generation_through_a_fellow_that_left_resumes_after_the_move(
        autojump_clock, tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=61, n=4)
        ((leader_id, _),) = swarm.leaders()
        driver = next(a for a in swarm.live() if a.node_id == leader_id)
        message = request(exclude=[f"{f.name}:cpu" for f in swarm.fellows
                                   if f.identity.node_id != leader_id][-1:])
        plan = await driver.planning.ask_plan(message)
        await driver.serving.load(message, plan_id=plan["plan_id"])
        short_grace(swarm)
        local = reference(plan, MODEL).generate(PROMPT[:30], 12, Sampler.greedy(),
                                                stop_token_ids=())
        staged = [s["fellow"] for s in plan["stages"]]
        name = next(n for n in staged if n != driver.name)
        stage = staged.index(name)
        victim = _index(swarm, name)
        spare = next(f.name for f in swarm.fellows if f.name not in staged)
        seen: list[int] = []

        def leave_after_five(token: int, text: str) -> None:
            seen.append(token)
            if len(seen) == 5:
                nursery.start_soon(_sigterm, swarm, victim)

        result = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                               stop_token_ids=(), on_token=leave_after_five)
        assert result.token_ids == local.token_ids and tuple(seen) == local.token_ids
        assert result.resumes >= 1 and result.route[stage]["fellow"] == spare
        assert swarm.states_seen_by_all(victim) == {"left"}
        (record,) = await driver.serving.list_loads()
        assert [(m["stage"], m["from"], m["to"]) for m in record["moves"]] == [
            (stage, name, spare)]
        nursery.cancel_scope.cancel()


async def test_a_generation_asked_while_a_stage_fellow_is_left_waits_for_the_move(
        autojump_clock, tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=62, n=4)
        ((leader_id, _),) = swarm.leaders()
        driver = next(a for a in swarm.live() if a.node_id == leader_id)
        message = request(exclude=[f"{f.name}:cpu" for f in swarm.fellows
                                   if f.identity.node_id != leader_id][-1:])
        plan = await driver.planning.ask_plan(message)
        await driver.serving.load(message, plan_id=plan["plan_id"])
        short_grace(swarm)
        local = reference(plan, MODEL).generate(PROMPT[:30], 12, Sampler.greedy(),
                                                stop_token_ids=())
        staged = [s["fellow"] for s in plan["stages"]]
        name = next(n for n in staged if n != driver.name)
        victim = _index(swarm, name)
        await _sigterm(swarm, victim)
        # the load now shows the stage on a departed fellow, until the leader moves it
        (record,) = await driver.serving.list_loads()
        assert record["stages"][staged.index(name)]["state"] == "left"
        began = trio.current_time()
        result = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                               stop_token_ids=())
        assert result.token_ids == local.token_ids and result.resumes == 0
        assert name not in [r["fellow"] for r in result.route]
        assert trio.current_time() - began < driver.serving.driver.stage_wait_s
        nursery.cancel_scope.cancel()


async def test_a_leader_hosting_a_stage_leaves_and_the_next_one_adopts_then_heals(
        autojump_clock, tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=63, n=4)
        ((leader_id, _),) = swarm.leaders()
        leader_at = next(i for i, f in enumerate(swarm.fellows)
                         if f.identity.node_id == leader_id)
        leader = swarm.fellows[leader_at].agent
        assert leader is not None
        others = [f.name for f in swarm.fellows if f.identity.node_id != leader_id]
        message = request(exclude=[f"{others[-1]}:cpu"])
        plan = await leader.planning.ask_plan(message)
        await leader.serving.load(message, plan_id=plan["plan_id"])
        staged = [s["fellow"] for s in plan["stages"]]
        assert leader.name in staged
        stage = staged.index(leader.name)
        driver = swarm.fellows[_index(swarm, next(n for n in staged
                                                  if n != leader.name))].agent
        assert driver is not None
        short_grace(swarm)
        spare = others[-1]
        local = reference(plan, MODEL).generate(PROMPT[:30], 12, Sampler.greedy(),
                                                stop_token_ids=())
        seen: list[int] = []

        def leave_after_five(token: int, text: str) -> None:
            seen.append(token)
            if len(seen) == 5:
                nursery.start_soon(_sigterm, swarm, leader_at)

        result = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                               stop_token_ids=(), on_token=leave_after_five)
        assert result.token_ids == local.token_ids and tuple(seen) == local.token_ids
        assert result.resumes >= 1 and result.route[stage]["fellow"] == spare
        ((new_id, _),) = swarm.leaders()
        assert new_id not in (None, leader_id)
        nursery.cancel_scope.cancel()


async def test_a_heal_refused_while_the_new_leader_adopts_the_load_is_asked_again(
        autojump_clock, tmp_path) -> None:
    """The rolling upgrade's race: the new leader has not adopted the load yet when the
    driver asks it to heal (its fellows have not all answered), so it refuses; the driver
    asks again until it leads the load, and the generation goes on."""
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=64, n=4)
        ((leader_id, _),) = swarm.leaders()
        leader_at = next(i for i, f in enumerate(swarm.fellows)
                         if f.identity.node_id == leader_id)
        leader = swarm.fellows[leader_at].agent
        assert leader is not None
        others = [f.name for f in swarm.fellows if f.identity.node_id != leader_id]
        message = request(exclude=[f"{others[-1]}:cpu"])
        plan = await leader.planning.ask_plan(message)
        await leader.serving.load(message, plan_id=plan["plan_id"])
        staged = [s["fellow"] for s in plan["stages"]]
        assert leader.name in staged
        stage = staged.index(leader.name)
        driver = swarm.fellows[_index(swarm, next(n for n in staged
                                                  if n != leader.name))].agent
        assert driver is not None
        short_grace(swarm)
        local = reference(plan, MODEL).generate(PROMPT[:30], 12, Sampler.greedy(),
                                                stop_token_ids=())
        refused: list[str] = []
        left_at: list[float] = []

        def slow_to_adopt(adoption: Any) -> None:
            adopt = adoption.adopt

            async def not_yet(plan_id: str, refresh: bool = False) -> Any:
                if not left_at or trio.current_time() < left_at[0] + 20.0:
                    refused.append(plan_id)
                    return None  # its fellows have not all said what they keep yet
                return await adopt(plan_id, refresh)

            adoption.adopt = not_yet

        for agent in swarm.live():
            if agent is not leader:
                slow_to_adopt(agent.serving.failover.adoption)
        seen: list[int] = []

        def leave_after_five(token: int, text: str) -> None:
            seen.append(token)
            if len(seen) == 5:
                left_at.append(trio.current_time())
                nursery.start_soon(_sigterm, swarm, leader_at)

        result = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                               stop_token_ids=(), on_token=leave_after_five)
        assert refused and result.token_ids == local.token_ids
        assert result.resumes >= 1 and result.route[stage]["fellow"] == others[-1]
        nursery.cancel_scope.cancel()
