"""Checkpoints of any size and any cut: a stage's state over 64 MiB (the old one-frame
cap) travels in parts, is copied to two fellows, and a job resumed from it goes on
exactly as if never stopped; a checkpoint resumed on another cut is re-sharded. In
virtual time, torch inline, on the built-in tiny model (and a smaller one)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from p2pswarm.planner.profile import BUILTIN_MODELS
from p2pswarm.sim.virtual import wait_until
from p2pswarm.training import JobConfig, LocalRun
from p2pswarm.training.checkpoint import CheckpointStore
from tests.training_swarm import (
    disks_under,
    finished,
    job_config,
    leader_and_asker,
    start_swarm,
    stopping_at,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

OLD_FRAME_CAP = 64 * 1024 * 1024
# tiny-llama shrunk further, for what needs no size: eight layers, tied head
SMALL = {**BUILTIN_MODELS["tiny-llama"], "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def _equal(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal to the bit, tensors included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


async def test_a_stage_state_over_64_mib_is_copied_twice_and_resumed_exactly(
        autojump_clock, tmp_path: Path) -> None:
    # tiny-llama cut in two: each stage's AdamW state with its sync vectors is ~72 MB
    def config(name: str, every: int, copies: int) -> dict[str, Any]:
        return job_config(steps=4, checkpoint={"dir": str(tmp_path / name),
                                               "interval_steps": every, "copies": copies})

    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, n=4)
        disks_under(swarm, tmp_path)
        leader, asker = leader_and_asker(swarm)

        # undisturbed: four steps, a checkpoint at the end (one copy is enough here)
        calm = await asker.training.submit(config("calm", 4, 1), stages=2)
        calm = await finished(asker, calm["job_id"])
        assert calm["state"] == "finished", calm["reason"]

        # the same job stopped after its checkpoint of step 2
        record = await asker.training.submit(config("ckpt", 2, 2), stages=2)
        job_id = record["job_id"]
        job = leader.training.jobs[job_id]

        stop_after_the_checkpoint = stopping_at(job, 3)

        await wait_until(stop_after_the_checkpoint, timeout_s=120, step_s=0.0005)
        stopped = await finished(asker, job_id)
        assert stopped["state"] == "cancelled" and stopped["checkpoint"]
        # submitted from another fellow: the leader keeps it in its own state directory
        ckpt = Path(stopped["checkpoint_dir"])
        assert ckpt != tmp_path / "ckpt" and ckpt.name == job_id
        store = CheckpointStore(ckpt)
        assert store.latest() == 2
        stage_shards = [n for n in store.manifest(2)["shards"] if ".stage-" in n
                        and n.startswith("replica-")]
        assert len(stage_shards) == 2
        for name in stage_shards:  # each over the cap a single frame used to have
            assert (store.step_dir(2) / f"{name}.pt").stat().st_size > OLD_FRAME_CAP
        # each shard on two fellows besides the leader, whole and verified on their disks
        copies = stopped["checkpoint_copies"]
        assert all(len(h) == 2 and leader.name not in h for h in copies.values())
        for name in stage_shards:
            for holder in copies[name]:
                agent = next(a for a in swarm.live() if a.name == holder)
                held = agent.training.copies.step_dir(job_id, 2) / f"{name}.pt"
                assert held.read_bytes() == (store.step_dir(2) / f"{name}.pt").read_bytes()
        # the leader's own copy lost: resume fetches every shard back from the fellows
        shutil.rmtree(ckpt)
        resumed = await asker.training.submit(None, stages=2, resume=job_id)
        assert resumed["job_id"] == job_id
        record = await finished(asker, job_id)
        assert record["state"] == "finished", record["reason"]
        assert record["losses"] == calm["losses"]
        # parameters and optimizer state equal to the bit at the end
        want, got = CheckpointStore(calm["checkpoint_dir"]), CheckpointStore(ckpt)
        assert got.latest() == want.latest() == 4
        for name in sorted(want.manifest(4)["shards"]):
            _equal(got.read(4, name), want.read(4, name), name)
        nursery.cancel_scope.cancel()


async def test_a_checkpoint_resumed_on_another_cut_is_re_sharded(
        autojump_clock, tmp_path: Path) -> None:
    """Trained in two stages, resumed in three: the leader re-shards the checkpoint and
    the job goes on as the run on the old cut would have."""
    config = job_config(model={"config": SMALL}, steps=4,
                        checkpoint={"dir": str(tmp_path / "ckpt"), "interval_steps": 2})
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, n=4)
        disks_under(swarm, tmp_path)
        leader, asker = leader_and_asker(swarm)
        record = await asker.training.submit(config, stages=2)
        job_id = record["job_id"]
        job = leader.training.jobs[job_id]
        ckpt = Path(record["checkpoint_dir"])  # the leader's own: asked from a fellow

        stop_after_the_checkpoint = stopping_at(job, 3)

        await wait_until(stop_after_the_checkpoint, timeout_s=120, step_s=0.0005)
        old_cut = job.placement[0].cut
        assert (await finished(asker, job_id))["state"] == "cancelled"
        resumed = await asker.training.submit(None, stages=3, resume=job_id)
        assert resumed["job_id"] == job_id
        record = await finished(asker, job_id)
        assert record["state"] == "finished", record["reason"]
        again = leader.training.jobs[job_id]  # the resumed job's record
        new_cut = again.placement[0].cut
        assert len(new_cut) == 2 and len(old_cut) == 1
        assert not list(ckpt.glob(".reshard-*"))  # the scratch copy is gone
        assert CheckpointStore(ckpt).manifest(4)["meta"]["cut"] == new_cut
        calm = LocalRun(JobConfig.from_dict({**config, "checkpoint": {}}), cut=old_cut).run()
        assert record["losses"] == pytest.approx(calm, abs=1e-4)
        nursery.cancel_scope.cancel()


async def test_a_resume_keeps_the_checkpoints_cut_where_the_cards_hold_it(
        autojump_clock, tmp_path: Path) -> None:
    """Trained in two stages, resumed without saying how many: the cards would hold the
    model in one, but the leader keeps the checkpoint's cut, so nothing is re-sharded."""
    config = job_config(model={"config": SMALL}, steps=4,
                        checkpoint={"dir": str(tmp_path / "ckpt"), "interval_steps": 2})
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, n=3)
        leader, asker = leader_and_asker(swarm)
        free_plan = await asker.training.ask_plan(config)
        assert len(free_plan["stages"]) == 1  # left to itself, the planner takes one card
        record = await asker.training.submit(config, stages=2)
        job_id = record["job_id"]
        job = leader.training.jobs[job_id]

        stop_after_the_checkpoint = stopping_at(job, 3)

        await wait_until(stop_after_the_checkpoint, timeout_s=120, step_s=0.0005)
        old_cut = job.placement[0].cut
        assert (await finished(asker, job_id))["state"] == "cancelled"
        await asker.training.submit(None, resume=job_id)
        record = await finished(asker, job_id)
        assert record["state"] == "finished", record["reason"]
        again = leader.training.jobs[job_id]
        assert again.placement[0].cut == old_cut
        calm = LocalRun(JobConfig.from_dict({**config, "checkpoint": {}}), cut=old_cut).run()
        assert record["losses"] == pytest.approx(calm, abs=1e-4)
        nursery.cancel_scope.cancel()


