"""A real job's replicas sync by the sharded all-reduce, in virtual time: the stages of
each index average their deltas among themselves (``agent.training.ring``), the leader's
driver only mirrors the global parameters. Four in-process agents on MemoryNetwork."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio

from p2pswarm.agent.world import Services
from p2pswarm.sim.virtual import wait_until
from p2pswarm.training.codec import make_codec
from tests.cpu_swarm import start_cpu_swarm
from tests.training_swarm import SMALL_LLAMA, finished, job_config, leader_of

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

SERVICES = Services(training_step_s=1.0, training_step_timeout_s=10.0, training_retry_s=2.0)


def ring_hosts(swarm: Any, job_id: str) -> list[Any]:
    """Every stage host of ``job_id`` with a ring, over the live fellows."""
    return [h for a in swarm.live() for k, h in a.training.hosts.items()
            if k[0] == job_id and h.ring is not None]


async def test_four_replicas_sync_through_the_ring_bit_equal_and_bounded(
        autojump_clock) -> None:
    config = job_config(model={"config": SMALL_LLAMA}, replicas="auto", steps=16,
                        micro_batch=2,
                        sync={"inner_steps": 2, "codec": "int8"})
    async with trio.open_nursery() as nursery:
        swarm = await start_cpu_swarm(nursery, 4, 7, services=SERVICES)
        leader = leader_of(swarm)
        plan = await leader.training.ask_plan(config)
        assert len(plan["replicas"]) == 4
        record = await leader.training.submit(config)
        job_id = record["job_id"]
        job = leader.training.jobs[job_id]
        await wait_until(lambda: len(job.rounds) >= 3 and len(ring_hosts(swarm, job_id)) == 4,
                         timeout_s=300, step_s=0.01)
        hosts = ring_hosts(swarm, job_id)
        # every replica that stands at a version holds the same global parameters there,
        # and so does the leader's mirror of them
        mirror = job.driver.keepers[0]
        by_version: dict[int, list[torch.Tensor]] = {}
        for h in hosts:
            sync = h.compute.sync
            by_version.setdefault(sync.version, []).append(sync.anchor.clone())
        if mirror.version in by_version:
            by_version[mirror.version].append(mirror.outer.params.clone())
        assert max(len(v) for v in by_version.values()) >= 2, by_version.keys()
        for anchors in by_version.values():
            assert all(torch.equal(anchors[0], a) for a in anchors[1:])
        # no fellow is a hub: each sends and receives about twice a quarter... of one
        # compressed delta a round, far from the (R - 1) deltas a keeper takes in
        numel = hosts[0].compute.sync.numel
        delta = len(make_codec("int8").encode(torch.zeros(numel)).to_bytes())
        for h in hosts:
            t = h.ring.traffic
            assert t.rounds >= 2
            assert t.sent_bytes / t.rounds <= 3 * delta, (t, delta)
            assert t.received_bytes / t.rounds <= 3 * delta, (t, delta)
        record = await finished(leader, job_id)
        nursery.cancel_scope.cancel()
    assert record["state"] == "finished", record["reason"]
    assert record["replicas"] == 4
    assert all(len(r["replicas"]) == 4 for r in record["rounds"]), [
        (r["version"], r["step"], r["closed_at_s"], len(r["replicas"])) for r in record["rounds"]]
    losses = record["losses"]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2


def test_a_roster_with_a_fellow_of_the_previous_release_syncs_through_the_keepers() -> None:
    """Protocol 1 does not speak the ring's messages: one such fellow anywhere in the
    roster keeps the whole job on its stages' keepers; one replica syncs with nobody."""
    from p2pswarm.agent.training.placed import BatchShape, ReplicaPlacement, StagePlacement
    from p2pswarm.agent.training.ring_rounds import sync_by_allreduce

    def replica(*fellow_ids: str) -> ReplicaPlacement:
        stages = tuple(StagePlacement(i, fid, f"f{fid}", f"127.0.0.1:{9000 + i}", (i, i + 1),
                                      "cpu", 0, "CPU", 1 << 20)
                       for i, fid in enumerate(fellow_ids))
        return ReplicaPlacement(stages, BatchShape(1, 1))

    roster = [replica("aa", "bb"), replica("cc", "dd"), replica("ee", "ff")]
    assert sync_by_allreduce(roster, lambda fellow_id: True)
    assert not sync_by_allreduce(roster, lambda fellow_id: fellow_id != "dd")
    assert not sync_by_allreduce(roster[:1], lambda fellow_id: True)
