"""A job outlives its leader, and a whole swarm restarted, with real processes: three
`join` fellows on loopback train two replicas; the leader's process is killed (SIGKILL)
mid-job; another fellow is elected and takes the job over from the copy the old leader
left. Then every fellow stops (SIGTERM: each leaves) and all three start again from
their state directories, on their addresses: a leader is elected again, takes the job
over from the copies kept on disk (``<home>/job-copies/``) and trains on from where it
stood, the user resubmitting nothing; then the user cancels it.

The job is far longer than the test: a job that could finish while a starved machine
answers the test's polls slowly would leave nothing to take over (it did, at load 20)."""

from __future__ import annotations

import re
import signal
import time
from typing import Any

import pytest

from p2pswarm.agent.training.kept_store import MAX_HEAD_BYTES
from p2pswarm.control.client import request
from p2pswarm.demo import DEMO_TRAIN_MEMORY, DEMO_TRAIN_MODEL
from p2pswarm.errors import SwarmError
from p2pswarm.sim.field import free_address, one_leader
from p2pswarm.sim.processes import LocalSwarm, local_swarm
from p2pswarm.wire.codec import decode
from p2pswarm.wire.jobs import JobKeep

pytestmark = pytest.mark.slow

STEPS = 100_000  # never reached: the test cancels the job once it has seen it go on
INNER_STEPS = 4
KILL_AFTER_ROUND = 2  # round 1's copy has reached the keepers by the time round 2 closes


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


def kept_term(swarm: LocalSwarm, name: str, job_id: str) -> int:
    """The term of the copy of ``job_id`` fellow ``name`` keeps on its disk (0: none)."""
    path = swarm.homes[name] / "job-copies" / f"{job_id}.head"
    try:
        messages = decode(path.read_bytes(), max_bytes=MAX_HEAD_BYTES)
    except (OSError, ValueError, SwarmError):
        return 0
    head = messages[0] if len(messages) == 1 else None
    return head.term if isinstance(head, JobKeep) else 0


def test_a_job_outlives_its_leader_and_a_whole_swarm_restarted() -> None:
    names = ["fellow-1", "fellow-2", "fellow-3"]
    addresses = {name: free_address() for name in names}
    with local_swarm(lambda line: None, start_timeout_s=120) as swarm:
        start_all(swarm, addresses)
        first = poll(lambda: one_leader(swarm, names), 60, "one leader for all")[0]
        asked = [next(n for n in names if n != first)]  # whose agent the test asks

        record = request(swarm.homes[asked[0]], {"op": "job_submit", "config": job()},
                         timeout_s=60)
        job_id = record["job_id"]

        def the_job() -> dict[str, Any] | None:
            jobs = request(swarm.homes[asked[0]], {"op": "jobs"}, timeout_s=10)
            return next((j for j in jobs if j["job_id"] == job_id), None)

        def shown() -> Any:
            try:
                j = the_job() or {}
            except SwarmError as exc:
                return str(exc)
            return {k: j.get(k) for k in ("state", "reason", "step", "replicas", "moves")}

        poll(lambda: (j := the_job()) and j["rounds"] and
             j["rounds"][-1]["version"] >= KILL_AFTER_ROUND, 180,
             f"round {KILL_AFTER_ROUND}", shown)
        # the leader now (a starved machine may have moved it since the start), and the
        # job as it stood under it
        leader = poll(lambda: one_leader(swarm, names), 60, "one leader for all")[0]
        asked[0] = next(n for n in names if n != leader)
        before = poll(the_job, 30, "the job", shown)
        swarm.processes[leader].kill()
        swarm.processes[leader].wait()
        killed = time.monotonic()
        moved = poll(lambda: (j := the_job()) and len(j["moves"]) > len(before["moves"])
                     and j["state"] == "running" and j, 60, "a new leader running the job",
                     shown)
        running_again_s = time.monotonic() - killed
        assert leader not in moved["moved"].split(" to ")[1]  # a new leader leads it
        assert f"moved from leader {leader}" in moved["moved"]
        # resumed from a round its copies kept, not from step 0
        resumed = re.search(r"\(round (\d+), step (\d+)\)", moved["moved"])
        assert resumed is not None and int(resumed.group(1)) >= 1, moved["moved"]
        assert moved["step"] >= before["step"] - 2 * INNER_STEPS, (before["step"],
                                                                   moved["moved"])
        assert running_again_s < 45, running_again_s

        # then the whole swarm stops, and starts again, once the copy the new leader made
        # as the job ran again (the one that says it moved) is on the fellows' disks: it
        # travels in the background, and a swarm stopped before it arrived resumes from
        # the old leader's copy, which does not say so
        took = re.search(r"\(term (\d+)\)", moved["moved"])
        assert took is not None, moved["moved"]
        took_term = int(took.group(1))
        poll(lambda: all(kept_term(swarm, n, job_id) >= took_term for n in names
                         if n != leader), 60, "the new leader's copy on the fellows' disks",
             lambda: {n: kept_term(swarm, n, job_id) for n in names})
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
        # taken over again, and training past where it stood at the stop
        done = poll(lambda: (j := the_job()) and len(j["moves"]) > len(moved["moves"]) and
                    j["state"] == "running" and j["step"] >= at_stop["step"] + 2 * INNER_STEPS
                    and j, 240, "the job to go on after the restart", shown)
        done_s = time.monotonic() - restarted
        request(swarm.homes[asked[0]], {"op": "job_cancel", "job_id": job_id}, timeout_s=60)
        poll(lambda: (j := the_job()) and j["state"] == "cancelled", 60, "the job cancelled",
             shown)
    last = re.search(r"to (\S+) \(term (\d+)\) at step (\d+): (.*)", done["moves"][-1])
    assert last is not None, done["moves"]
    assert int(last.group(2)) >= again[1] > took_term, (done["moves"], again)
    assert "started again from step 0" not in last.group(4), last.group(0)  # its kept round
    assert int(last.group(3)) >= at_stop["step"] - INNER_STEPS, (at_stop["step"], last[0])
    assert len(done["losses"]) == done["step"]  # one loss a step, the copies' included
    assert sum(done["losses"][-5:]) / 5 < sum(done["losses"][:5]) / 5 - 0.5
    print(f"running again {running_again_s:.1f} s after the kill; {moved['moved']}; "
          f"after the whole restart: {last.group(0)}; on at step {done['step']} "
          f"{done_s:.1f} s after it; "
          f"losses {[round(x, 2) for x in done['losses']]}")
