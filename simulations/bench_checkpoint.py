"""One training checkpoint over 64 MiB per stage, written and copied, measured on this machine.

tiny-llama cut in two stages with AdamW after one optimizer step: each stage's state
(parameters, both moments, the sync anchor, snapshot and residual) is about 72 MB, over
the 64 MiB one frame used to carry. Measured, on real loopback sockets between agents in
this process (sealed TCP streams, as `p2pswarm join` uses them):

1. serialize: ``torch.save`` of one stage's state into bytes;
2. write: the leader's ``CheckpointStore.write`` of both stages (atomic files, fsync);
3. parts: one state's bytes in ``StatePart`` frames over a sealed stream into a verified
   file on another fellow (the path a stage's state takes to the driver and back);
4. copy: the leader's ``spread`` of the checkpoint, each stage shard to two fellows
   (hashed, written, fsynced there), all copies at once;
5. fetch: the leader, its own copy gone, fetching both shards back from the fellows.

MB/s counts the shard bytes moved (copy: both copies of both shards). One torch thread.

    python simulations/bench_checkpoint.py [--runs 3] [--json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import hashlib
import json
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trio

from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld
from p2pswarm.cards import Card
from p2pswarm.config import local
from p2pswarm.inventory import FakeCardSource
from p2pswarm.security import Identity, Keyring, SwarmSecret
from p2pswarm.training.checkpoint import CheckpointStore, read_shard_bytes, shard_bytes
from p2pswarm.training.job import JobConfig
from p2pswarm.training.run import LocalRun
from p2pswarm.transport.udp_tcp import open_udp_tcp_transport

JOB_ID = "job-bench000"


def stage_states() -> list[dict[str, Any]]:
    """Both stages' states of tiny-llama cut at layer 4, after one AdamW step."""
    job = JobConfig.from_dict({"model": "tiny-llama", "seq_len": 32, "micro_batch": 2,
                               "steps": 1, "seed": 3, "sync": {"codec": "int8"}})
    run = LocalRun(job, cut=[4])
    run.run()
    return [run.replicas[0].shard_state(s) for s in range(2)]


async def _transport(config: Any, *, task_status: Any) -> None:
    async with open_udp_tcp_transport("127.0.0.1:0", config.transport) as transport:
        task_status.started(transport)
        await trio.sleep_forever()


async def loopback_agents(nursery: trio.Nursery, n: int, homes: Path) -> list[Agent]:
    config = local()
    secret = SwarmSecret.generate()
    transports = [await nursery.start(_transport, config) for _ in range(n)]
    agents = []
    for i, transport in enumerate(transports):
        cards = FakeCardSource((Card(index=0, kind="cpu", name="CPU", uuid="",
                                     total_bytes=16 * 10**9, free_bytes=16 * 10**9),))
        agent = Agent(AgentWorld(
            name=f"fellow-{i + 1}", transport=transport, keyring=Keyring([secret]),
            identity=Identity.generate(), config=config, epoch=time.time_ns() // 1000,
            rng=random.Random(i), card_source=cards,
            seeds=() if i == 0 else (transports[0].local_addr,)))
        agent.training.copies._root = homes / agent.name / "checkpoint-copies"
        agent.training.data._root = homes / agent.name / "job-data"
        agent.training.data._root.mkdir(parents=True)
        agents.append(agent)
        await nursery.start(agent.run)
    while not all(a.membership is not None and sum(
            m.state == "alive" for m in a.membership.members()) == n for a in agents):
        await trio.sleep(0.05)
    return agents


def timed(fn: Any) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


async def measure(runs: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    states = stage_states()
    blobs = [shard_bytes(s) for s in states]
    sizes = [len(b) for b in blobs]
    out: dict[str, Any] = {"stage_bytes": sizes, "runs": runs}
    rows: dict[str, list[float]] = {k: [] for k in
                                    ("serialize", "write", "parts", "copy", "fetch")}
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    try:
        async with trio.open_nursery() as nursery:
            leader, *others = await loopback_agents(nursery, 4, root)
            for run in range(runs):
                rows["serialize"].append(timed(lambda: shard_bytes(states[0])))
                store = CheckpointStore(root / f"ckpt-{run}", keep=1)
                step = run + 1
                rows["write"].append(timed(lambda: store.write(
                    step, {f"replica-0.stage-{s}": states[s] for s in range(2)},
                    {"step": step})))
                # parts: one state over a sealed stream into a verified file elsewhere
                state_file = root / f"state-{run}.pt"
                state_file.write_bytes(blobs[0])
                digest = hashlib.sha256(blobs[0]).hexdigest()
                shutil.copy(state_file, leader.training.data.path(digest))
                began = time.perf_counter()
                await leader.training.data.push(
                    {"model": "tiny-llama", "data": {"files": [f"sha256:{digest}"]}},
                    others[0].addr)
                rows["parts"].append(time.perf_counter() - began)
                assert others[0].training.data.has(digest)
                for agent in (leader, others[0]):
                    agent.training.data.path(digest).unlink()
                began = time.perf_counter()
                copies = await leader.training.copies.spread(JOB_ID, step,
                                                             store.step_dir(step), 2)
                rows["copy"].append(time.perf_counter() - began)
                assert all(len(h) == 2 for h in copies.values()), copies
                shutil.rmtree(store.directory)
                began = time.perf_counter()
                assert await leader.training.copies.restore(JOB_ID, store) == step
                rows["fetch"].append(time.perf_counter() - began)
                read_shard_bytes((store.step_dir(step) / "replica-0.stage-0.pt").read_bytes())
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    moved = {"serialize": sizes[0], "write": sum(sizes), "parts": sizes[0],
             "copy": 2 * sum(sizes), "fetch": sum(sizes)}
    for key, times in rows.items():
        median = statistics.median(times)
        out[key] = {"s": round(median, 3), "MB_per_s": round(moved[key] / median / 1e6, 1),
                    "MB": round(moved[key] / 1e6, 1)}
    out["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = trio.run(measure, args.runs)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    sizes = ", ".join(f"{b / 1e6:.1f} MB" for b in result["stage_bytes"])
    print(f"tiny-llama, 2 stages, AdamW: stage states of {sizes} ({result['machine']}, "
          f"median of {result['runs']})")
    for key in ("serialize", "write", "parts", "copy", "fetch"):
        r = result[key]
        print(f"  {key:<10} {r['MB']:>7.1f} MB in {r['s']:>6.3f} s  {r['MB_per_s']:>7.1f} MB/s")


if __name__ == "__main__":
    main()
