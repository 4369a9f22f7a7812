"""Copies ahead, in virtual time: fellow A offers a model from its directory and leads; the
model is loaded in two stages on B and C, and the leader has each stage's tensors copied
to the spare D. Then A leaves and a stage's fellow crashes mid-generation: the stage is
re-placed on D from its copy and the generation ends with the undisturbed run's tokens.
Without the copies nobody holds that stage's tensors and the load waits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.serving.leader_load import LeaderLoad
from p2pswarm.agent.weights import WeightsCache
from p2pswarm.cli.loads import copies_line
from p2pswarm.errors import SwarmError
from p2pswarm.models import Checkpoint, stage_tensor_names, write_builtin_checkpoint
from p2pswarm.runtime import Sampler
from p2pswarm.sim.virtual import wait_until
from p2pswarm.wire.orders import CallFailed, pack_doc
from p2pswarm.wire.serving import StageCopied, StageCopy
from tests.serving_swarm import MODEL, PROMPT, adopted, reference, request, short_grace, start_swarm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def _copied(record: LeaderLoad) -> set[int]:
    return {c.stage for c in record.copies if c.since is None}


async def _lose_a_stage_after_its_offerer(tmp_path: Any, model_dir: Any,
                                          copies: bool) -> None:
    checkpoint = Checkpoint(model_dir)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=47, n=4)
        ((old_id, old_term),) = swarm.leaders()
        offerer = next(i for i, f in enumerate(swarm.fellows) if f.identity.node_id == old_id)
        leader = swarm.fellows[offerer].agent
        assert leader is not None
        if not copies:
            for agent in swarm.live():
                agent.serving.copies.wanted = 0
        ask = {**request(stages=2, exclude=[f"{swarm.fellows[offerer].name}:cpu"]),
               "model": {"name": MODEL, "config": checkpoint.hf_config}}
        plan = await leader.planning.ask_plan(ask)
        plan_id = plan["plan_id"]
        loaded = await leader.serving.load(ask, plan_id=plan_id, model_dir=str(model_dir))
        manifest = leader.serving.weights.offers[loaded["model"]["key"]]
        agents = {a.name: a for a in swarm.live()}
        staged = [s["fellow"] for s in plan["stages"]]
        (spare,) = [n for n in agents if n != leader.name and n not in staged]
        assert "copies" not in loaded  # the load answered before any copy
        record = leader.serving.loads[plan_id]
        if copies:
            await wait_until(lambda: _copied(record) == {0, 1}, timeout_s=60)
            # both stages' tensors on the spare, which failover would move either to
            copies = copies_line([c.to_doc() for c in record.copies])
            assert copies == f"stage 0 on {spare}, stage 1 on {spare}"
            held = set(agents[spare].serving.weights_cache().held())
            for s in plan["stages"]:
                names = stage_tensor_names(checkpoint.config, *s["layers"])
                assert {manifest.tensor(n).sha256 for n in names} <= held
            # kept from eviction while the load is gossiped
            assert held <= set(agents[spare].serving.offers.in_use())
            await _refusals(leader, agents[spare], agents[staged[1]], plan_id, plan, loaded)
        else:
            await trio.sleep(10)
            assert not record.copies and not agents[spare].serving.weights_cache().held()
        local = reference(plan, checkpoint).generate(PROMPT[:30], 12, Sampler.greedy(),
                                                     stop_token_ids=())
        short_grace(swarm)

        await swarm.leave(offerer)  # the laptop that offered the model and led goes home

        new = await adopted(swarm, old_id, old_term, plan_id)
        # the stage whose fellow is not the new leader is lost; the other fellow drives
        lost = staged[0] if staged[0] != new.name else staged[1]
        driver = agents[staged[1] if lost == staged[0] else staged[0]]
        seen: list[int] = []

        def crash_after_five(token: int, text: str) -> None:
            seen.append(token)
            if len(seen) == 5:
                swarm.crash(next(i for i, f in enumerate(swarm.fellows) if f.name == lost))

        if not copies:  # the lost stage's tensors were on the lost fellow and A only
            with pytest.raises(SwarmError, match="the generation stopped after 5 tokens"):
                await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                              stop_token_ids=(), on_token=crash_after_five)
            assert ("and no connected fellow holds model.layers"
                    in new.serving.loads[plan_id].waiting)
            nursery.cancel_scope.cancel()
            return
        with trio.fail_after(120):
            result = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                                   stop_token_ids=(),
                                                   on_token=crash_after_five)
        assert result.token_ids == local.token_ids and tuple(seen) == local.token_ids
        lost_stage = staged.index(lost)
        assert [r["fellow"] for r in result.route][lost_stage] == spare
        (record,) = await driver.serving.list_loads()
        (move,) = record["moves"]
        assert (move["stage"], move["from"], move["to"]) == (lost_stage, lost, spare)
        assert record["stages"][lost_stage]["fetched_bytes"] == 0  # the copy was there
        # after the move the stage runs on its copy's fellow: it is copied again, to the
        # one fellow left outside it, while the other stage keeps its copy on the spare
        healed = new.serving.loads[plan_id]
        expected = {(lost_stage, driver.name), (1 - lost_stage, spare)}
        await wait_until(lambda: {(c.stage, c.fellow) for c in healed.copies
                                  if c.since is None} == expected, timeout_s=60)
        nursery.cancel_scope.cancel()


async def _refusals(leader: Agent, spare: Agent, other: Agent, plan_id: str,
                    plan: dict[str, Any], loaded: dict[str, Any]) -> None:
    """A copy order the spare cannot verify is refused, counted, and fetches nothing."""
    order = leader.serving.leader.orders[plan_id][1]
    a, b = plan["stages"][1]["layers"]

    async def copy(msg: StageCopy, sender: Agent = leader) -> Any:
        if sender is leader:
            try:
                return await leader.leadership.order(spare.addr, msg, StageCopied)
            except SwarmError as exc:
                return str(exc)
        return await sender.call(spare.addr, msg)

    model = dict(order.model)
    # the same stage again: held already, nothing fetched
    again = await copy(StageCopy(plan_id, 1, a, b, pack_doc(model)))
    assert isinstance(again, StageCopied) and again.fetched_bytes == 0
    # layers no stage of that load runs
    assert "no stage fellow gossips" in await copy(StageCopy(plan_id, 1, a, b - 1,
                                                             pack_doc(model)))
    # a manifest whose key is not its content's (a tensor swapped in)
    forged = {**model, "manifest": {**model["manifest"],
                                    "tensors": model["manifest"]["tensors"][::-1][:1]
                                    + model["manifest"]["tensors"][1:]}}
    assert "not the model its key names" in await copy(StageCopy(plan_id, 1, a, b,
                                                                 pack_doc(forged)))
    assert spare.counters.refused["stage-copy-unfit"] == 2
    # no room: a cache (empty, capped below the stage's bytes) it may not fill
    cache, world = spare.serving.offers.cache, spare.world
    spare.serving.offers.cache = WeightsCache(Path(str(cache.root) + "-small"))
    storage = replace(world.config.storage, weights_cache_bytes=4096)
    spare.world = replace(world, config=replace(world.config, storage=storage))
    try:
        assert "has no room to copy stage 1" in await copy(StageCopy(plan_id, 1, a, b,
                                                                     pack_doc(model)))
        assert spare.counters.refused["stage-copy-no-room"] == 1
        assert not spare.serving.offers.cache.held()
    finally:
        spare.serving.offers.cache, spare.world = cache, world
    # an order from a fellow that does not lead
    reply = await copy(StageCopy(plan_id, 1, a, b, pack_doc(model),
                                 term=leader.leadership.term()), sender=other)
    assert isinstance(reply, CallFailed) and "only the leader gives orders" in reply.text


@pytest.mark.parametrize("copies", [True, False], ids=["copied-ahead", "without-copies"])
async def test_a_stage_is_re_placed_from_its_copy_after_its_offerer_left(
        autojump_clock, tmp_path, tmp_path_factory, copies) -> None:
    model_dir = write_builtin_checkpoint(MODEL, tmp_path_factory.mktemp("model") / MODEL,
                                         max_shard_bytes=4_000_000)
    await _lose_a_stage_after_its_offerer(tmp_path, model_dir, copies)
