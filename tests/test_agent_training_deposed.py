"""A deposed leader stops driving its jobs, on MemoryNetwork in virtual time: the leader is
cut off on a minority side while a job of three replicas trains; the other side elects a
leader of a later term, which takes the job over from the copies; the sides meet again,
the old leader follows the new term and steps down, sends no order after that, and the
new leader finishes the job with no round or step driven twice."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from p2pswarm.agent.leadership import Leadership
from p2pswarm.agent.training.links import Link
from p2pswarm.planner.profile import BUILTIN_MODELS
from p2pswarm.sim.virtual import wait_until
from tests.test_agent_training_takeover import leader_of, start_swarm
from tests.training_swarm import finished, job_config

CUT_AT_STEP = 4
STEPS = 12
# tiny-llama cut down to two narrow layers: the test is about who drives, not the model
SMALL = {**BUILTIN_MODELS["tiny-llama"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 32}


def _sender(link: Link) -> str:
    """The address a driver's link sends from (its MemoryNetwork stream's owner)."""
    owner = getattr(getattr(link.stream, "_stream", None), "_owner", None)
    return str(getattr(owner, "local_addr", ""))


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
async def test_a_deposed_leader_stops_driving_and_the_new_one_finishes(
        autojump_clock, monkeypatch: pytest.MonkeyPatch) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery)
        old = leader_of(swarm)
        term = old.leadership.term()
        sent = {"leading": 0, "after": 0}
        after: list[str] = []

        def leading(agent: Any) -> bool:
            return agent is not old or old.training.leads(term)

        def tally(was_leading: bool, what: str) -> None:
            if was_leading:
                sent["leading"] += 1
            else:
                sent["after"] += 1
                after.append(what)

        order, send = Leadership.order, Link.send

        async def counted_order(self: Leadership, addr: str, msg: Any, reply: Any) -> Any:
            if self.agent is old:  # an order decided on: counted as it starts
                tally(leading(old), type(msg).__name__)
            return await order(self, addr, msg, reply)

        async def counted_send(self: Link, msg: object) -> None:
            was_leading = leading(old)
            await send(self, msg)
            if _sender(self) == old.addr:  # it left: counted by whether it led then
                tally(was_leading, type(msg).__name__)

        monkeypatch.setattr(Leadership, "order", counted_order)
        monkeypatch.setattr(Link, "send", counted_send)
        record = await old.training.submit(job_config(
            model={"config": SMALL}, replicas="auto", steps=STEPS, micro_batches=1,
            sync={"inner_steps": 2, "codec": "fp16"}))
        job_id = record["job_id"]
        job = old.training.jobs[job_id]
        await wait_until(lambda: job.step >= CUT_AT_STEP, timeout_s=120, step_s=0.01)
        assert sent["leading"] > 0 and sent["after"] == 0  # the counting sees its orders
        others = [a for a in swarm.live() if a is not old]
        swarm.net.partition([old.addr], [a.addr for a in others])

        def new_leader() -> Any:
            return next((a for a in others if a.leadership.is_leader()), None)

        await wait_until(lambda: new_leader() is not None
                         and job_id in new_leader().training.jobs
                         and new_leader().training.jobs[job_id].state == "running",
                         timeout_s=120, step_s=0.05)
        new = new_leader()
        assert new.leadership.term() > term
        swarm.net.heal()  # the old leader hears of the later term and steps down
        await wait_until(lambda: not old.leadership.is_leader(), timeout_s=60)
        # the old leader's record: handed on, neither failed nor cancelled, not driven
        assert job.state not in ("failed", "cancelled", "finished"), job.reason
        assert job.reason.startswith("handed to the new leader"), job.reason
        assert job.driver is None
        rounds_then, step_then = len(job.rounds), job.step
        record = await finished(new, job_id)
        await wait_until(lambda: not old.leadership.is_leader()
                         and old.leadership.term() == new.leadership.term(), timeout_s=60)
        assert job.reason == f"handed to the new leader {new.name} (term " \
            f"{new.leadership.term()})", job.reason
        assert (len(job.rounds), job.step) == (rounds_then, step_then)  # none closed here
        nursery.cancel_scope.cancel()
    assert sent["after"] == 0, after
    assert record["state"] == "finished", record["reason"]
    assert "moved from leader" in record["moved"] and new.name in record["moved"]
    # every step once, every round once: nothing was driven twice
    assert record["step"] == STEPS and len(record["losses"]) == STEPS
    versions = [r["version"] for r in record["rounds"]]
    assert versions == sorted(set(versions)), versions
