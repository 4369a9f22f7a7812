"""The leader's jobs: their records and the calls that plan, submit, list, cancel them.

A job is ``job.json`` (``training.JobConfig``). The leader plans it (``JobPlanAsk``): one
pipeline with the planner's ``kind="train"`` request, then, while the job asks for more
replicas (or ``replicas: "auto"`` and more fit), another pipeline on the cards still
unused. One replica's plan keeps the planner's ``plan_id``; several get one ``plan_id``
over all of theirs. A submit (``JobSubmit``) pinned to a ``plan_id`` that the leader's
current view no longer gives is refused at once as ``plan-changed`` (409) with what
changed, as a pinned load is. Otherwise the job is recorded ``pending`` and placed
(``placement``), then driven (``driver``). Progress (step, loss, tokens/s, replicas,
bytes) lives in the job record (``Job.report``), which ``JobsAsk`` lists; ``JobCancel``
cancels a job and ``JobConfigAsk`` shows its config (for an export).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypedDict

from p2pswarm.agent.training.job_data import refuse_paths
from p2pswarm.agent.training.job_paths import (
    JOB_ID,
    JobPathRefused,
    check_model_from_fellow,
    check_resume_from_fellow,
)
from p2pswarm.agent.training.job_plan import JobPlan
from p2pswarm.agent.training.job_record import (
    LOSSES_KEPT,
    ROUNDS_KEPT,
    STATES,
    TERMINAL,
    Job,
    JobReport,
    job_config,
)
from p2pswarm.errors import ConfigError, PlacementError
from p2pswarm.models.files import read_model_config
from p2pswarm.planner import pinned_plan_message
from p2pswarm.planner.plan import Plan, StagePlan
from p2pswarm.training.job import JobConfig
from p2pswarm.wire.jobs import (
    JobCancel,
    JobConfigAsk,
    JobConfigShown,
    JobList,
    JobPlanAsk,
    JobPlanShown,
    JobRecord,
    JobsAsk,
    JobSubmit,
)
from p2pswarm.wire.orders import pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.training.ports import JobsPort

CHANGED = "the cluster changed since the plan was shown: "


class ModelDoc(TypedDict):
    """The planner's ``model`` for a job: the model's name and its config.json."""

    name: str
    config: object  # config.json, as the planner's ``profile_from_config`` reads it


@dataclass(frozen=True, slots=True)
class ModelSource:
    """The model a job trains, as the planner reads it: its name and its config.json."""

    name: str
    config: dict[str, Any]  # config.json, as the model's files give it

    def cut_at(self, cut: list[int]) -> ModelSource:
        """The same model, with the stage cut the planner keeps where it fits."""
        return ModelSource(self.name, {**self.config, "p2pswarm_stage_cut": cut})

    def to_doc(self) -> ModelDoc:
        return {"name": self.name, "config": self.config}


def model_source(job: JobConfig) -> ModelSource:
    """The job's model: a scratch config or the named model's."""
    if job.model.init_config is not None:
        return ModelSource("scratch", dict(job.model.init_config))
    return ModelSource(*read_model_config(str(job.model.name)))


def model_message(job: JobConfig) -> ModelDoc:
    """The planner's ``model`` for the job (``ModelSource.to_doc``)."""
    return model_source(job).to_doc()


def job_plan(job: JobConfig, plans: list[Plan]) -> dict[str, Any]:
    """A job's plan document from its replicas' plans: the first replica's plan with
    every replica's stages; several replicas get one ``plan_id`` over all of theirs."""
    several = {"plan_id": replicas_plan_id([p.plan_id for p in plans]),
               "summary": (f"{len(plans)} replicas, synced every {job.sync.inner_steps} "
                           f"steps ({job.sync.codec}). Replica 0: {plans[0].summary}")}
    return {**plans[0].to_dict(), **(several if len(plans) > 1 else {}),
            "replicas": [{"replica": i, "plan_id": p.plan_id,
                          "stages": [s.to_dict() for s in p.stages],
                          "strip_text": p.strip_text,
                          "micro_batch": p.request.micro_batch,
                          "micro_batches": p.request.micro_batches,
                          "request": p.request.to_dict()}
                         for i, p in enumerate(plans)],
            "job": {"steps": job.steps, "seq_len": job.seq_len, "mode": job.mode,
                    "replicas": len(plans)}}


