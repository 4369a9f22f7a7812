"""A replica whose fellow crashes comes back, with real processes: three `join` fellows
on loopback train two replicas; a fellow holding a stage, not the leader, is killed
(SIGKILL) mid-job and the user starts it again from its state directory. The replica is
placed again (on cards free meanwhile, or on that fellow once it is back) and, before it
takes the global parameters, its stages built anew borrow the optimizer moments of the
replica that trained on (``CheckpointKeeper.lend_moments``); both replicas then close rounds
together, the job never restarted; then the user cancels it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from p2pswarm.control.client import request
from p2pswarm.demo import DEMO_TRAIN_MEMORY, DEMO_TRAIN_MODEL
from p2pswarm.errors import SwarmError
from p2pswarm.sim.field import free_address, one_leader
from p2pswarm.sim.processes import local_swarm
from tests.real_swarm import poll

pytestmark = pytest.mark.slow

INNER_STEPS = 4


def job() -> dict[str, Any]:
    return {"model": {"config": DEMO_TRAIN_MODEL}, "seq_len": 32, "micro_batch": 2,
            "micro_batches": 1, "steps": 100_000, "replicas": 2, "seed": 0,
            "lr": {"peak": 4e-3, "schedule": "constant"},
            "sync": {"inner_steps": INNER_STEPS, "codec": "fp16", "round_deadline_s": 20}}


def test_a_crashed_fellow_started_again_takes_its_replica_back_with_borrowed_moments(
        ) -> None:
    names = ["fellow-1", "fellow-2", "fellow-3"]
    addresses = {name: free_address() for name in names}
    cap = ("--cpu-memory", DEMO_TRAIN_MEMORY, "--log-level", "info")

    def launch(swarm: Any, name: str) -> None:
        swarm.launch(name, seeds=tuple(a for n, a in addresses.items() if n != name),
                     listen=addresses[name], extra=cap)

    with local_swarm(lambda line: None, start_timeout_s=120) as swarm:
        for name in names:
            launch(swarm, name)
        for name in names:
            swarm.address(name)
        leader = poll("one leader for all", lambda: one_leader(swarm, names), 60,
                      tolerate=(SwarmError,))[0]
        record = request(swarm.homes[leader], {"op": "job_submit", "config": job()},
                         timeout_s=60)
        job_id = record["job_id"]

        def the_job() -> dict[str, Any] | None:
            jobs = request(swarm.homes[leader], {"op": "jobs"}, timeout_s=10)
            return next((j for j in jobs if j["job_id"] == job_id), None)

        both = poll("a round closed by both replicas", lambda: (j := the_job()) and any(
            len(r["replicas"]) == 2 for r in j["rounds"]) and j, 180, tolerate=(SwarmError,))
        hosts = {s["fellow"] for replica in both["stages"] for s in replica}
        victim = next(n for n in names if n != leader and n in hosts)
        swarm.processes[victim].kill()
        swarm.processes[victim].wait()
        killed = time.monotonic()
        paused = poll("a replica paused", lambda: (j := the_job()) and j["replicas"] == 1
                      and j, 60, tolerate=(SwarmError,))
        launch(swarm, victim)  # the user starts it again, from its home
        back = poll("the replica back", lambda: (j := the_job()) and j["rejoins"] >= 1
                    and j["replicas"] == 2 and j, 120, tolerate=(SwarmError,))
        back_s = time.monotonic() - killed
        # both replicas in a round closed after the rejoin: the borrowed moments and the
        # global parameters took, and it trains with the other
        poll("a round of both after the rejoin", lambda: (j := the_job()) and any(
            len(r["replicas"]) == 2 and r["version"] > back["rounds"][-1]["version"]
            for r in j["rounds"]), 120, tolerate=(SwarmError,))
        request(swarm.homes[leader], {"op": "job_cancel", "job_id": job_id}, timeout_s=60)
        logs = {n: (swarm.root / f"{n}.log").read_text(errors="replace") for n in names}
    assert paused["state"] == "running" and back["state"] == "running"
    assert not back["moves"]  # one leader throughout, the job never placed again whole
    lent = [line for line in logs[leader].splitlines()
            if f"job {job_id}: replica-" in line and "was lent the moments of" in line]
    assert len(lent) == 1, lent
    taken = [line for n in names for line in logs[n].splitlines()
             if "borrowed the moments of" in line and f"of {job_id}" in line]
    assert taken and all("the moments of 0 parameters" not in line for line in taken), taken
    print(f"replica back {back_s:.1f} s after the kill; {lent[0].split('INFO')[-1]}")
