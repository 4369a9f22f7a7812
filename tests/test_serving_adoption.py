"""Failover after a change of leader: a new leader adopts the load its predecessor brought
up, from the route and stage orders every stage's fellow keeps, and re-places a stage
lost after the change on the spare; the orders a fellow keeps are checked."""

from __future__ import annotations

import dataclasses
import io

import pytest
import trio
from rich.console import Console

from p2pswarm.agent.serving.adoption import kept_orders, newest_kept
from p2pswarm.agent.serving.records import StageOrder, runtime_block
from p2pswarm.cli.loads import print_load
from p2pswarm.errors import ConfigError
from p2pswarm.runtime import Sampler
from p2pswarm.sim.virtual import wait_until
from p2pswarm.wire.loads import RouteHop, StageOrdersKept
from tests.serving_swarm import MODEL, PROMPT, adopted, reference, request, short_grace, start_swarm


async def test_a_new_leader_moves_a_stage_lost_after_the_change_of_leader(
        autojump_clock, tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=7, n=5)
        ((old_id, old_term),) = swarm.leaders()
        old = next(i for i, f in enumerate(swarm.fellows) if f.identity.node_id == old_id)
        leader = swarm.fellows[old].agent
        assert leader is not None
        ask = request(exclude=[f"{swarm.fellows[old].name}:cpu"])  # the leader holds none
        plan = await leader.planning.ask_plan(ask)
        await leader.serving.load(ask, plan_id=plan["plan_id"])
        plan_id = plan["plan_id"]
        staged = [s["fellow"] for s in plan["stages"]]
        (spare,) = [f.name for i, f in enumerate(swarm.fellows)
                    if i != old and f.name not in staged]
        local = reference(plan, MODEL).generate(PROMPT[:30], 12, Sampler.greedy(),
                                                stop_token_ids=())
        short_grace(swarm)

        swarm.crash(old)  # the leader that made the load, and kept its orders, is gone

        new = await adopted(swarm, old_id, old_term, plan_id)
        assert [h.fellow for h in new.serving.loads[plan_id].stages] == staged
        as_adopted = new.serving.loads[plan_id].stages

        victim_name = next(n for n in staged if n != new.name)
        stage = staged.index(victim_name)
        victim = next(i for i, f in enumerate(swarm.fellows) if f.name == victim_name)
        swarm.crash(victim)  # a stage lost after the change of leader
        await wait_until(
            lambda: new.serving.loads[plan_id].stages[stage].fellow == spare,
            timeout_s=60)

        driver = next(a for a in swarm.live() if a.node_id != new.node_id)
        result = await driver.serving.generate(prompt_ids=PROMPT[:30], max_tokens=12,
                                               stop_token_ids=())
        assert result.token_ids == local.token_ids and result.resumes == 0
        assert [r["fellow"] for r in result.route] == [
            spare if n == victim_name else n for n in staged]
        (record,) = await driver.serving.list_loads()
        (move,) = record["moves"]
        assert (move["stage"], move["from"], move["to"]) == (stage, victim_name, spare)
        assert record["complete"] and record["adopted"]["leader"] == new.name
        shown = io.StringIO()
        print_load(record, Console(file=shown, width=200))
        assert f"led by {new.name} since" in shown.getvalue()
        assert f"moved stage {stage} at " in shown.getvalue()
        # a leader elected again takes the load as its fellows keep it now, not as it
        # left it (another leader may have moved a stage meanwhile)
        led = new.serving.loads[plan_id]
        moves = led.moves
        led.stages = as_adopted
        again = await new.serving.failover.adoption.adopt(plan_id, refresh=True)
        assert again is not None and again is new.serving.loads[plan_id] and again is not led
        assert [h.fellow for h in again.stages] == [r["fellow"] for r in result.route]
        assert again.moves == moves
        assert new.serving.leader.orders[plan_id][stage].fellow_id == \
            again.stages[stage].fellow_id
        # every fellow of the healed load keeps the new route and orders, for the next one
        for agent in swarm.live():
            for (p, _), hosted in agent.serving.hosted.items():
                assert p == plan_id and [h.fellow for h in hosted.route] == [
                    r["fellow"] for r in result.route]
                assert [o.fellow_id for o in hosted.kept_orders] == [
                    h.fellow_id for h in hosted.route]
        nursery.cancel_scope.cancel()


