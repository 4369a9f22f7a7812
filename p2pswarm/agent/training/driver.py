"""The leader driving one job: a stream to every stage, steps, pauses, placing again.

``drive`` is a job's life on the leader: place it (waiting while pending), drive it,
release its stages. The ``Driver`` opens one sealed control stream to every stage (last
first: each stage opens its data stream on to the next); activations flow down those and
their gradients back up, micro-batch by micro-batch in the order the schedule gives each
stage. The driver holds each replica's data stream: inputs go to the first stage,
targets to the last. After the backwards each stage reports its squared gradient norm
(and a tied-embedding gradient, which the driver adds up for both copies); the driver
answers with the clip coefficient and every stage steps its own optimizer. With one
replica this is exactly ``LocalTrainPipeline``; with several, ``rounds`` syncs them.

A job taken over from a leader that is gone starts from where its copy says its rounds
stood, or from its checkpoint (``takeover``); the driver copies where it stands to a few
fellows as it goes (``handover``).

A replica whose fellow drops or fails is paused: it leaves the rounds and the others go
on. Every ``retry_s`` the driver places a paused replica again (same cut, cards nobody
trains on); after the next round closes it joins (``rounds``). When no replica is left
and none is being placed again, every replica is placed again from the latest
checkpoint (``replace_all``); a job of one replica waits ``pending`` for cards and
resumes from its latest checkpoint (``checkpoints``). A stage whose stream fails as a
job resumes, or as its keepers are made, pauses its replica like any other loss.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.streams import send_best_effort
from p2pswarm.agent.training.checkpoints import CheckpointKeeper
from p2pswarm.agent.training.global_state import GlobalState
from p2pswarm.agent.training.handover import KEEP_EVERY_STEPS
from p2pswarm.agent.training.jobs import TERMINAL, Job
from p2pswarm.agent.training.links import Link
from p2pswarm.agent.training.placed import Placement, ReplicaPlacement
from p2pswarm.agent.training.replica import Replica
from p2pswarm.agent.training.ring_rounds import RingRounds, sync_by_allreduce
from p2pswarm.agent.training.rounds import RoundsKeeper
from p2pswarm.errors import EveryReplicaLost, PlacementError, ReplicaLost, SwarmError
from p2pswarm.wire.training import (
    Ack,
    Params,
    ParamsAsk,
    StepApply,
    StepReport,
    StepRun,
    Stop,
    TrainOpen,
    TrainTensor,
)
from p2pswarm.wire.versions import ALLREDUCE, speaks

if TYPE_CHECKING:
    from p2pswarm.agent.training.job_state import Handed
    from p2pswarm.agent.training.ports import DrivePort
    from p2pswarm.agent.training.runtime import StageKeeper

log = logging.getLogger("p2pswarm.training")


async def run_all_or_fail_first(fns: list[Callable[[], Awaitable[None]]]) -> None:
    """Run ``fns`` concurrently; the first failure cancels the rest and is raised as
    itself (not as an exception group), so a caller's ``except SwarmError`` sees it."""
    errors: list[BaseException] = []

    async def guard(fn: Callable[[], Awaitable[None]], scope: trio.CancelScope) -> None:
        try:
            await fn()
        except (SwarmError, trio.TooSlowError) as exc:
            errors.append(exc)
            scope.cancel()

    async with trio.open_nursery() as nursery:
        for fn in fns:
            nursery.start_soon(guard, fn, nursery.cancel_scope)
    if errors:
        raise errors[0]


def links(placed: ReplicaPlacement) -> list[Link]:
    """A driver's link to every stage of a replica (streams not open yet)."""
    return [Link(s.stage, s.fellow, s.addr) for s in placed.stages]


async def replace_all(training: DrivePort, job: Job, lost: ReplicaLost
                      ) -> tuple[Placement, Handed | None]:
    """Every replica of ``job`` placed afresh after ``lost``: where the rounds stood at
    this leader's last copy (the keepers' global state, newer than any checkpoint), else
    from its latest checkpoint, or from step 0 when it wrote none (and says so); and
    what the new driver resumes from."""
    placer = training.placer
    await placer.release(job)
    handed = training.takeover.own_copy(job)
    if handed is not None and handed.rounds is not None:
        whence = (f"resumes where its rounds stood (round {handed.rounds.version}, step "
                  f"{job.step})")
    else:
        whence = training.takeover.from_checkpoint(job)
    job.state, job.reason = "pending", f"{lost}; placing every replica again: {whence}"
    job.paused_times += 1
    log.warning("job %s: %s", job.job_id, job.reason)
    await trio.sleep(training.timings.retry_s)
    if handed is None:
        return await placer.place(job), None
    placement = await training.takeover.place_afresh(job, handed, synced=True, moved=False)
    handed.generation = job.generation  # what the placer placed them with
    return placement, handed if handed.restore_rounds else None


