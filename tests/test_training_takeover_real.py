"""A job outlives its leader, and a whole swarm restarted, with real processes: three
`join` fellows on loopback train two replicas; the leader's process is killed (SIGKILL)
mid-job; another fellow is elected and takes the job over from the copy the old leader
left. Then every fellow stops (SIGTERM: each leaves) and all three start again from
their state directories, on their addresses: a leader is elected again, takes the job
over from the copies kept on disk (``<home>/job-copies/``) and finishes it, the user
resubmitting nothing."""

from __future__ import annotations

import re
import signal
import time
from typing import Any

import pytest

from p2pswarm.control.client import request
from p2pswarm.demo import DEMO_TRAIN_MEMORY, DEMO_TRAIN_MODEL
from p2pswarm.errors import SwarmError
from p2pswarm.sim.field import free_address, one_leader
from p2pswarm.sim.processes import LocalSwarm, local_swarm

pytestmark = pytest.mark.slow

STEPS = 16
INNER_STEPS = 4
KILL_AT_STEP = 6


def job() -> dict[str, Any]:
    return {"model": {"config": DEMO_TRAIN_MODEL}, "seq_len": 32, "micro_batch": 2,
            "micro_batches": 1, "steps": STEPS, "replicas": 2, "seed": 0,
            "lr": {"peak": 4e-3, "schedule": "constant"},
            "sync": {"inner_steps": INNER_STEPS, "codec": "fp16", "outer_lr": 1.0,
                     "outer_momentum": 0.0, "round_deadline_s": 20}}


def poll(fn: Any, timeout_s: float, what: str, show: Any = None) -> Any:
    """``fn()`` once it returns something truthy (errors count as not yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = fn()
            if got:
                return got
        except SwarmError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout_s:g} s: "
                                 f"{show() if show else ''}")
        time.sleep(0.2)


def start_all(swarm: LocalSwarm, addresses: dict[str, str]) -> None:
    """Every fellow on its own address, each naming the others as seeds."""
    cap = ("--cpu-memory", DEMO_TRAIN_MEMORY, "--log-level", "info")
    for name, addr in addresses.items():
        swarm.launch(name, seeds=tuple(a for n, a in addresses.items() if n != name),
                     listen=addr, extra=cap)
    for name in addresses:
        swarm.address(name)


def test_a_job_outlives_its_leader_and_a_whole_swarm_restarted() -> None:
    names = ["fellow-1", "fellow-2", "fellow-3"]
    addresses = {name: free_address() for name in names}
    with local_swarm(lambda line: None, start_timeout_s=120) as swarm:
        start_all(swarm, addresses)
        leader = poll(lambda: one_leader(swarm, names), 60, "one leader for all")[0]
        survivor = next(n for n in names if n != leader)
        record = request(swarm.homes[survivor], {"op": "job_submit", "config": job()},
                         timeout_s=60)
        job_id = record["job_id"]
        asked = [survivor]  # the fellow whose agent the test asks about the job

        def the_job() -> dict[str, Any] | None:
            jobs = request(swarm.homes[asked[0]], {"op": "jobs"}, timeout_s=10)
            return next((j for j in jobs if j["job_id"] == job_id), None)

        def shown() -> Any:
            try:
                j = the_job() or {}
            except SwarmError as exc:
                return str(exc)
            return {k: j.get(k) for k in ("state", "reason", "step", "replicas", "moves")}

        before = poll(lambda: (j := the_job()) and j["step"] >= KILL_AT_STEP and j,
                      180, f"step {KILL_AT_STEP}", shown)
        swarm.processes[leader].kill()
        swarm.processes[leader].wait()
        killed = time.monotonic()
        moved = poll(lambda: (j := the_job()) and j["moved"] and
                     j["state"] == "running" and j, 60, "a new leader running the job", shown)
        running_again_s = time.monotonic() - killed
        assert leader not in moved["moved"].split(" to ")[1]  # a new leader leads it
        assert f"moved from leader {leader}" in moved["moved"]
        # resumed from the round it stood at, not from step 0
        assert moved["step"] >= before["step"] - 2 * INNER_STEPS, (before["step"],
                                                                   moved["moved"])
        assert running_again_s < 45, running_again_s

        # then the whole swarm stops, and starts again
        at_stop = moved
        for name in names:
            if swarm.processes[name].poll() is None:
                swarm.processes[name].send_signal(signal.SIGTERM)
        for name in names:
            swarm.processes[name].wait(timeout=30)
        restarted = time.monotonic()
        start_all(swarm, addresses)  # from the same homes, on the same addresses
        again = poll(lambda: one_leader(swarm, names), 60, "a leader after the restart")
        asked[0] = names[0]
        done = poll(lambda: (j := the_job()) and j["state"] in (
            "finished", "failed", "cancelled") and j, 240, "the job to end", shown)
        done_s = time.monotonic() - restarted
    assert done["state"] == "finished", done["reason"]
    assert len(done["moves"]) >= 2, done["moves"]
    last = re.search(r"to (\S+) \(term (\d+)\) at step (\d+): (.*)", done["moves"][-1])
    assert last is not None, done["moves"]
    first_term = int(re.search(r"\(term (\d+)\)", moved["moved"]).group(1))  # type: ignore[union-attr]
    assert int(last.group(2)) >= again[1] > first_term, (done["moves"], again)
    assert "started again from step 0" not in last.group(4), last.group(0)  # its kept round
    assert int(last.group(3)) >= at_stop["step"] - INNER_STEPS, (at_stop["step"], last[0])
    assert done["step"] == STEPS and len(done["losses"]) == STEPS
    assert sum(done["losses"][-5:]) / 5 < sum(done["losses"][:5]) / 5 - 0.5
    print(f"running again {running_again_s:.1f} s after the kill; {moved['moved']}; "
          f"after the whole restart: {last.group(0)}; finished {done_s:.1f} s after it; "
          f"losses {[round(x, 2) for x in done['losses']]}")
