"""An interrupted load is cancelled all or nothing, in virtual time: a bring-up under way
is stopped and every stage released; a load that came up just before the cancel is
unloaded; a cancel that overtakes its load makes the load refused when it comes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from p2pswarm.agent import Agent
from p2pswarm.errors import PlacementError
from p2pswarm.models import Checkpoint
from p2pswarm.sim.virtual import VirtualSwarm, wait_until
from p2pswarm.transport.memory import LinkModel, UniformDelay
from p2pswarm.wire.loads import LoadAsk, LoadCancel, LoadCancelled, LoadDone
from p2pswarm.wire.orders import pack_doc
from tests.serving_swarm import MODEL, request, start_swarm, write_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

SLOW_LINK = LinkModel(delay=UniformDelay(0.002, 0.010), bandwidth_bytes_per_s=2_000_000)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory)


def nothing_held(swarm: VirtualSwarm) -> bool:
    """No stage reserved, loading, live or still being built after its release."""
    return all(not a.serving.held_stages() and a.serving.allocated_bytes() == 0
               for a in swarm.live())


def nothing_loaded(swarm: VirtualSwarm) -> bool:
    return all(a.serving.loads_view() == [] for a in swarm.live())


def the_leader(swarm: VirtualSwarm) -> Agent:
    ((leader_id, _),) = swarm.leaders()
    return next(a for a in swarm.live() if a.node_id == leader_id)


@pytest.mark.parametrize("asker_leads", [False, True])
async def test_a_load_cancelled_while_its_stages_fetch_leaves_nothing(
        autojump_clock: trio.testing.MockClock, tmp_path: Path, model_dir: Path,
        asker_leads: bool) -> None:
    message = {**request(), "model": {"name": MODEL,
                                      "config": Checkpoint(model_dir).hf_config}}
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=31)
        leader = the_leader(swarm)
        asker = leader if asker_leads else next(a for a in swarm.live() if a is not leader)
        swarm.net.set_default(SLOW_LINK)  # each stage's weights take seconds to fetch
        plan = await asker.planning.ask_plan(message)
        phases: list[str] = []
        failed: list[BaseException] = []

        async def load() -> None:
            try:
                await asker.serving.load(message, plan_id=plan["plan_id"],
                                         model_dir=str(model_dir), load_id="cli-1",
                                         on_progress=lambda e: phases.append(
                                             e["progress"]["phase"]))
            except PlacementError as exc:
                failed.append(exc)

        nursery.start_soon(load)
        await wait_until(lambda: "fetching" in phases, timeout_s=30)
        assert any(a.serving.held_stages() for a in swarm.live())
        began = trio.current_time()
        outcome = await asker.serving.cancel_load("cli-1")
        assert outcome.to_doc() == {"load_id": "cli-1", "outcome": "cancelled",
                                    "plan_id": plan["plan_id"]}
        assert trio.current_time() - began < 2.0  # not the rest of the fetch
        assert failed and "cancelled" in str(failed[0])
        assert phases.count("ready") < len(plan["stages"])  # it never came up whole
        assert nothing_loaded(swarm) and await asker.serving.list_loads() == []
        # a stage whose fetch was under way drops what it built once its build ends
        await wait_until(lambda: nothing_held(swarm), timeout_s=60)
        assert nothing_loaded(swarm)
        nursery.cancel_scope.cancel()


async def test_a_load_that_came_up_before_its_cancel_is_unloaded(
        autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=32)
        asker = swarm.live()[1]
        record = await asker.serving.load(request(), load_id="cli-2")
        assert not nothing_held(swarm)
        outcome = await asker.serving.cancel_load("cli-2")
        assert outcome.to_doc() == {"load_id": "cli-2", "outcome": "unloaded",
                                    "plan_id": record["plan_id"]}
        assert nothing_held(swarm) and await asker.serving.list_loads() == []
        await wait_until(lambda: nothing_loaded(swarm), timeout_s=10)  # gossip catches up
        nursery.cancel_scope.cancel()


async def test_a_cancel_that_overtakes_its_load_makes_it_refused(
        autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=33)
        asker = swarm.live()[2]
        assert (await asker.serving.cancel_load("cli-3")).outcome == "not-started"
        with pytest.raises(PlacementError, match="cancelled"):
            await asker.serving.load(request(), load_id="cli-3")
        # the leader does the same for a ticket: a LoadAsk after its LoadCancel is refused
        reply = await asker.leadership.ask(LoadCancel("ticket-4"), LoadCancelled)
        assert (reply.outcome, reply.plan_id) == ("unknown", "")
        call = LoadAsk(pack_doc(request()), "", pack_doc({"kind": "builtin", "name": MODEL}),
                       b"", asker.addr, "ticket-4")
        with pytest.raises(PlacementError, match="cancelled by the fellow that asked"):
            await asker.leadership.ask(call, LoadDone)
        assert nothing_held(swarm) and nothing_loaded(swarm)
        with pytest.raises(Exception, match="load_id"):
            await asker.serving.cancel_load("../etc")
        nursery.cancel_scope.cancel()