async def drive(training: DrivePort, job: Job, handed: Handed | None = None) -> None:
    """Place the job (waiting while pending), train it, release its stages. A job taken
    over from another leader (``handed``) goes back on its fellows first (``takeover``).

    It is driven in the term this agent leads now: when it stops leading (it steps down,
    follows a newer term, or is cut off on a minority side) ``Training.leader_changed``
    cancels the drive, which then closes its streams and sends nothing more: no release,
    no copy. The new leader takes the job over from its copies; the record here says it
    was handed on, neither failed nor cancelled."""
    driver: Driver | None = None
    placer = training.placer
    job.term, job.handed = training.leadership.term(), ""
    with trio.CancelScope() as scope:
        job.scope = scope
        if job.cancel_asked:
            scope.cancel()
        if not training.leads(job.term):
            training.hand_on(job)
        try:
            if handed is None:
                await training.handover.keep(job)  # submitted: a new leader would place it
                placement = await placer.place(job)
            else:  # the copy it came from stays the newest until it runs here
                placement = await training.takeover.place(job, handed)
            while True:
                driver = job.driver = Driver(training, job, placement, handed)
                handed = None
                try:
                    await driver.run()
                    break
                except EveryReplicaLost as exc:  # several replicas, none left: all again
                    with trio.CancelScope(shield=True):
                        await driver.close()
                    driver = job.driver = None
                    placement, handed = await replace_all(training, job, exc)
                except ReplicaLost as exc:
                    if len(placement) != 1:
                        raise
                    with trio.CancelScope(shield=True):
                        await driver.close()
                    driver = job.driver = None
                    placement = await placer.wait_to_resume(job, exc)
            job.state, job.reason = "finished", ""
        except SwarmError as exc:
            if training.leads(job.term):
                job.state, job.reason = "failed", str(exc)
                log.warning("job %s failed: %s", job.job_id, exc)
            else:  # it failed because this agent was cut off: the new leader drives it
                training.hand_on(job)
    if job.handed:
        job.driver, job.reason = None, job.handed
        log.info("job %s: %s", job.job_id, job.handed)
        if driver is not None:
            with trio.CancelScope(shield=True):
                await driver.close()  # its streams only: the stages are the new leader's
        return
    if scope.cancelled_caught or (job.cancel_asked and job.state not in TERMINAL):
        job.state, job.reason = "cancelled", "cancelled by request"
    with trio.CancelScope(shield=True):
        # its end, first: a new leader does not drive it again (releasing may wait on a
        # dead fellow for a while)
        await training.handover.keep(job)
        if driver is not None:
            await driver.close()
        await placer.release(job)