async def test_a_copy_that_lies_about_its_name_size_or_bytes_never_lands(
        autojump_clock, tmp_path: Path) -> None:
    from p2pswarm.agent.streams import send_message
    from p2pswarm.agent.training.links import receive_answer
    from p2pswarm.errors import TransportError
    from p2pswarm.wire.training import Ack, TrainShard

    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, n=2)
        sender, holder = swarm.live()
        holder.training.copies._root = tmp_path / "copies"
        good = hashlib.sha256(b"shard").hexdigest()
        cap = holder.config.transport.max_shard_bytes

        async def offer(*frames: TrainShard) -> str:
            async with await sender.open_secure(holder.addr) as stream:
                for frame in frames:
                    await send_message(stream, frame)
                with pytest.raises(TransportError) as refused:
                    await receive_answer(stream, Ack, "holder", name_stage=False)
            return str(refused.value)

        assert "bad name" in await offer(TrainShard("job-0000abcd", 1, "../evil", good, 0, 5,
                                                    b"shard"))
        assert "bad name" in await offer(TrainShard("..", 1, "replica-0.stage-0", good, 0, 5,
                                                    b"shard"))
        assert "over the" in await offer(TrainShard("job-0000abcd", 1, "replica-0.stage-0",
                                                    good, 0, cap + 1, b"shard"))
        assert "does not match" in await offer(TrainShard(
            "job-0000abcd", 1, "replica-0.stage-0", good, 0, 5, b"sharp"))
        assert "a part at" in await offer(
            TrainShard("job-0000abcd", 1, "replica-0.stage-0", good, 0, 5, b"sh"),
            TrainShard("job-0000abcd", 1, "replica-0.stage-0", good, 3, 5, b"ard"))
        left = [p for p in (tmp_path / "copies").rglob("*") if p.is_file()]
        assert left == []  # nothing half-written, nothing outside its directory
        nursery.cancel_scope.cancel()


async def test_sync_traffic_past_64_mib_a_frame_travels_in_parts(autojump_clock) -> None:
    """small-llama cut to six layers (19 M parameters) whole on one card, two replicas
    synced in fp32: the keeper's parameters, each delta and each update are about 76 MB,
    past the 64 MiB a frame holds, and the job trains through its rounds."""
    six = {**BUILTIN_MODELS["small-llama"], "num_hidden_layers": 6}
    config = job_config(model={"config": six}, seq_len=8, micro_batch=1, micro_batches=1,
                        steps=2, replicas=2,
                        sync={"inner_steps": 1, "codec": "fp32", "outer_lr": 1.0,
                              "outer_momentum": 0.0})
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, n=3)
        asker = swarm.live()[1]
        record = await asker.training.submit(config, stages=1)
        record = await finished(asker, record["job_id"])
        assert record["state"] == "finished", record["reason"]
        assert record["replicas"] == 2 and len(record["losses"]) == 2
        assert record["bytes_sent"] > 4 * OLD_FRAME_CAP  # two rounds' deltas and updates
        nursery.cancel_scope.cancel()
