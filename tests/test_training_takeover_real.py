"""A job outlives its leader with real processes: three `join` fellows on loopback train
two replicas; the leader's process is killed (SIGKILL) mid-job; another fellow is
elected, takes the job over from the copy the old leader left, and finishes it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from p2pswarm.control.client import request
from p2pswarm.demo import DEMO_TRAIN_MEMORY, DEMO_TRAIN_MODEL, form_swarm, local_swarm
from p2pswarm.errors import SwarmError

pytestmark = pytest.mark.slow

STEPS = 30
KILL_AT_STEP = 10


def job() -> dict[str, Any]:
    return {"model": {"config": DEMO_TRAIN_MODEL}, "seq_len": 32, "micro_batch": 2,
            "micro_batches": 1, "steps": STEPS, "replicas": 2, "seed": 0,
            "lr": {"peak": 4e-3, "schedule": "constant"},
            "sync": {"inner_steps": 4, "codec": "fp16", "outer_lr": 1.0,
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


def test_the_leader_killed_mid_job_a_new_leader_finishes_it() -> None:
    names = ["fellow-1", "fellow-2", "fellow-3"]
    cap = ("--cpu-memory", DEMO_TRAIN_MEMORY, "--log-level", "warning")
    with local_swarm(lambda line: None) as swarm:
        status = form_swarm(swarm, names, cap, DEMO_TRAIN_MEMORY, lambda line: None,
                            time.monotonic())
        leader = status["leader"]["name"]
        survivor = next(n for n in names if n != leader)
        record = request(swarm.homes[survivor], {"op": "job_submit", "config": job()},
                         timeout_s=60)
        job_id = record["job_id"]

        def the_job(name: str) -> dict[str, Any] | None:
            jobs = request(swarm.homes[name], {"op": "jobs"}, timeout_s=10)
            return next((j for j in jobs if j["job_id"] == job_id), None)

        def shown() -> Any:
            try:
                j = the_job(survivor) or {}
            except SwarmError as exc:
                return str(exc)
            return {k: j.get(k) for k in ("state", "reason", "step", "replicas", "moved")}

        before = poll(lambda: (j := the_job(survivor)) and j["step"] >= KILL_AT_STEP and j,
                      180, f"step {KILL_AT_STEP}", shown)
        swarm.processes[leader].kill()
        killed = time.monotonic()
        moved = poll(lambda: (j := the_job(survivor)) and j["moved"] and
                     j["state"] == "running" and j, 60, "a new leader running the job", shown)
        running_again_s = time.monotonic() - killed
        done = poll(lambda: (j := the_job(survivor)) and j["state"] in (
            "finished", "failed", "cancelled") and j, 240, "the job to end", shown)
    assert done["state"] == "finished", done["reason"]
    assert leader not in moved["moved"].split(" to ")[1]  # a new leader leads it
    assert f"moved from leader {leader}" in moved["moved"]
    # resumed from the round it stood at, not from step 0
    assert moved["step"] >= before["step"] - 2 * 4, (before["step"], moved["moved"])
    assert done["step"] == STEPS and len(done["losses"]) == STEPS
    assert sum(done["losses"][-5:]) / 5 < sum(done["losses"][:5]) / 5 - 0.5
    assert running_again_s < 45, running_again_s
    print(f"running again {running_again_s:.1f} s after the kill; {moved['moved']}")
