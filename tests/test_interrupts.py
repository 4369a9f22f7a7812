"""Stopping and interrupting, as a user does it, on real processes on loopback.

- Ctrl-C on `load` while the stages fetch cancels it all or nothing: `loads` shows
  nothing and no fellow holds a stage.
- Ctrl-C on `train` with no terminal leaves the job running and prints the exact command
  that stops it; that command stops it.
- A fellow stopped with SIGTERM, with SIGINT (Ctrl-C on `join`) or with `p2pswarm leave`
  is recorded ``left`` by every other fellow, never ``dead``; twice, the second time after
  the three came back from the same homes.

One swarm of three fellows serves all three; the leavers join it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from p2pswarm.demo import DEMO_TRAIN_MEMORY, demo_job
from p2pswarm.errors import ControlError
from p2pswarm.sim.commands import cli, poll, start
from p2pswarm.sim.processes import LocalSwarm, local_swarm

pytestmark = pytest.mark.slow  # real processes: a minute or two, not seconds

QUIET = ("--http", "off", "--log-level", "info")


def command(*args: str) -> subprocess.Popen[str]:
    """A `p2pswarm` command with its output (both streams) readable line by line."""
    return start(*args, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})


def states_of(swarm: LocalSwarm, observer: str) -> dict[str, str]:
    try:
        return {m["name"]: m["state"] for m in swarm.status(observer)["members"]}
    except ControlError:
        return {}


def interrupt_when(process: subprocess.Popen[str], seen: Callable[[str], bool],
                   timeout_s: float) -> tuple[int, str]:
    """Send SIGINT (Ctrl-C) once a line of output satisfies ``seen``; the exit code and
    the whole output."""
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    interrupted = False
    for line in process.stdout:  # ends when the command exits
        lines.append(line)
        if not interrupted and seen(line):
            process.send_signal(signal.SIGINT)
            interrupted = True
        if time.monotonic() > deadline:
            process.kill()
            break
    code = process.wait(timeout=60)
    output = "".join(lines)
    assert interrupted, f"never saw what to interrupt on:\n{output[-3000:]}"
    return code, output


# --- interrupting load and train -----------------------------------------------------------


@pytest.fixture(scope="module")
def swarm() -> Iterator[LocalSwarm]:
    """Three fellows offering 1.5 GB of RAM each (enough to train the demo's model)."""
    with local_swarm(lambda line: None) as running:
        extra = ("--cpu-memory", DEMO_TRAIN_MEMORY, *QUIET)
        seed = running.start("fellow-1", extra=extra)
        for name in ("fellow-2", "fellow-3"):
            running.launch(name, seeds=(seed,), extra=extra)
        for name in ("fellow-1", "fellow-2", "fellow-3"):
            running.wait_for(name, lambda s: s["leader"] is not None and sum(
                m["state"] == "alive" for m in s["members"]) == 3, timeout_s=120,
                what="the swarm to form and elect a leader")
        yield running


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    from p2pswarm.models import write_builtin_checkpoint

    where = Path(tempfile.mkdtemp(prefix="p2ps-model-"))
    try:
        yield write_builtin_checkpoint("small-llama", where / "small-llama")
    finally:
        shutil.rmtree(where, ignore_errors=True)


def nothing_held(swarm: LocalSwarm) -> bool:
    return all(swarm.status(name)["stages_held"] == [] for name in swarm.homes)


def test_ctrl_c_on_load_while_stages_fetch_leaves_nothing_allocated(
        swarm: LocalSwarm, model_dir: Path) -> None:
    home = str(swarm.homes["fellow-1"])  # the model directory is on fellow-1's disk
    load = command("load", str(model_dir), "--stages", "3", "--weights-dtype", "f32", "--floor",
               "cpu=250MB", "--home", home)
    # a stage fetching its weights from fellow-1: the leader holds reservations everywhere
    code, output = interrupt_when(load, lambda line: "fetching weights" in line, 300)
    assert code == 130, output
    assert "checked, memory reserved" in output  # the leader had reserved stages
    assert "interrupted: cancelling the load" in output
    assert "load cancelled" in output and "nothing stays loaded" in output, output
    assert "loaded plan" not in output
    listed = cli("loads", "--json", "--home", home, check=True)
    assert json.loads(listed.stdout) == []
    # a stage released while its build ran drops what it built once the build ends
    poll("every fellow to hold no stage", lambda: nothing_held(swarm), 120)


def test_ctrl_c_on_train_without_a_terminal_leaves_the_job_running(
        swarm: LocalSwarm, tmp_path: Path) -> None:
    home = str(swarm.homes["fellow-2"])
    job = tmp_path / "job.json"
    job.write_text(json.dumps(demo_job(100_000, tmp_path / "checkpoints")))
    train = command("train", "--config", str(job), "--home", home)
    code, output = interrupt_when(train, lambda line: " running: step " in line
                                  and " running: step 0/" not in line, 300)
    assert code == 130, output
    last = output.strip().splitlines()[-1]
    prefix = "keeps running; stop it with: "
    assert prefix in last, output
    job_id = last.split()[1]
    stop = last.split(prefix, 1)[1]
    assert stop == f"p2pswarm jobs cancel {job_id} --home {shlex.quote(home)}"

    def state() -> str:
        done = cli("jobs", "--json", "--home", home, check=True)
        return str(next(j["state"] for j in json.loads(done.stdout) if j["job_id"] == job_id))

    assert state() == "running"
    # the printed command, as printed, stops it
    argv = shlex.split(stop)
    stopped = cli(*argv[1:])
    assert stopped.returncode == 0, stopped.stderr
    poll(f"job {job_id} to be cancelled", lambda: state() == "cancelled", 60)


# --- leaving -------------------------------------------------------------------------------


def test_sigterm_sigint_and_leave_are_each_recorded_left_by_every_fellow(
        swarm: LocalSwarm) -> None:
    seed = swarm.address("fellow-1")
    watchers = ["fellow-1", "fellow-2", "fellow-3"]
    leavers = ["f-term", "f-int", "f-leave"]
    ways = ["SIGTERM", "SIGINT", "leave"]
    for round_ in range(2):  # the second time from the same homes, ways rotated
        for name in leavers:
            # each offers its CPU as it is: free memory moves, and the cards are
            # republished (a republish during the goodbye once took it back)
            swarm.launch(name, seeds=(seed,), extra=QUIET)
        everyone = [*watchers, *leavers]
        for name in everyone:
            swarm.wait_for(name, lambda s: sum(m["state"] == "alive" for m in s["members"])
                           == len(everyone), timeout_s=90, what="the leavers to join")
        for name, way in zip(leavers, ways[round_:] + ways[:round_]):
            process = swarm.processes[name]
            everyone.remove(name)
            logs = {o: swarm.root / f"{o}.log" for o in everyone}
            since = {o: log.stat().st_size for o, log in logs.items()}
            if way == "leave":
                said = cli("leave", "--home", str(swarm.homes[name]))
                assert said.returncode == 0, said.stderr
                # all of them, or enough (3) with gossip carrying it to the rest
                acked = re.fullmatch(r"left the swarm: (\d+) of (\d+) fellows acknowledged"
                                     r"(, gossip carries it to the rest)?\n", said.stdout)
                assert acked is not None, said.stdout
                assert int(acked[2]) == len(everyone)
                assert min(3, len(everyone)) <= int(acked[1]) <= len(everyone)
            else:
                process.send_signal(getattr(signal, way))
            assert process.wait(timeout=30) == 0, f"{name} ({way}) exited badly"
            for observer in everyone:
                poll(f"{observer} to record {name} ({way}) as left",
                     lambda: states_of(swarm, observer).get(name) == "left", 20)
            # a goodbye missed at first and heard later would have been a death verdict
            # first (a `left` is never overturned by one): the logs since are the witness
            for observer, log in logs.items():
                with log.open("rb") as f:
                    f.seek(since[observer])
                    lines = f.read().decode(errors="replace").splitlines()
                assert [line for line in lines if f" dead {name} " in line] == [], observer


_HOLDS_A_SWARM = r"""
import sys, time
from p2pswarm.sim.processes import local_swarm
with local_swarm(lambda text: None) as swarm:
    swarm.start("fellow-1", extra=("--http", "off"))
    print(swarm.processes["fellow-1"].pid, flush=True)
    time.sleep(600)
"""


def test_sigterm_on_a_local_swarm_stops_its_fellows() -> None:
    """`timeout` or `kill` on a demo must not leave its fellows running without a parent."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDS_A_SWARM], stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True)
    assert holder.stdout is not None
    fellow = int(holder.stdout.readline())
    holder.send_signal(signal.SIGTERM)
    assert holder.wait(timeout=30) == 128 + signal.SIGTERM

    def gone() -> bool:
        try:
            os.kill(fellow, 0)
        except ProcessLookupError:
            return True
        return False

    poll("the fellow to stop", gone, timeout_s=20)
