"""A job from another fellow names no path on the leader's disk (issue 19, part 5).

A rogue fellow (it holds the token, it is not the leader) submits jobs whose
``checkpoint.dir`` is a directory outside any state directory, a relative climb, or a
sensitive directory, whose model is a path to read, or which resume from a directory.
The leader keeps such a job's checkpoints in its own state directory (the record says
where), refuses the model and the resume in one line, counts each, and stays up; a
snapshot of the whole temporary tree shows nothing written outside the state
directories. The leader's own user still gets the directory it names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pswarm.agent.training.job_paths import (
    JobPathRefused,
    check_model_from_fellow,
    check_resume_from_fellow,
    leader_checkpoint_dir,
)
from p2pswarm.names import UnsafeName
from p2pswarm.training.job import JobConfig
from p2pswarm.wire.jobs import JobPlanAsk, JobRecord, JobSubmit
from p2pswarm.wire.orders import CallFailed, pack_doc, unpack_doc
from tests.adversary.rogue import Rogue, rogue_factory
from tests.adversary.snapshot import tree
from tests.cpu_swarm import start_cpu_swarm
from tests.training_swarm import finished, job_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_rules_alone(tmp_path: Path) -> None:
    model_dir = tmp_path / "served"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    check_model_from_fellow(JobConfig.from_dict({"model": "tiny-llama"}), [])
    check_model_from_fellow(JobConfig.from_dict({"model": str(model_dir)}), [str(model_dir)])
    for name in ("/etc", str(model_dir), "org/model", "../../etc"):
        with pytest.raises(JobPathRefused, match="refused: a job from a fellow"):
            check_model_from_fellow(JobConfig.from_dict({"model": name}), [str(tmp_path)])
    check_resume_from_fellow("job-0123abcd")
    for resume in ("/tmp/ckpt", "../ckpt", "job-0123abcd/..", "ckpt"):
        with pytest.raises(JobPathRefused, match="by its id"):
            check_resume_from_fellow(resume)
    assert leader_checkpoint_dir(tmp_path, "job-0123abcd") == tmp_path / "job-0123abcd"
    for job_id in ("..", "../x", "/etc", ".hidden"):
        with pytest.raises(UnsafeName):
            leader_checkpoint_dir(tmp_path, job_id)


def _submit(config: dict[str, Any], term: int, resume: str = "") -> JobSubmit:
    return JobSubmit(pack_doc(config), "", 1, resume, "", (), term)


async def test_a_rogue_fellows_job_paths_stay_in_the_leaders_state_dir(
        autojump_clock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    cwd = tmp_path / "cwd" / "a" / "b"  # where a relative climb would land, in the snapshot
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    sensitive = tmp_path / "home" / ".ssh"
    sensitive.mkdir(parents=True)
    (sensitive / "authorized_keys").write_text("ssh-ed25519 AAAA honest\n")
    model_dir = tmp_path / "models" / "secret"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    async with trio.open_nursery() as nursery:
        swarm = await start_cpu_swarm(nursery, 3, 5, agent_factory=rogue_factory(2))
        rogue = Rogue(swarm, 2)
        leader = next(a for a in swarm.live() if a.leadership.is_leader())
        assert leader is not rogue.agent
        for a in swarm.live():
            a.training.copies._root = state / a.name / "checkpoint-copies"
            a.training._checkpoints_root = state / a.name / "job-checkpoints"
        before = tree(tmp_path, skip=state)
        kept = leader.training.checkpoints_root

        # a checkpoint.dir outside, a relative climb, a sensitive directory: each job is
        # taken, its checkpoints kept in the leader's own state directory
        records = []
        for where in (str(tmp_path / "outside"), "../../escape", str(sensitive)):
            steps = 2 if not records else 1000
            config = job_config(steps=steps, checkpoint={"dir": where, "interval_steps": 2,
                                                         "keep": 1})
            reply = await rogue.order(leader.addr, _submit(config, rogue.term))
            assert isinstance(reply, JobRecord), reply
            record = unpack_doc(reply.record)
            assert record["checkpoint_dir"] == str(kept / record["job_id"])
            records.append(record)
        for record in records[1:]:  # only the first needs to train
            await leader.training.leader.cancel(record["job_id"])
        done = await finished(leader, records[0]["job_id"])
        assert done["state"] == "finished", done["reason"]
        assert Path(done["checkpoint"]).parent == kept / done["job_id"]
        assert (kept / done["job_id"] / "step-00000002" / "manifest.json").is_file()

        # a model to read, and a resume from a directory: refused in one line, counted
        for model in ("/etc", str(model_dir)):
            for call in (_submit(job_config(model=model), rogue.term),
                         JobPlanAsk(pack_doc(job_config(model=model)), 1, "", (), rogue.term)):
                reply = await rogue.order(leader.addr, call)
                assert isinstance(reply, CallFailed) and reply.kind == "ConfigError", reply
                assert "refused: a job from a fellow" in reply.text
        for resume in ("/root/.ssh", "../../escape"):
            reply = await rogue.order(leader.addr, _submit(job_config(), rogue.term,
                                                           resume=resume))
            assert isinstance(reply, CallFailed) and "by its id" in reply.text

        refused = leader.status()["counters"]["refused"]
        assert refused["job-checkpoint-dir-moved"] == 3
        assert refused["job-model-path"] == 4
        assert refused["job-resume-path"] == 2
        assert all(not a.stopped.is_set() for a in swarm.live())
        assert len(await leader.training.list_jobs()) == 3
        nursery.cancel_scope.cancel()
    assert tree(tmp_path, skip=state) == before


async def test_the_leaders_own_user_gets_the_directory_it_names(
        autojump_clock: Any, tmp_path: Path) -> None:
    """Through the leader's own control socket (the CLI on its machine) the job's
    ``checkpoint.dir`` is honoured; a job resumed by id keeps it. (That the driver writes
    there: tests/test_agent_training_churn.py, tests/test_agent_training_takeover.py.)"""
    mine = tmp_path / "mine"
    async with trio.open_nursery() as nursery:
        swarm = await start_cpu_swarm(nursery, 2, 5)
        leader = next(a for a in swarm.live() if a.leadership.is_leader())
        for a in swarm.live():
            a.training.copies._root = tmp_path / "state" / a.name
        config = job_config(steps=1000, checkpoint={"dir": str(mine), "interval_steps": 2})
        record = await leader.training.submit(config, stages=1)
        assert record["checkpoint_dir"] == str(mine)
        job = leader.training.jobs[record["job_id"]]
        await leader.training.leader.cancel(record["job_id"])
        await finished(leader, record["job_id"])
        assert leader.training.checkpoint_dir(job) == mine  # where the driver writes
        again = await leader.training.submit(None, stages=1, resume=record["job_id"])
        assert again["checkpoint_dir"] == str(mine)
        await leader.training.leader.cancel(record["job_id"])
        assert leader.status()["counters"]["refused"].get("job-checkpoint-dir-moved", 0) == 0
        nursery.cancel_scope.cancel()


def test_train_says_where_the_leader_keeps_the_checkpoints() -> None:
    from p2pswarm.cli.training import kept_elsewhere_note

    job = {"checkpoint": {"dir": "/home/me/ckpt"}}
    kept = {"job_id": "job-0123abcd", "checkpoint_dir": "/srv/leader/job-checkpoints/x"}
    line = kept_elsewhere_note(job, kept)
    assert "kept on the leader in /srv/leader/job-checkpoints/x" in line
    assert "jobs export job-0123abcd --out DIR" in line
    assert kept_elsewhere_note(job, {**kept, "checkpoint_dir": "/home/me/ckpt"}) == ""
    assert kept_elsewhere_note({"checkpoint": {}}, kept) == ""
    assert kept_elsewhere_note(None, kept) == ""
