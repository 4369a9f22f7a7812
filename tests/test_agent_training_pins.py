"""A pinned training job keeps its plan while the plan still holds, in virtual time.

``plan --train --maximize-seq-len`` on identical idle fellows, then their free memory
moves up a little: the plan the leader would make now differs (a longer ``seq_len``
fits), yet the shown placement still holds its claims, so ``train --plan-id`` starts
exactly it, at the shown ``seq_len``. A card filled past its stage's claim still refuses
the pin. The driver is stubbed: the test is about where a job starts, not about its
steps.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import trio

from p2pswarm.agent.training.driver import Driver
from p2pswarm.config import local
from p2pswarm.errors import PlacementError
from tests.cpu_swarm import start_cpu_swarm
from tests.test_pins import NOISY, set_free
from tests.training_swarm import finished, job_config

IDLE_FREE_GB = 3.0
MOVED_GB = 0.3  # freed on every fellow after the plan was shown: a longer seq_len fits
CONFIG = job_config(micro_batch=64)  # activations that make memory limit the seq_len


def placed(plan_or_job: Any) -> list[tuple[str, list[int]]]:
    if isinstance(plan_or_job, dict):
        return [(s["fellow"], list(s["layers"])) for s in plan_or_job["stages"]]
    return [(s.fellow, list(s.layers)) for s in plan_or_job.placement[0].stages]


async def test_a_pinned_job_starts_the_shown_plan_while_it_still_holds(
        autojump_clock, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[list[tuple[str, list[int]]], int]] = []

    async def run(self: Driver) -> None:  # where it starts, and at what seq_len
        started.append((placed(self.job), self.job.config.seq_len))

    monkeypatch.setattr(Driver, "run", run)
    async with trio.open_nursery() as nursery:
        swarm = await start_cpu_swarm(nursery, 3, 7, config=replace(local(), inventory=NOISY))
        for i in range(3):
            set_free(swarm, i, IDLE_FREE_GB)
        await trio.sleep(3.0)  # an inventory read, and gossip to the leader
        asker = swarm.live()[1]
        shown = await asker.training.ask_plan(CONFIG, stages=3, maximize="seq_len")
        for i in range(3):
            set_free(swarm, i, IDLE_FREE_GB + MOVED_GB)
        await trio.sleep(3.0)
        now = await asker.training.ask_plan(CONFIG, stages=3, maximize="seq_len")
        assert now["plan_id"] != shown["plan_id"]  # the noise moved the plan made now
        record = await asker.training.submit(CONFIG, plan_id=shown["plan_id"], stages=3,
                                             maximize="seq_len")
        assert record["plan_id"] == shown["plan_id"] and record["pinned"]
        assert record["seq_len"] == shown["request"]["seq_len"]
        record = await finished(asker, record["job_id"])
        assert record["state"] == "finished", record["reason"]
        assert started == [(placed(shown), shown["request"]["seq_len"])]
        # a real change still refuses it: a card filled past its stage's claim (and with
        # one of three cards full no plan of three stages is left at all)
        set_free(swarm, 0, 0.2)
        await trio.sleep(3.0)
        with pytest.raises(PlacementError, match=f"plan {shown['plan_id']} no longer holds"):
            await asker.training.submit(CONFIG, plan_id=shown["plan_id"], stages=3,
                                        maximize="seq_len")
        nursery.cancel_scope.cancel()
