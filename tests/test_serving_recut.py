"""A live move that re-cuts a load, in virtual time: three slow fellows serve a load of
three stages; a fast fellow joins and the leader proposes the planner's faster plan, with
another cut. A move whose new stages cannot be prepared is refused and leaves the load
serving; the move taken while a generation runs re-cuts the load under it, and the
generation completes with the undisturbed run's greedy tokens."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import trio
from rich.console import Console

from p2pswarm.agent import Agent
from p2pswarm.agent.serving.records import LoadRecord
from p2pswarm.cards import ESTIMATED_MEM_BANDWIDTH, Benchmark
from p2pswarm.cli.loads import print_load, print_moved
from p2pswarm.errors import ConfigError, PlacementError
from p2pswarm.runtime import Sampler
from p2pswarm.sim.virtual import VirtualSwarm, cpu_card, wait_until
from p2pswarm.wire.control import LoadMoveRequest
from tests.cpu_swarm import start_cpu_swarm
from tests.serving_swarm import MODEL, PROMPT, reference, request

FAST = 3  # the fellow that joins late, with a card far faster than the others'


async def _three_slow_serving(nursery: trio.Nursery, seed: int
                              ) -> tuple[VirtualSwarm, Agent, dict[str, Any]]:
    """Three slow fellows (a fourth, ``FAST``, not started) serving a load of three
    stages; the swarm, its leader (which drives) and the plan."""
    swarm = await start_cpu_swarm(nursery, FAST + 1, seed, started=FAST)
    ((leader_id, _),) = swarm.leaders()
    driver = next(a for a in swarm.live() if a.node_id == leader_id)
    plan = await driver.planning.ask_plan(request())
    await driver.serving.load(request(), plan_id=plan["plan_id"])
    return swarm, driver, plan


def _printed(show: Any, doc: dict[str, Any]) -> str:
    console = Console(record=True, width=240)
    show(doc, console)
    return console.export_text()


async def _join_fast(swarm: VirtualSwarm) -> Agent:
    agent = await swarm.start(FAST)
    measured = Benchmark(flops=1e13, mem_bandwidth=ESTIMATED_MEM_BANDWIDTH["cpu"] * 50,
                         dtype="f32", measured=True, fingerprint="fast")
    agent.extra_metadata["benchmarks"] = {"cards": {"cpu:0": measured.to_dict()}}
    agent.publish_metadata()
    return agent


async def _faster(driver: Agent) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    async def proposed() -> bool:
        (record,) = await driver.serving.list_loads()
        found[:] = [record]
        return bool((record.get("faster") or {}).get("plan_id"))

    with trio.fail_after(60):
        while not await proposed():
            await trio.sleep(0.5)
    return found[0]


async def test_a_fast_fellow_joins_and_the_load_is_re_cut_live_under_a_generation(
        autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        swarm, driver, plan = await _three_slow_serving(nursery, seed=41)
        local = reference(plan, MODEL).generate(PROMPT[:30], 12, Sampler.greedy(),
                                                stop_token_ids=())

        # the fast fellow joins: the leader proposes the planner's plan, another cut
        await _join_fast(swarm)
        record = await _faster(driver)
        faster = record["faster"]
        assert record["plan_id"] == plan["plan_id"] and len(record["stages"]) == 3
        assert 1 <= len(faster["stages"]) <= 2 and faster["plan_id"] != plan["plan_id"]
        assert swarm.fellows[FAST].name in {s["fellow"] for s in faster["stages"]}
        assert faster["ms_per_token_after"] <= 0.75 * faster["ms_per_token_now"]
        shown = _printed(print_load, record)
        assert (f"faster: plan {faster['plan_id']}, {len(faster['stages'])} stage" in shown
                and f"p2pswarm load --move {faster['plan_id']}" in shown)

        # its memory is taken before the move (by another program, say): the new stage
        # cannot be prepared beside the load, the move is refused with why, and the load
        # serves on as it was
        fast = swarm.fellows[FAST]
        fast.cards.cards = (cpu_card(16.0, free_gb=0.001, name=f"{fast.name} CPU"),)
        with pytest.raises(PlacementError, match="refused, the load serves on") as refused:
            await driver.control_ops["load_move"]({"op": "load_move",
                                                   "plan_id": plan["plan_id"]})
        assert f"{fast.name}: " in str(refused.value) and "free now" in str(refused.value)
        assert "cannot hold both" in str(refused.value)
        (record,) = await driver.serving.list_loads()
        assert record["plan_id"] == plan["plan_id"] and not record.get("moves")
        assert not any(k[0] == faster["plan_id"] for a in swarm.live()
                       for k in a.serving.hosted)
        kept = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                             stop_token_ids=())
        assert kept.token_ids == local.token_ids and len(kept.route) == 3

        # its memory free again: the move, asked by the proposed plan's id, is taken while
        # a generation runs; the generation resumes on the new cut with the same tokens
        await wait_until(lambda: driver.serving.leader.loads[plan["plan_id"]].faster is None,
                         timeout_s=30)  # the shortage is heard: no proposal
        # the plan proposed before is stale now, and the refusal says so
        with pytest.raises(PlacementError, match=f"plan {faster['plan_id']} is no longer the "
                           r"faster placement .* \(now: nothing faster\)"):
            await driver.control_ops["load_move"]({"op": "load_move",
                                                   "plan_id": faster["plan_id"]})
        fast.cards.cards = (cpu_card(16.0, name=f"{fast.name} CPU"),)
        record = await _faster(driver)
        new_id = record["faster"]["plan_id"]
        moved: list[dict[str, Any]] = []

        async def move() -> None:
            moved.append(await driver.control_ops["load_move"]({"op": "load_move",
                                                                "plan_id": new_id}))

        def move_after_three(token: int, text: str) -> None:
            if len(heard) == 3:
                nursery.start_soon(move)
            heard.append(token)

        heard: list[int] = []
        result = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                               stop_token_ids=(), on_token=move_after_three)
        assert moved and result.token_ids == local.token_ids
        assert result.resumes == 1 and result.plan_id == new_id
        assert [r["fellow"] for r in result.route] == [s["fellow"] for s in
                                                       record["faster"]["stages"]]
        (move_record,) = moved[0]["moved"]
        assert move_record["recut"] and move_record["from_plan"] == plan["plan_id"]

        said = _printed(print_moved, moved[0]).splitlines()
        assert said[0].startswith(f"moved plan {plan['plan_id']} live to plan {new_id}")
        assert f"3 stages -> {len(result.route)}" in said[0]
        assert said[1:] == [f"  stage {s['stage']}: layers {s['layers'][0]}-"
                            f"{s['layers'][1] - 1} on {s['fellow']} ({s['card']})"
                            for s in record["faster"]["stages"]]

        # `loads` shows the new placement and the move; the old stages are released
        (now,) = await driver.serving.list_loads()
        assert now["plan_id"] == new_id and now["recut_from"] == [plan["plan_id"]]
        assert [s["fellow"] for s in now["stages"]] == [s["fellow"] for s in
                                                       record["faster"]["stages"]]
        assert now["moves"][-1]["to_plan"] == new_id and "faster" not in now
        assert f"from plan {plan['plan_id']} (3 stages) into" in _printed(print_load, now)
        assert not any(k[0] == plan["plan_id"] for a in swarm.live()
                       for k in a.serving.hosted)
        # asked for by the plan_id it had, it is the same load
        assert (await driver.serving.find_load(plan["plan_id"])).plan_id == new_id
        with pytest.raises(PlacementError, match=f"plan {new_id} \\(plan {plan['plan_id']} "
                           "before it was re-cut\\): no markedly faster placement"):
            await driver.control_ops["load_move"]({"op": "load_move",
                                                   "plan_id": plan["plan_id"]})
        nursery.cancel_scope.cancel()


def test_a_driver_takes_a_new_cut_only_from_a_record_that_names_its_load() -> None:
    def hop(i: int) -> dict[str, Any]:
        return {"stage": i, "fellow_id": "ab" * 8, "fellow": f"f{i}", "addr": "a:1"}

    def _same_load(healed: dict[str, Any], record: dict[str, Any]) -> bool:
        try:
            return LoadRecord.from_doc(healed).continues(LoadRecord.from_doc(record))
        except ConfigError:  # a malformed answer
            return False

    old = {"plan_id": "a" * 16, "stages": [hop(0), hop(1), hop(2)], "runtime": {}}
    new = {"plan_id": "b" * 16, "stages": [hop(0)], "runtime": {}}
    assert not _same_load(new, old)  # another load altogether
    assert _same_load({**new, "recut_from": ["a" * 16]}, old)
    assert not _same_load({**new, "recut_from": "a" * 16}, old)  # malformed
    assert not _same_load({**new, "recut_from": ["a" * 16], "stages": []}, old)
    assert not _same_load({**old, "stages": [hop(0)]}, old)  # same plan, stages lost


def test_the_planners_new_cut_is_proposed_only_when_markedly_faster() -> None:
    from p2pswarm.agent.serving.leader_load import LoadAsked
    from p2pswarm.agent.serving.loads import stage_orders
    from p2pswarm.agent.serving.moves import recut_proposal
    from p2pswarm.planner import Plan, cluster_view, fellow_view, plan_message

    def fellow(i: int, bandwidth: float) -> Any:
        card = {"index": 0, "kind": "cpu", "name": f"c{i}", "total_bytes": 16 * 10**9,
                "free_bytes": 16 * 10**9, "mem_bandwidth": bandwidth, "flops": 1e12}
        return fellow_view(f"{i:02x}" * 8, f"n{i}", {"cards": [card]})

    slow = [fellow(i, ESTIMATED_MEM_BANDWIDTH["cpu"]) for i in range(3)]
    placed = plan_message(request(), cluster_view(slow))
    orders = stage_orders(Plan.from_doc(placed),
                          LoadAsked({}, {"kind": "builtin", "name": MODEL}), "", "")
    again = {**request(), "stages": None}
    # the same slow cards: the planner's plan is no markedly faster placement
    assert recut_proposal(cluster_view(slow), orders,
                          Plan.from_doc(plan_message(again, cluster_view(slow))), None) is None
    # a fast card joins: its plan has another cut, and is proposed whole
    view = cluster_view([*slow, fellow(9, ESTIMATED_MEM_BANDWIDTH["cpu"] * 50)])
    fastest = Plan.from_doc(plan_message(again, view))
    proposal = recut_proposal(view, orders, fastest, None)
    assert proposal is not None and proposal.plan is fastest and not proposal.moves
    assert len(fastest.stages) < 3 and proposal.after_s <= 0.75 * proposal.now_s
    assert proposal.to_dict()["plan_id"] == fastest.plan_id
    # a plan that does not fit is never proposed
    assert recut_proposal(view, orders, replace(fastest, fits=False), None) is None


def test_load_move_prints_one_line_per_stage_moved_or_refuses_in_one_line(agent: Any) -> None:
    from typer.testing import CliRunner

    from p2pswarm.cli import app
    from tests.fakes import RECORD

    moved = {"stage": 1, "layers": [4, 8], "from": "fellow-2", "to": "gpu-box",
             "card": "cuda:0 (RTX 3060)", "took_s": 2.25, "at": 0.0, "why": "live move"}
    agent.answers["load_move"] = {**RECORD, "moves": [moved], "moved": [moved]}
    shown = CliRunner().invoke(app, ["load", "--move", RECORD["plan_id"]])
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.splitlines() == [
        f"moved 1 stage of plan {RECORD['plan_id']} live:",
        "  stage 1 (layers 4-7): fellow-2 -> gpu-box (cuda:0 (RTX 3060)) in 2.2 s"]
    assert agent.sent(LoadMoveRequest)[-1] == LoadMoveRequest(RECORD["plan_id"])
    agent.answers["load_move"] = PlacementError("plan 0123456789abcdef: no markedly faster "
                                                "placement now")
    refused = CliRunner().invoke(app, ["load", "--move", RECORD["plan_id"]])
    assert refused.exit_code == 1
    assert refused.stderr == ("error: plan 0123456789abcdef: no markedly faster placement "
                              "now\n")


async def test_a_load_not_re_planned_moves_a_whole_stage_live_under_a_generation(
        autojump_clock) -> None:
    """A load the leader adopted is not re-planned (its request is not known there): the
    fast fellow takes the slowest stage whole, and the generation goes on."""
    async with trio.open_nursery() as nursery:
        swarm, driver, plan = await _three_slow_serving(nursery, seed=43)
        local = reference(plan, MODEL).generate(PROMPT[:30], 12, Sampler.greedy(),
                                                stop_token_ids=())
        del driver.serving.leader.asked[plan["plan_id"]]  # as if adopted
        await _join_fast(swarm)
        fast = swarm.fellows[FAST].name
        with trio.fail_after(60):
            while not (record := (await driver.serving.list_loads())[0]).get("faster"):
                await trio.sleep(0.5)
        ((stage, to),) = [(m["stage"], m["to"]) for m in record["faster"]["moves"]]
        assert to == fast and "plan_id" not in record["faster"]
        moved: list[dict[str, Any]] = []
        heard: list[int] = []

        async def move() -> None:
            moved.append(await driver.control_ops["load_move"]({"op": "load_move",
                                                                "plan_id": plan["plan_id"]}))

        def move_after_three(token: int, text: str) -> None:
            if len(heard) == 3:
                nursery.start_soon(move)
            heard.append(token)

        result = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                               stop_token_ids=(), on_token=move_after_three)
        assert moved and result.token_ids == local.token_ids and result.resumes == 1
        assert result.plan_id == plan["plan_id"] and result.route[stage]["fellow"] == fast
        ((done,),) = [moved[0]["moved"]]
        assert (done["stage"], done["to"]) == (stage, fast)
        nursery.cancel_scope.cancel()


async def test_after_a_live_move_no_fellows_own_view_lists_the_old_plan(
        autojump_clock) -> None:
    """The listing a fellow falls back to when the leader does not answer is its own view,
    made from its fellows' gossip, which lags: a move is answered only once every fellow
    was told the old plan is gone, and from then on no fellow's view lists it, the new
    plan's stages coming into view as their gossip arrives."""
    async with trio.open_nursery() as nursery:
        swarm, driver, plan = await _three_slow_serving(nursery, seed=43)
        old_id = plan["plan_id"]
        await _join_fast(swarm)
        new_id = (await _faster(driver))["faster"]["plan_id"]
        others = [a for a in swarm.live() if a is not driver]
        await wait_until(lambda: all(
            [v.plan_id for v in a.serving.loads_view()] == [old_id] for a in others),
            timeout_s=10)
        await driver.control_ops["load_move"]({"op": "load_move", "plan_id": new_id})

        def seen() -> list[list[str]]:
            return [[v.plan_id for v in a.serving.loads_view()] for a in others]

        with trio.fail_after(30):
            while seen() != [[new_id]] * len(others):
                assert not any(old_id in ids for ids in seen()), seen()
                await trio.sleep(0.01)
        assert await others[0].serving.list_loads() == await driver.serving.list_loads()
        nursery.cancel_scope.cancel()



