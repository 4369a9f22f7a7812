"""Three replicas on real processes, auto batches: samples/s against the sum of each alone.

Three `join` fellows on loopback with different ``--cpu-memory`` (as in
tests/test_training_replicas_real.py); the leader plans a job of three replicas with
``micro_batch: auto``, so each fellow's replica gets the batch its memory holds. Each
fellow first trains its own replica alone (a swarm of that one fellow, its batch from
that plan, one replica: no sync), then the three train together, syncing by the sharded
all-reduce. Samples/s is measured on the leader's job record after a warm-up, over a
fixed window of wall time. The figure: together / (sum of each alone), target >= 0.8.

Each fellow runs one torch thread; the machine needs a free core per fellow, or the
ratio measures the cores shared, not the sync.

Run:  python simulations/bench_replicas_real.py [--window-s 30] [--warmup-steps 4]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from p2pswarm.control.client import request
from p2pswarm.demo import DEMO_TRAIN_MODEL
from p2pswarm.errors import SwarmError
from p2pswarm.sim.commands import poll
from p2pswarm.sim.field import free_address, one_leader
from p2pswarm.sim.processes import LocalSwarm, local_swarm

MODEL = {**DEMO_TRAIN_MODEL, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 8, "vocab_size": 32768}
MEMORY = {"fellow-1": "1050MB", "fellow-2": "1300MB", "fellow-3": "1650MB"}


def job(replicas: int, micro_batch: int | str) -> dict[str, Any]:
    return {"model": {"config": MODEL}, "seq_len": 128, "micro_batch": micro_batch,
            "micro_batches": 1, "steps": 100_000, "replicas": replicas, "seed": 0,
            "lr": {"peak": 4e-3, "schedule": "constant"},
            "sync": {"inner_steps": 4, "codec": "int8", "round_deadline_s": 30}}



def start(swarm: LocalSwarm, names: list[str]) -> str:
    addresses = {name: free_address() for name in names}
    for name in names:
        swarm.launch(name, seeds=tuple(a for n, a in addresses.items() if n != name),
                     listen=addresses[name], extra=("--cpu-memory", MEMORY[name]))
    for name in names:
        swarm.address(name)
    return str(poll("one leader", lambda: one_leader(swarm, names), 90, tolerate=(SwarmError,))[0])


def samples_per_s(swarm: LocalSwarm, leader: str, config: dict[str, Any], warmup: int,
                  window_s: float) -> float:
    """The job's samples/s over ``window_s`` once it took ``warmup`` steps."""
    home = swarm.homes[leader]
    job_id = request(home, {"op": "job_submit", "config": config}, timeout_s=60)["job_id"]

    def record() -> dict[str, Any]:
        jobs = request(home, {"op": "jobs"}, timeout_s=10)
        found: dict[str, Any] = next(j for j in jobs if j["job_id"] == job_id)
        if found["state"] in ("failed", "cancelled"):
            raise SystemExit(f"job {found['state']}: {found['reason']}")
        return found

    poll(f"{warmup} steps", lambda: record()["step"] >= warmup, 300, tolerate=(SwarmError,))
    first, began = record()["samples"], time.monotonic()
    time.sleep(window_s)  # a measuring window, not a wait for something to happen
    last, ended = record()["samples"], time.monotonic()
    request(home, {"op": "job_cancel", "job_id": job_id}, timeout_s=60)
    return (last - first) / (ended - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--warmup-steps", type=int, default=4)
    args = parser.parse_args()
    names = list(MEMORY)
    with local_swarm(lambda line: None, start_timeout_s=120) as swarm:
        leader = start(swarm, names)
        plan = request(swarm.homes[leader], {"op": "job_plan", "config": job(3, "auto")},
                       timeout_s=60)
    batches = {r["stages"][0]["fellow"]: int(r["micro_batch"]) for r in plan["replicas"]}
    print(f"auto batches of the three-replica plan: {batches}")
    alone: dict[str, float] = {}
    for name in names:
        with local_swarm(lambda line: None, start_timeout_s=120) as swarm:
            leader = start(swarm, [name])
            alone[name] = samples_per_s(swarm, leader, job(1, batches[name]),
                                        args.warmup_steps, args.window_s)
        print(f"{name} alone (batch {batches[name]}): {alone[name]:.1f} samples/s")
    with local_swarm(lambda line: None, start_timeout_s=120) as swarm:
        leader = start(swarm, names)
        together = samples_per_s(swarm, leader, job(3, "auto"), args.warmup_steps,
                                 args.window_s)
    total = sum(alone.values())
    print(f"three together, all-reduce: {together:.1f} samples/s; sum alone {total:.1f}; "
          f"ratio {together / total:.2f} (target >= 0.8)")


if __name__ == "__main__":
    main()
