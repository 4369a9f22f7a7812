"""A swarm that trains, for the training tests: three fellows in virtual time with their
torch work inline (it takes no virtual time), a small job on the built-in tiny model,
and a wait for a job to end."""

from __future__ import annotations

from typing import Any

import trio

from p2pswarm.sim.virtual import VirtualSwarm
from tests.cpu_swarm import start_cpu_swarm


def job_config(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "seq_len": 32, "micro_batch": 2, "micro_batches": 2,
            "steps": 6, "lr": {"peak": 0.003, "schedule": "constant"}, "seed": 3,
            "replicas": 1, "sync": {"inner_steps": 2, "codec": "int8"}, **extra}


async def start_swarm(nursery: trio.Nursery, n: int = 3, seed: int = 5) -> VirtualSwarm:
    return await start_cpu_swarm(nursery, n, seed)


async def finished(agent: Any, job_id: str, timeout_s: float = 600) -> dict[str, Any]:
    record: dict[str, Any] = {}

    async def done() -> bool:
        nonlocal record
        record = next(j for j in await agent.training.list_jobs() if j["job_id"] == job_id)
        return record["state"] in ("finished", "failed", "cancelled")

    with trio.fail_after(timeout_s):
        while not await done():
            await trio.sleep(0.5)
    return record