async def _deposed(swarm: VirtualSwarm, driver: Agent) -> Agent:
    """Freeze the leader ``driver`` (deposed, as by a stalled machine): the next leader
    the others elect."""
    ((old_leader, old_term),) = swarm.leaders()
    swarm.freeze(next(i for i, f in enumerate(swarm.fellows) if f.agent is driver))
    others = [a for a in swarm.live() if a is not driver]

    def elected() -> set[tuple[bytes | None, int]]:
        seen = set()
        for agent in others:
            assert agent.election is not None
            status = agent.election.status()
            seen.add((status.leader_id, status.term))
        return seen

    def one() -> bool:
        seen = elected()
        return len(seen) == 1 and next(iter(seen))[1] > old_term \
            and next(iter(seen))[0] not in (None, old_leader)

    await wait_until(one, timeout_s=60)
    ((new_leader, _),) = elected()
    return next(a for a in others if a.node_id == new_leader)


def _refuse_orders(driver: Agent) -> None:
    """The orders that release a load's stages and hand out its tombstone never land
    ("only the leader gives orders": the leader is deposed a moment later)."""
    async def refused(*_: Any) -> None:
        return None

    driver.serving.leader.release_all = refused  # type: ignore[method-assign]
    driver.serving.failover.unloads._hand = refused  # type: ignore[method-assign]
    driver.serving.failover.recut._release_stragglers = refused  # type: ignore[method-assign]


