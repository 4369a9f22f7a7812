"""Training jobs across real agents on MemoryNetwork, in virtual time.

Torch runs inline (``Serving.inline_compute``), so compute takes no virtual time; the
models are the built-in tiny one, the steps few.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing

from p2pswarm.errors import ConfigError, PlanChanged
from p2pswarm.sim.virtual import VirtualSwarm, cpu_card, wait_until
from p2pswarm.training import JobConfig, LocalRun


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def job_config(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "seq_len": 32, "micro_batch": 2, "micro_batches": 2,
            "steps": 6, "lr": {"peak": 0.003, "schedule": "constant"}, "seed": 3,
            "replicas": 1, "sync": {"inner_steps": 2, "codec": "int8"}, **extra}


async def start_swarm(nursery: trio.Nursery, n: int = 3, seed: int = 5) -> VirtualSwarm:
    swarm = VirtualSwarm(n, seed=seed)
    for fellow in swarm.fellows:
        fellow.cards.cards = (cpu_card(16.0, name=f"{fellow.name} CPU"),)
    await nursery.start(swarm.run)
    for i in range(n):
        agent = await swarm.start(i)
        agent.serving.inline_compute = True
    await wait_until(lambda: swarm.converged() and len(swarm.leaders()) == 1
                     and None not in {lid for lid, _ in swarm.leaders()}, timeout_s=30)
    return swarm


async def finished(agent: Any, job_id: str, timeout_s: float = 600) -> dict[str, Any]:
    record: dict[str, Any] = {}

    async def done() -> bool:
        nonlocal record
        record = next(j for j in await agent.training.list_jobs() if j["job_id"] == job_id)
        return record["state"] in ("finished", "failed", "cancelled")

    with trio.fail_after(timeout_s):
        while not await done():
            await trio.sleep(0.5)
    return record


async def test_one_replica_three_stages_equals_one_process(autojump_clock) -> None:
    config = job_config()
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        asker = swarm.live()[1]
        plan = await asker.leadership.ask("job-plan", {"config": config, "stages": 3})
        assert plan["fits"] and len(plan["replicas"]) == 1
        assert len({s["fellow"] for s in plan["stages"]}) == 3
        record = await asker.training.submit(config, plan_id=plan["plan_id"], stages=3)
        assert record["state"] == "pending" and record["plan_id"] == plan["plan_id"]
        record = await finished(asker, record["job_id"])
        assert record["state"] == "finished", record["reason"]
        cut = [s["layers"][0] for s in plan["stages"][1:]]
        local = LocalRun(JobConfig.from_dict(config), cut=cut).run()
        assert len(record["losses"]) == len(local) == 6
        for got, want in zip(record["losses"], local):
            assert abs(got - want) <= 1e-4
        # every stage was released: nobody is training any more
        await wait_until(lambda: all(not a.training.hosts for a in swarm.live()), timeout_s=5)
        nursery.cancel_scope.cancel()


async def test_replicas_across_three_fellows_sync_and_loss_falls(autojump_clock) -> None:
    config = job_config(replicas="auto", steps=8, micro_batch=4)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        asker = swarm.live()[2]
        plan = await asker.leadership.ask("job-plan", {"config": config})
        assert len(plan["replicas"]) == 3
        fellows = {s["fellow"] for r in plan["replicas"] for s in r["stages"]}
        assert len(fellows) == 3
        record = await asker.training.submit(config)
        record = await finished(asker, record["job_id"])
        assert record["state"] == "finished", record["reason"]
        assert record["replicas"] == 3 and record["bytes_sent"] > 0
        losses = record["losses"]
        assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1
        nursery.cancel_scope.cancel()


async def test_pinned_plan_on_a_changed_cluster_is_refused(autojump_clock) -> None:
    config = job_config()
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        plan = await swarm.live()[0].leadership.ask("job-plan", {"config": config,
                                                                 "stages": 2})
        used = {s["fellow"] for s in plan["stages"]}
        asker = next((a for a in swarm.live() if a.name not in used), swarm.live()[0])
        gone = next(i for i, f in enumerate(swarm.fellows)
                    if f.name in used and f.agent is not asker
                    and not f.agent.leadership.is_leader())
        swarm.crash(gone)
        await wait_until(lambda: swarm.states_seen_by_all(gone) <= {"dead"}, timeout_s=60)
        with pytest.raises(PlanChanged) as caught:
            await asker.training.submit(config, plan_id=plan["plan_id"], stages=2)
        assert caught.value.expected_plan_id == plan["plan_id"]
        assert caught.value.changes
        assert await asker.training.list_jobs() == []
        nursery.cancel_scope.cancel()


async def test_pinned_job_whose_fellow_changed_stays_pending(autojump_clock) -> None:
    config = job_config()
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        asker = swarm.live()[0]
        plan = await asker.leadership.ask("job-plan", {"config": config, "stages": 3})
        # a fellow's memory is taken before its gossip says so: the leader's view still
        # gives the plan, the fellow's live view refuses its stage
        victim = next(f for f in swarm.fellows if f.name == plan["stages"][1]["fellow"])
        victim.cards.cards = (cpu_card(16.0, free_gb=0.01, name=f"{victim.name} CPU"),)
        record = await asker.training.submit(config, plan_id=plan["plan_id"], stages=3)
        job_id = record["job_id"]

        async def state() -> dict[str, Any]:
            return next(j for j in await asker.training.list_jobs() if j["job_id"] == job_id)

        await trio.sleep(3)
        now = await state()
        assert now["state"] == "pending"
        assert now["reason"].startswith("the cluster changed since the plan was shown: ")
        assert victim.name in now["reason"] or "free" in now["reason"]
        await trio.sleep(30)  # gossip catches up: still pending, never started elsewhere
        now = await state()
        assert now["state"] == "pending" and now["step"] == 0
        assert now["reason"].startswith("the cluster changed since the plan was shown: ")
        assert all(not a.training.hosts for a in swarm.live())
        cancelled = await asker.leadership.ask("job-cancel", {"job_id": job_id})
        assert cancelled["job_id"] == job_id
        await wait_until(lambda: asker.training is not None, timeout_s=1)
        await trio.sleep(1)
        assert (await state())["state"] == "cancelled"
        nursery.cancel_scope.cancel()


async def test_cancel_a_running_job_releases_its_stages(autojump_clock) -> None:
    config = job_config(steps=1000)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        asker = swarm.live()[1]
        record = await asker.training.submit(config, stages=3)
        job_id = record["job_id"]
        await wait_until(lambda: any(a.training.hosts for a in swarm.live()), timeout_s=30)
        leader = next(a for a in swarm.live() if a.leadership.is_leader())
        await wait_until(lambda: leader.training.jobs[job_id].step >= 2, timeout_s=60)
        await asker.training._op_cancel({"job_id": job_id})
        record = await finished(asker, job_id)
        assert record["state"] == "cancelled" and 2 <= record["step"] < 1000
        await wait_until(lambda: all(not a.training.hosts for a in swarm.live()), timeout_s=10)
        nursery.cancel_scope.cancel()


async def test_bad_config_is_refused_with_a_clear_error(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, n=1)
        agent = swarm.live()[0]
        with pytest.raises(ConfigError, match="model"):
            await agent.training._op_plan({"op": "job_plan", "config": {"steps": 3}})
        with pytest.raises(ConfigError, match="seq_len"):
            await agent.training._op_submit({"config": job_config(seq_len=0)})
        with pytest.raises(ConfigError, match="unknown setting"):
            await agent.training._op_submit({"config": job_config(speed=3)})
        with pytest.raises(ConfigError, match="job_id"):
            await agent.training._op_cancel({})
        assert await agent.training.list_jobs() == []
        nursery.cancel_scope.cancel()


async def test_resume_continues_the_loss_trajectory(autojump_clock, tmp_path: Path) -> None:
    config = job_config(steps=6, checkpoint={"dir": str(tmp_path / "ckpt"),
                                             "interval_steps": 2})
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        asker = swarm.live()[1]
        record = await asker.training.submit(config, stages=3)
        job_id = record["job_id"]
        leader = next(a for a in swarm.live() if a.leadership.is_leader())
        job = leader.training.jobs[job_id]

        def stop_at_step_3() -> bool:  # every process stopped mid-run
            if job.step >= 3 and job.scope is not None:
                job.cancel_asked = True
                job.scope.cancel()
                return True
            return False

        await wait_until(stop_at_step_3, timeout_s=60, step_s=0.0005)
        stopped = await finished(asker, job_id)
        assert stopped["state"] == "cancelled" and stopped["checkpoint"]
        resumed = await asker.training.submit(None, stages=3, resume=job_id)
        assert resumed["job_id"] == job_id
        record = await finished(asker, job_id)
        assert record["state"] == "finished", record["reason"]
        plan = await asker.leadership.ask("job-plan", {"config": config, "stages": 3})
        cut = [s["layers"][0] for s in plan["stages"][1:]]
        local = LocalRun(JobConfig.from_dict({**config, "checkpoint": {}}), cut=cut).run()
        assert len(record["losses"]) == 6
        for got, want in zip(record["losses"], local):
            assert abs(got - want) <= 1e-4
        nursery.cancel_scope.cancel()
