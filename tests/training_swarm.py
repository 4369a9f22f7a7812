"""A swarm that trains, for the training tests: three fellows in virtual time with their
torch work inline (it takes no virtual time), a small job on the built-in tiny model,
and a wait for a job to end."""

from __future__ import annotations

from typing import Any

import trio

from p2pswarm.sim.virtual import VirtualSwarm, cpu_card, wait_until


def job_config(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "seq_len": 32, "micro_batch": 2, "micro_batches": 2,
            "steps": 6, "lr": {"peak": 0.003, "schedule": "constant"}, "seed": 3,
            "replicas": 1, "sync": {"inner_steps": 2, "codec": "int8"}, **extra}


async def start_swarm(nursery: trio.Nursery, n: int = 3, seed: int = 5) -> VirtualSwarm:
    swarm = VirtualSwarm(n, seed=seed, inline_compute=True)
    for fellow in swarm.fellows:
        fellow.cards.cards = (cpu_card(16.0, name=f"{fellow.name} CPU"),)
    await nursery.start(swarm.run)
    for i in range(n):
        await swarm.start(i)
    await wait_until(lambda: swarm.converged() and len(swarm.leaders()) == 1
                     and None not in {lid for lid, _ in swarm.leaders()}, timeout_s=30)
    return swarm


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