def _served(swarm: VirtualSwarm) -> set[str]:
    return {p for a in swarm.live() for (p, _), h in a.serving.hosted.items()
            if h.state == "active"}


@pytest.mark.parametrize("comes_back", [True, False])
async def test_a_re_cut_whose_leader_is_deposed_right_after_ends_on_the_new_plan_only(
        autojump_clock, comes_back: bool) -> None:
    """The leader re-cuts the load and is deposed at once: its orders to release the old
    plan and to hand out its tombstone never land, so the fellows serve both plans, and
    the deposed leader, the only one holding the old plan's tombstone, does not answer
    the next leader. The new plan names the bring-up it replaced, and the deposed leader,
    back and following, says it remembers its unload: either way the next leader ends
    with one plan, the new one."""
    async with trio.open_nursery() as nursery:
        swarm, driver, plan = await _three_slow_serving(nursery, seed=44)
        old_id = plan["plan_id"]
        await _join_fast(swarm)
        new_id = (await _faster(driver))["faster"]["plan_id"]
        _refuse_orders(driver)
        await driver.control_ops["load_move"]({"op": "load_move", "plan_id": new_id})
        assert old_id in _served(swarm)
        new = await _deposed(swarm, driver)
        await wait_until(lambda: new_id in new.serving.loads, timeout_s=60)
        at = next(i for i, f in enumerate(swarm.fellows) if f.agent is driver)
        if comes_back:
            swarm.thaw(at)
        else:
            swarm.crash(at)
        await wait_until(lambda: set(new.serving.loads) == {new_id}
                         and _served(swarm) == {new_id}, timeout_s=60)
        await trio.sleep(10.0)  # long past another adoption: the old plan stays gone
        assert set(new.serving.loads) == {new_id} and _served(swarm) == {new_id}
        assert [r["plan_id"] for r in await new.serving.list_loads()] == [new_id]
        nursery.cancel_scope.cancel()


async def test_an_unload_whose_leader_is_deposed_right_after_stays_unloaded(
        autojump_clock) -> None:
    """The leader unloads the load and is deposed at once, its orders never landing: the
    next leader adopts the load its fellows still serve while the deposed leader, the
    only one holding the tombstone, does not answer; it asks again, and once the deposed
    leader answers, unloads it."""
    async with trio.open_nursery() as nursery:
        swarm, driver, plan = await _three_slow_serving(nursery, seed=45)
        plan_id = plan["plan_id"]
        _refuse_orders(driver)
        await driver.serving.unload(plan_id)
        assert plan_id in _served(swarm)
        new = await _deposed(swarm, driver)
        await wait_until(lambda: plan_id in new.serving.loads, timeout_s=60)
        swarm.thaw(next(i for i, f in enumerate(swarm.fellows) if f.agent is driver))
        await wait_until(lambda: not new.serving.loads and not _served(swarm), timeout_s=60)
        await trio.sleep(10.0)  # long past another adoption: it stays unloaded
        assert not new.serving.loads and not _served(swarm)
        assert await new.serving.list_loads() == []
        nursery.cancel_scope.cancel()
