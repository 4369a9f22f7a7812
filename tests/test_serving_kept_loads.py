"""A load outlives the restart of every fellow that knew it, in virtual time: each stage's
fellow and a few keepers keep its route and orders, on disk too (``kept_loads``,
``keepers``), and a leader adopts the load from them and re-places the stages no fellow
holds. The load here is the worst case: one stage, hosted by the leader."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.serving.kept_loads import MAX_KEPT, KeptLoads
from p2pswarm.agent.serving.leader_load import LoadAsked
from p2pswarm.agent.serving.loads import asked_from_doc
from p2pswarm.agent.serving.records import StageOrder, runtime_block
from p2pswarm.agent.serving.tombstones import KEEP_S, Tombstones, unfit
from p2pswarm.errors import ConfigError, PlacementError
from p2pswarm.runtime import Sampler
from p2pswarm.sim.virtual import VirtualSwarm, wait_until
from p2pswarm.wire.loads import LoadKeep, LoadUnloaded, RouteHop, UnloadRecord
from p2pswarm.wire.orders import pack_doc
from tests.serving_swarm import (
    MODEL,
    PROMPT,
    next_leader,
    reference,
    request,
    short_grace,
    start_swarm,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def _load_on_the_leader(swarm: VirtualSwarm) -> tuple[int, dict[str, Any]]:
    """A one-stage load the leader hosts, and its keepers holding its orders; the
    leader's index and the plan."""
    ((leader_id, _),) = swarm.leaders()
    at = next(i for i, f in enumerate(swarm.fellows) if f.identity.node_id == leader_id)
    leader = swarm.fellows[at].agent
    assert leader is not None
    ask = request(stages=1, exclude=[f"{f.name}:cpu" for i, f in enumerate(swarm.fellows)
                                     if i != at])
    plan = await leader.planning.ask_plan(ask)
    await leader.serving.load(ask, plan_id=plan["plan_id"])
    assert [s["fellow"] for s in plan["stages"]] == [leader.name]
    others = [a for a in swarm.live() if a is not leader]
    await wait_until(lambda: all(plan["plan_id"] in a.serving.host.kept.loads
                                 for a in others), timeout_s=10)
    short_grace(swarm)
    return at, plan


def _served_on(swarm: VirtualSwarm, plan_id: str) -> list[str]:
    return sorted(a.name for a in swarm.live() for (p, _), h in a.serving.hosted.items()
                  if p == plan_id and h.state == "active")


async def _generates(driver: Agent, plan: dict[str, Any]) -> None:
    local = reference(plan, MODEL).generate(PROMPT[:20], 8, Sampler.greedy(),
                                            stop_token_ids=())
    result = await driver.serving.generate(prompt_ids=PROMPT[:20], max_tokens=8,
                                           stop_token_ids=(), plan_id=plan["plan_id"])
    assert result.token_ids == local.token_ids


@pytest.mark.parametrize("comes_back", [False, True])
async def test_the_leader_hosting_a_one_stage_load_crashes_and_the_load_is_served_again(
        autojump_clock, tmp_path, comes_back) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=11, n=3, keep_loads=True)
        ((old_id, old_term),) = swarm.leaders()
        at, plan = await _load_on_the_leader(swarm)
        plan_id = plan["plan_id"]
        leader = swarm.fellows[at].agent
        assert leader is not None
        asked = leader.serving.leader.asked[plan_id]

        swarm.crash(at)  # the only fellow serving the load, and its leader
        if comes_back:
            await trio.sleep(1.0)
            await swarm.start(at)  # from its home: it keeps the orders, not the stage
        new = await next_leader(swarm, old_id, old_term)
        await wait_until(lambda: len(_served_on(swarm, plan_id)) == 1
                         and plan_id in new.serving.loads
                         and not new.serving.loads[plan_id].waiting,
                         timeout_s=60)
        record = new.serving.loads[plan_id]
        assert record.adopted is not None and record.adopted.leader == new.name
        # what it was asked as came with its orders: a re-cut can plan it again
        assert new.serving.leader.asked[plan_id] == asked
        driver = next(a for a in swarm.live() if a is not new)
        await _generates(driver, plan)
        # no second copy comes up, and what each fellow keeps is the load as it runs
        await trio.sleep(5.0)
        assert len(_served_on(swarm, plan_id)) == 1
        route = list(new.serving.loads[plan_id].fellow_ids)
        for agent in swarm.live():
            kept = agent.serving.host.kept.get(plan_id)
            if kept is not None:
                assert [h.fellow_id for h in kept.route] == route
        nursery.cancel_scope.cancel()


