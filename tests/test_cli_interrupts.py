"""What `leave` says, and Ctrl-C on `load` and `train`, against a stand-in agent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from p2pswarm.cli import app
from p2pswarm.wire.control import LoadCancelRequest, LoadRequest
from tests.fakes import FakeAgent
from tests.test_training_cli import JOB, record

runner = CliRunner()


def interrupted(req: dict[str, Any]) -> Any:
    raise KeyboardInterrupt  # as Python raises it in the blocked read on Ctrl-C


@pytest.mark.parametrize(("outcome", "said"), [
    ({"acknowledged": 3, "fellows": 3, "spread": True},
     "left the swarm: 3 of 3 fellows acknowledged\n"),
    ({"acknowledged": 3, "fellows": 5, "spread": True},
     "left the swarm: 3 of 5 fellows acknowledged, gossip carries it to the rest\n"),
    ({"acknowledged": 1, "fellows": 3, "spread": False},
     "left the swarm: 1 of 3 fellows acknowledged; the rest hear it by gossip (one that "
     "misses it records this fellow dead)\n"),
    ({"acknowledged": 0, "fellows": 0, "spread": True},
     "left the swarm (no fellow was connected)\n"),
])
def test_leave_says_how_many_fellows_acknowledged(agent: FakeAgent, outcome: dict[str, Any],
                                                  said: str) -> None:
    agent.answers["leave"] = outcome
    result = runner.invoke(app, ["leave"])
    assert result.exit_code == 0 and result.stdout == said


@pytest.mark.parametrize(("outcome", "said"), [
    ({"outcome": "cancelled", "plan_id": "0123456789abcdef"},
     "load cancelled (plan 0123456789abcdef): nothing stays loaded"),
    ({"outcome": "unloaded", "plan_id": "0123456789abcdef"},
     "load cancelled: plan 0123456789abcdef had just come up, and is unloaded again; "
     "nothing stays loaded"),
    ({"outcome": "unconfirmed", "plan_id": None},
     "the leader did not confirm the cancel: see `p2pswarm loads`"),
])
def test_ctrl_c_on_load_cancels_it_by_its_id(agent: FakeAgent, outcome: dict[str, Any],
                                             said: str) -> None:
    agent.events["load"] = [{"progress": {"stage": 0, "fellow": "fellow-1", "phase": "checked",
                                          "done_bytes": 0, "total_bytes": 59_000_000}}]
    agent.answers["load"] = interrupted
    agent.answers["load_cancel"] = {"load_id": "x", **outcome}
    result = runner.invoke(app, ["load", "small-llama"])
    assert result.exit_code == 130, result.output
    out = " ".join(result.stdout.split())
    assert "interrupted: cancelling the load, releasing every stage" in out
    assert said in out
    (load,), (cancel,) = agent.sent(LoadRequest), agent.sent(LoadCancelRequest)
    assert len(agent.requests) == 2
    assert len(load.load_id) == 16 and cancel.load_id == load.load_id


@pytest.fixture
def job_json(tmp_path: Path) -> Path:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(JOB))
    return path


def test_ctrl_c_on_train_without_a_terminal_leaves_it_running(
        agent: FakeAgent, job_json: Path, tmp_path: Path) -> None:
    agent.events["job_submit"] = [{"job": record()}]
    agent.answers["job_submit"] = interrupted
    home = tmp_path / "my home"
    result = runner.invoke(app, ["train", "--config", str(job_json), "--home", str(home)])
    assert result.exit_code == 130, result.output
    assert result.stdout.splitlines()[-1] == (
        f"job job-0000abcd keeps running; stop it with: p2pswarm jobs cancel job-0000abcd "
        f"--home '{home}'")
    assert [r["op"] for r in agent.requests] == ["job_submit"]  # nothing cancelled


def test_ctrl_c_on_train_at_a_terminal_asks(agent: FakeAgent, job_json: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("p2pswarm.cli.training.interactive", lambda: True)
    agent.events["job_submit"] = [{"job": record()}]
    agent.answers["job_submit"] = interrupted
    agent.answers["job_cancel"] = lambda req: record(job_id=req["job_id"])
    result = runner.invoke(app, ["train", "--config", str(job_json)], input="y\n")
    assert result.exit_code == 130, result.output
    assert "cancel job job-0000abcd? (no: it keeps running)" in result.output
    assert "cancelling job-0000abcd (was running); its checkpoints stay" in result.stdout
    assert agent.requests[-1] == {"op": "job_cancel", "job_id": "job-0000abcd"}

    agent.requests.clear()
    result = runner.invoke(app, ["train", "--config", str(job_json)], input="n\n")
    assert result.exit_code == 130, result.output
    assert result.stdout.splitlines()[-1] == ("job job-0000abcd keeps running; stop it "
                                              "with: p2pswarm jobs cancel job-0000abcd")
    assert [r["op"] for r in agent.requests] == ["job_submit"]


def test_ctrl_c_on_train_before_the_leader_answered(agent: FakeAgent, job_json: Path) -> None:
    agent.answers["job_submit"] = interrupted
    result = runner.invoke(app, ["train", "--config", str(job_json)])
    assert result.exit_code == 130, result.output
    assert "interrupted before the leader answered: the job may still start; " \
        "`p2pswarm jobs` lists it, `p2pswarm jobs cancel JOB_ID` stops it" in result.stdout


def test_status_lists_the_stages_this_fellow_holds(agent: FakeAgent) -> None:
    agent.answers["status"] = {
        "self": {"id": "ab" * 16, "name": "fellow-1", "addr": "127.0.0.1:7946"},
        "preset": "local", "health": 0, "leader": None, "leader_note": "no leader yet",
        "members": [], "counters": {}, "stages_held": [
            {"plan_id": "0123456789abcdef", "stage": 1, "state": "releasing",
             "claim_bytes": 67_125_376, "allocated_bytes": 0}]}
    result = runner.invoke(app, ["status"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "holds: stage 1 of 0123456789abcdef (releasing, 67.1 MB claimed)" in result.stdout


async def test_a_streaming_client_that_hangs_up_cancels_its_op_at_once(
        tmp_path: Path) -> None:
    import socket

    import trio

    from p2pswarm.control.protocol import pack, socket_path
    from p2pswarm.control.server import serve_control

    home = tmp_path / "h"
    home.mkdir()
    began, ended = trio.Event(), trio.Event()

    async def handle(request: dict[str, Any]) -> Any:
        began.set()
        try:
            await trio.sleep_forever()  # a load waiting on its stages, emitting nothing
        finally:
            ended.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, home, handle)

        def ask_then_hang_up() -> None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(socket_path(home)))
                sock.sendall(pack({"op": "load", "stream": True}))
                trio.from_thread.run(began.wait)

        await trio.to_thread.run_sync(ask_then_hang_up)
        with trio.fail_after(5):
            await ended.wait()
        nursery.cancel_scope.cancel()


def test_a_second_ctrl_c_stops_waiting_for_the_cancel(agent: FakeAgent) -> None:
    agent.answers["load"] = interrupted
    agent.answers["load_cancel"] = interrupted
    result = runner.invoke(app, ["load", "small-llama"])
    assert result.exit_code == 130, result.output
    assert "not waiting: the agent goes on cancelling it" in result.stdout