class Driver:
    """One job on the leader, from its placement to its end: its replicas' links and
    steps here; its sync rounds in a ``RoundsKeeper``, its checkpoints in a
    ``CheckpointKeeper``, both of which it holds."""

    def __init__(self, training: DrivePort, job: Job, placement: Placement,
                 handed: Handed | None = None) -> None:
        self.training = training
        self.agent = training.agent
        self.runtime = training.runtime
        self.job = job
        self.cfg = job.config
        self.handed = handed  # a job taken over from another leader
        generation = handed.generation if handed is not None else job.generation
        self.replicas = [Replica(i, links(placed), placed.batch, generation=generation)
                         for i, placed in enumerate(placement)]
        self.keepers: list[StageKeeper] = []
        self.started_s = 0.0
        self.tokens = 0
        self.global_state = GlobalState(self)
        self.checkpoints = CheckpointKeeper(self, self.global_state)
        # several replicas average their deltas among themselves (no hub), or through
        # each stage's keeper here when some fellow cannot (``sync_by_allreduce``)
        rounds = RingRounds if sync_by_allreduce(placement, self.speaks_allreduce) else RoundsKeeper
        self.rounds = rounds(self, self.global_state, self.checkpoints)

    def speaks_allreduce(self, fellow_id: str) -> bool:
        """Whether the fellow of ``fellow_id`` announced the all-reduce's messages."""
        fellow = self.agent.fellow(fellow_id)
        if fellow is None:
            return False
        return fellow.is_self or speaks(self.agent.release_of(fellow.node_id), ALLREDUCE)

    @property
    def active(self) -> list[Replica]:
        return [r for r in self.replicas if not r.paused]

    def batch_of(self, r: Replica) -> int:
        """Sequences replica ``r`` trains on a step."""
        return r.batch.sequences

    @property
    def synced(self) -> bool:
        return len(self.replicas) > 1

    async def run(self) -> None:
        cfg, job, runtime = self.cfg, self.job, self.runtime
        here = await self.training.data.local(cfg)  # its data files, sent with the job
        data = await self.agent.compute.run(lambda: runtime.replica_data(here,
                                                                         len(self.replicas)))
        for r, stream in zip(self.replicas, data):
            r.data = stream
            r.kept_position = stream.position
        handed = self.handed
        for i, why in sorted(handed.lost.items() if handed is not None else ()):
            await self.pause(self.replicas[i], ReplicaLost(why))  # placed again later
        async with trio.open_nursery() as nursery:
            for r in self.active:
                nursery.start_soon(self._open, r)
        if self.synced:  # the global parameters from a replica whose stages answer
            await self._make_keepers()
        where = self.training.checkpoint_dir(job)  # the leader's own choice, not a copy's
        if where is not None:
            self.checkpoints.store = runtime.checkpoint_store(where, cfg.checkpoint.keep)
        if handed is not None and handed.restore_rounds:
            await self._restore_rounds(handed)
        elif job.resume:
            await self.checkpoints.resume()
        if self.synced and not self.active:  # a stage failed each replica as it resumed
            raise EveryReplicaLost("every replica lost a fellow as the job resumed: " +
                                   "; ".join(r.paused for r in self.replicas))
        job.state, job.reason = "running", ""
        job.replicas = len(self.active)
        self.started_s = trio.current_time()
        await self.training.handover.keep(job, self)
        if not self.synced:
            await self._train()
            return
        failed: list[SwarmError] = []  # raised as itself, not in an exception group
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._place_again_loop)
            try:
                await self.rounds.run(nursery)
            except SwarmError as exc:
                failed.append(exc)
            nursery.cancel_scope.cancel()
        if failed:
            raise failed[0]

    async def _train(self) -> None:
        """One replica (or replicas in lockstep, unsynced): step after step."""
        cfg, job = self.cfg, self.job
        while job.step < cfg.steps:
            if not self.active:
                raise ReplicaLost("; ".join(r.paused for r in self.replicas))
            losses: dict[int, float] = {}

            async def one(r: Replica, losses: dict[int, float]) -> None:
                try:
                    with trio.fail_after(self.training.timings.step_timeout_s):
                        losses[r.index] = await self.step(r)
                except (SwarmError, trio.TooSlowError) as exc:
                    await self.pause(r, exc)

            async with trio.open_nursery() as nursery:
                for r in self.active:
                    nursery.start_soon(one, r, losses)
            if not losses:
                continue
            job.step += 1
            samples = sum(self.batch_of(self.replicas[i]) for i in losses)
            job.samples += samples
            self.tokens += samples * cfg.seq_len
            job.loss = sum(losses[i] for i in sorted(losses)) / len(losses)
            job.losses.append(job.loss)
            if self.checkpoints.store is not None \
                    and job.step % cfg.checkpoint.interval_steps == 0:
                await self.checkpoints.checkpoint()
                await self.training.handover.keep(job, self)
            elif job.step % KEEP_EVERY_STEPS == 0:
                await self.training.handover.keep(job, self)
            elapsed = trio.current_time() - self.started_s
            job.tokens_per_s = self.tokens / elapsed if elapsed > 0 else 0.0
            job.replicas = len(self.active)

    async def _open(self, r: Replica) -> None:
        try:
            await self._open_links(r)
        except (SwarmError, trio.TooSlowError) as exc:
            await self.pause(r, exc)

    async def _open_links(self, r: Replica) -> None:
        """Control streams to every stage, last first (each opens its data stream on)."""
        with trio.fail_after(self.training.timings.open_timeout_s):
            for link in reversed(r.links):
                link.stream = await self.agent.open_secure(link.addr)
                await link.ask(TrainOpen(self.job.job_id, r.index, link.stage, "control"),
                               Ack)

    async def pause(self, r: Replica, exc: BaseException) -> None:
        why = str(exc) if isinstance(exc, SwarmError) else "a stage fell silent"
        r.paused = f"{r.name} paused: {why}"
        r.joining = False
        log.warning("job %s: %s", self.job.job_id, r.paused)
        for keeper in self.keepers:
            keeper.leave(r.name)
        await self._close_links(r)
        # released in the background: a dead fellow's silence must not hold the others up
        addrs = self.job.placement[r.index].addrs
        self.agent.spawn(self.training.placer.release, self.job, r.index, addrs,
                         r.generation)

    # --- rejoin: a paused replica placed again ----------------------------------------------

    async def _place_again_loop(self) -> None:
        """Every ``retry_s``, try to place each paused replica again (on its fellow, alive
        again, or on free cards); it joins the rounds at the next round boundary."""
        while True:
            await trio.sleep(self.training.timings.retry_s)
            for r in self.replicas:
                if r.paused and not r.joining:
                    await self._place_again(r)

    async def _place_again(self, r: Replica) -> None:
        placer = self.training.placer
        r.placing = True
        try:
            placed = await placer.replacement(self.job, r.index)
            generation = self.job.next_generation()
            refusals = await placer.prepare(self.job, {r.index: placed}, generation)
            if refusals:
                await placer.release(self.job, r.index, placed.addrs, generation)
                raise PlacementError("; ".join(refusals))
            r.generation = generation
            self.job.placement = tuple(placed if i == r.index else was
                                       for i, was in enumerate(self.job.placement))
            r.links = links(placed)
            r.batch = placed.batch
            await self._open_links(r)
            r.joining = True
            self.rounds.wake()
            log.info("job %s: %s placed again on %s", self.job.job_id, r.name,
                     ", ".join(s.fellow for s in placed.stages))
        except (SwarmError, trio.TooSlowError) as exc:
            why = str(exc) if isinstance(exc, SwarmError) else "a stage fell silent"
            log.info("job %s: %s not placed again yet: %s", self.job.job_id, r.name, why)
            await self._close_links(r)
        finally:
            r.placing = False

    async def _close_links(self, r: Replica) -> None:
        for link in r.links:
            if link.stream is not None:
                stream, link.stream = link.stream, None
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(1.0):
                        await send_best_effort(stream, Stop())
                    await stream.aclose()

    async def close(self) -> None:
        for r in self.replicas:
            await self._close_links(r)

    # --- one step of one replica ------------------------------------------------------------

    async def step(self, r: Replica, position: int | None = None) -> float:
        """One optimizer step of replica ``r``; ``position`` is its place in the
        learning-rate schedule (default: the steps it has taken)."""
        cfg = self.cfg
        step = r.steps
        inputs, targets = r.stream.next_step(r.batch.micro_batches, r.batch.micro_batch)
        n_micro = len(inputs)
        lr = cfg.lr.lr_at(r.steps if position is None else position)
        first, last = r.links[0], r.links[-1]
        for link in r.links:
            await link.send(StepRun(step, n_micro, lr))
        for m in range(n_micro):
            await first.send(TrainTensor("input", step, m, inputs[m]))
        for m in range(n_micro):
            await last.send(TrainTensor("target", step, m, targets[m]))
        reports: dict[int, StepReport] = {}
        tied: dict[int, bytes] = {}

        async def report(link: Link) -> None:
            msg = await link.receive(StepReport)
            reports[link.stage] = msg
            if msg.has_tied_grad:
                tied[link.stage] = (await link.receive(TrainTensor)).tensor

        await run_all_or_fail_first([partial(report, link) for link in r.links])
        total_sq = sum(reports[s].grad_sq for s in sorted(reports))
        tied_sum = None
        if len(tied) == 2:
            a, b = (tied[s] for s in sorted(tied))
            tied_sum, tied_sq = self.runtime.tied_total(a, b)
            total_sq += tied_sq
        coef = self.runtime.clip_coefficient([total_sq], cfg.optimizer.grad_clip)
        for link in r.links:
            await link.send(StepApply(step, coef))
            if link.stage in tied:
                await link.send(TrainTensor("tied", step, 0, tied_sum if tied_sum is not None
                                            else tied[link.stage]))
        for link in r.links:
            await link.receive(Ack)
        r.steps += 1
        r.samples_unsent += n_micro * r.batch.micro_batch
        r.steps_unsent += 1
        return reports[last.stage].loss_sum / n_micro

    async def _restore_rounds(self, handed: Handed) -> None:
        """A job taken over (``takeover``): the keepers take the copied outer state;
        every replica placed takes the global parameters and goes on from its place in
        the copy."""
        rounds = handed.rounds
        assert rounds is not None
        runtime = self.runtime
        now = trio.current_time()
        for keeper, blob in zip(self.keepers, handed.outer):
            state = await self.agent.compute.run(partial(runtime.read_shard, blob))
            keeper.load_state_dict(state, now)
        for r, was in zip(self.replicas, rounds.replicas):
            r.steps = was.steps
            r.stream.position = r.kept_position = was.position
            if r.paused:
                for keeper in self.keepers:
                    keeper.leave(r.name)
        for r in self.active:
            await self.global_state.put(r)

    async def _make_keepers(self) -> None:
        """Each stage's keeper, from the first replica whose stages all answer: one whose
        stream fails meanwhile is paused (placed again later), not the job's end."""
        for r in self.active:
            try:
                blobs = [(await link.ask(ParamsAsk(), Params)).blob for link in r.links]
            except SwarmError as exc:
                await self.pause(r, exc)
                continue
            for blob in blobs:
                keeper = self.runtime.keeper(blob, self.cfg)
                for replica in self.active:
                    keeper.join(replica.name)
                self.keepers.append(keeper)
            return
        raise EveryReplicaLost("every replica lost a fellow before its rounds began")


__all__ = ["Driver", "Replica", "drive", "run_all_or_fail_first"]
