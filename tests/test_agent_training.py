"""Training jobs across real agents on MemoryNetwork, in virtual time.

Torch runs inline (``VirtualSwarm(inline_compute=True)``), so compute takes no virtual time; the
models are the built-in tiny one, the steps few.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from p2pswarm.errors import ConfigError, PlanChanged
from p2pswarm.sim.virtual import cpu_card, wait_until
from p2pswarm.training import JobConfig, LocalRun
from tests.training_swarm import (
    SMALL_LLAMA,
    disks_under,
    finished,
    job_config,
    leader_and_asker,
    leader_of,
    new_disk_under,
    start_swarm,
    stopping_at,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


async def test_one_replica_three_stages_equals_one_process(autojump_clock) -> None:
    config = job_config()
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        asker = swarm.live()[1]
        plan = await asker.training.ask_plan(config, stages=3)
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


async def test_pinned_plan_on_a_changed_cluster_is_refused(autojump_clock) -> None:
    config = job_config()
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        plan = await swarm.live()[0].training.ask_plan(config, stages=2)
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


async def test_a_pin_made_with_cards_left_out_holds_only_with_them_left_out(
        autojump_clock) -> None:
    config = job_config(steps=1000)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        asker = swarm.live()[1]
        whole = await asker.control_ops["job_plan"]({"config": config, "stages": 2})
        left_out = f"{whole['stages'][0]['fellow_id']}:cpu"
        plan = await asker.control_ops["job_plan"]({"config": config, "stages": 2,
                                                   "exclude_cards": [left_out]})
        assert plan["plan_id"] != whole["plan_id"]
        with pytest.raises(PlanChanged):  # the same pin without the exclusion
            await asker.training.submit(config, plan_id=plan["plan_id"], stages=2)
        record = await asker.training.submit(config, plan_id=plan["plan_id"], stages=2,
                                             exclude_cards=[left_out])
        assert record["plan_id"] == plan["plan_id"]
        await asker.control_ops["job_cancel"]({"job_id": record["job_id"]})
        nursery.cancel_scope.cancel()


async def test_pinned_job_whose_fellow_changed_stays_pending(autojump_clock) -> None:
    config = job_config()
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        asker = swarm.live()[0]
        plan = await asker.training.ask_plan(config, stages=3)
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
        cancelled = await asker.training.ask_cancel(job_id)
        assert cancelled["job_id"] == job_id
        await wait_until(lambda: asker.training is not None, timeout_s=1)
        await trio.sleep(1)
        assert (await state())["state"] == "cancelled"
        nursery.cancel_scope.cancel()


async def test_a_refused_attempt_to_place_a_job_again_releases_what_it_placed(
        autojump_clock) -> None:
    """A job placed again (it holds an old placement) whose attempt one fellow refuses:
    the stages the other fellows took in that attempt are released, not left held to
    refuse the next attempt's order for them ("already holds"). The release used to go
    to the old placement's fellows only."""
    from p2pswarm.agent.training.jobs import Job
    from p2pswarm.agent.training.placed import BatchShape, ReplicaPlacement, StagePlacement
    from p2pswarm.training.job import JobConfig

    config = job_config()
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        leader = leader_of(swarm)
        plan = await leader.training.ask_plan(config, stages=3)
        victim = next(f for f in swarm.fellows if f.name == plan["stages"][1]["fellow"])
        victim.cards.cards = (cpu_card(16.0, free_gb=0.01, name=f"{victim.name} CPU"),)
        cfg = JobConfig.from_dict(config)
        job = Job("job-0000aaaa", cfg, plan["plan_id"], pinned=False, stages=3)
        job.term = leader.leadership.term()
        before = StagePlacement(0, "", victim.name, victim.addr, (0, 1), "cpu", 0, "CPU", 0)
        job.placement = (ReplicaPlacement((before,), BatchShape.of_job(cfg)),)  # it ran here
        with trio.move_on_after(1):  # one attempt, refused by the victim
            await leader.training.placer.place(job)
        assert job.state == "pending" and victim.name in job.reason
        assert not any(a.training.hosts for a in swarm.live())
        nursery.cancel_scope.cancel()


