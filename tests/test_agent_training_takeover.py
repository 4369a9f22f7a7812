"""A job outlives its leader, on MemoryNetwork in virtual time: the leader is killed while
a job of three replicas trains; a new leader takes it over from the copy the old one left
on fellows and finishes it from where its rounds stood, never from step 0."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from p2pswarm.agent.training.handover import JobCopy, JobHandover, receive_outer
from p2pswarm.agent.training.job_state import JobSnapshot, ReplicaState, RoundsState
from p2pswarm.agent.training.jobs import Job
from p2pswarm.agent.training.placed import BatchShape, ReplicaPlacement, StagePlacement
from p2pswarm.agent.world import Services
from p2pswarm.errors import PlacementError, RemoteProtocolError, SwarmError
from p2pswarm.sim.virtual import VirtualSwarm, wait_until
from p2pswarm.training.job import JobConfig
from p2pswarm.wire.jobs import (
    MAX_KEPT_JOBS,
    OUTER_KEEP_BYTES,
    JobKeep,
    JobKept,
    JobsKept,
    JobsKeptAsk,
)
from p2pswarm.wire.orders import CallFailed, pack_doc
from tests.cpu_swarm import start_cpu_swarm
from tests.training_swarm import SMALL_LLAMA, disks_under, finished, job_config, new_disk_under

STEP_S = 1.0  # the virtual seconds one stage step takes
SERVICES = Services(training_step_s=STEP_S, training_step_timeout_s=10.0,
                    training_retry_s=2.0)
KILL_AT_STEP = 8


def takeover_config() -> dict[str, Any]:
    return job_config(model={"config": SMALL_LLAMA}, replicas="auto", steps=20,
                      micro_batch=2, sync={"inner_steps": 2, "codec": "fp16"})


async def start_swarm(nursery: trio.Nursery) -> VirtualSwarm:
    return await start_cpu_swarm(nursery, 3, 5, services=SERVICES)


def leader_of(swarm: VirtualSwarm) -> Any:
    return next((a for a in swarm.live() if a.leadership.is_leader()), None)


async def run_job(kill_leader: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        leader = leader_of(swarm)
        record = await leader.training.submit(takeover_config())
        job_id = record["job_id"]
        if kill_leader:
            job = leader.training.jobs[job_id]
            await wait_until(lambda: job.step >= KILL_AT_STEP, timeout_s=120, step_s=0.01)
            # what the fellows that live on hold: their stages' computes (inner optimizer)
            before = {(a.name, key): id(h.compute) for a in swarm.live() if a is not leader
                      for key, h in a.training.hosts.items()}
            out["killed_at_step"] = job.step
            killed_at = trio.current_time()
            swarm.crash(next(i for i, f in enumerate(swarm.fellows) if f.agent is leader))
            await wait_until(lambda: leader_of(swarm) is not None
                             and job_id in leader_of(swarm).training.jobs
                             and leader_of(swarm).training.jobs[job_id].state == "running",
                             timeout_s=120, step_s=0.05)
            new = leader_of(swarm)
            taken = new.training.jobs[job_id]
            out["step_when_taken"] = taken.step
            out["running_again_s"] = trio.current_time() - killed_at
            out["kept_computes"] = sum(
                1 for a in swarm.live() for key, h in a.training.hosts.items()
                if before.get((a.name, key)) == id(h.compute))
            out["survivor_stages"] = len(before)
            leader = new
        record = await finished(leader, job_id)
        record["leader"] = leader.name
        nursery.cancel_scope.cancel()
    return {**record, **out}


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
async def test_the_leader_killed_mid_job_a_new_leader_finishes_it(autojump_clock) -> None:
    calm = await run_job(kill_leader=False)
    assert calm["state"] == "finished", calm["reason"]
    churned = await run_job(kill_leader=True)
    assert churned["state"] == "finished", churned["reason"]
    # taken over where the rounds stood, never from step 0
    assert churned["step_when_taken"] >= churned["killed_at_step"] - 2
    assert churned["step"] == 20 and len(churned["losses"]) == 20
    assert "moved from leader" in churned["moved"]
    assert "resumed where its rounds stood" in churned["moved"]
    # the replicas on fellows that lived on kept their stages, inner optimizer and all
    assert churned["survivor_stages"] == 2 and churned["kept_computes"] == 2
    assert churned["running_again_s"] < 30, churned["running_again_s"]
    final_calm = sum(calm["losses"][-4:]) / 4
    final_churned = sum(churned["losses"][-4:]) / 4
    # within 10%: after the kill two replicas of three train on (the dead leader's
    # replica is gone and its fellow does not come back), and the steps the survivors
    # took after the last copy (at most one round) are taken again from the copy
    assert abs(final_churned - final_calm) <= 0.1 * final_calm, (final_calm, final_churned)


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
async def test_a_lone_replica_whose_leader_died_resumes_from_its_checkpoint(
        autojump_clock, tmp_path: Any) -> None:
    from p2pswarm.training import JobConfig, LocalRun

    config = job_config(model={"config": {**SMALL_LLAMA, "num_hidden_layers": 3}}, steps=8,
                        checkpoint={"dir": str(tmp_path / "ckpt"), "interval_steps": 3})
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        disks_under(swarm, tmp_path)
        leader = leader_of(swarm)
        record = await leader.training.submit(config, stages=3)
        job_id = record["job_id"]
        job = leader.training.jobs[job_id]
        await wait_until(lambda: job.step >= 4, timeout_s=60, step_s=0.01)
        cut = job.placement[0].cut
        dead = next(i for i, f in enumerate(swarm.fellows) if f.agent is leader)
        swarm.crash(dead)
        # a new leader adopts it; its three stages need three cards: it waits pending
        await wait_until(lambda: leader_of(swarm) is not None
                         and job_id in leader_of(swarm).training.jobs, timeout_s=120)
        new = leader_of(swarm)
        taken = new.training.jobs[job_id]
        await wait_until(lambda: "waiting for cards" in taken.reason, timeout_s=60)
        assert taken.state == "pending"
        assert "waiting for cards to resume from its checkpoint of step 3" in taken.reason
        await swarm.start(dead)  # the old leader's fellow is back, as a follower
        back = swarm.fellows[dead].agent
        new_disk_under(back, tmp_path)
        record = await finished(new, job_id)
        nursery.cancel_scope.cancel()
    assert record["state"] == "finished", record["reason"]
    assert "moved from leader" in record["moved"] and record["step"] == 8
    # from the checkpoint the trajectory goes on exactly as if never interrupted
    local = LocalRun(JobConfig.from_dict({**config, "checkpoint": {}}), cut=cut).run()
    assert len(record["losses"]) == 8
    for got, want in zip(record["losses"], local):
        assert abs(got - want) <= 1e-4


# --- the copy itself ---------------------------------------------------------------------------


def _job() -> Job:
    config = JobConfig.from_dict(takeover_config())
    stage = StagePlacement(0, "ab" * 16, "f000", "10.0.0.1:7000", (0, 2), "cpu", 0, "CPU",
                           1 << 20)
    return Job("job-0000abcd", config, "ab" * 8, pinned=False, stages=None,
               state="running", step=7, losses=[3.0, 2.5], loss=2.5,
               placement=(ReplicaPlacement((stage,), BatchShape.of_job(config)),))


def _copy_doc(job: Job, leader: str) -> dict[str, Any]:
    return JobSnapshot.of(job, None, leader).to_doc()


def test_a_job_copy_reads_back_as_the_job() -> None:
    job = _job()
    back = JobSnapshot.from_doc(_copy_doc(job, "f000"))
    assert back.rounds is None and back.leader == "f000"
    assert back.job.report() == job.report()


def test_a_job_copy_document_round_trips() -> None:
    rounds = RoundsState(4, (ReplicaState(0, False, 2, 9, 1234, 3),))
    doc = JobSnapshot("f000", _job(), rounds).to_doc()
    back = JobSnapshot.from_doc(doc)
    assert back.rounds == rounds and back.to_doc() == doc
    assert JobSnapshot.read(back.packed()).to_doc() == doc


@pytest.mark.parametrize("change", [
    {"job_id": "../../etc"}, {"step": -1}, {"state": "exploded"}, {"losses": ["x"]},
    {"placement": [[{"stage": 0}]]}, {"config": {"model": "tiny-llama", "steps": "many"}},
    {"rounds_state": {"version": 1, "replicas": [{"index": 5, "paused": False}]}},
    {"loss": float("nan")}, {"reason": "x" * 10_000},
])
def test_a_malformed_job_copy_is_refused_with_one_line(change: dict[str, Any]) -> None:
    doc = {**_copy_doc(_job(), "f000"), **change}
    with pytest.raises(RemoteProtocolError) as err:
        JobSnapshot.from_doc(doc)
    assert "\n" not in str(err.value)


async def test_a_fellow_keeps_copies_only_from_its_leader_in_its_term(
        autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_cpu_swarm(nursery, 3, 5)
        leader = leader_of(swarm)
        a, b = [x for x in swarm.live() if x is not leader]
        term = leader.leadership.term()
        state = JobSnapshot.of(_job(), None, leader.name).packed()
        # from a fellow that is not the leader: refused
        with pytest.raises(PlacementError, match="only from the leader it follows"):
            await a.leadership.order(b.addr, JobKeep("job-0000abcd", 1, state), JobKept)
        # from the leader, stamped with a term that is not the fellow's: refused
        reply = await leader.call(b.addr, JobKeep("job-0000abcd", 1, state, term=term + 1))
        assert isinstance(reply, CallFailed) and "only from the leader" in reply.text
        assert not b.training.handover.kept
        # from the leader in its term: kept; an older copy never replaces a newer one
        order = leader.training.leadership.order
        assert (await order(b.addr, JobKeep("job-0000abcd", 5, state), JobKept)).seq == 5
        await order(b.addr, JobKeep("job-0000abcd", 3, state), JobKept)
        assert b.training.handover.kept["job-0000abcd"].head.seq == 5
        listed = await leader.training.leadership.order(b.addr, JobsKeptAsk(), JobsKept)
        assert [(c.job_id, c.term, c.seq, c.state) for c in listed.copies] == [
            ("job-0000abcd", term, 5, "running")]
        # a copy that does not read back as a job is refused, not kept
        bad = pack_doc({**_copy_doc(_job(), leader.name), "step": -3})
        with pytest.raises(SwarmError, match="step is malformed"):
            await order(b.addr, JobKeep("job-0000beef", 6, bad), JobKept)
        assert "job-0000beef" not in b.training.handover.kept
        nursery.cancel_scope.cancel()


async def test_outer_state_over_the_bound_is_refused_before_it_is_read() -> None:
    head = JobKeep("job-0000abcd", 1, b"", (OUTER_KEEP_BYTES, 1), "ab" * 32)
    with pytest.raises(RemoteProtocolError, match="over the"):
        await receive_outer(head, None, "the leader")  # type: ignore[arg-type]


def test_a_fellow_keeps_a_bounded_number_of_copies_finished_ones_first() -> None:
    agent = SimpleNamespace(on_stream=lambda *args: None)
    handover = JobHandover(SimpleNamespace(agent=agent))  # type: ignore[arg-type]
    state = JobSnapshot.of(_job(), None, "f000").packed()
    for i in range(MAX_KEPT_JOBS):
        handover._hold(JobCopy(JobKeep(f"job-{i:08x}", 1, state, term=2)),
                       "finished" if i == 7 else "running")
    handover._hold(JobCopy(JobKeep("job-ffffffff", 1, state, term=2)), "running")
    assert len(handover.kept) == MAX_KEPT_JOBS
    assert "job-00000007" not in handover.kept and "job-ffffffff" in handover.kept
    # a copy of a later term wins over any of an earlier one, whatever its seq
    handover._hold(JobCopy(JobKeep("job-00000001", 1, state, term=3)), "running")
    handover._hold(JobCopy(JobKeep("job-00000001", 99, state, term=2)), "running")
    assert handover.kept["job-00000001"].order == (3, 1)
