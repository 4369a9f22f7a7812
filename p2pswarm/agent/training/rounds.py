"""DiLoCo sync rounds between a job's replicas, run by the driver on the leader.

The driver keeps each stage's keeper (``OuterSync``, through the ``TrainRuntime``) and
runs the rounds asynchronously, by the rule of ``training.round_rule`` (the one
``training.virtual.VirtualSwarm`` plays in virtual time): each replica trains in its own
task, takes its step budget (by measured speed: the fastest ``inner_steps``), and sends
its compressed pseudo-gradients tagged with the version it is anchored on. A round closes
when every member has sent or at its deadline, with whatever arrived; a late delta is
down-weighted by its staleness, or dropped beyond the bound. A replica whose delta was
fresh waits for its round to close while the others should send within about one of its
steps (so equal speeds give ``training.LocalRun`` round for round); otherwise it trains
on and applies each update before its next step. A replica placed again joins after the
next round closes: its stages take the keepers' global parameters and version and it
trains from there.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.training.round_entry import LateContribution, RoundEntry
from p2pswarm.errors import EveryReplicaLost, SwarmError
from p2pswarm.training.round_rule import (
    delta_weight,
    round_budgets,
    round_closes,
    worth_waiting,
)
from p2pswarm.wire.training import Ack, Delta, TakeDelta, Update

if TYPE_CHECKING:
    from p2pswarm.agent.training.checkpoints import CheckpointKeeper
    from p2pswarm.agent.training.global_state import GlobalState
    from p2pswarm.agent.training.ports import DriverPort
    from p2pswarm.agent.training.replica import Replica
    from p2pswarm.agent.training.runtime import StageKeeper

log = logging.getLogger("p2pswarm.training")


class RoundsKeeper:
    """A driver's sync rounds: the round-closer, each replica's task, the sync traffic.
    Its state is its own (the losses per step, the open round's late contributions,
    when it last checkpointed); the driver's replicas and keepers it reaches through the
    driver (``ports.DriverPort``)."""

    def __init__(self, driver: DriverPort, global_state: GlobalState,
                 checkpoints: CheckpointKeeper) -> None:
        self._driver = driver
        self._global = global_state
        self._checkpoints = checkpoints
        self._buckets: dict[int, list[float]] = {}  # job step -> the replicas' losses there
        self._wake = trio.Event()  # something the round-closer should look at happened
        self._closed = trio.Event()  # set (and replaced) when a round closes
        self._late: list[LateContribution] = []  # late contributions of the open round
        self._nursery: trio.Nursery | None = None
        self._checkpointed = 0

    @asynccontextmanager
    async def all_locks(self) -> AsyncIterator[None]:
        """Hold every replica's lock, taken in replica order."""
        async with AsyncExitStack() as stack:
            for r in self._driver.replicas:
                await stack.enter_async_context(r.lock)
            yield

    # --- the round-closer -------------------------------------------------------------------

    async def run(self, nursery: trio.Nursery) -> None:
        """Every replica trains in its own task; this one closes each stage's round by
        ``round_rule.round_closes``, admits replicas placed again, checkpoints."""
        driver = self._driver
        self._nursery = nursery
        self._checkpointed = driver.job.step
        for i, loss in enumerate(driver.job.losses):  # a resumed job's record goes on
            self._buckets[i + 1] = [loss]
        now = trio.current_time()
        for keeper in driver.keepers:
            keeper.restart_deadline(now)
        for r in driver.active:
            r.running = True
            nursery.start_soon(self._replica_loop, r)
        keeper = driver.keepers[0]
        while True:
            if not any(r.running for r in driver.replicas) and any(
                    r.joining for r in driver.replicas):
                await self._admit()  # no round would close to let it in
            now = trio.current_time()
            if not any(r.running for r in driver.replicas):
                if any(r.finished for r in driver.replicas):
                    await self._close_round(now)  # what the last budgets sent
                    return
                if not any(r.joining or r.placing for r in driver.replicas):
                    # none left to close a round: the job goes on from its checkpoint,
                    # every replica placed again as fellows come back (``replace_all``)
                    raise EveryReplicaLost("every replica lost a fellow: " + "; ".join(
                        r.paused for r in driver.replicas))
            if self._round_due(keeper, now):
                await self._close_round(now)
                continue
            with trio.move_on_at(keeper.next_deadline()):
                await self._wake.wait()
            self._wake = trio.Event()

    def wake(self) -> None:
        self._wake.set()

    def _round_due(self, keeper: StageKeeper, now: float) -> bool:
        """Whether the round-closer closes a round now (``round_rule.round_closes``)."""
        return round_closes(keeper, now)

    async def _close_round(self, now: float) -> None:
        driver = self._driver
        results = [keeper.close_round(now) for keeper in driver.keepers]
        first = results[0]
        if first is None:
            return  # nothing arrived: the deadline moved on
        driver.job.rounds.append(RoundEntry(
            driver.job.step, first.version, round(now, 3),
            tuple(dict.fromkeys(a.replica for a in first.applied)),
            tuple(dict.fromkeys(a.replica for a in first.dropped)), tuple(self._late)))
        self._late = []
        closed, self._closed = self._closed, trio.Event()
        closed.set()
        await self._admit()
        await driver.training.handover.keep(driver.job, driver)  # resumed from here
        due = driver.cfg.checkpoint.interval_steps
        store = self._checkpoints.store
        if store is not None and driver.job.step // due > self._checkpointed // due:
            async with self.all_locks():
                await self._checkpoints.checkpoint()
            self._checkpointed = driver.job.step

    # --- one replica's task -----------------------------------------------------------------

    def _budget(self, r: Replica) -> int:
        """Local steps this round, by ``round_rule.round_budgets``."""
        driver = self._driver
        inner = driver.cfg.sync.inner_steps
        if not driver.cfg.sync.speed_aware or r.step_s <= 0:
            return inner
        speeds = {x.name: 1.0 / x.step_s for x in driver.replicas
                  if x.running and x.step_s > 0}
        return round_budgets(speeds, inner)[r.name]

    def _samples_per_step(self) -> int:
        """Sequences one step of the job is: one step of every replica's batch."""
        driver = self._driver
        return max(1, sum(driver.batch_of(x) for x in driver.replicas))

    def _trained_enough(self) -> bool:
        """Whether the job has trained its length: ``steps`` steps of every replica's
        batch, in sequences. A paused replica's share (and a slow one's, which takes
        fewer steps a round) is trained by the others, so churn makes a job take longer,
        never learn from less data."""
        driver = self._driver
        return driver.job.samples >= driver.cfg.steps * self._samples_per_step()

    def _worth_waiting(self, r: Replica) -> bool:
        """``round_rule.worth_waiting`` over the replicas yet to send this round."""
        driver = self._driver
        version = driver.keepers[0].version
        unsent = [(x.budget - x.in_round, x.step_s) for x in driver.replicas
                  if x is not r and x.running and x.sent_version != version]
        return worth_waiting(r.step_s, unsent)

    async def _replica_loop(self, r: Replica) -> None:
        """Catch up on the updates, take this round's budget of steps, send the deltas;
        wait for the round only while it is open (never past its deadline)."""
        driver = self._driver
        try:
            while True:
                async with r.lock:
                    await self._catch_up(r)
                r.budget, r.in_round = self._budget(r), 0
                if self._trained_enough():
                    break
                while r.in_round < r.budget and not self._trained_enough():
                    await self._one_step(r)
                # where sending now would only wait for a slower replica, it trains on
                budget_done_s = trio.current_time()
                while not self._trained_enough() and self._train_on(r, budget_done_s):
                    await self._one_step(r)
                async with r.lock:
                    version, fresh = await self._contribute(r)
                r.rounds_done += 1
                if fresh:
                    r.sent_version = version
                if fresh and self._worth_waiting(r):
                    while driver.keepers[0].version <= version:
                        await self._closed.wait()
            async with r.lock:
                if r.samples_unsent:
                    await self._contribute(r)
            r.finished = True
        except (SwarmError, trio.TooSlowError) as exc:
            await driver.pause(r, exc)
        finally:
            r.running = False
            for keeper in driver.keepers:
                keeper.leave(r.name)
            self.wake()

    async def _one_step(self, r: Replica) -> None:
        """One step of ``r`` in its round, its speed measured, into the job's record."""
        driver = self._driver
        async with r.lock:
            await self._catch_up(r)  # a round that closed meanwhile
            began = trio.current_time()
            # the job's place, not the replica's, sets the learning rate
            position = driver.job.samples // self._samples_per_step()
            with trio.fail_after(driver.training.timings.step_timeout_s):
                loss = await driver.step(r, min(position, driver.cfg.steps - 1))
        took = trio.current_time() - began
        r.step_s = took if r.step_s <= 0 else 0.5 * r.step_s + 0.5 * took
        r.in_round += 1
        self._count(r, loss)

    def _train_on(self, r: Replica, budget_done_s: float) -> bool:
        """Whether ``r``, its budget taken at ``budget_done_s``, takes one more step
        before it sends: never here (a fresh delta may wait for its round to close,
        ``worth_waiting``); the all-reduce's rounds say otherwise."""
        return False

    def _count(self, r: Replica, loss: float) -> None:
        """A replica's step into the job's record: the job's step is the samples trained
        in steps of every replica's batch; each step's loss is the mean of the replicas'
        losses there."""
        driver = self._driver
        cfg, job = driver.cfg, driver.job
        per_step = driver.batch_of(r)
        job.samples += per_step
        at = min(cfg.steps, max(1, math.ceil(job.samples / self._samples_per_step())))
        self._buckets.setdefault(at, []).append(loss)
        job.step = max(job.step, at)
        job.losses = [sum(v) / len(v) for _, v in sorted(self._buckets.items())]
        job.loss = job.losses[-1]
        driver.tokens += per_step * cfg.seq_len
        elapsed = trio.current_time() - driver.started_s
        job.tokens_per_s = driver.tokens / elapsed if elapsed > 0 else 0.0
        job.replicas = len(driver.active)
        job.replica_steps = {x.name: x.steps for x in driver.replicas}

    # --- sync traffic -----------------------------------------------------------------------

    async def _contribute(self, r: Replica) -> tuple[int, bool]:
        """Send each stage's delta to its keeper; (the version it is anchored on, whether
        it is fresh: for the round still open)."""
        driver = self._driver
        deltas = [await link.ask(TakeDelta(), Delta) for link in r.links]
        now = trio.current_time()
        version = deltas[0].version
        verdict = None
        for keeper, delta in zip(driver.keepers, deltas):
            verdict = keeper.contribute(r.name, delta.version, delta.blob, r.samples_unsent,
                                        now)
            driver.job.bytes_sent += len(delta.blob)
        assert verdict is not None
        if verdict.staleness:
            sync = driver.cfg.sync
            decay = sync.staleness_decay ** verdict.staleness
            weight = delta_weight(1, verdict.staleness, sync.staleness_decay,
                                  sync.staleness_bound) if verdict.accepted else 0.0
            self._late.append(LateContribution(r.name, verdict.staleness, r.samples_unsent,
                                               weight, not verdict.accepted))
            log.info("job %s: %s sent %d round(s) late: %s", driver.job.job_id, r.name,
                     verdict.staleness, "dropped" if not verdict.accepted
                     else f"weighed {decay:g}")
        if not verdict.accepted:  # too stale: the model never learns from these
            driver.job.samples = max(0, driver.job.samples - r.samples_unsent)
        r.samples_unsent = r.steps_unsent = 0
        r.kept_position = r.stream.position
        self.wake()
        return version, verdict.accepted and verdict.staleness == 0

    async def _catch_up(self, r: Replica) -> None:
        """Apply the updates the replica has not had (or, when the keepers no longer hold
        them, start it over from the global parameters)."""
        driver = self._driver
        target = driver.keepers[0].version
        if r.version >= target:
            return
        missed = [keeper.updates_since(r.version) for keeper in driver.keepers]
        if any(m is None for m in missed):
            await self._global.send(r)
            self._global.forget_local_steps(r)
        else:
            for i in range(target - r.version):
                for link, updates in zip(r.links, missed):
                    assert updates is not None
                    await link.ask(Update(r.version + i + 1, updates[i]), Ack)
                    driver.job.bytes_sent += len(updates[i])
        r.version = target
        r.rounds_done = max(r.rounds_done, target)
        await self._global.copy_tied(r)

    async def _admit(self) -> None:
        """After a round closes (or when no replica is training): replicas placed again
        borrow a training replica's optimizer moments, take the keepers' current global
        parameters and version, and start training in the round that opens now."""
        driver = self._driver
        for r in driver.replicas:
            if not r.joining or not await self._checkpoints.lend_moments(r) \
                    or not await self._global.put(r):
                continue
            r.joining, r.paused = False, ""
            r.in_round, r.step_s, r.sent_version = 0, 0.0, -1
            r.running, r.finished = True, False
            driver.job.rejoins += 1
            assert self._nursery is not None
            self._nursery.start_soon(self._replica_loop, r)
            log.info("job %s: %s rejoined at step %d", driver.job.job_id, r.name,
                     driver.job.step)


__all__ = ["RoundsKeeper"]
