"""Three replicas with auto batches on three real `join` processes of different
``--cpu-memory``, synced by the sharded all-reduce (no hub): each fellow's replica gets
its own batch, the loss falls, and a fellow SIGKILLed mid-round and started again does
not stall the others (they close rounds without it) and rejoins the ring."""

from __future__ import annotations

import time
from typing import Any

import pytest

from p2pswarm.control.client import request
from p2pswarm.demo import DEMO_TRAIN_MODEL
from p2pswarm.errors import SwarmError
from p2pswarm.sim.field import free_address, one_leader
from p2pswarm.sim.processes import local_swarm
from tests.real_swarm import poll

pytestmark = pytest.mark.slow

# a model whose memory a sample grows with its wide logits while its compute stays small,
# so the fellows' memories, not the batch cap, set their batches at a short sequence
MODEL = {**DEMO_TRAIN_MODEL, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 8, "vocab_size": 32768}
MEMORY = {"fellow-1": "1050MB", "fellow-2": "1300MB", "fellow-3": "1650MB"}


def job(steps: int = 100_000) -> dict[str, Any]:
    return {"model": {"config": MODEL}, "seq_len": 128, "micro_batch": "auto",
            "micro_batches": 1, "steps": steps, "replicas": 3, "seed": 0,
            "lr": {"peak": 4e-3, "schedule": "constant"},
            "sync": {"inner_steps": 2, "codec": "int8", "round_deadline_s": 20}}


def test_three_replicas_of_own_batches_sync_by_all_reduce_and_ride_out_a_kill() -> None:
    names = list(MEMORY)
    addresses = {name: free_address() for name in names}

    def launch(swarm: Any, name: str) -> None:
        swarm.launch(name, seeds=tuple(a for n, a in addresses.items() if n != name),
                     listen=addresses[name],
                     extra=("--cpu-memory", MEMORY[name], "--log-level", "info"))

    with local_swarm(lambda line: None, start_timeout_s=120) as swarm:
        for name in names:
            launch(swarm, name)
        for name in names:
            swarm.address(name)
        leader = poll("one leader for all", lambda: one_leader(swarm, names), 60,
                      tolerate=(SwarmError,))[0]
        home = swarm.homes[leader]
        plan = request(home, {"op": "job_plan", "config": job()}, timeout_s=60)
        batches = {r["stages"][0]["fellow"]: r["micro_batch"] for r in plan["replicas"]}
        assert len(batches) == 3 and len(set(batches.values())) >= 2, batches
        record = request(home, {"op": "job_submit", "config": job()}, timeout_s=60)
        job_id = record["job_id"]

        def the_job() -> dict[str, Any] | None:
            jobs = request(home, {"op": "jobs"}, timeout_s=10)
            return next((j for j in jobs if j["job_id"] == job_id), None)

        three = poll("two rounds of all three replicas", lambda: (j := the_job()) and len(
            [r for r in j["rounds"] if len(r["replicas"]) == 3]) >= 2 and j,
            180, tolerate=(SwarmError,))
        victim = next(n for n in names if n != leader)
        swarm.processes[victim].kill()
        swarm.processes[victim].wait()
        killed = time.monotonic()
        killed_at = three["rounds"][-1]["version"]
        # the others go on: rounds close without it, none stalls
        two = poll("rounds closed without the killed fellow",
                   lambda: (j := the_job()) and len([
                       r for r in j["rounds"] if r["version"] > killed_at
                       and len(r["replicas"]) == 2]) >= 2 and j,
                   90, tolerate=(SwarmError,))
        without_s = time.monotonic() - killed
        launch(swarm, victim)  # the user starts it again, from its home
        back = poll("its replica back in the ring", lambda: (j := the_job()) and any(
            len(r["replicas"]) == 3 and r["version"] > two["rounds"][-1]["version"]
            for r in j["rounds"]) and j, 180, tolerate=(SwarmError,))
        request(home, {"op": "job_cancel", "job_id": job_id}, timeout_s=60)
    assert back["state"] == "running" and back["rejoins"] >= 1
    # the job never restarted whole: a new leader may take it over before its first step
    # (a busy machine can cost the first leader its term), never once it trained
    assert all(" at step 0: " in move for move in back["moves"]), back["moves"]
    losses = back["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses
    print(f"batches {batches}; two rounds without the killed fellow {without_s:.1f} s "
          f"after the kill; loss {sum(losses[:5]) / 5:.3f} -> {sum(losses[-5:]) / 5:.3f}")