async def test_cancel_a_running_job_releases_its_stages(autojump_clock) -> None:
    config = job_config(steps=1000)
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        asker = swarm.live()[1]
        record = await asker.training.submit(config, stages=3)
        job_id = record["job_id"]
        await wait_until(lambda: any(a.training.hosts for a in swarm.live()), timeout_s=30)
        leader = leader_of(swarm)
        await wait_until(lambda: leader.training.jobs[job_id].step >= 2, timeout_s=60)
        await asker.control_ops["job_cancel"]({"job_id": job_id})
        record = await finished(asker, job_id)
        assert record["state"] == "cancelled" and 2 <= record["step"] < 1000
        await wait_until(lambda: all(not a.training.hosts for a in swarm.live()), timeout_s=10)
        nursery.cancel_scope.cancel()


async def test_bad_config_is_refused_with_a_clear_error(autojump_clock) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, n=1)
        agent = swarm.live()[0]
        with pytest.raises(ConfigError, match="model"):
            await agent.control_ops["job_plan"]({"op": "job_plan", "config": {"steps": 3}})
        with pytest.raises(ConfigError, match="seq_len"):
            await agent.control_ops["job_submit"]({"config": job_config(seq_len=0)})
        with pytest.raises(ConfigError, match="unknown setting"):
            await agent.control_ops["job_submit"]({"config": job_config(speed=3)})
        with pytest.raises(ConfigError, match="job_id"):
            await agent.control_ops["job_cancel"]({})
        assert await agent.training.list_jobs() == []
        nursery.cancel_scope.cancel()


async def test_resume_continues_the_loss_trajectory_from_surviving_copies(
        autojump_clock, tmp_path: Path) -> None:
    """Every process stopped mid-run, the leader's checkpoint directory lost and one more
    fellow lost with its disk: ``resume`` fetches the shards from the fellows that hold
    copies and the loss trajectory goes on as if never interrupted."""
    config = job_config(model={"config": {**SMALL_LLAMA, "num_hidden_layers": 3}}, steps=6,
                        checkpoint={"dir": str(tmp_path / "ckpt"), "interval_steps": 3})
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, n=4)
        disks_under(swarm, tmp_path)
        leader, asker = leader_and_asker(swarm)
        record = await asker.training.submit(config, stages=3)
        job_id = record["job_id"]
        job = leader.training.jobs[job_id]

        stop_at_step_4 = stopping_at(job, 4)  # every process stopped mid-run

        await wait_until(stop_at_step_4, timeout_s=60, step_s=0.0005)
        stopped = await finished(asker, job_id)
        assert stopped["state"] == "cancelled" and stopped["checkpoint"]
        assert stopped["step"] == 4  # the checkpoint is from step 3
        # each shard is on two fellows besides the leader, on disk, so losing any one
        # fellow (the leader included) leaves a copy of every shard
        copies = stopped["checkpoint_copies"]
        assert copies and all(len(h) == 2 and leader.name not in h for h in copies.values())
        on_disk = {a.name: set(a.training.copies.held(job_id).get(3, []))
                   for a in swarm.live()}
        for shard, holders in copies.items():
            assert {n for n, held in on_disk.items() if shard in held} == set(holders)
        assert len({h for hs in copies.values() for h in hs}) == 3  # spread, not all on two
        ckpt = Path(stopped["checkpoint_dir"])  # the leader's own: asked from a fellow
        assert ckpt.name == job_id and not (tmp_path / "ckpt").exists()
        shutil.rmtree(ckpt)
        victim = next(i for i, f in enumerate(swarm.fellows)
                      if f.agent is not leader and f.name in copies[sorted(copies)[0]])
        swarm.crash(victim)
        await trio.sleep(1)
        again = await swarm.start(victim)  # back, its disk gone
        new_disk_under(again, tmp_path)
        assert again.training.copies.held(job_id) == {}
        await wait_until(lambda: swarm.converged(), timeout_s=60)
        resumed = await asker.training.submit(None, stages=3, resume=job_id)
        assert resumed["job_id"] == job_id
        record = await finished(asker, job_id)
        assert record["state"] == "finished", record["reason"]
        plan = await asker.training.ask_plan(config, stages=3)
        cut = [s["layers"][0] for s in plan["stages"][1:]]
        local = LocalRun(JobConfig.from_dict({**config, "checkpoint": {}}), cut=cut).run()
        assert len(record["losses"]) == 6
        for got, want in zip(record["losses"], local):
            assert abs(got - want) <= 1e-4
        assert (ckpt / "step-00000006" / "manifest.json").is_file()
        nursery.cancel_scope.cancel()