async def test_a_swarm_restarted_from_its_homes_serves_its_load_again(
        autojump_clock, tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=12, n=3, keep_loads=True)
        at, plan = await _load_on_the_leader(swarm)
        plan_id = plan["plan_id"]
        served_by = swarm.fellows[at].name

        for i in range(3):  # every fellow at once: nothing is left in memory
            swarm.crash(i)
        await trio.sleep(2.0)
        for i in range(3):
            await swarm.start(i)
        await wait_until(lambda: len(swarm.leaders()) == 1 and None not in {
            lid for lid, _ in swarm.leaders()} and len(_served_on(swarm, plan_id)) == 1,
            timeout_s=90)
        # back on the fellow that served it: its card has room, its weights are there
        assert _served_on(swarm, plan_id) == [served_by]
        await _generates(swarm.live()[0], plan)

        # orders that do not fit their route are not kept
        host = swarm.live()[2].serving.host
        kept = host.kept.get(plan_id)
        assert kept is not None
        with pytest.raises(PlacementError, match="refused"):
            await host._keep(LoadKeep("ab" * 8, kept.route, kept.orders, term=99))
        assert host.kept.get("ab" * 8) is None
        assert host.agent.counters.refused["stage-orders-unfit"] == 1

        # an unload forgets it everywhere: no fellow keeps its orders, nor its file
        await swarm.live()[1].serving.unload(plan_id)
        await wait_until(lambda: all(not a.serving.host.kept.loads for a in swarm.live()),
                         timeout_s=10)
        assert not list(tmp_path.glob("loads-*/*.json"))
        await trio.sleep(10.0)
        assert _served_on(swarm, plan_id) == []
        nursery.cancel_scope.cancel()


async def test_a_fellow_away_during_the_unload_does_not_bring_the_load_back(
        autojump_clock, tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=13, n=3, keep_loads=True)
        at, plan = await _load_on_the_leader(swarm)
        plan_id = plan["plan_id"]
        away = next(i for i in range(3) if i != at)  # a keeper
        leader = swarm.fellows[at].agent
        assert leader is not None
        gone = swarm.fellows[away].identity.node_id
        await wait_until(lambda: swarm.fellows[away].addr in leader.serving.leader.keeping(
            plan_id), timeout_s=10)  # its gossip says it keeps them

        swarm.crash(away)
        await wait_until(lambda: leader.membership is not None and getattr(
            leader.membership.member(gone), "state", "") == "dead", timeout_s=30)
        await leader.serving.unload(plan_id)
        assert list(tmp_path.glob(f"loads-{away}/*.json"))  # it was away: it keeps them
        back = await swarm.start(away)
        assert plan_id in back.serving.host.kept.loads  # read back from its disk
        await wait_until(lambda: not back.serving.host.kept.loads, timeout_s=30)
        assert not list(tmp_path.glob("loads-*/*.json"))
        await trio.sleep(10.0)
        assert _served_on(swarm, plan_id) == [] and plan_id not in leader.serving.loads
        nursery.cancel_scope.cancel()


def _orders() -> tuple[tuple[RouteHop, ...], tuple[Any, ...]]:
    order = StageOrder("ab" * 8, 0, 1, "aa", (0, 6), "cpu", 0, "CPU", claim_bytes=10,
                       need_bytes=20, runtime=runtime_block({"dtype": "float32", "quant": "none",
                                               "quant_group_size": 0, "kv_dtype": "float32",
                                               "max_context_tokens": 512, "max_sessions": 4,
                                               "prefill_chunk_tokens": 256}),
                       model={"kind": "builtin", "name": MODEL})
    hop = RouteHop(0, "aa", "naa", "addr-aa", 0, 6, "CPU", 10, 10, 0, 0.0)
    return (hop,), (order.to_wire(),)


def test_kept_orders_are_read_back_checked_and_bounded(tmp_path: Path) -> None:
    route, orders = _orders()
    kept = KeptLoads(tmp_path)
    assert kept.keep("ab" * 8, 3, route, orders)
    assert not kept.keep("ab" * 8, 2, route, orders)  # an older term does not win
    again = KeptLoads(tmp_path)
    assert again.get("ab" * 8) == kept.get("ab" * 8)
    # a damaged file, one for another plan, a name that is no plan id: left out, removed
    good = json.loads((tmp_path / f"{'ab' * 8}.json").read_text())
    (tmp_path / "cd.json").write_text(json.dumps({**good, "plan_id": "ef"}))
    (tmp_path / "ef.json").write_text("{not json")
    (tmp_path / "gh.json").write_text(json.dumps({**good, "plan_id": "gh",
                                                  "orders": "AAAA"}))
    (tmp_path / ".hidden.json").write_text(json.dumps({**good, "plan_id": ".hidden"}))
    read = KeptLoads(tmp_path)
    assert read.plan_ids() == ["ab" * 8] and read.bad_files == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{'ab' * 8}.json"]
    # a plan id that may not be a file name is kept in memory only
    assert read.keep("../x", 1, route, orders) and read.get("../x") is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{'ab' * 8}.json"]
    # at most MAX_KEPT loads
    for i in range(MAX_KEPT):
        read.keep(f"p{i}", 1, route, orders)
    assert len(read.loads) == MAX_KEPT
    assert read.forget("ab" * 8) and not (tmp_path / f"{'ab' * 8}.json").exists()
    assert not read.forget("ab" * 8)


