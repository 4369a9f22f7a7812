"""Three replicas on real processes, auto batches: samples/s against the sum of each alone.

Three `join` fellows on loopback with different ``--cpu-memory`` (as in
tests/test_training_replicas_real.py); the leader plans a job of three replicas with
``micro_batch: auto``, so each fellow's replica gets the batch its memory holds. Each
fellow first trains its own replica alone (a swarm of that one fellow, its batch from
that plan, one replica: no sync), then the three train together, syncing by the sharded
all-reduce. Samples/s is measured on the leader's job record after a warm-up, over a
fixed window of wall time. The figure: together / (sum of each alone), target >= 0.8.

Each fellow runs one torch thread. Three fellows on a machine of fewer than three free
cores share them, while each alone had them all: the ratio would measure the cores
shared, not the sync. So by default each fellow's process runs in a cgroup of its own
with the same CPU quota (``--cpu-quota``, in cores; half a core by default, so three
fit in two cores and leave the machine's other work half a core) and a weight over the
machine's other processes high enough that the quota, not their load, bounds it,
whether it trains alone or with the others. That needs cgroup v1's cpu
controller at /sys/fs/cgroup/cpu, writable (root); where it is not, the run says so in
one line and measures without a quota. ``--unconstrained`` measures the old way (each
fellow takes what the machine gives it).

Run:  python simulations/bench_replicas_real.py [--window-s 30] [--warmup-steps 4]
                                                [--cpu-quota 0.5 | --unconstrained]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
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

CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller
PERIOD_US = 100_000
# a fellow's cgroup weighs as 64 busy processes beside the machine's others, so on a
# busy machine the quota, not the others' load, bounds it, alone as together (with
# shares of one process each, three fellows under a load of 8 got about 0.4 of a core)
SHARES = 65536
POLL_S = 1.0  # how often the window reads the job's count of samples


class CpuQuota:
    """One cgroup per fellow under ``CPU_CGROUPS``, each allowed ``cores`` of CPU time
    (``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``); ``cores`` None: no quota."""

    def __init__(self, cores: float | None) -> None:
        self.cores = cores
        self.groups: list[Path] = []

    def usable(self) -> str:
        """"" when the quota can be set here, else why not."""
        if self.cores is None:
            return "no quota asked (--unconstrained)"
        probe = CPU_CGROUPS / f"p2pswarm-bench-{os.getpid()}-probe"
        try:
            probe.mkdir()
            (probe / "cpu.cfs_quota_us").write_text(f"{int(self.cores * PERIOD_US)}\n")
            probe.rmdir()
        except OSError as exc:
            return f"cgroups not writable at {CPU_CGROUPS} ({exc.strerror or exc})"
        return ""

    def confine(self, name: str, pid: int) -> None:
        """Move the process ``pid`` (all its threads) into a cgroup of its own."""
        if self.cores is None:
            return
        group = CPU_CGROUPS / f"p2pswarm-bench-{os.getpid()}-{name}"
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
        (group / "cpu.cfs_quota_us").write_text(f"{int(self.cores * PERIOD_US)}\n")
        (group / "cpu.shares").write_text(f"{SHARES}\n")
        (group / "cgroup.procs").write_text(f"{pid}\n")
        if group not in self.groups:
            self.groups.append(group)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Its cgroups removed at the end (what is left in one goes back to the root)."""
        try:
            yield
        finally:
            for group in self.groups:
                try:
                    for pid in (group / "cgroup.procs").read_text().split():
                        (CPU_CGROUPS / "cgroup.procs").write_text(f"{pid}\n")
                    group.rmdir()
                except OSError:
                    pass  # a process that exited meanwhile; the group goes with the last


def start(swarm: LocalSwarm, names: list[str], quota: CpuQuota) -> str:
    addresses = {name: free_address() for name in names}
    for name in names:
        swarm.launch(name, seeds=tuple(a for n, a in addresses.items() if n != name),
                     listen=addresses[name], extra=("--cpu-memory", MEMORY[name]))
        quota.confine(name, swarm.processes[name].pid)
    for name in names:
        swarm.address(name)
    return str(poll("one leader", lambda: one_leader(swarm, names), 90, tolerate=(SwarmError,))[0])


