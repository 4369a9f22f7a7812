"""A job of several replicas keeps its progress under churn, on MemoryNetwork in virtual
time: a new leader that finds none of the replicas' fellows places them again where the
rounds stood (not from step 0); a leader whose every replica loses a fellow does the
same from its own last copy; checkpoints are written while a replica is paused (under
churn one nearly always is), and resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing

from p2pswarm.agent.world import Services
from p2pswarm.sim.virtual import VirtualSwarm, cpu_card, wait_until
from tests.cpu_swarm import start_cpu_swarm
from tests.training_swarm import SMALL_LLAMA, disks_under, finished, job_config, new_disk_under

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

STEP_S = 1.0  # the virtual seconds one stage step takes
SERVICES = Services(training_step_s=STEP_S, training_step_timeout_s=10.0,
                    training_retry_s=2.0)
STEPS = 20


def two_replicas(**extra: Any) -> dict[str, Any]:
    return job_config(**{"model": {"config": SMALL_LLAMA}, "replicas": 2, "steps": STEPS,
                         "micro_batch": 2, "sync": {"inner_steps": 2, "codec": "fp16"},
                         **extra})


def leader_of(swarm: VirtualSwarm) -> Any:
    return next((a for a in swarm.live() if a.leadership.is_leader()), None)


def index_of(swarm: VirtualSwarm, name: str) -> int:
    return next(i for i, f in enumerate(swarm.fellows) if f.name == name)


def hosts(job: Any) -> set[str]:
    return {s.fellow for replica in job.placement for s in replica.stages}


def offer(fellow: Any, free_gb: float) -> None:
    fellow.cards.cards = (cpu_card(16.0, free_gb=free_gb, name=f"{fellow.name} CPU"),)


async def test_a_new_leader_that_finds_every_replica_gone_resumes_where_the_rounds_stood(
        autojump_clock: trio.testing.MockClock) -> None:
    """The leader hosting one replica dies with the other replica's fellow: the new
    leader can put no replica back on its fellows, places both on the cards left and
    gives them the global state of the copy (it used to start again from step 0, and
    say it was "waiting for its fellows")."""
    async with trio.open_nursery() as nursery:
        swarm = await start_cpu_swarm(nursery, 5, 5, services=SERVICES)
        leader = leader_of(swarm)
        other = next(a for a in swarm.live() if a is not leader)
        spare = [f for f in swarm.fellows if f.agent not in (leader, other)]
        for f in spare:  # the job fits only on the leader and `other` at first
            offer(f, 0.01)
        await trio.sleep(15)  # their card news reaches the leader
        record = await leader.training.submit(two_replicas())
        job_id = record["job_id"]
        job = leader.training.jobs[job_id]
        await wait_until(lambda: job.state == "running", timeout_s=60, step_s=0.01)
        assert hosts(job) == {leader.name, other.name}
        for f in spare:
            offer(f, 16.0)
        await wait_until(lambda: job.step >= 10, timeout_s=120, step_s=0.01)
        killed_at = job.step
        swarm.crash(index_of(swarm, leader.name))
        swarm.crash(index_of(swarm, other.name))

        def running_again() -> bool:
            new = leader_of(swarm)
            return new is not None and job_id in new.training.jobs \
                and new.training.jobs[job_id].state == "running"

        await wait_until(running_again, timeout_s=120, step_s=0.05)
        new = leader_of(swarm)
        taken = new.training.jobs[job_id]
        step_when_taken = taken.step
        assert hosts(taken) <= {f.name for f in spare}
        record = await finished(new, job_id)
        nursery.cancel_scope.cancel()
    assert record["state"] == "finished", record["reason"]
    assert step_when_taken >= killed_at - 2, (killed_at, step_when_taken)
    assert record["step"] == STEPS and len(record["losses"]) == STEPS
    assert "resumes where its rounds stood" in record["moved"], record["moves"]
    assert not any("step 0" in m for m in record["moves"]), record["moves"]


async def test_every_replica_losing_a_fellow_goes_on_where_the_rounds_stood(
        autojump_clock: trio.testing.MockClock) -> None:
    """Both replicas' fellows crash at once and the job has no checkpoint: the leader
    places them again from its own last copy of the rounds (it used to start the job
    again from step 0)."""
    async with trio.open_nursery() as nursery:
        swarm = await start_cpu_swarm(nursery, 5, 5, services=SERVICES)
        leader = leader_of(swarm)
        record = await leader.training.submit(
            two_replicas(), exclude_cards=[f"{leader.node_id.hex()}:cpu"])
        job = leader.training.jobs[record["job_id"]]
        await wait_until(lambda: job.step >= 4, timeout_s=120, step_s=0.01)
        # first one fellow drops and comes back: its replica is placed again (a later
        # placement generation than the job's first)
        victim = index_of(swarm, job.placement[0].stages[0].fellow)
        swarm.crash(victim)
        await wait_until(lambda: job.rejoins >= 1, timeout_s=120, step_s=0.01)
        await swarm.start(victim)
        await wait_until(lambda: job.step >= 8, timeout_s=120, step_s=0.01)
        generation_before = max(h.generation for a in swarm.live()
                                for k, h in a.training.stages.hosts.items()
                                if k[0] == job.job_id)
        lost_at = job.step
        for name in hosts(job):  # a shared access point goes down
            swarm.crash(index_of(swarm, name))
        await wait_until(lambda: "placing every replica again" in job.reason,
                         timeout_s=120, step_s=0.01)
        assert "resumes where its rounds stood" in job.reason, job.reason
        assert job.step >= lost_at - 2
        # the new placement's generation is later than any the old one's releases carry
        # (the replicas' own numbers and the job's once overlapped: a late release of the
        # replica placed again could drop a stage of the new placement)
        await wait_until(lambda: job.state == "running", timeout_s=120, step_s=0.01)
        live = [h for a in swarm.live() for k, h in a.training.stages.hosts.items()
                if k[0] == job.job_id]
        assert live and all(h.generation > generation_before for h in live), \
            (generation_before, [h.generation for h in live])
        record = await finished(leader, record["job_id"])
        nursery.cancel_scope.cancel()
    assert record["state"] == "finished", record["reason"]
    assert record["paused_times"] == 1
    assert record["step"] == STEPS and len(record["losses"]) == STEPS


async def test_a_checkpoint_is_written_while_a_replica_is_paused_and_resumes(
        autojump_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    """A replica paused for good (no card to place it again on): the job's checkpoints
    are written all the same, with the paused replica's shards standing in from the
    other's and marked to take the global state; every reader takes them (it used to
    skip every checkpoint while a replica was paused)."""
    from p2pswarm.training import JobConfig, LocalRun
    from p2pswarm.training.checkpoint import CheckpointStore
    from p2pswarm.training.job_export import export_checkpoint
    from p2pswarm.training.replica import synced_tensors
    from p2pswarm.training.sync import flatten

    steps = 8
    config = two_replicas(steps=steps, checkpoint={"dir": str(tmp_path / "ckpt"),
                                                   "interval_steps": 4})
    async with trio.open_nursery() as nursery:
        swarm = await start_cpu_swarm(nursery, 3, 5, services=SERVICES)
        disks_under(swarm, tmp_path)
        leader = leader_of(swarm)
        record = await leader.training.submit(
            config, exclude_cards=[f"{leader.node_id.hex()}:cpu"])
        job_id = record["job_id"]
        job = leader.training.jobs[job_id]
        await wait_until(lambda: job.step >= 2, timeout_s=120, step_s=0.01)
        victim = job.placement[1].stages[0].fellow
        swarm.crash(index_of(swarm, victim))
        await wait_until(lambda: job.replicas == 1, timeout_s=60, step_s=0.01)
        paused_at = job.step
        await wait_until(lambda: job.checkpoint_step > paused_at, timeout_s=120,
                         step_s=0.01)
        assert job.driver is not None and job.driver.replicas[1].paused
        store = CheckpointStore(Path(job.checkpoint_dir))
        written = job.checkpoint_step
        manifest = json.loads((store.step_dir(written) / "manifest.json").read_text())
        positions = manifest["meta"]["positions"]
        assert positions["replica-1.stage-0"].get("global_state") == 1
        assert "global_state" not in positions["replica-0.stage-0"]
        assert set(manifest["shards"]) >= {"replica-0.stage-0", "replica-1.stage-0",
                                           "keeper.stage-0"}
        await leader.training.leader.cancel(job_id)
        stopped = await finished(leader, job_id)
        assert stopped["state"] == "cancelled"
        # the core's resume and export take it: the paused replica on the global state
        local = LocalRun.resume(JobConfig.from_dict({**config, "checkpoint": {
            "dir": str(store.directory), "interval_steps": 4}}), step=written)
        keeper = local.keepers[0]
        params = flatten(synced_tensors(local.replicas[1].stages[0]))
        assert torch.equal(params, keeper.params)
        assert not torch.equal(flatten(synced_tensors(local.replicas[0].stages[0])), params)
        exported = export_checkpoint(store, tmp_path / "exported", step=written)
        assert exported.step == written
        # and so does the swarm's: the job resumed from it finishes its steps
        again = await swarm.start(index_of(swarm, victim))
        new_disk_under(again, tmp_path)
        await wait_until(lambda: swarm.converged(), timeout_s=60)
        await leader.training.submit(None, resume=job_id)
        record = await finished(leader, job_id)
        nursery.cancel_scope.cancel()
    assert record["state"] == "finished", record["reason"]
    assert record["step"] == steps and len(record["losses"]) == steps
