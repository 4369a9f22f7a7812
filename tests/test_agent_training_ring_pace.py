"""Replicas of different speeds syncing by the all-reduce, in virtual time: one that
finished its round's steps while another has not sent the round the ring waits on keeps
taking steps instead of idling at the ring (``RingRounds``), and its delta weighs the
samples it took. Three in-process agents on MemoryNetwork, one of them twice as slow."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import trio

from p2pswarm.agent.world import Services
from p2pswarm.sim.virtual import wait_until
from tests.cpu_swarm import start_cpu_swarm
from tests.training_swarm import job_config, leader_of

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

STEP_S = 1.0  # the virtual seconds one stage step takes on a fast fellow
SERVICES = Services(training_step_s=STEP_S, training_step_timeout_s=20.0,
                    training_retry_s=2.0)
IDLE_AT_MOST = 0.15  # of a replica's time in the measuring window


async def busy_fractions(sync: dict[str, Any]) -> tuple[dict[str, float], str, int]:
    """A job of three replicas, the fellow of one of them twice as slow: each replica's
    share of a window of the job's middle spent in its steps (its steps there times its
    measured seconds a step, over the window), the slow replica's name, and how many
    rounds closed with all three in the window."""
    config = job_config(replicas="auto", steps=10_000, micro_batch=2, micro_batches=1,
                        sync={"codec": "int8", "round_deadline_s": 30.0, **sync})
    async with trio.open_nursery() as nursery:
        swarm = await start_cpu_swarm(nursery, 3, 5, services=SERVICES)
        leader = leader_of(swarm)
        slow = next(a for a in swarm.live() if a is not leader)
        slow.training.timings = replace(slow.training.timings, simulated_step_s=2 * STEP_S)
        record = await leader.training.submit(config)
        job = leader.training.jobs[record["job_id"]]
        await wait_until(lambda: job.driver is not None and len(job.rounds) >= 3,
                         timeout_s=600, step_s=0.05)
        driver = job.driver
        began, steps_before = trio.current_time(), [r.steps for r in driver.replicas]
        rounds_before = len(job.rounds)
        await trio.sleep(60.0)
        took_s = trio.current_time() - began
        busy = {r.name: (r.steps - before) * r.step_s / took_s
                for r, before in zip(driver.replicas, steps_before)}
        full = [e for e in job.rounds[rounds_before:] if len(e.replicas) == 3]
        slow_replica = next(r.name for r, placed in zip(driver.replicas, job.placement)
                            if placed.stages[0].fellow == slow.name)
        assert job.state == "running", job.reason
        await leader.training.leader.cancel(job.job_id)
        nursery.cancel_scope.cancel()
    return busy, slow_replica, len(full)


async def test_fast_replicas_train_on_while_a_slow_one_finishes_its_round(
        autojump_clock) -> None:
    """Every replica the same budget (no speed-aware budgets): the fast ones would idle
    half of each round at the ring while the slow one takes its steps."""
    busy, slow, full = await busy_fractions({"inner_steps": 4, "speed_aware": False})
    print(f"busy share of each replica ({slow} twice as slow): {busy}; {full} full rounds")
    fast = {name: b for name, b in busy.items() if name != slow}
    assert all(b >= 1 - IDLE_AT_MOST for b in fast.values()), (busy, slow)
    assert busy[slow] >= 1 - IDLE_AT_MOST, (busy, slow)
    assert full >= 4, full  # the rounds went on with all three in them


async def test_a_slow_replica_whose_budget_rounds_down_does_not_idle(
        autojump_clock) -> None:
    """Speed-aware budgets of 3 steps: the slow replica's rounds down to 1 (it manages
    1.5 in the fast ones' time), so it would idle a third of each round."""
    busy, slow, full = await busy_fractions({"inner_steps": 3})
    print(f"busy share of each replica ({slow} twice as slow): {busy}; {full} full rounds")
    assert all(b >= 1 - IDLE_AT_MOST for b in busy.values()), (busy, slow)
    assert full >= 4, full
