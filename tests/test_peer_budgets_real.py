"""Real `join` processes under a fellow's costly asks: a plan of a model with 2^24 and
2^31-1 layers (refused, counted, the leader alive and leading), a model directory whose
generation_config.json links to the fellow's identity (refused in one line, nothing
offered), and `status --json` showing the loop's lag and the stores against their caps."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2pswarm.control.client import request
from p2pswarm.errors import SwarmError
from p2pswarm.models.files import SHIPPED_MODELS
from p2pswarm.sim.commands import cli
from p2pswarm.sim.processes import LocalSwarm, local_swarm
from tests.planner_cases import MID_CONFIG
from tests.real_swarm import poll

NAMES = ["pa", "pb"]
QUIET = ("--http", "off", "--cpu-memory", "300MB")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair() -> Iterator[LocalSwarm]:
    with local_swarm(lambda text: None) as swarm:
        seed = swarm.start(NAMES[0], extra=QUIET)
        swarm.start(NAMES[1], seeds=(seed,), extra=QUIET)
        swarm.wait_formed(NAMES)
        yield swarm


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return cli(*args, "--home", str(home), timeout_s=120)


def test_a_plan_ask_with_huge_layers_is_refused_and_the_leader_keeps_leading(
        pair: LocalSwarm) -> None:
    leader = pair.wait_formed(NAMES)
    asker = next(n for n in NAMES if n != leader)
    for layers in (2**24, 2**31 - 1):
        message = {"model": {"name": "deep",
                             "config": dict(MID_CONFIG, num_hidden_layers=layers)}}
        # the asker passes the ask on unread: the leader reads it, and refuses it
        with pytest.raises(SwarmError, match=f"num_layers {layers:,} is over the 512"):
            request(pair.homes[asker], {"op": "plan", "request": message}, timeout_s=60)
    status = pair.status(leader)
    assert status["counters"]["refused"].get("plan-request") == 2
    assert status["leader"]["name"] == leader
    assert all(m["state"] == "alive" for m in status["members"])
    assert all(p.poll() is None for p in pair.processes.values())


def test_status_json_shows_the_loop_lag(pair: LocalSwarm) -> None:
    from typer.testing import CliRunner

    from p2pswarm.cli import app

    home = pair.homes[NAMES[0]]
    poll("the self watch to tick", lambda: pair.status(NAMES[0])["self_watch"]["ticks"], 30)
    shown = _cli(home, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    watch = json.loads(shown.stdout)["self_watch"]
    assert {"loop_lag_ms", "loop_lag_recent_max_ms", "loop_lag_max_ms", "held_bytes",
            "held_by_fellow", "over_budget"} <= set(watch)
    assert watch["ticks"] > 0 and watch["loop_lag_ms"] < 1000
    # and each store of its home against its cap (a share of this disk)
    disks = {d["store"]: d for d in json.loads(shown.stdout)["disks"]}
    assert {"weights", "checkpoint-copies", "job-data", "job-checkpoints"} <= set(disks)
    assert 0 < disks["weights"]["cap_bytes"] <= 64 << 30
    assert disks["loads"]["cap_bytes"] is None
    table = CliRunner().invoke(app, ["status", "--home", str(home)])
    assert table.exit_code == 0 and "loop lag" in table.output, table.output
    assert "disk: weights " in table.output, table.output


def test_a_model_directory_linking_to_the_identity_is_refused_in_one_line(
        pair: LocalSwarm, tmp_path: Path) -> None:
    name = NAMES[1]
    home = pair.homes[name]
    model = tmp_path / "leaky"
    shutil.copytree(SHIPPED_MODELS["demo-llama"], model)
    (model / "generation_config.json").symlink_to(home / "identity.json")
    loaded = _cli(home, "load", str(model), "--floor", "cpu=200MB", "--weights-dtype", "f32")
    assert loaded.returncode != 0
    lines = [line for line in loaded.stderr.splitlines() if line.strip()
             and " INFO " not in line and " WARNING " not in line]
    assert len(lines) == 1, loaded.stderr
    assert "generation_config.json leads outside its model directory" in lines[0]
    assert request(home, {"op": "loads"}, timeout_s=30)["loads"] == []
    assert all(p.poll() is None for p in pair.processes.values())
