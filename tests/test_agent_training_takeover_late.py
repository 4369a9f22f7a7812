"""A leader asks a fellow that comes back for the job copies it keeps
(``Takeover.fellow_back``): the gather at the election missed it (it was cut off, or
still booting after a whole swarm restarted), and it may hold the only copy of a job."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from p2pswarm.agent.training.handover import JobCopy
from p2pswarm.agent.training.job_state import JobSnapshot
from p2pswarm.agent.training.jobs import Job
from p2pswarm.sim.virtual import wait_until
from p2pswarm.training.job import JobConfig
from p2pswarm.wire.jobs import JobKeep
from tests.cpu_swarm import start_cpu_swarm
from tests.training_swarm import job_config


def finished_job(job_id: str) -> Job:
    return Job(job_id, JobConfig.from_dict(job_config(steps=4)), "ab" * 8, pinned=False,
               stages=None, state="finished", step=4, losses=[3.0, 2.9, 2.7, 2.5], loss=2.5)


def leader_of(swarm: Any) -> Any:
    return next((a for a in swarm.live() if a.leadership.is_leader()), None)


async def test_a_fellow_that_comes_back_hands_the_leader_the_copies_it_keeps(
        autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_cpu_swarm(nursery, 3, 5)
        leader = leader_of(swarm)
        other = next(f for f in swarm.fellows if f.agent is not leader)
        away = other.agent
        assert away is not None
        swarm.net.down(other.addr)  # cut off: the leader sees it gone
        await wait_until(lambda: leader.fellow(away.node_id.hex()) is None or
                         leader.fellow(away.node_id.hex()).state != "alive", timeout_s=60)
        # meanwhile it holds the only copy of a job (kept from an earlier leader)
        job = finished_job("job-0000cafe")
        head = JobKeep(job.job_id, 1, JobSnapshot.of(job, None, "an earlier leader").packed(),
                       (), "", leader.leadership.term())
        away.training.handover._hold(JobCopy(head), job.state, write=False)
        assert job.job_id not in leader.training.jobs
        swarm.net.up(other.addr)  # back: the leader asks it and adopts the job
        await wait_until(lambda: job.job_id in leader.training.jobs, timeout_s=60)
        adopted = leader.training.jobs[job.job_id]
        assert adopted.state == "finished" and adopted.losses == job.losses
        assert leader_of(swarm) is leader
        nursery.cancel_scope.cancel()
