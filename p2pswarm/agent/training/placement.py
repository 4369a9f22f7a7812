"""Placing a job's replicas: ordering fellows to take stages, releasing them, retrying.

The leader orders every stage's fellow to take its stage (``TrainPrepare``; the fellow's
side is ``stage_host``). A refusal releases everything (``TrainRelease``); the job stays
``pending`` with the reason, and the leader tries again every ``retry_s``: a pinned job
only on its own placement (its reason is then ``the cluster changed since the plan was
shown: ...``; it never starts elsewhere), an unpinned one on whatever the swarm now gives.

A replica paused by a lost fellow is placed again on the cards nobody trains on, keeping
the job's cut (``replacement``), so its stages still sync with the other replicas'. A job
of one replica that lost a fellow waits ``pending`` for cards the same way and resumes
from its latest checkpoint (``wait_to_resume``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.training.job_plan import JobPlan
from p2pswarm.agent.training.jobs import CHANGED, TERMINAL, Job, model_source
from p2pswarm.agent.training.placed import (
    BatchShape,
    Placement,
    ReplicaPlacement,
    StagePlacement,
)
from p2pswarm.errors import PlacementError, ReplicaLost, SwarmError
from p2pswarm.planner import ClusterView, profile_from_config, request_from_dict
from p2pswarm.planner import plan as plan_pipeline
from p2pswarm.planner.plan import Segments
from p2pswarm.planner.wording import card_label
from p2pswarm.training.checkpoint_files import latest_cut
from p2pswarm.wire.jobs import TrainPrepare, TrainPrepared, TrainRelease, TrainReleased
from p2pswarm.wire.orders import pack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.training.ports import PlacerPort
    from p2pswarm.training.job import JobConfig

log = logging.getLogger("p2pswarm.training")


def claimed_bytes(segments: Segments) -> int:
    """What a stage claims on its card: every segment but the card's other programs,
    its free memory and how far the plan runs past its end."""
    return sum(segments.claims_dict().values())


class Placer:
    """The leader's side of placing jobs' stages on fellows."""

    def __init__(self, training: PlacerPort) -> None:
        self.training = training
        self.agent = training.agent

    async def place(self, job: Job, cut: list[int] | None = None) -> Placement:
        """Each replica's stages with their fellows' addresses, once every fellow took
        its stage; the job stays pending (with why) until then. ``cut``: the one its
        replicas trained on, kept where the cards hold it (their global state is cut so)."""
        while True:
            try:
                plan = await self.training.leader.placing_plan(
                    job, None if job.pinned else cut or self._checkpoint_cut(job))
                if job.maximize and not job.pinned:
                    assert plan.seq_len is not None  # a plan maximizing seq_len says it
                    job.config = replace(job.config, seq_len=plan.seq_len)
                if not plan.fits:
                    raise PlacementError(plan.why_not)
                sync = job.config.sync
                if sync.inner_steps_auto and plan.inner_steps:  # the round the plan sized
                    job.config = replace(job.config, sync=replace(
                        sync, inner_steps=plan.inner_steps, inner_steps_auto=False))
                job.plan_id = plan.plan_id
                placement = self.placement(plan, job.config)
                refusals = await self.prepare(job, dict(enumerate(placement)),
                                              job.next_generation())
                if not refusals:
                    job.placement = placement
                    return placement
                # what this attempt placed, not the job's last placement: a stage left
                # held here would refuse the next attempt's order for it ("already holds")
                await self.release(job, None, sorted({a for r in placement for a in r.addrs}),
                                   job.generation)
                raise PlacementError((CHANGED if job.pinned else "waiting for fellows: ")
                                     + "; ".join(refusals))
            except PlacementError as exc:
                reason = str(exc)
                if job.pinned and not reason.startswith(CHANGED):
                    reason = CHANGED + reason
                job.state, job.reason = "pending", reason
                log.info("job %s pending: %s", job.job_id, exc)
            await trio.sleep(self.training.timings.retry_s)

    def _checkpoint_cut(self, job: Job) -> list[int] | None:
        """The cut of the checkpoint an unpinned job resumes from, on this leader's disk:
        kept where the cards hold it, so nothing needs re-sharding."""
        where = self.training.checkpoint_dir(job)
        if not job.resume or job.pinned or where is None:
            return None
        return latest_cut(where)

    async def wait_to_resume(self, job: Job, lost: ReplicaLost) -> Placement:
        """A lone replica lost a fellow: the job waits ``pending`` until cards take its
        stages again (a pinned job: its own plan; otherwise any free cards, on the cut
        it trained with), then resumes from its latest checkpoint (or from the start
        when it has written none yet). Without a checkpoint directory it fails."""
        if job.config.checkpoint.dir is None:
            raise PlacementError(f"{lost}; the job names no checkpoint.dir to resume from")
        if job.checkpoint:
            job.resume = True
            whence = f"resume from its checkpoint of step {job.checkpoint_step}"
        else:
            job.resume = False
            job.step, job.loss, job.losses, job.samples = 0, None, [], 0
            whence = "start again (it wrote no checkpoint yet)"
        first = job.placement[0].stages if job.placement else ()
        gone = sorted({s.fellow for s in first if s.addr in str(lost)})
        paused = (f"lost {', '.join(gone)}: " if gone else "") + f"{lost}; waiting for " \
            f"cards to {whence}"
        job.state, job.reason = "pending", paused
        job.paused_times += 1
        log.warning("job %s: %s", job.job_id, paused)
        if job.pinned:
            return await self.place(job)
        while True:
            await trio.sleep(self.training.timings.retry_s)
            try:
                replica = await self.replacement(job, 0)
                refusals = await self.prepare(job, {0: replica}, job.next_generation())
                if not refusals:
                    job.placement = (replica,)
                    return job.placement
                await self.release(job, 0, replica.addrs, job.generation)
                why = "; ".join(refusals)
            except PlacementError as exc:
                why = str(exc)
            job.reason = f"{paused} ({why})"
            log.info("job %s still pending: %s", job.job_id, why)

    def placement(self, plan: JobPlan, job: JobConfig) -> Placement:
        """Each replica of the leader's job plan ``plan`` with its fellows' addresses and
        its batch shape, resolved here once: the one the plan sized for it (a fleet plan,
        ``micro_batch: "auto"``), else the job's."""
        cards = {(c.fellow_id, c.kind, c.index): c for c in plan.cards}
        default = BatchShape.of_job(job)
        out = []
        for replica in plan.replicas:
            batch = default
            if plan.auto_batch:
                batch = BatchShape(
                    default.micro_batch if replica.micro_batch is None else replica.micro_batch,
                    default.micro_batches if replica.micro_batches is None
                    else replica.micro_batches)
            stages = []
            for s in replica.stages:
                card = cards.get((s.fellow_id, s.kind, s.card_index))
                need = claimed_bytes(card.segments if card else Segments())
                stages.append(self._stage(s.index, s.fellow_id, s.fellow, s.layers, s.kind,
                                          s.card_index, s.name, need))
            out.append(ReplicaPlacement(tuple(stages), batch))
        return tuple(out)

    def _stage(self, stage: int, fellow_id: str, planned_as: str, layers: tuple[int, ...],
               kind: str, index: int, name: str, need_bytes: int) -> StagePlacement:
        """A planned stage on a connected fellow's card, with the fellow's address."""
        member = self.agent.fellow(fellow_id)
        if member is None or not member.present:
            raise PlacementError(f"stage {stage}'s fellow {planned_as} is not connected")
        start, end = layers
        return StagePlacement(stage, fellow_id, member.name, member.addr, (start, end), kind,
                              index, card_label(kind, index, name), need_bytes)

    async def replacement(self, job: Job, replica: int) -> ReplicaPlacement:
        """Cards for a paused replica, on this leader's view now: the planner places one
        pipeline on the cards nobody trains on (the replica's own fellow, alive again, or
        free ones); the replica keeps the job's cut and its batch shape, so its stages
        still sync with the other replicas' stages."""
        cfg = job.config
        old = job.placement[replica]
        model = model_source(cfg)
        profile = profile_from_config(model.config, model.name or "model")
        request = request_from_dict({
            **cfg.plan_request(), "stages": len(old.stages), "maximize": None,
            "exclude": sorted(job.exclude_cards), **old.batch.to_doc()})
        planned = plan_pipeline(profile, self._view_for_training(), request)
        if not planned.fits:
            raise PlacementError(planned.limit.sentence)
        if len(planned.stages) != len(old.stages):
            raise PlacementError(f"the free cards give {len(planned.stages)} stages, the job "
                                 f"is cut in {len(old.stages)}")
        claims = {(c.fellow_id, c.kind, c.index): claimed_bytes(c.segments)
                  for c in planned.cards if c.used}
        stages = tuple(
            self._stage(s.index, s.fellow_id, s.fellow, was.layers, s.kind, s.card_index,
                        s.name, claims.get((s.fellow_id, s.kind, s.card_index), 0))
            for s, was in zip(planned.stages, old.stages))
        return ReplicaPlacement(stages, old.batch)

    def _view_for_training(self) -> ClusterView:
        """The leader's view with each fellow's ``training`` flag from the leader's own
        record (the fellows holding live stages of its jobs), not from gossip: a fellow
        restarted after a crash may still be gossiped with the flag its old self set."""
        busy: set[str] = set()
        for job in self.training.jobs.values():
            if job.state in TERMINAL or job.driver is None:
                continue  # a pending job holds no stages
            idle = {r.index for r in job.driver.replicas if r.paused and not r.joining}
            busy.update(s.fellow_id for i, replica in enumerate(job.placement)
                        if i not in idle for s in replica.stages)
        busy.update(self.agent.node_id.hex() for _ in self.training.hosts)
        view = self.agent.planning.view()
        fellows = tuple(replace(f, training=f.id in busy) for f in view.fellows)
        return ClusterView(fellows, view.default_link, view.local_link, view.links)

    async def prepare(self, job: Job, replicas: Mapping[int, ReplicaPlacement],
                      generation: int = 0) -> list[str]:
        """Order every stage of ``replicas`` (by replica index) onto its fellow; the
        refusals."""
        refusals: list[str] = []
        config = pack_doc(job.config.to_dict())
        timeout_s = self.training.timings.open_timeout_s

        async def one(r: int, s: StagePlacement, n_stages: int, next_addr: str,
                      prev_fellow: str) -> None:
            if not self.training.leads(job.term):
                refusals.append(f"{s.fellow}: not ordered, this fellow no longer leads")
                return
            start, end = s.layers
            order = TrainPrepare(job.job_id, r, s.stage, n_stages, s.fellow_id, start, end,
                                 s.card_kind, s.card_index, s.need_bytes, next_addr, config,
                                 generation, prev_fellow=prev_fellow)
            try:
                with trio.fail_after(timeout_s):
                    await self.training.leadership.order(s.addr, order, TrainPrepared)
            except SwarmError as exc:
                refusals.append(f"{s.fellow}: {exc}")
            except trio.TooSlowError:
                refusals.append(f"{s.fellow}: no answer within {timeout_s:g} s")

        async with trio.open_nursery() as nursery:
            for r, replica in sorted(replicas.items()):
                stages = replica.stages
                for i, s in enumerate(stages):
                    nxt = stages[i + 1].addr if i + 1 < len(stages) else ""
                    prev = stages[i - 1].fellow_id if i else ""
                    nursery.start_soon(one, r, s, len(stages), nxt, prev)
        return sorted(refusals)

    async def release(self, job: Job, replica: int | None = None,
                      addrs: list[str] | None = None, generation: int | None = None) -> None:
        """Order the job's stages (of one replica, up to one placement of it) released."""
        if addrs is None:
            addrs = sorted({s.addr for r, placed in enumerate(job.placement)
                            for s in placed.stages if replica is None or r == replica})
        if not job.placement and replica is None:
            # a failed prepare: every fellow that may hold a stage
            membership = self.agent.membership
            addrs = sorted({m.addr for m in (membership.members() if membership else ())
                            if m.present})
        order = TrainRelease(job.job_id, replica, generation)

        async def one(addr: str) -> None:
            if not self.training.leads(job.term):
                return  # the stages are the new leader's to keep or release
            try:
                with trio.fail_after(self.training.timings.open_timeout_s):
                    await self.training.leadership.order(addr, order, TrainReleased)
            except (SwarmError, trio.TooSlowError) as exc:
                log.info("release of %s on %s: %s", job.job_id, addr, exc)

        async with trio.open_nursery() as nursery:
            for addr in addrs:
                nursery.start_soon(one, addr)


__all__ = ["Placement", "Placer"]