def replicas_plan_id(plan_ids: list[str]) -> str:
    """A job's ``plan_id`` over its replicas' (one replica: its own)."""
    if len(plan_ids) == 1:
        return plan_ids[0]
    return hashlib.sha256(f"job|{','.join(plan_ids)}".encode()).hexdigest()[:16]


def fleet_job_plan(job: JobConfig, fleet: dict[str, Any]) -> dict[str, Any]:
    """A job's plan from the planner's fleet plan (``micro_batch: "auto"``): its
    replicas with their own batches, under the job's ``plan_id`` rule."""
    replicas = JobPlan.from_doc(fleet).replicas
    own = {"plan_id": replicas_plan_id([r.plan_id for r in replicas])} if replicas else {}
    return {**fleet, **own,
            "job": {"steps": job.steps, "seq_len": job.seq_len, "mode": job.mode,
                    "replicas": len(replicas), "micro_batch": "auto"}}


def card_key(stage: StagePlan) -> str:
    """How ``exclude`` names a plan stage's card."""
    which = "cpu" if stage.kind == "cpu" else str(stage.card_index)
    return f"{stage.fellow_id}:{which}"


class LeaderJobs:
    """The leader's side: the job calls it serves and the jobs it leads."""

    def __init__(self, training: JobsPort) -> None:
        self.training = training
        self.agent = training.agent
        self.jobs: dict[str, Job] = {}  # jobs this agent leads, by id
        serve = training.leadership.serve
        training.leadership.serve_from(JobPlanAsk, self._serve_plan)
        training.leadership.serve_from(JobSubmit, self._serve_submit)
        serve(JobsAsk, self._serve_jobs)
        serve(JobCancel, self._serve_cancel)
        serve(JobConfigAsk, self._serve_config)

    # --- plans ----------------------------------------------------------------------------

    async def plan(self, job: JobConfig, *, stages: int | None = None,
                   maximize: str | None = None,
                   exclude_cards: list[str] | None = None,
                   cut: list[int] | None = None) -> dict[str, Any]:
        """The job's plan on this leader's view: one pipeline per replica (on ``cut``,
        a resumed checkpoint's, where the cards hold it)."""
        source = model_source(job)
        # the planner keeps a model's trained cut where it fits
        model = (source.cut_at(cut) if cut else source).to_doc()
        exclude = list(exclude_cards or [])
        wanted = job.replicas
        if job.auto_batch and not cut:  # the fleet planner sizes each replica's batch
            fleet = await self.agent.planning.plan({
                "model": model, **job.fleet_request(), "stages": stages,
                "maximize": maximize, "exclude": sorted(exclude)})
            shown = JobPlan.from_doc(fleet)
            if shown.replicas and not shown.fits:
                raise PlacementError(shown.fleet_sentence)
            return self.training.shown.remember(  # type: ignore[no-any-return]
                fleet_job_plan(job, fleet))
        plans: list[Plan] = []
        # "auto": replicas until no more fit; each takes at least one card, so the
        # usable cards bound the count (no fixed cap)
        for r in itertools.count():
            if wanted and r >= wanted:
                break
            message = {"model": model, **job.plan_request(), "stages": stages,
                       "maximize": maximize, "exclude": sorted(exclude)}
            try:
                doc = await self.agent.planning.plan(message)
            except PlacementError:
                if r == 0 or wanted:
                    raise
                break
            plan = Plan.from_doc(doc)
            if not plan.fits:
                if r == 0:
                    return doc  # says why; nothing to run
                if wanted:
                    raise PlacementError(f"only {r} of the {wanted} replicas asked for fit: "
                                         f"{plan.limit.sentence}")
                break
            plans.append(plan)
            exclude += [card_key(s) for s in plan.stages]
        return self.training.shown.remember(job_plan(job, plans))  # type: ignore[no-any-return]

    async def pinned_plan(self, expected: str | None, config: JobConfig, *,
                          stages: int | None = None, maximize: str | None = None,
                          exclude_cards: list[str] | None = None) -> dict[str, Any]:
        """The plan a job pinned to ``expected`` (None: not pinned) gets: the plan now, or
        the shown one while it still holds (as a pinned load's, ``Planning.pinned_plan``).
        The caller checks the pin, which refuses any other plan with what changed."""
        try:
            plan = await self.plan(config, stages=stages, maximize=maximize,
                                   exclude_cards=exclude_cards)
        except PlacementError:
            held = self.still_holds(expected, config, stages, maximize, exclude_cards) \
                if expected else None
            if held is None:
                raise
            return held
        if expected and JobPlan.from_doc(plan).plan_id != expected:
            return self.still_holds(expected, config, stages, maximize, exclude_cards) \
                or plan
        return plan

    async def placing_plan(self, job: Job, cut: list[int] | None) -> JobPlan:
        """The plan ``job`` is placed on: a pinned job's shown plan while it still holds
        (refused with what changed once it does not), else the plan on this view now (on
        ``cut``, a resumed checkpoint's, where the cards hold it)."""
        if job.pinned:  # the shown plan, while it still holds
            doc = await self.pinned_plan(job.plan_id, job.config, stages=job.stages,
                                         maximize=job.maximize,
                                         exclude_cards=job.exclude_cards)
        else:
            doc = await self.plan(job.config, stages=job.stages, maximize=job.maximize,
                                  exclude_cards=job.exclude_cards, cut=cut)
        plan = JobPlan.from_doc(doc)
        if job.pinned and plan.plan_id != job.plan_id:
            raise PlacementError(CHANGED + "; ".join(
                self.training.shown.changes(job.plan_id, doc)))
        return plan

    def still_holds(self, expected: str, job: JobConfig, stages: int | None,
                    maximize: str | None, exclude_cards: list[str] | None
                    ) -> dict[str, Any] | None:
        """The job plan ``expected`` this leader showed, as it stands on its view now,
        when every replica's placement still holds its claims (``plan_pinned``: memory
        that moved within the plan's headroom, a tie that would fall the other way now,
        a longer ``seq_len`` that would fit now); None when it was not shown here or no
        longer holds."""
        shown = self.training.shown.get(expected)
        replicas = shown.get("replicas") if shown is not None else None
        if shown is None or not isinstance(replicas, list) or not replicas:
            return None
        model = model_message(job)
        view = self.agent.planning.view()
        exclude = list(exclude_cards or [])
        plans: list[Plan] = []
        for replica in replicas:  # each on the cards the ones before it left, as planned
            if not isinstance(replica, dict):
                return None
            message = {"model": model, **job.plan_request(), "stages": stages,
                       "maximize": maximize, "exclude": sorted(exclude)}
            own = replica.get("request")
            if job.auto_batch and isinstance(own, dict):  # its own batch and exclusions
                message = {"model": model, **own}
            held = pinned_plan_message(message, view, {"stages": replica.get("stages"),
                                                       "request": shown.get("request")})
            if held is None:
                return None
            plans.append(Plan.from_doc(held))
            if plans[-1].plan_id != replica.get("plan_id"):
                return None
            exclude += [card_key(s) for s in plans[-1].stages]
        plan = job_plan(job, plans)
        if job.auto_batch:
            plan = fleet_job_plan(job, {**shown, "replicas": plan["replicas"]})
        return plan if JobPlan.from_doc(plan).plan_id == expected else None

    def _from_fellow(self, origin: bytes | None, config: Any, resume: str = "") -> None:
        """A job from another fellow (``origin``; None: this leader's own user) may name
        no path on this leader's disk but where ``job_paths`` allows; refused and
        counted otherwise."""
        if origin is None:
            return
        try:
            check_resume_from_fellow(resume)
            if config is not None:
                offers = self.agent.serving.offers.server.offers.values()
                check_model_from_fellow(job_config(config), (m.path for m in offers))
        except JobPathRefused as exc:
            self.agent.counters.refuse(exc.reason)
            raise ConfigError(str(exc)) from None  # a ConfigError at the asker's end too

    async def _serve_plan(self, call: JobPlanAsk, origin: bytes | None) -> JobPlanShown:
        config = unpack_doc(call.config)
        self._from_fellow(origin, config)
        plan = await self.plan(job_config(config), stages=call.stages,
                               maximize=call.maximize or None,
                               exclude_cards=list(call.exclude_cards))
        return JobPlanShown(pack_doc(plan))

    # --- jobs -----------------------------------------------------------------------------

    async def _serve_submit(self, call: JobSubmit, origin: bytes | None) -> JobRecord:
        resume = call.resume
        config: Any = None if call.config is None else unpack_doc(call.config)
        self._from_fellow(origin, config, resume)
        cfg = self._resume_config(resume, config) if resume else job_config(config)
        refuse_paths(cfg)  # data comes with the job, never from this disk
        expected = call.plan_id or None
        maximize = "seq_len" if call.maximize == "seq_len" else None
        exclude = list(call.exclude_cards)
        try:
            plan = await self.pinned_plan(expected, cfg, stages=call.stages,
                                          maximize=maximize, exclude_cards=exclude)
        except PlacementError as exc:
            if not expected:
                raise
            raise PlacementError(f"plan {expected} no longer holds, and no plan does: "
                                 f"{exc}") from exc
        self.training.shown.check_pin(expected, plan)
        planned = JobPlan.from_doc(plan)
        if not planned.fits:
            raise PlacementError(f"plan {planned.plan_id} does not fit: {planned.why_not}")
        busy = [j for j in self.jobs.values() if j.state in ("pending", "running")]
        if resume and any(j.job_id == resume for j in busy):
            raise PlacementError(f"job {resume} is still {self.jobs[resume].state}")
        job_id = resume if resume in self.jobs or JOB_ID.fullmatch(resume) \
            else f"job-{self.agent.rng.getrandbits(32):08x}"
        if maximize:  # the job runs at the sequence length the plan found
            assert planned.seq_len is not None  # a plan maximizing seq_len says it
            cfg = replace(cfg, seq_len=planned.seq_len)
        job = Job(job_id, cfg, planned.plan_id, pinned=bool(expected),
                  stages=call.stages, resume=bool(resume),
                  reason="waiting for its fellows to take their stages", maximize=maximize,
                  exclude_cards=exclude)
        job.checkpoint_dir = self._checkpoint_dir(call, origin, cfg, resume)
        self.training.checkpoint_dir(job)  # "": this leader's state directory, said now
        self.jobs[job_id] = job
        self.agent.spawn(self.training.drive, job)
        return JobRecord(pack_doc(job.report().to_doc()))

    def _checkpoint_dir(self, call: JobSubmit, origin: bytes | None, cfg: JobConfig,
                        resume: str) -> str:
        """The submitter's ``checkpoint.dir`` when it wrote it on this disk (this
        leader's own user); a known job resumed without a config keeps its directory;
        "" otherwise (``Training.checkpoint_dir``: this leader's state directory)."""
        if cfg.checkpoint.dir is None:
            return ""
        if call.config is None:
            known = self.jobs.get(resume)
            return known.checkpoint_dir if known is not None else ""
        if origin is None:
            return cfg.checkpoint.dir
        self.agent.counters.refuse("job-checkpoint-dir-moved")
        return ""

    def _resume_config(self, resume: str, config: Any) -> JobConfig:
        if isinstance(config, dict):
            return job_config(config)
        known = self.jobs.get(resume)
        if known is not None:
            return known.config
        raise ConfigError(f"the leader does not know job {resume}: give its job.json "
                          "(--config) or its checkpoint directory")

    async def _serve_jobs(self, call: JobsAsk) -> JobList:
        return JobList(tuple(pack_doc(j.report().to_doc()) for j in self.jobs.values()))

    def _known(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise ConfigError(f"no job {job_id!r}; jobs: {', '.join(self.jobs) or 'none'}")
        return job

    async def _serve_config(self, call: JobConfigAsk) -> JobConfigShown:
        job = self._known(call.job_id)
        return JobConfigShown(pack_doc(job.config.to_dict()), job.state, job.step,
                              job.checkpoint_step)

    async def cancel(self, job_id: str) -> JobReport:
        """Cancel job ``job_id`` (this agent leads it); its record."""
        job = self._known(job_id)
        if job.state in TERMINAL:
            raise PlacementError(f"job {job.job_id} is already {job.state}")
        job.cancel_asked = True
        if job.scope is not None:
            job.scope.cancel()
        return job.report()

    async def _serve_cancel(self, call: JobCancel) -> JobRecord:
        return JobRecord(pack_doc((await self.cancel(call.job_id)).to_doc()))


__all__ = ["CHANGED", "JOB_ID", "LOSSES_KEPT", "ROUNDS_KEPT", "STATES", "TERMINAL", "Job",
           "LeaderJobs", "ModelSource", "card_key",
           "job_config", "job_plan", "model_message", "model_source"]
