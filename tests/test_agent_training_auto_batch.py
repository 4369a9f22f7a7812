"""A live job with ``micro_batch: "auto"``: the leader plans it over the fleet, each
replica's batch rides on its placement and survives the copy a new leader reads."""

from __future__ import annotations

import pytest
import trio

from p2pswarm.agent.training.job_plan import JobPlan
from p2pswarm.agent.training.placed import placement_from_doc, placement_to_doc
from p2pswarm.sim.virtual import VirtualSwarm, cpu_card, wait_until
from p2pswarm.training.job import JobConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def test_replicas_of_fellows_with_different_memory_get_their_own_batches(
        autojump_clock) -> None:
    config = {"model": "tiny-llama", "seq_len": 2048, "micro_batch": "auto",
              "weights_dtype": "f32", "steps": 4, "replicas": "auto",
              "sync": {"inner_steps": 2}}
    async with trio.open_nursery() as nursery:
        swarm = VirtualSwarm(2, seed=7, inline_compute=True)
        for fellow, free_gb in zip(swarm.fellows, (16.0, 2.0)):
            fellow.cards.cards = (cpu_card(16.0, free_gb, name=f"{fellow.name} CPU"),)
        await nursery.start(swarm.run)
        for i in range(2):
            await swarm.start(i)
        await wait_until(lambda: swarm.converged() and len(swarm.leaders()) == 1
                         and None not in {lid for lid, _ in swarm.leaders()}, timeout_s=30)
        asker = swarm.live()[0]
        plan = await asker.training.ask_plan(config)
        assert plan["fits"] and len(plan["replicas"]) == 2, plan.get("fleet")
        batches = {r["stages"][0]["fellow"]: r["micro_batch"] for r in plan["replicas"]}
        roomy, tight = (f.name for f in swarm.fellows)
        assert batches[roomy] > batches[tight] >= 1, batches
        leader = next(a for a in swarm.live() if a.leadership.is_leader())
        job = JobConfig.from_dict(config)
        placement = leader.training.placer.placement(JobPlan.from_doc(plan), job)
        assert [r.batch.micro_batch for r in placement] == \
            [r["micro_batch"] for r in plan["replicas"]]
        # kept in the copies a new leader reads
        assert placement_from_doc(placement_to_doc(placement, job), job) == placement
        nursery.cancel_scope.cancel()
