"""The leader itself crashes mid-generation, in virtual time: it offered the model and
hosted a stage (on a home swarm the leader is often the machine the user sits at). The
driver's ask to heal finds a dead leader, then none; it waits for the next leader and asks
again, the new leader moves the stage (its tensors from a fellow that holds them), and
the generation ends with the undisturbed run's greedy tokens. When the new leader cannot
heal (no card can hold the stage), the generation ends with the error, promptly."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pswarm.agent.weights import Manifest, WeightsCache
from p2pswarm.errors import TransportError
from p2pswarm.models import Checkpoint, stage_tensor_names
from p2pswarm.runtime import Sampler
from p2pswarm.sim.virtual import VirtualSwarm
from tests.serving_swarm import (
    MODEL,
    PROMPT,
    crashing_after,
    reference,
    request,
    short_grace,
    start_swarm,
    write_model,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _index(swarm: VirtualSwarm, name: str) -> int:
    return next(i for i, f in enumerate(swarm.fellows) if f.name == name)


def _cache_copy(cache: WeightsCache, model_dir: Path, manifest: Manifest,
                names: list[str]) -> None:
    """Put ``names`` into ``cache``, as an earlier load of the model would have."""
    for name in names:
        t = manifest.tensor(name)
        with (model_dir / t.file).open("rb") as f:
            f.seek(t.offset_bytes)
            data = f.read(t.nbytes)
        path = cache.path(t.sha256)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


async def _load_on_the_leader(swarm: VirtualSwarm, spare: bool,  # type: ignore[no-untyped-def]
                              model: dict[str, Any] | None = None,
                              model_dir: Path | None = None):
    """A three-stage load one of whose stages the leader hosts (with ``spare``, a fellow
    is left out of the plan; with ``model_dir``, the leader offers the model from it); the
    leader's index, the plan, the load, and a surviving stage fellow to drive from."""
    ((leader_id, _),) = swarm.leaders()
    leader_at = next(i for i, f in enumerate(swarm.fellows)
                     if f.identity.node_id == leader_id)
    leader = swarm.fellows[leader_at].agent
    assert leader is not None
    others = [f.name for f in swarm.fellows if f.identity.node_id != leader_id]
    message = request(exclude=[f"{others[-1]}:cpu"] if spare else [])
    if model is not None:
        message["model"] = model
    plan = await leader.planning.ask_plan(message)
    loaded = await leader.serving.load(message, plan_id=plan["plan_id"],
                                       model_dir=str(model_dir) if model_dir else None)
    staged = [s["fellow"] for s in plan["stages"]]
    assert leader.name in staged
    driver = swarm.fellows[_index(swarm, next(n for n in staged if n != leader.name))].agent
    assert driver is not None
    short_grace(swarm)
    return leader_at, plan, loaded, driver


@pytest.mark.slow
async def test_the_leader_that_hosts_a_stage_crashes_and_the_next_leader_heals_the_load(
        autojump_clock, tmp_path, tmp_path_factory) -> None:
    model_dir = write_model(tmp_path_factory)
    checkpoint = Checkpoint(model_dir)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=51, n=4)
        leader_at, plan, loaded, driver = await _load_on_the_leader(
            swarm, spare=True, model={"name": MODEL, "config": checkpoint.hf_config},
            model_dir=model_dir)
        old = swarm.fellows[leader_at]
        assert old.agent is not None
        manifest = old.agent.serving.weights.offers[loaded["model"]["key"]]
        stage = next(s["stage"] for s in plan["stages"] if s["fellow"] == old.name)
        agents = {a.name: a for a in swarm.live()}
        spare = next(n for n in agents if n not in {s["fellow"] for s in plan["stages"]})
        # the leader's stage's tensors: on its disk, and cached by another stage's fellow
        lost_names = stage_tensor_names(checkpoint.config, *plan["stages"][stage]["layers"])
        holder = next(s["fellow"] for s in plan["stages"]
                      if s["fellow"] not in (old.name, driver.name))
        _cache_copy(agents[holder].serving.weights_cache(), model_dir, manifest, lost_names)
        local = reference(plan, checkpoint).generate(PROMPT[:30], 12, Sampler.greedy(),
                                                     stop_token_ids=())
        seen: list[int] = []
        at: list[float] = []

        def crash_after_five(token: int, text: str) -> None:
            seen.append(token)
            at.append(trio.current_time())
            if len(seen) == 5:
                swarm.crash(leader_at)

        result = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                               stop_token_ids=(), on_token=crash_after_five)
        assert result.token_ids == local.token_ids and tuple(seen) == local.token_ids
        assert result.resumes >= 1 and result.route[stage]["fellow"] == spare
        # a pause: the loss noticed, an election, the grace window, the move
        assert at[5] - at[4] < 15
        held = set(agents[spare].serving.weights_cache().held())
        assert {manifest.tensor(n).sha256 for n in lost_names} <= held
        ((new_id, _),) = swarm.leaders()
        assert new_id not in (None, old.identity.node_id)
        (record,) = await driver.serving.list_loads()
        (move,) = record["moves"]
        assert (move["stage"], move["from"], move["to"]) == (stage, old.name, spare)
        assert record["complete"]
        nursery.cancel_scope.cancel()


async def test_a_new_leader_that_cannot_heal_ends_the_generation_promptly(
        autojump_clock, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="p2pswarm.serving")
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=52, n=3)
        leader_at, plan, _, driver = await _load_on_the_leader(swarm, spare=False)
        old = swarm.fellows[leader_at].name
        seen: list[int] = []
        crash_after_three = crashing_after(swarm, leader_at, 3, seen)

        began = trio.current_time()
        with pytest.raises(TransportError, match=f"on fellow {old}") as error:
            await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=200,
                                          stop_token_ids=(), on_token=crash_after_three)
        assert str(error.value).endswith("stopped after 3 tokens")
        # the driver asked the new leader (the old one is gone), and it refused
        assert [r for r in caplog.records if r.getMessage().startswith("a driver lost stage")]
        # the election, then the new leader's grace window: far from the heal's deadline
        assert trio.current_time() - began < 15
        ((new_id, _),) = swarm.leaders()
        assert new_id is not None and new_id != swarm.fellows[leader_at].identity.node_id
        record = (await driver.serving.list_loads())[0]
        assert "needs a card with" in record["waiting"] and not record.get("moves")
        nursery.cancel_scope.cancel()


async def test_a_driver_left_without_any_leader_ends_the_generation_saying_so(
        autojump_clock, tmp_path) -> None:
    """The leader and the third fellow crash together: the driver, cut off from the rest
    (one of three), cannot tell them dead from its own silence, and no leader answers; the
    heal gives up after ``heal_leaderless_s``, not after its 900 s, and the error says why."""
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=53, n=3)
        leader_at, _, _, driver = await _load_on_the_leader(swarm, spare=False)
        other_at = next(i for i, f in enumerate(swarm.fellows)
                        if i != leader_at and f.agent is not driver)
        seen: list[int] = []

        def crash_both_after_three(token: int, text: str) -> None:
            seen.append(token)
            if len(seen) == 3:
                swarm.crash(leader_at)
                swarm.crash(other_at)

        began = trio.current_time()
        with pytest.raises(TransportError, match=r"stopped after 3 tokens \(no leader answered for "
                                                 r"60 s; ") as error:
            await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=200,
                                          stop_token_ids=(), on_token=crash_both_after_three)
        assert 60 <= trio.current_time() - began < 120, error.value
        nursery.cancel_scope.cancel()
