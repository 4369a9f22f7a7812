"""Bad metadata is dropped, not propagated into views (issue 19, part 8).

A fellow holding the token signs and gossips metadata of its choosing. Here a rogue
fellow (an agent like the others, built from the project's own modules, whose
published metadata is hostile) gossips malformed cards, benchmarks, training flags and
serving records; every honest fellow must go on planning, listing loads, exporting the
cluster and loading, with the rogue's bad entries dropped and counted in ``status``.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
from rich.console import Console

from p2pswarm.agent import Agent
from p2pswarm.agent.fellow_meta import FellowSays
from p2pswarm.agent.world import AgentWorld
from p2pswarm.cli.loads import print_load
from p2pswarm.cli.render import print_plan
from p2pswarm.cli.swarm import render_status
from p2pswarm.sim.virtual import Fellow, VirtualSwarm, cpu_card, wait_until
from p2pswarm.wire.loads import UnloadAsk, Unloaded
from tests.serving_swarm import request

ROGUE = 3
GOOD_CARD = {**cpu_card(16.0, name="rogue CPU").to_dict(), "memory_source": "[/red]"}
HOSTILE: dict[str, Any] = {
    "cards": [GOOD_CARD, {"kind": "cuda", "index": 0, "total_bytes": "lots",
                          "free_bytes": 1}, {"kind": "tpu", "total_bytes": 1, "free_bytes": 1},
              {"kind": "cuda", "index": 1, "total_bytes": 10, "free_bytes": -5}, 7,
              {"kind": "cuda", "index": 2, "total_bytes": (1 << 64) - 1, "free_bytes": 0},
              {"kind": "cuda", "index": 3, "name": "[/bold]", "total_bytes": 8 << 30,
               "free_bytes": 4 << 30, "held_by_others": [{"pid": "x", "bytes": 1}]}],
    "benchmarks": {"cards": {"cpu:0": {"flops": "fast", "mem_bandwidth": 1.0},
                             "cuda:9": {"flops": float("nan"), "mem_bandwidth": 1.0},
                             "cuda:8": [1, 2],
                             "cuda:7": {"flops": 1.0, "mem_bandwidth": 1.0,
                                        "dtype_tokens_per_s": {"int8": -1, "q2": 5}}}},
    "training": "sometimes",
    # loads it keeps the orders of: one plan id, and what no plan id is
    "kept_loads": ["0123456789abcdef", 5, "", "x" * 65, None],
    "stages": [{"plan_id": "0123456789abcdef", "stage": "first"},
               {"plan_id": 5, "stage": 0, "route": [{"stage": "a"}]},
               {"plan_id": "fedcba9876543210", "stage": 0, "model": "x", "runtime": [],
                "route": [{"stage": 0, "fellow_id": "zz", "layers": "all"}]},
               "nonsense",
               # a load record whose model key and file names would be paths
               {"plan_id": "00000000000000aa", "stage": 0, "runtime": {},
                "model": {"kind": "files", "name": "m", "key": "../../../lib/site-packages",
                          "path": "/", "files": [["evil.pth", 5, "/etc/hostname"]]},
                "layers": [0, 1],
                "route": [{"stage": 0, "fellow_id": "ab" * 16, "fellow": "x", "addr": "y",
                           "layers": [0, 1]}]},
               # a context length a driver would do arithmetic with
               {"plan_id": "00000000000000cc", "stage": 0, "layers": [0, 1],
                "runtime": {"max_context_tokens": "many"}},
               # a hop that names no fellow and no address
               {"plan_id": "00000000000000bb", "stage": 0, "layers": [0, 1], "runtime": {},
                "route": [{"stage": 0, "fellow_id": "ab" * 16}]}],
}


def rogue_factory(fellow: Fellow, world: AgentWorld) -> Agent:
    if fellow.index == ROGUE:  # a name that is rich markup, and hostile metadata
        world = dataclasses.replace(world, name="[/bold]", metadata=HOSTILE)
    return Agent(world)


def clean_metadata(meta: dict[Any, Any]) -> tuple[dict[str, Any], int]:
    """``meta`` as a fellow's check leaves it (in gossip form), and how many entries it
    dropped."""
    says = FellowSays.from_doc(meta)
    return says.to_doc(), says.dropped


def test_clean_metadata_keeps_the_good_and_drops_the_bad() -> None:
    clean, dropped = clean_metadata(HOSTILE)
    assert clean["cards"][0] == GOOD_CARD
    assert len(clean["cards"]) == 2 and clean["cards"][1]["name"] == "[/bold]"
    assert clean["cards"][1]["held_by_others"] == []
    assert "training" not in clean and clean["benchmarks"] == {"cards": {}}
    assert clean["stages"] == []
    assert clean["kept_loads"] == ["0123456789abcdef"]
    assert dropped >= 14
    assert clean_metadata({"cards": "x", "stages": {}, "benchmarks": 3})[0] == {}
    assert clean_metadata({"note": "hello"}) == ({"note": "hello"}, 0)


@pytest.mark.usefixtures("one_torch_thread")
async def test_a_rogue_gossiping_malformed_metadata_breaks_no_view(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        swarm = VirtualSwarm(4, seed=5, inline_compute=True, agent_factory=rogue_factory)
        for fellow in swarm.fellows:
            fellow.cards.cards = (cpu_card(16.0, name=f"{fellow.name} CPU"),)
        await nursery.start(swarm.run)
        for i in range(4):
            await swarm.start(i)
        await wait_until(lambda: swarm.converged() and len(swarm.leaders()) == 1
                         and None not in {lid for lid, _ in swarm.leaders()}, timeout_s=30)
        rogue = swarm.live()[ROGUE]
        honest = [a for a in swarm.live() if a is not rogue]
        await wait_until(lambda: all(
            a.membership is not None and a.membership.member(rogue.node_id) is not None
            and a.membership.member(rogue.node_id).metadata for a in honest), timeout_s=30)
        for agent in honest:
            view = agent.planning.view()
            rogue_view = view.fellow(rogue.node_id.hex())
            assert rogue_view is not None and len(rogue_view.cards) == 2
            await agent.control_ops["cluster"]({})
            assert (await agent.control_ops["loads"]({}))["loads"] == []
            status = agent.status()
            assert status["counters"]["drops"]["bad-metadata"] >= 10
        # the honest fellows load a model among themselves (the rogue's own stage host
        # would refuse: it believes its own "training" flag)
        ask = request(exclude=[f"{rogue.name}:cpu", f"{rogue.name}:3"])
        plan = await honest[0].planning.ask_plan(ask)
        assert plan["fits"]
        loaded = await honest[1].serving.load(ask, plan_id=plan["plan_id"])
        assert loaded["plan_id"] == plan["plan_id"]
        for agent in honest:
            listed = (await agent.control_ops["loads"]({}))["loads"]
            assert [r["plan_id"] for r in listed] == [plan["plan_id"]]
        # the honest stage fellows' gossiped records pass the checks whole
        await wait_until(lambda: all(
            [r.plan_id for r in a.serving.loads_view()] == [plan["plan_id"]]
            and a.serving.loads_view()[0].complete for a in honest), timeout_s=10)
        for agent in honest:
            for member in agent.fellows():
                if member.node_id != rogue.node_id and member.metadata:
                    raw = msgpack.unpackb(member.metadata, raw=False, strict_map_key=False)
                    assert clean_metadata(raw) == (raw, 0)
        # every listed command's human output renders the rogue's names as text
        for agent in honest:
            render_status(agent.status())
        print_plan(plan, Console(file=io.StringIO()))
        out = io.StringIO()
        print_load({**loaded, "model": {"name": "[/red]"}}, Console(file=out))
        assert "[/red]" in out.getvalue()
        await honest[1].leadership.ask(UnloadAsk(plan["plan_id"]), Unloaded)
        assert all(not a.stopped.is_set() for a in swarm.live())
        nursery.cancel_scope.cancel()


def test_the_pages_put_fellow_data_in_as_text_only() -> None:
    # names reach the pages from fellows: scripts set textContent, never parse HTML
    static = Path(__file__).parents[2] / "p2pswarm" / "http" / "static"
    for script in static.glob("*.js"):
        code = script.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write",
                     "eval(", "new Function"):
            assert sink not in code, f"{script.name} uses {sink}"
