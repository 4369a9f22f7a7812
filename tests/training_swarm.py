"""A swarm that trains, for the training tests: three fellows in virtual time with their
torch work inline (it takes no virtual time), a small job on the built-in tiny model,
and a wait for a job to end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from p2pswarm.models import BUILTIN_MODELS
from p2pswarm.sim.virtual import VirtualSwarm
from tests.cpu_swarm import start_cpu_swarm

# a llama small enough that checkpoints and job copies cost little (tiny-llama's stage
# states with AdamW are about 150 MB, and every copy is sealed, sent and written)
SMALL_LLAMA = {**BUILTIN_MODELS["tiny-llama"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "head_dim": 16, "max_position_embeddings": 128}


def job_config(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "seq_len": 32, "micro_batch": 2, "micro_batches": 2,
            "steps": 6, "lr": {"peak": 0.003, "schedule": "constant"}, "seed": 3,
            "replicas": 1, "sync": {"inner_steps": 2, "codec": "int8"}, **extra}


async def start_swarm(nursery: trio.Nursery, n: int = 3, seed: int = 5) -> VirtualSwarm:
    return await start_cpu_swarm(nursery, n, seed)


def leader_of(swarm: VirtualSwarm) -> Any:
    """The live fellow that leads."""
    return next(a for a in swarm.live() if a.leadership.is_leader())


def leader_and_asker(swarm: VirtualSwarm) -> tuple[Any, Any]:
    """The leader, and a live fellow that does not lead: a job asked from it is kept
    in the leader's own state directory."""
    leader = leader_of(swarm)
    return leader, next(a for a in swarm.live() if a is not leader)


def disks_under(swarm: VirtualSwarm, root: Path) -> None:
    """Each live fellow keeps the checkpoint copies it holds for others in a directory of
    its own, ``root / name``."""
    for agent in swarm.live():
        agent.training.copies._root = root / agent.name


def new_disk_under(agent: Any, root: Path) -> None:
    """A fellow started again with its disk gone: its copies go to a new directory."""
    agent.training.copies._root = root / f"{agent.name}-again"


def stopping_at(job: Any, step: int) -> Callable[[], bool]:
    """A wait's predicate that stops every process of ``job`` (as a cancel on the leader)
    once it reaches ``step``: wait in steps small enough to catch it there."""
    def stop() -> bool:
        if job.step >= step and job.scope is not None:
            job.cancel_asked = True
            job.scope.cancel()
            return True
        return False

    return stop


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
