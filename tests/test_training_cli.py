"""The training commands (train, jobs, jobs cancel) against a stand-in agent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from p2pswarm.cli import app
from p2pswarm.errors import ConfigError
from p2pswarm.planner import BUILTIN_MODELS, cluster_from_dict, plan_message
from tests.fakes import FakeAgent

runner = CliRunner()

JOB = {"model": "tiny-llama", "seq_len": 32, "micro_batch": 2, "steps": 6, "seed": 3}


def a_train_plan() -> dict[str, Any]:
    view = cluster_from_dict({"fellows": [
        {"id": f"{i:02x}", "name": f"fellow-{i + 1}",
         "cards": [{"index": 0, "kind": "cpu", "name": "CPU", "total_bytes": "16GB",
                    "free_bytes": "16GB"}]} for i in range(3)]})
    plan = plan_message({"model": {"name": "tiny-llama", "config": BUILTIN_MODELS[
        "tiny-llama"]}, "kind": "train", "seq_len": 32, "micro_batch": 2, "steps": 6,
        "stages": 3}, view)
    plan["replicas"] = [{"replica": 0, "plan_id": plan["plan_id"], "stages": plan["stages"],
                         "strip_text": plan["layout"]["strip_text"]}]
    return plan


def record(state: str = "running", **extra: Any) -> dict[str, Any]:
    return {"job_id": "job-0000abcd", "state": state, "reason": "", "step": 3, "steps": 6,
            "loss": 3.25, "losses": [3.5, 3.4, 3.25], "tokens_per_s": 1200.0,
            "replicas": 2, "bytes_sent": 4_000_000, "samples": 12, "plan_id": "0" * 16,
            "pinned": False, "model": "tiny-llama", "checkpoint": "", "stages": [],
            **extra}


@pytest.fixture
def job_json(tmp_path: Path) -> Path:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(JOB))
    return path


def test_train_plan_json_prints_the_plan_and_starts_nothing(agent: FakeAgent,
                                                            job_json: Path) -> None:
    plan = a_train_plan()
    agent.answers["job_plan"] = plan
    result = runner.invoke(app, ["train", "--config", str(job_json), "--plan", "--json",
                                 "--stages", "3", "--maximize-seq-len"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["plan_id"] == plan["plan_id"] and len(shown["replicas"]) == 1
    (req,) = agent.requests
    assert req["op"] == "job_plan" and req["stages"] == 3 and req["maximize"] == "seq_len"
    assert req["config"]["model"] == "tiny-llama" and req["config"]["seq_len"] == 32


def test_train_maximize_seq_len_reaches_the_job_that_runs(agent: FakeAgent,
                                                          job_json: Path) -> None:
    agent.answers["job_submit"] = record("finished", step=6, seq_len=512)
    result = runner.invoke(app, ["train", "--config", str(job_json), "--maximize-seq-len",
                                 "--json"])
    assert result.exit_code == 0, result.output
    (req,) = agent.requests
    assert req["op"] == "job_submit" and req["maximize"] == "seq_len"
    assert json.loads(result.stdout)["state"] == "finished"


def test_train_shows_live_progress_and_fails_on_a_failed_job(agent: FakeAgent,
                                                             job_json: Path) -> None:
    agent.events["job_submit"] = [{"job": record()}, {"job": record(step=4, loss=3.1)}]
    agent.answers["job_submit"] = record("failed", reason="every replica lost a fellow")
    result = runner.invoke(app, ["train", "--config", str(job_json)])
    assert result.exit_code == 1
    assert "step 3/6, loss 3.2500" in result.output and "step 4/6" in result.output
    assert "every replica lost a fellow" in result.output


def test_jobs_json_lists_the_records(agent: FakeAgent) -> None:
    agent.answers["jobs"] = [record(), record("pending", job_id="job-0000beef",
                                              reason="waiting for fellows: f001: busy")]
    result = runner.invoke(app, ["jobs", "--json"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)
    assert [j["state"] for j in listed] == ["running", "pending"]
    result = runner.invoke(app, ["jobs"])
    assert "job-0000beef pending" in result.stdout and "waiting for fellows" in result.stdout


def test_jobs_cancel_names_the_job_and_errors_in_one_line(agent: FakeAgent) -> None:
    agent.answers["job_cancel"] = lambda req: record(job_id=req["job_id"])
    result = runner.invoke(app, ["jobs", "cancel", "job-0000abcd", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["job_id"] == "job-0000abcd"
    assert agent.requests[-1] == {"op": "job_cancel", "job_id": "job-0000abcd"}
    agent.answers["job_cancel"] = ConfigError("no job 'job-x'; jobs: none")
    result = runner.invoke(app, ["jobs", "cancel", "job-x"])
    assert result.exit_code != 0
    assert "no job 'job-x'" in result.output and "Traceback" not in result.output


def test_a_bad_job_json_is_one_clear_line(agent: FakeAgent, tmp_path: Path) -> None:
    bad = tmp_path / "job.json"
    bad.write_text(json.dumps({**JOB, "seq_len": 0}))
    result = runner.invoke(app, ["train", "--config", str(bad)])
    assert result.exit_code != 0 and "seq_len" in result.output
    assert len(result.output.strip().splitlines()) == 1 and agent.requests == []


def test_jobs_says_when_a_job_moved_to_a_new_leader(agent: FakeAgent) -> None:
    moved = ("moved from leader f000 to f001 (term 3) at step 8: resumed where its rounds "
             "stood (round 4, step 8)")
    agent.answers["jobs"] = [record(moved=moved), record(job_id="job-0000beef")]
    result = runner.invoke(app, ["jobs"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("job-0000abcd running") and lines[1] == f"  {moved}"
    assert lines[2].startswith("job-0000beef running") and len(lines) == 3