async def test_an_unload_is_remembered_after_the_leader_that_unloaded_is_gone(
        autojump_clock, tmp_path) -> None:
    """A keeper away during the unload comes back keeping the load after its leader died:
    the next leader learns of the unload from the other keeper and does not bring the
    load back; a later load of the same plan is a new bring-up, kept and served."""
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=14, n=3, keep_loads=True)
        ((old_id, old_term),) = swarm.leaders()
        at, plan = await _load_on_the_leader(swarm)
        plan_id = plan["plan_id"]
        leader = swarm.fellows[at].agent
        assert leader is not None
        away, stays = (i for i in range(3) if i != at)
        gone = swarm.fellows[away].identity.node_id

        swarm.crash(away)
        await wait_until(lambda: leader.membership is not None and getattr(
            leader.membership.member(gone), "state", "") == "dead", timeout_s=30)
        await leader.serving.unload(plan_id)
        stayed = swarm.fellows[stays].agent
        assert stayed is not None and plan_id not in stayed.serving.host.kept.loads
        swarm.crash(at)  # the only leader that knew of the unload
        await trio.sleep(1.0)
        back = await swarm.start(away, seeds=(swarm.fellows[stays].addr,))  # not the dead
        assert plan_id in back.serving.host.kept.loads  # read back from its disk
        new = await next_leader(swarm, old_id, old_term)
        await wait_until(lambda: not back.serving.host.kept.loads, timeout_s=30)
        await trio.sleep(20.0)  # long past an adoption and a heal
        assert _served_on(swarm, plan_id) == [] and plan_id not in new.serving.loads
        assert not list(tmp_path.glob("loads-*/*.json"))

        # the same plan loaded again is not covered by the tombstone
        again = await swarm.start(at, seeds=(swarm.fellows[stays].addr,))
        ask = request(stages=1, exclude=[f"{f.name}:cpu" for i, f in enumerate(swarm.fellows)
                                         if i != at])

        async def replanned() -> str:
            try:
                return str((await new.planning.ask_plan(ask))["plan_id"])
            except PlacementError:
                return ""  # the leader does not see it back yet

        while await replanned() != plan_id:
            await trio.sleep(0.5)
        await new.serving.load(ask, plan_id=plan_id)
        await wait_until(lambda: all(plan_id in a.serving.host.kept.loads
                                     for a in swarm.live()), timeout_s=10)
        await trio.sleep(5.0)
        assert _served_on(swarm, plan_id) == [again.name]
        assert all(plan_id in a.serving.host.kept.loads for a in swarm.live())

        # a tombstone from the network is checked: a term later than the current one
        unloads = back.serving.failover.unloads
        with pytest.raises(PlacementError, match="refused"):
            await unloads._unloaded(LoadUnloaded(UnloadRecord(plan_id, "00ff", 10**6)))
        assert back.counters.refused["unload-record-unfit"] == 1
        assert unloads.tombstones.covers(plan_id, "00ff") is None
        nursery.cancel_scope.cancel()


def test_tombstones_cover_one_bring_up_and_are_checked_bounded_and_read_back(
        tmp_path: Path) -> None:
    now = [1000.0]
    path = tmp_path / "unloaded"
    stones = Tombstones(path, clock=lambda: now[0])
    assert stones.remember(UnloadRecord("ab" * 8, "00ff", 3))
    assert not stones.remember(UnloadRecord("ab" * 8, "00ff", 3))
    assert stones.covers("ab" * 8, "00ff") is not None
    assert stones.covers("ab" * 8, "0100") is None  # a later load of the same plan
    assert stones.covers("ab" * 8, "") is None  # orders from before generations
    assert [t.generation for t in Tombstones(path, clock=lambda: now[0]).of_plan(
        "ab" * 8)] == ["00ff"]
    # hostile records: a path for a name, no hex, a term from the future
    assert unfit(UnloadRecord("../x", "00ff", 1), 5) is not None
    assert unfit(UnloadRecord("ab", "zz", 1), 5) is not None
    assert unfit(UnloadRecord("ab", "00ff", 6), 5) is not None
    assert unfit(UnloadRecord("ab", "00ff", 5), 5) is None
    # bounded in time and in count (the oldest go first)
    now[0] += KEEP_S + 1
    assert stones.covers("ab" * 8, "00ff") is None and not Tombstones(
        path, clock=lambda: now[0]).kept
    in_memory = Tombstones(None)
    for i in range(300):
        in_memory.remember(UnloadRecord(f"p{i}", "01", 1))
    assert len(in_memory.kept) == 256 and in_memory.covers("p43", "01") is None
    assert in_memory.covers("p299", "01") is not None
    # a damaged file is left out and removed
    path.write_text("{not json")
    assert Tombstones(path).bad_file and not path.exists()