def _order(stage: int, fid: str, layers: tuple[int, int], n: int = 3,
           model: str = "tiny-llama") -> StageOrder:
    return StageOrder("ab" * 8, stage, n, fid, layers, "cpu", 0, "CPU", claim_bytes=10,
                      need_bytes=20, runtime=runtime_block({"dtype": "float32", "quant": "none",
                                              "quant_group_size": 0, "kv_dtype": "float32",
                                              "max_context_tokens": 512, "max_sessions": 4,
                                              "prefill_chunk_tokens": 256}),
                      model={"kind": "builtin", "name": model})


def _hop(order: StageOrder, fellow_id: str | None = None) -> RouteHop:
    return RouteHop(order.stage, fellow_id or order.fellow_id, f"n{order.fellow_id}",
                    f"addr-{order.fellow_id}", order.layers[0], order.layers[1], "CPU",
                    10, 10, 0, 0.0)


ORDERS = [_order(0, "aa", (0, 2)), _order(1, "bb", (2, 4)), _order(2, "cc", (4, 6))]
ROUTE = tuple(_hop(o) for o in ORDERS)


def test_kept_orders_fit_their_route_or_are_refused() -> None:
    wire = tuple(o.to_wire() for o in ORDERS)
    assert [o.fellow_id for o in kept_orders("ab" * 8, ROUTE, wire)] == ["aa", "bb", "cc"]
    bad = {
        "too few": (ROUTE, wire[:2]),
        "none": ((), ()),
        "another plan": (ROUTE, (dataclasses.replace(ORDERS[0], plan_id="cd" * 8).to_wire(),
                                 *wire[1:])),
        "out of order": (ROUTE, (wire[1], wire[0], wire[2])),
        "another fellow": ((ROUTE[0], _hop(ORDERS[1], "dd"), ROUTE[2]), wire),
        "a gap in the layers": (ROUTE[:2] + (dataclasses.replace(ROUTE[2], start_layer=5),),
                                (*wire[:2], _order(2, "cc", (5, 6)).to_wire())),
        "another model": (ROUTE, (*wire[:2], _order(2, "cc", (4, 6),
                                                    model="small-llama").to_wire())),
        "a wrong stage count": (ROUTE, (*wire[:2], _order(2, "cc", (4, 6), n=4).to_wire())),
    }
    for why, (route, orders) in bad.items():
        with pytest.raises(ConfigError):
            kept_orders("ab" * 8, route, orders)
            pytest.fail(why)


def test_the_newest_kept_route_wins_whatever_order_the_answers_came_in() -> None:
    wire = tuple(o.to_wire() for o in ORDERS)
    moved = [ORDERS[0], _order(1, "dd", (2, 4)), ORDERS[2]]
    now = StageOrdersKept(5, tuple(_hop(o) for o in moved), tuple(o.to_wire() for o in moved))
    stale = StageOrdersKept(5, ROUTE, wire)  # bb, lost before the move, back since
    older = StageOrdersKept(4, ROUTE, wire)
    answers = [("addr-aa", now, moved), ("addr-bb", stale, ORDERS),
               ("addr-cc", now, moved), ("addr-dd", now, moved)]
    for seen in (answers, list(reversed(answers))):
        assert newest_kept(seen)[1] is now
    # a later term wins even when fewer fellows hold it
    assert newest_kept([("a", older, ORDERS), ("b", older, ORDERS), ("c", now, moved)])[1] is now
