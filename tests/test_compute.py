"""Compute runs below the agent's loop: its worker threads lower their own priority, the
loop's thread keeps its own, and threads the work starts inherit the lower one."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import trio

from p2pswarm.agent.compute import Compute

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="a thread's own nice value is Linux's")


def nice_here() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def seen_by_compute(compute: Compute) -> tuple[int, int, int, int]:
    """(loop thread's nice before, a worker's, a thread the worker started, the loop
    thread's after)."""
    async def main() -> tuple[int, int, int, int]:
        before = nice_here()

        def work() -> tuple[int, int]:
            child: list[int] = []
            thread = threading.Thread(target=lambda: child.append(nice_here()))
            thread.start()
            thread.join()
            return nice_here(), child[0]

        worker, child = await compute.run(work)
        return before, worker, child, nice_here()

    try:
        return trio.run(main)
    finally:
        compute.close()


@linux_only
def test_a_worker_runs_below_the_loop_and_the_loop_keeps_its_priority() -> None:
    before, worker, child, after = seen_by_compute(Compute(nice=5))
    assert worker == min(19, before + 5)
    assert child == worker  # torch's threads, started from the worker, inherit it
    assert after == before


@linux_only
def test_nice_zero_leaves_compute_at_the_loops_priority() -> None:
    before, worker, child, after = seen_by_compute(Compute(nice=0))
    assert worker == child == after == before


def test_errors_limiters_and_cancellation_behave_as_a_thread_call() -> None:
    compute = Compute(nice=3)
    limiter = trio.CapacityLimiter(1)
    running = 0
    most = 0
    finished: list[str] = []

    def step() -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        threading.Event().wait(0.02)  # (in the worker thread: the work itself)
        running -= 1

    def fails() -> None:
        raise ValueError("from the worker")

    def slow() -> None:
        threading.Event().wait(0.2)
        finished.append("slow")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(compute.run, step, limiter)
        with pytest.raises(ValueError, match="from the worker"):
            await compute.run(fails)
        with trio.move_on_after(0.05) as scope:
            await compute.run(slow)
            finished.append("returned")
            await trio.sleep(0)
            finished.append("not reached")
        # a cancellation waits for the work and its result, as trio.to_thread's does
        assert scope.cancelled_caught and finished == ["slow", "returned"]

    try:
        trio.run(main)
    finally:
        compute.close()
    assert most == 1