def test_a_kept_request_is_checked_against_the_orders_model() -> None:
    route, orders = _orders()
    model = StageOrder.from_wire(orders[0]).model
    message = request(stages=1)
    asked = LoadAsked(message, model, None)
    assert asked_from_doc(asked.to_doc(), model) == asked
    assert asked.to_doc() == pack_doc({"request": message, "adapter": None})
    other = {**message, "model": {"name": "x", "config": {"hidden_size": 1}}}
    for raw in (LoadAsked(other, model).to_doc(), b"\xc1", pack_doc({"request": 3}),
                LoadAsked({**message, "adapter": "ab" * 32}, model).to_doc()):
        with pytest.raises(ConfigError):
            asked_from_doc(raw, model)


def test_a_kept_request_names_the_bring_up_it_replaces_checked() -> None:
    """A re-cut's new load keeps the bring-up it replaced, (plan_id, generation); from the
    network it is checked: a safe plan id and a hex generation, two of them."""
    route, orders = _orders()
    model = StageOrder.from_wire(orders[0]).model
    message = request(stages=1)
    asked = LoadAsked(message, model, None, ("cd" * 8, "00ff"))
    assert asked_from_doc(asked.to_doc(), model) == asked
    for bad in (["cd" * 8], ["../x", "00ff"], ["cd" * 8, "XY"], ["cd" * 8, 7], "cd",
                ["cd" * 8, "00ff", "00"], [None, "00ff"]):
        with pytest.raises(ConfigError, match="replaces"):
            asked_from_doc(pack_doc({"request": message, "adapter": None, "replaces": bad}),
                           model)


async def test_an_unload_asked_before_a_new_leader_adopted_the_load_is_remembered(
        autojump_clock, tmp_path) -> None:
    """A new leader asked to unload a load its fellows serve before it adopted it (its
    watch has not come round yet) adopts it first, so that the tombstone it hands every
    fellow names the bring-up (which outlives it, as above): a keeper away during the
    unload comes back and drops the load's orders, and nothing brings the load back."""
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=15, n=5, keep_loads=True)
        ((old_id, old_term),) = swarm.leaders()
        at = next(i for i, f in enumerate(swarm.fellows) if f.identity.node_id == old_id)
        leader = swarm.fellows[at].agent
        assert leader is not None
        stage_at = (at + 1) % 5  # the stage on a fellow that does not lead
        ask = request(stages=1, exclude=[f"{f.name}:cpu" for i, f in enumerate(swarm.fellows)
                                         if i != stage_at])
        plan = await leader.planning.ask_plan(ask)
        plan_id = plan["plan_id"]
        await leader.serving.load(ask, plan_id=plan_id)
        generation = leader.serving.leader.orders[plan_id][0].generation
        await wait_until(lambda: sum(plan_id in a.serving.host.kept.loads
                                     for a in swarm.live()) >= 3, timeout_s=10)
        keeping = [i for i, f in enumerate(swarm.fellows) if f.agent is not None
                   and plan_id in f.agent.serving.host.kept.loads]
        away = next(i for i in keeping if i not in (at, stage_at))
        swarm.crash(away)
        swarm.crash(at)
        # the leaders to come look at their loads late: the unload comes first
        watch = {}
        for agent in swarm.live():
            watch[agent.name] = agent.serving.failover.timings
            agent.serving.failover.timings = replace(watch[agent.name], watch_s=60.0)
        new = await next_leader(swarm, old_id, old_term)
        assert plan_id not in new.serving.loads  # not adopted yet
        assert plan_id in {v.plan_id for v in new.serving.loads_view()}  # its fellow serves it
        await new.serving.unload(plan_id)
        for agent in swarm.live():
            agent.serving.failover.timings = watch[agent.name]
        assert _served_on(swarm, plan_id) == []
        for agent in swarm.live():  # each could lead next: each knows that bring-up is gone
            assert agent.serving.failover.unloads.tombstones.covers(plan_id, generation), \
                agent.name

        back = await swarm.start(away, seeds=(swarm.fellows[stage_at].addr,))
        assert plan_id in back.serving.host.kept.loads  # read back from its disk
        await wait_until(lambda: not back.serving.host.kept.loads, timeout_s=60)
        await trio.sleep(20.0)  # long past an adoption and a heal
        assert _served_on(swarm, plan_id) == []
        assert all(plan_id not in a.serving.loads for a in swarm.live())
        nursery.cancel_scope.cancel()