def samples_per_s(swarm: LocalSwarm, leader: str, config: dict[str, Any], warmup: int,
                  window_s: float) -> tuple[float, float, dict[str, int]]:
    """The job's samples/s over ``window_s`` once it took ``warmup`` steps, the
    machine's load average (1 min) at the window's end, and each replica's steps in it."""
    home = swarm.homes[leader]
    job_id = request(home, {"op": "job_submit", "config": config}, timeout_s=60)["job_id"]

    def record() -> dict[str, Any]:
        jobs = request(home, {"op": "jobs"}, timeout_s=10)
        found: dict[str, Any] = next(j for j in jobs if j["job_id"] == job_id)
        if found["state"] in ("failed", "cancelled"):
            raise SystemExit(f"job {found['state']}: {found['reason']}")
        return found

    poll(f"{warmup} steps", lambda: record()["step"] >= warmup, 300, tolerate=(SwarmError,))
    was, began = record(), time.monotonic()
    # each time the job's count of samples moved, and to what: the rate runs from the
    # first move in the window to the last, so a step cut by the window's edges does
    # not count (a step takes seconds here: 16 samples in a 20 s window is 0.8/s)
    moves: list[tuple[float, int]] = []
    now = was
    while time.monotonic() < began + window_s:
        time.sleep(POLL_S)  # sampling the job's count, not waiting for something
        now = record()
        if now["samples"] != (moves[-1][1] if moves else was["samples"]):
            moves.append((time.monotonic(), now["samples"]))
    ended = time.monotonic()
    load = os.getloadavg()[0]
    request(home, {"op": "job_cancel", "job_id": job_id}, timeout_s=60)
    steps = {name: n - (was.get("replica_steps") or {}).get(name, 0)
             for name, n in (now.get("replica_steps") or {}).items()}
    if len(moves) >= 2 and moves[-1][0] > moves[0][0]:
        rate = (moves[-1][1] - moves[0][1]) / (moves[-1][0] - moves[0][0])
    else:  # fewer than two moves: the window is too short for this rate
        rate = (now["samples"] - was["samples"]) / (ended - began)
    return rate, load, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--cpu-quota", type=float, default=0.5, metavar="CORES",
                        help="CPU time each fellow may take, in cores (default 0.5)")
    parser.add_argument("--unconstrained", action="store_true",
                        help="no CPU quota: each fellow takes what the machine gives it")
    args = parser.parse_args()
    if not args.unconstrained and not 0.01 <= args.cpu_quota <= os.cpu_count():
        parser.error(f"--cpu-quota {args.cpu_quota}: give a share of a core between 0.01 "
                     f"and this machine's {os.cpu_count()} cores, or --unconstrained")
    quota = CpuQuota(None if args.unconstrained else args.cpu_quota)
    why = quota.usable()
    if why and quota.cores is not None:
        print(f"{why}: measuring without a CPU quota; the ratio then measures the cores "
              f"shared, not only the sync")
        quota = CpuQuota(None)
    print(f"CPU quota per fellow: {quota.cores:g} core(s) (cgroup cpu.cfs_quota_us "
          f"{int(quota.cores * PERIOD_US)} of {PERIOD_US}, cpu.shares {SHARES})"
          if quota.cores is not None
          else f"CPU quota per fellow: none, on {os.cpu_count()} cores")
    names = list(MEMORY)
    with quota.held():
        with local_swarm(lambda line: None, start_timeout_s=120) as swarm:
            leader = start(swarm, names, quota)
            plan = request(swarm.homes[leader], {"op": "job_plan", "config": job(3, "auto")},
                           timeout_s=60)
        batches = {r["stages"][0]["fellow"]: int(r["micro_batch"]) for r in plan["replicas"]}
        print(f"auto batches of the three-replica plan: {batches}")
        alone: dict[str, float] = {}
        for name in names:
            with local_swarm(lambda line: None, start_timeout_s=120) as swarm:
                leader = start(swarm, [name], quota)
                alone[name], load, _ = samples_per_s(swarm, leader, job(1, batches[name]),
                                                  args.warmup_steps, args.window_s)
            print(f"{name} alone (batch {batches[name]}): {alone[name]:.1f} samples/s "
                  f"(load average {load:.1f})")
        with local_swarm(lambda line: None, start_timeout_s=120) as swarm:
            leader = start(swarm, names, quota)
            together, load, steps = samples_per_s(swarm, leader, job(3, "auto"),
                                                  args.warmup_steps, args.window_s)
            print(f"steps of each replica in the window, together: {steps}")
    total = sum(alone.values())
    print(f"three together, all-reduce: {together:.1f} samples/s (load average {load:.1f}); "
          f"sum alone {total:.1f}; ratio {together / total:.2f} (target >= 0.8)")


if __name__ == "__main__":
    main()
