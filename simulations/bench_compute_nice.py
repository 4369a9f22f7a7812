"""How late a trio loop's timers ring while torch trains on the agent's compute threads,
with those threads at the loop's priority (nice 0) and below it (``--nice N``), in
alternating runs in one process: the loop wakes every 20 ms and does a little Python
work, as the agent's does; two workers train a small MLP with AdamW meanwhile.

    python simulations/bench_compute_nice.py [--nice 10] [--seconds 15] [--rounds 2]
                                             [--threads 2] [--json]

Reports the loop's lateness (p50, p99, max, ms) and the training steps made, per run.
The machine's other work is part of the measurement: report the load average beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pswarm.agent.compute import Compute  # noqa: E402

WAKE_EVERY_S = 0.02


def train_until(stop: threading.Event) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 512))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 512)
    steps = 0
    while not stop.is_set():
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    return steps


async def one_run(nice: int, seconds: float, workers: int) -> dict[str, Any]:
    compute = Compute(nice=nice)
    stop = threading.Event()
    lags: list[float] = []
    steps: list[int] = []

    async def worker() -> None:
        steps.append(await compute.run(lambda: train_until(stop)))

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(worker)
            end = trio.current_time() + seconds
            while trio.current_time() < end:
                due = trio.current_time() + WAKE_EVERY_S
                await trio.sleep_until(due)
                lags.append(trio.current_time() - due)
                sum(range(2000))  # a little Python work per wake-up
            stop.set()
    finally:
        compute.close()
    lags.sort()
    return {"nice": nice, "p50_ms": round(1000 * lags[len(lags) // 2], 1),
            "p99_ms": round(1000 * lags[int(0.99 * len(lags))], 1),
            "max_ms": round(1000 * lags[-1], 1), "steps": sum(steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nice", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    runs = [trio.run(one_run, nice, args.seconds, args.workers)
            for _ in range(args.rounds) for nice in (0, args.nice)]
    if args.json:
        print(json.dumps({"runs": runs, "uptime": load}, indent=2))
    else:
        for r in runs:
            print(f"nice {r['nice']:>2}: loop late p50 {r['p50_ms']} ms, p99 {r['p99_ms']} "
                  f"ms, max {r['max_ms']} ms; {r['steps']} training steps")
        print(f"load before: [{load}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
