"""Training jobs: placed by the leader, stages hosted by fellows, replicas synced DiLoCo-style.

``Training`` is what the agent constructs; it joins the rooms, one role each:

- ``jobs``: the leader's job records and the calls it serves (plan, submit, jobs, cancel,
  config);
- ``placement``: ordering fellows to take a job's stages, releasing them, retrying;
- ``stage_host``: a fellow hosting stages (the orders, the control and data streams);
- ``driver``: the leader driving a job (streams, steps, pauses, placing again); it holds
  a ``rounds.RoundsKeeper`` (DiLoCo sync rounds between replicas, ``training.round_rule``),
  a ``checkpoints.CheckpointKeeper`` (checkpoints gathered, stored, copied to fellows,
  resumed; ``transfer``: states and shards of any size, in parts) and a
  ``global_state.GlobalState`` (a replica put on the keepers' global parameters);
- values: ``job_record.Job`` (``config`` a ``JobConfig``, ``placement`` a tuple of
  ``placed.ReplicaPlacement``, each with its batch shape resolved once, at placement),
  ``checkpoint_meta``, ``job_state.JobSnapshot`` (a job copy); each with one document
  form, read at the edge;
- ``ports``: what each part uses of the agent and of the other parts, as protocols (no
  part takes the whole ``Agent``, none imports it);
- ``job_data``: the files a job trains on, read where it is submitted and sent with it;
- ``control_ask``: the control ops' typed requests (``wire.jobs``) made from a plain map;
- ``job_state``, ``handover``, ``takeover``: each job's record and round state copied to
  a few fellows, and a new leader driving the jobs on from there;
- ``runtime`` / ``torch_runtime``: the seam to torch, loaded on first use.

Here: the control ops of the CLI's own agent (``job_plan``, ``job_submit``, ``jobs``,
``job_cancel``, ``job_export``; each handler takes its typed request), which ask the
leader with typed calls; the fellow whose ``job_submit`` streams follows the job's record
until it ends.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm.agent.pins import ShownPlans
from p2pswarm.agent.training import control_ask
from p2pswarm.agent.training.checkpoints import TrainCopies
from p2pswarm.agent.training.driver import drive
from p2pswarm.agent.training.handover import JobHandover
from p2pswarm.agent.training.job_data import JobData, sent_files_of
from p2pswarm.agent.training.job_paths import leader_checkpoint_dir
from p2pswarm.agent.training.job_record import JobReport, JobReportDoc
from p2pswarm.agent.training.jobs import (
    CHANGED,
    STATES,
    TERMINAL,
    Job,
    LeaderJobs,
    job_config,
)
from p2pswarm.agent.training.placement import Placer
from p2pswarm.agent.training.stage_host import StageHosts, TrainHost
from p2pswarm.agent.training.takeover import Handed, Takeover
from p2pswarm.config import TrainingConfig
from p2pswarm.control.requests import typed_op
from p2pswarm.control.server import current_emitter, emit
from p2pswarm.errors import ConfigError, PlacementError, SwarmError, TransportError
from p2pswarm.wire.jobs import (
    JobCancel,
    JobCancelRequest,
    JobConfigAsk,
    JobConfigShown,
    JobExportRequest,
    JobList,
    JobPlanAsk,
    JobPlanRequest,
    JobPlanShown,
    JobRecord,
    JobsAsk,
    JobsRequest,
    JobSubmit,
    JobSubmitRequest,
)
from p2pswarm.wire.orders import pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.training.ports import Leadership, TrainingAgent
    from p2pswarm.agent.training.runtime import TrainRuntime

log = logging.getLogger("p2pswarm.training")

FOLLOW_POLL_S = 0.5  # how often a streaming job_submit asks the leader for the record
TAKEOVER_GRACE_S = 60.0  # how long a followed job may be missing while a new leader adopts it


class Training:
    """Jobs (the leader's calls), hosted training stages (orders, streams) and the control
    ops ``job_plan``, ``job_submit``, ``jobs``, ``job_cancel``, ``job_export`` of one
    agent."""

    def __init__(self, agent: TrainingAgent, leadership: Leadership,
                 runtime: TrainRuntime | None = None, *,
                 timings: TrainingConfig = TrainingConfig()) -> None:
        self.agent = agent
        self.leadership = leadership
        self._runtime = runtime
        self.timings = timings  # how long the driver waits, how often it retries
        self.shown = ShownPlans(agent.name)  # job plans this leader has shown
        self._checkpoints_root: Path | None = None
        self.leader = LeaderJobs(self)
        self.placer = Placer(self)
        self.stages = StageHosts(self)
        self.copies = TrainCopies(agent, leadership)
        self.data = JobData(agent, self._data_in_use)
        self.handover = JobHandover(self)
        self.takeover = Takeover(self)
        agent.control_ops.update({
            "job_plan": typed_op(JobPlanRequest, control_ask.job_plan_request, self._op_plan),
            "job_submit": typed_op(JobSubmitRequest, control_ask.job_submit_request,
                                   self._op_submit),
            "jobs": typed_op(JobsRequest, control_ask.jobs_request, self._op_jobs),
            "job_cancel": typed_op(JobCancelRequest, control_ask.job_cancel_request,
                                   self._op_cancel),
            "job_export": typed_op(JobExportRequest, control_ask.job_export_request,
                                   self._op_export)})

    def _data_in_use(self) -> set[str]:
        """The data files (by SHA-256) of the jobs this fellow leads that may still run."""
        out: set[str] = set()
        for job in self.leader.jobs.values():
            if job.state not in TERMINAL:
                try:
                    out.update(sent_files_of(job.config))
                except SwarmError:
                    continue
        return out

    @property
    def checkpoints_root(self) -> Path:
        """Where this leader keeps the checkpoints of jobs whose submitter is not local
        to its disk (and of every job it took over): ``<home>/job-checkpoints``."""
        if self._checkpoints_root is None:
            self._checkpoints_root = self.agent.state_dir("job-checkpoints")
        return self._checkpoints_root

    def checkpoint_dir(self, job: Job) -> Path | None:
        """Where this leader writes and reads ``job``'s checkpoints (None: it keeps none):
        the directory its submit settled (``jobs``, ``job_paths``), else one named by the
        job's id in this leader's own state directory."""
        if job.config.checkpoint.dir is None:
            return None
        if not job.checkpoint_dir:
            job.checkpoint_dir = str(leader_checkpoint_dir(self.checkpoints_root, job.job_id))
        return Path(job.checkpoint_dir)

    @property
    def runtime(self) -> TrainRuntime:
        """The torch side (``torch_runtime.TorchRuntime``), loaded on first use."""
        if self._runtime is None:
            from p2pswarm.agent.training.torch_runtime import TorchRuntime

            self._runtime = TorchRuntime()
        return self._runtime

    @property
    def hosts(self) -> dict[tuple[str, int, int], TrainHost]:
        """The stages this fellow hosts, by (job, replica, stage)."""
        return self.stages.hosts

    @property
    def jobs(self) -> dict[str, Job]:
        """The jobs this agent leads, by id."""
        return self.leader.jobs

    async def drive(self, job: Job, handed: Handed | None = None) -> None:
        await drive(self, job, handed)

    def elected(self) -> None:
        """This agent won an election: take over the jobs the last leader led."""
        self.takeover.elected()

    def leads(self, term: int) -> bool:
        """Whether this agent leads, in ``term``: what a driver of that term checks
        before it gives an order."""
        return self.leadership.is_leader() and self.leadership.term() == term

    def leader_changed(self) -> None:
        """The election moved (this agent stepped down, or a leader is known): every job
        driven in a term this agent no longer leads stops being driven here. The new
        leader takes it over from its copies (``takeover``); a leader elected again takes
        its jobs over the same way, never by the loop it stopped."""
        for job in self.jobs.values():
            if job.state in TERMINAL or job.scope is None or self.leads(job.term):
                continue
            self.hand_on(job)

    def hand_on(self, job: Job) -> None:
        """Stop driving ``job``: its record says to whom it went, its drive is cancelled."""
        status = self.agent.election.status() if self.agent.election is not None else None
        if status is not None and status.leader_id is not None \
                and status.leader_id != self.agent.node_id and status.term > job.term:
            job.handed = f"handed to the new leader {status.leader_name} (term {status.term})"
        elif not job.handed:
            job.handed = (f"handed to the new leader: {self.agent.name} stopped leading "
                          f"(term {job.term})")
        job.reason = job.handed
        if job.scope is not None:
            job.scope.cancel()

    # --- asking the leader ----------------------------------------------------------------

    async def ask_plan(self, config: Any, *, stages: int | None = None,
                       maximize: str | None = None,
                       exclude_cards: list[str] | None = None) -> dict[str, Any]:
        """The leader's plan for job ``config``: one pipeline per replica."""
        call = JobPlanAsk(pack_doc(config), stages, maximize or "",
                          tuple(exclude_cards or ()))
        return unpack_doc((await self.leadership.ask(call, JobPlanShown)).plan)

    async def ask_cancel(self, job_id: str) -> JobReportDoc:
        """Cancel job ``job_id`` on the leader; its record (read, checked)."""
        reply = await self.leadership.ask(JobCancel(job_id), JobRecord)
        return JobReport.from_doc(unpack_doc(reply.record)).to_doc()

    async def list_jobs(self) -> list[JobReportDoc]:
        """The leader's job records, as documents (the ``jobs`` op's answer)."""
        return [r.to_doc() for r in await self.job_reports()]

    async def job_reports(self) -> list[JobReport]:
        """The leader's job records, read."""
        reply = await self.leadership.ask(JobsAsk(), JobList)
        return [JobReport.from_doc(unpack_doc(r)) for r in reply.records]

    async def submit(self, config: dict[str, Any] | None, *, plan_id: str | None = None,
                     stages: int | None = None, resume: str = "",
                     follow: bool = False, maximize: str | None = None,
                     exclude_cards: list[str] | None = None) -> JobReportDoc:
        """Submit a job to the leader; with ``follow``, stream its record (control events
        ``{"job": record}``) until it ends, and return the last one. ``maximize="seq_len"``
        trains at the longest sequence length that fits now."""
        # the data files it names stay in this fellow's store: the leader fetches them
        # (``DataFetch``); job data is never pushed to a leader
        call = JobSubmit(None if config is None else pack_doc(config), plan_id or "", stages,
                         resume, maximize or "", tuple(exclude_cards or ()))
        report = JobReport.from_doc(unpack_doc((await self.leadership.ask(call,
                                                                          JobRecord)).record))
        if not follow:
            return report.to_doc()
        emit({"job": report.to_doc()})
        missing_since = 0.0
        while not report.ended:
            await trio.sleep(FOLLOW_POLL_S)
            try:
                reports = await self.job_reports()
            except (PlacementError, TransportError) as exc:
                log.info("following job %s: %s", report.job_id, exc)
                continue
            now = next((r for r in reports if r.job_id == report.job_id), None)
            if now is None:  # a new leader may still be taking it over
                missing_since = missing_since or trio.current_time()
                if trio.current_time() - missing_since < TAKEOVER_GRACE_S:
                    continue
                raise PlacementError(f"the leader no longer knows job {report.job_id} "
                                     "(a new leader without a copy of it); resume it with "
                                     "--resume")
            missing_since = 0.0
            if now != report:  # the record is what the follower streams
                report = now
                emit({"job": report.to_doc()})
        return report.to_doc()

    async def export(self, job_id: str, out: str) -> Any:
        """Export job ``job_id``'s latest checkpoint into ``out`` on this fellow (a Hugging
        Face directory, or LoRA adapters): the leader's copy where this fellow leads, the
        shards fetched from the fellows holding copies where it lacks them or leads not."""
        runtime = self.runtime
        out_dir = runtime.check_out_dir(out)  # refused before anything is fetched
        info = await self.leadership.ask(JobConfigAsk(job_id), JobConfigShown)
        config = job_config(unpack_doc(info.config))
        if config.checkpoint.dir is None:
            raise ConfigError(f"job {job_id} names no checkpoint.dir: it keeps no checkpoint "
                              "to export")
        staging: Path | None = None
        led = self.jobs.get(job_id) if self.leadership.is_leader() else None
        kept = self.checkpoint_dir(led) if led is not None else None
        if kept is not None:
            where = kept
        else:  # fetch the shards from the fellows holding copies into a scratch store
            root = self.copies.root.parent if self.agent.home is not None else None
            staging = where = Path(tempfile.mkdtemp(prefix=".export-", dir=root))
        try:
            store = runtime.checkpoint_store(where, max(1, config.checkpoint.keep))
            if staging is None and info.state not in TERMINAL:
                # the job still writes here: read its newest checkpoint as it is (restoring
                # could race a checkpoint being written and point "latest" back at an older one)
                step = store.latest()
            else:
                step = await self.copies.restore(job_id, store)
            if step is None:
                raise ConfigError(
                    f"job {job_id} has no checkpoint yet (state {info.state}, step "
                    f"{info.step}; it writes one every "
                    f"{config.checkpoint.interval_steps} steps)")
            found = step
            exported = await self.agent.compute.run(
                lambda: runtime.export(store, out_dir, found))
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        log.info("job %s: checkpoint %d exported to %s", job_id, exported.step, exported.path)
        return exported

    # --- control ops (the CLI's own agent) ------------------------------------------------

    async def _op_plan(self, request: JobPlanRequest) -> Any:
        return await self.ask_plan(unpack_doc(request.config), stages=request.stages,
                                   maximize=request.maximize or None,
                                   exclude_cards=list(request.exclude_cards))

    async def _op_submit(self, request: JobSubmitRequest) -> Any:
        config = None
        if request.config is not None:  # the files it names are read here and travel with it
            attached = await self.data.attach(job_config(unpack_doc(request.config)))
            config = attached.to_dict()
        return await self.submit(config, plan_id=request.plan_id or None,
                                 stages=request.stages, resume=request.resume,
                                 follow=current_emitter() is not None,
                                 maximize=request.maximize or None,
                                 exclude_cards=list(request.exclude_cards))

    async def _op_jobs(self, request: JobsRequest) -> Any:
        return await self.list_jobs()

    async def _op_cancel(self, request: JobCancelRequest) -> Any:
        return await self.ask_cancel(request.job_id)

    async def _op_export(self, request: JobExportRequest) -> Any:
        return (await self.export(request.job_id, request.out)).to_dict()


__all__ = ["CHANGED", "STATES", "TERMINAL", "Job", "TrainHost", "Training"]
