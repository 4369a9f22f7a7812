"""Plans made for fellows run off the loop, one at a time per asker, within a budget."""

from __future__ import annotations

import threading

import pytest
import trio

from p2pswarm.agent.compute import Compute
from p2pswarm.agent.counters import Counters
from p2pswarm.agent.plan_budget import PlanBudget, PlanBusy

ASKER = b"\x01" * 32


def budget(budget_s: float = 5.0, at_once: int = 2, inline: bool = False) -> PlanBudget:
    return PlanBudget(Compute(inline=inline), Counters(), budget_s=budget_s, at_once=at_once)


async def test_a_plan_runs_on_a_thread_and_the_loop_goes_on() -> None:
    plans = budget()
    release = threading.Event()
    ticks = 0

    def slow_plan() -> str:
        release.wait(10)
        return threading.current_thread().name

    async def loop_work() -> None:
        nonlocal ticks
        while not release.is_set():
            ticks += 1
            if ticks == 5:
                release.set()  # the loop ran while the plan waited: let it finish
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(loop_work)
        assert await plans.run(ASKER, slow_plan, "rogue") == "p2pswarm-plan"
    assert ticks >= 5


async def test_one_plan_at_a_time_per_asker_and_over_budget_is_refused() -> None:
    plans = budget(budget_s=0.2)
    release = threading.Event()

    def stuck() -> int:
        release.wait(10)
        return 1

    with pytest.raises(PlanBusy, match="took longer than the 0.2 s"):
        await plans.run(ASKER, stuck, "rogue")
    # its thread still runs: the same asker is refused at once, another is served
    with pytest.raises(PlanBusy, match="still being made"):
        await plans.run(ASKER, lambda: 2, "rogue")
    assert await plans.run(b"\x02" * 32, lambda: 3, "honest") == 3
    assert plans.refused == {"plan-budget": 1, "plan-asker-busy": 1}
    assert plans.counters.refused["plan-budget"] == 1
    release.set()
    with trio.fail_after(10):
        while plans.running():
            await trio.sleep(0.01)
    assert await plans.run(ASKER, lambda: 4, "rogue") == 4  # its turn came back


async def test_plans_at_once_are_bounded_and_a_plan_waiting_past_its_budget_is_refused(
        ) -> None:
    plans = budget(budget_s=0.2, at_once=1)
    release = threading.Event()
    async with trio.open_nursery() as nursery:
        async def first() -> None:
            with pytest.raises(PlanBusy):
                await plans.run(ASKER, lambda: release.wait(10), "one")
        nursery.start_soon(first)
        with trio.fail_after(10):
            while not plans.running():
                await trio.sleep(0)
        with pytest.raises(PlanBusy, match="busy making other plans"):
            await plans.run(b"\x02" * 32, lambda: 1, "two")
    release.set()


async def test_inline_compute_plans_inline(autojump_clock: trio.testing.MockClock) -> None:
    plans = budget(inline=True)
    assert await plans.run(ASKER, threading.current_thread, "x") is threading.current_thread()
