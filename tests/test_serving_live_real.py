"""Two serving paths a user takes, on real `join` processes on loopback (four fellows,
one swarm for both tests):

- a spare fellow is measured fast (the ``benchmarks.json`` `p2pswarm bench` writes), so
  `p2pswarm loads` proposes a faster plan; `p2pswarm load --move PLAN_ID`, typed while the
  CLI's `generate` runs, re-cuts the load live, and the generation ends with the greedy
  tokens of an undisturbed run. A bad or stale plan id gets one line and moves nothing.
- the leader, hosting a stage, is killed (SIGKILL) mid-generation, the generation driven
  from another fellow: a new leader adopts the load and moves the stage to the spare,
  and the generation ends with the same greedy tokens."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from p2pswarm.bench import BenchmarkCache
from p2pswarm.cards import ESTIMATED_MEM_BANDWIDTH, Benchmark, fingerprint
from p2pswarm.control.client import request
from p2pswarm.errors import PlacementError
from p2pswarm.inventory import local_card_source, read_inventory
from p2pswarm.planner import BUILTIN_MODELS
from p2pswarm.sim.processes import LocalSwarm, local_swarm
from tests.real_swarm import poll, stage_sessions

pytestmark = pytest.mark.slow  # real processes

NAMES = ["fellow-1", "fellow-2", "fellow-3", "fellow-4"]
PROMPT = "The swarm of fellows"
MAX_TOKENS = 200  # long enough that a move typed once a generation runs lands within it
KILL_TOKENS = 64  # the leader is killed as soon as the generation's session is at its stage
LOAD: dict[str, Any] = {
    "model": {"name": "tiny-llama", "config": BUILTIN_MODELS["tiny-llama"]}, "kind": "serve",
    "stages": 3, "weights_dtype": "f32", "kv_dtype": "f32", "context": 512, "sequences": 2,
    "exclude": [], "floors_bytes": {}, "maximize": None}


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2pswarm.cli", *args, "--home", str(home)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def _generation(home: Path, max_tokens: int) -> subprocess.Popen[str]:
    """The CLI's `generate`, greedy, as a user types it."""
    return subprocess.Popen([sys.executable, "-m", "p2pswarm.cli", "generate", PROMPT,
                             "--max-tokens", str(max_tokens), "--json", "--home", str(home)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finished(cli: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        out, err = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, err[-2000:]
    return json.loads(out)  # type: ignore[no-any-return]


def _loads(home: Path) -> list[dict[str, Any]]:
    return request(home, {"op": "loads"}, timeout_s=30)["loads"]  # type: ignore[no-any-return]


def _load(swarm: LocalSwarm, message: dict[str, Any]) -> dict[str, Any]:
    """Load from the leader, again if the leader changed mid-load (a busy machine may
    delay heartbeats past the local preset's 2 s lease)."""
    for attempt in range(3):
        leader = swarm.wait_formed([n for n in NAMES if swarm.processes[n].poll() is None])
        try:
            return request(swarm.homes[leader],  # type: ignore[no-any-return]
                           {"op": "load", "request": message}, timeout_s=120)
        except PlacementError as exc:
            if attempt == 2 or "only the leader gives orders" not in str(exc):
                raise
    raise AssertionError("unreachable")


def _measured_fast(home: Path, times: float) -> None:
    """Write what `p2pswarm bench` would on a machine whose CPU is ``times`` as fast as
    the estimate the fellows never measured go by."""
    cards = [c for c in read_inventory(local_card_source()).cards if c.kind == "cpu"]
    BenchmarkCache(home).save({fingerprint(c): Benchmark(
        flops=1e12, mem_bandwidth=ESTIMATED_MEM_BANDWIDTH["cpu"] * times, dtype="f32",
        measured=True, fingerprint=fingerprint(c), seconds=2.0) for c in cards})


def _proposed(home: Path, fellow: str) -> str:
    """The plan id `p2pswarm loads` proposes to move the load to, on ``fellow``."""
    shown = _cli(home, "loads")
    assert shown.returncode == 0, shown.stderr
    found = re.search(r"faster: plan (\w+), .* move it live: p2pswarm load --move (\w+)",
                      shown.stdout)
    assert found is not None and found[1] == found[2], shown.stdout
    assert f" on {fellow} (" in shown.stdout.split("faster: ")[1], shown.stdout
    return found[2]


@pytest.fixture(scope="module")
def swarm() -> Iterator[LocalSwarm]:
    with local_swarm(lambda line: None) as swarm:
        quiet = ("--log-level", "warning")
        seed = swarm.start(NAMES[0], extra=quiet)
        for name in NAMES[1:]:
            swarm.launch(name, seeds=(seed,), extra=quiet)
        swarm.wait_formed(NAMES)
        yield swarm


def _one_line_refusal(home: Path, plan_id: str, says: str) -> None:
    before = _loads(home)
    refused = _cli(home, "load", "--move", plan_id)
    assert refused.returncode == 1 and refused.stdout == "", refused
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("error: ")
    assert says in refused.stderr, refused.stderr
    assert _placed(_loads(home)) == _placed(before)


def _placed(loads: list[dict[str, Any]]) -> list[Any]:
    return [(r["plan_id"], [s["fellow"] for s in r["stages"]], r.get("moves")) for r in loads]


def test_load_move_re_cuts_a_load_live_under_the_clis_generate(swarm: LocalSwarm) -> None:
    home = swarm.homes[NAMES[0]]
    record = _load(swarm, LOAD)
    old_id = record["plan_id"]
    staged = [s["fellow"] for s in record["stages"]]
    fast = next(n for n in NAMES if n not in staged)
    want = request(home, {"op": "generate", "prompt": PROMPT, "max_tokens": MAX_TOKENS},
                   timeout_s=120)
    assert len(want["token_ids"]) == MAX_TOKENS

    # the spare is measured fast: `loads` proposes a plan with another cut, and says how
    # to take it
    _measured_fast(swarm.homes[fast], times=50)
    poll("the faster plan proposed", lambda: (_loads(home)[0].get("faster") or {}).get(
        "plan_id"))
    stale_id = _proposed(home, fast)
    assert stale_id != old_id

    # a plan id that names neither a load nor a proposal: one line, nothing moves
    _one_line_refusal(home, "0123456789abcdef", "0123456789abcdef")

    # the swarm changes before the user moves: a stage fellow is measured faster still,
    # and `loads` proposes another plan; the one shown before is stale, and says so
    fastest = staged[0]
    _measured_fast(swarm.homes[fastest], times=100)
    poll("another faster plan proposed", lambda: (_loads(home)[0].get("faster") or {}).get(
        "plan_id") not in (None, stale_id))
    _one_line_refusal(home, stale_id, f"plan {stale_id} is no longer the faster placement")
    new_id = _proposed(home, fastest)

    # the move, typed while a generation runs on the old cut (the session counted is the
    # CLI's: the first generation's have closed)
    poll("the first generation's sessions closed",
         lambda: stage_sessions(swarm, staged[-1]) == 0)
    cli = _generation(home, MAX_TOKENS)
    try:
        poll("the generation's session on the old cut",
              lambda: stage_sessions(swarm, staged[-1]) == 1)
        moved = _cli(home, "load", "--move", new_id)
    finally:
        got = _finished(cli)
    assert moved.returncode == 0, moved.stderr
    assert moved.stdout.startswith(f"moved plan {old_id} live to plan {new_id} in "), \
        moved.stdout
    assert got["resumes"] >= 1, "the generation ended before the move: make it longer"
    assert got["token_ids"] == want["token_ids"] and got["plan_id"] == new_id

    (now,) = _loads(home)
    assert now["plan_id"] == new_id and now["recut_from"] == [old_id]
    assert fastest in {s["fellow"] for s in now["stages"]} and "faster" not in now
    listed = _cli(home, "loads").stdout
    assert f"loaded plan {new_id} " in listed
    assert re.search(rf"re-cut at \S+ from plan {old_id} \(3 stages\) into \d stages?: "
                     rf".*{fastest}", listed), listed
    assert not any(h.get("plan_id") == old_id for n in NAMES
                   for h in swarm.status(n)["stages_held"])

    # the same plan id again (taken already), and the load's former id: one line each,
    # nothing moves
    _one_line_refusal(home, new_id, "no markedly faster placement")
    _one_line_refusal(home, old_id, "no markedly faster placement")


def test_the_leader_hosting_a_stage_is_killed_mid_generation_and_its_successor_heals(
        swarm: LocalSwarm) -> None:
    leader = swarm.wait_formed(NAMES)
    request(swarm.homes[leader], {"op": "unload", "all": True}, timeout_s=60)
    spare = [n for n in NAMES if n != leader][-1]  # left out, so the leader hosts a stage
    record = _load(swarm, {**LOAD, "exclude": [f"{spare}:cpu"]})
    staged = [s["fellow"] for s in record["stages"]]
    leader = swarm.wait_formed(NAMES)
    assert leader in staged and spare not in staged
    driver = next(n for n in staged if n != leader)
    home = swarm.homes[driver]
    want = request(home, {"op": "generate", "prompt": PROMPT, "max_tokens": KILL_TOKENS},
                   timeout_s=120)
    # that generation's sessions close after it answers: the one counted below must be
    # the CLI's, or the kill lands before the CLI has found the load (a busy machine)
    poll("the first generation's sessions closed", lambda: stage_sessions(swarm, leader) == 0)

    cli = _generation(home, KILL_TOKENS)
    try:
        poll("the generation's session at the leader's stage",
              lambda: stage_sessions(swarm, leader) == 1)
        os.kill(swarm.processes[leader].pid, signal.SIGKILL)
    finally:
        got = _finished(cli)
    assert got["token_ids"] == want["token_ids"] and got["resumes"] >= 1

    (after,) = _loads(home)
    stage = staged.index(leader)
    successor = swarm.status(driver)["leader"]["name"]
    assert successor != leader and after["adopted"]["leader"] == successor
    (move,) = after["moves"]
    assert (move["stage"], move["from"], move["to"]) == (stage, leader, spare)
    assert after["complete"] and [s["fellow"] for s in after["stages"]] == [
        spare if n == leader else n for n in staged]
    listed = _cli(home, "loads").stdout
    assert f"led by {successor} since " in listed
    assert f"moved stage {stage} at " in listed and f"from {leader} to {spare}" in listed
