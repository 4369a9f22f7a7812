"""A job's data travels with the job: relative paths resolve against the job file, the
submitting fellow reads the files and sends them, hashed; the leader never reads a path
from its own disk. In virtual time, torch inline."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import trio

from p2pswarm.agent.streams import send_message
from p2pswarm.agent.training.links import receive_answer
from p2pswarm.errors import ConfigError, RemoteProtocolError, TransportError
from p2pswarm.training import JobConfig, LocalRun
from p2pswarm.wire.training import Ack, DataPut, StatePart
from tests.training_swarm import (
    SMALL_LLAMA,
    finished,
    job_config,
    leader_and_asker,
    start_swarm,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

TEXT = "".join(f"Line {i}: the fellows trained on this text and on no other.\n"
               for i in range(200))


def _job_file(directory: Path) -> Path:
    directory.mkdir()
    (directory / "notes.txt").write_text(TEXT)
    path = directory / "job.json"
    path.write_text(json.dumps(job_config(model={"config": SMALL_LLAMA}, steps=3,
                                          data={"files": ["notes.txt"]})))
    return path


def test_relative_data_paths_resolve_against_the_job_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _job_file(tmp_path / "job")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    job = JobConfig.from_json(Path("../job/job.json"))
    assert job.data.files == (str((tmp_path / "job" / "notes.txt").resolve()),)
    assert JobConfig.from_json(path).data.files == job.data.files


async def test_the_submitting_fellow_sends_the_data_and_the_job_trains_on_it(
        autojump_clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _job_file(tmp_path / "job")
    monkeypatch.chdir(tmp_path)  # submitted from another working directory
    config = JobConfig.from_json(Path("job/job.json")).to_dict()
    digest = hashlib.sha256(TEXT.encode()).hexdigest()
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, n=3)
        leader, asker = leader_and_asker(swarm)
        record = await asker.control_ops["job_submit"]({"config": config, "stages": 2})
        record = await finished(asker, record["job_id"])
        assert record["state"] == "finished", record["reason"]
        # the job names its text by hash; the leader holds it in its store
        sent = leader.training.jobs[record["job_id"]].config.data.files
        assert sent == (f"sha256:{digest}",)
        assert leader.training.data.path(digest).read_text() == TEXT
        assert asker.training.data.has(digest)
        plan = await asker.training.ask_plan(config, stages=2)
        cut = [s["layers"][0] for s in plan["stages"][1:]]
        local = LocalRun(JobConfig.from_json(path), cut=cut).run()
        assert record["losses"] == pytest.approx(local, abs=1e-4)
        # a path reaching the leader is refused: it never reads one from its own disk
        with pytest.raises(ConfigError, match="never read from the leader's disk"):
            await asker.training.submit(config, stages=2)
        # and a relative path reaching an agent has no job file to resolve against
        relative = job_config(steps=3, data={"files": ["notes.txt"]})
        with pytest.raises(ConfigError, match="relative path"):
            await asker.control_ops["job_submit"]({"config": relative, "stages": 2})
        nursery.cancel_scope.cancel()


async def test_a_leader_without_the_data_fetches_it_and_bad_data_never_lands(
        autojump_clock, tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text(TEXT)
    digest = hashlib.sha256(TEXT.encode()).hexdigest()
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, n=3)
        holder, other, _ = swarm.live()
        job = await holder.training.data.attach(
            JobConfig.from_dict(job_config(model={"config": SMALL_LLAMA},
                                           data={"files": [str(text)]})))
        assert job.data.files == (f"sha256:{digest}",)
        assert not other.training.data.has(digest)
        here = await other.training.data.local(job)  # fetched from the holder
        assert Path(here.data.files[0]).read_text() == TEXT
        assert other.training.data.has(digest)
        leader, _ = leader_and_asker(swarm)
        target = next(a for a in swarm.live() if a is not leader)
        sender = next(a for a in swarm.live() if a is not leader and a is not target)
        # job data from a fellow that does not lead is refused and counted before anything
        # is evicted or written: it cannot push other jobs' data out of the store
        before = sorted(p.name for p in target.training.data.root.iterdir())
        bad = hashlib.sha256(b"something else").hexdigest()
        async with await sender.open_secure(target.addr) as stream:
            await send_message(stream, DataPut(bad, target.training.data.cap))
            with pytest.raises(TransportError, match="only the leader"):
                await receive_answer(stream, Ack, "target", name_stage=False)
        assert target.counters.refused["data-put-not-leader"] == 1
        assert sorted(p.name for p in target.training.data.root.iterdir()) == before
        # from the leader: bytes that do not match their name are refused, nothing kept
        async with await leader.open_secure(target.addr) as stream:
            await send_message(stream, DataPut(bad, 4))
            await send_message(stream, StatePart(0, b"evil"))
            with pytest.raises(TransportError, match="does not match"):
                await receive_answer(stream, Ack, "target", name_stage=False)
        assert not target.training.data.has(bad)
        assert sorted(p.name for p in target.training.data.root.iterdir()) == before
        # a size over the cap is refused before a byte is written
        async with await leader.open_secure(target.addr) as stream:
            await send_message(stream, DataPut(bad, target.training.data.cap + 1))
            with pytest.raises(TransportError, match="over the"):
                await receive_answer(stream, Ack, "target", name_stage=False)
        # a name that is no hash never becomes a path
        with pytest.raises(RemoteProtocolError):
            target.training.data.path("../../etc/passwd")
        nursery.cancel_scope.cancel()


def test_train_from_another_directory_sends_the_jobs_text_to_the_leader(
        tmp_path: Path) -> None:
    """Real processes: two `join` fellows on loopback; `train --config job/job.json` run
    from an unrelated directory on the fellow that does not lead: the relative text file
    is read there, sent to the leader under its hash, and the job trains on it."""
    import os

    from p2pswarm.demo import form_swarm, local_swarm
    from p2pswarm.sim.commands import cli

    _job_file(tmp_path / "job")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    digest = hashlib.sha256(TEXT.encode()).hexdigest()
    with local_swarm(lambda text: None) as swarm:
        names = ["fellow-1", "fellow-2"]
        status = form_swarm(swarm, names, ("--cpu-memory", "1500MB", "--log-level",
                                           "warning"), "1500MB", lambda text: None, 0.0)
        leader = status["leader"]["name"]
        submitter = next(n for n in names if n != leader)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
        done = cli("train", "--config", "../job/job.json", "--home",
                   str(swarm.homes[submitter]), "--json", cwd=elsewhere, timeout_s=240, env=env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        record = json.loads(done.stdout)
        assert record["state"] == "finished" and record["step"] == 3
        stored = swarm.homes[leader] / "job-data" / digest
        assert stored.read_text() == TEXT
        assert (swarm.homes[submitter] / "job-data" / digest).is_file()
