"""Training jobs: placed by the leader, stages hosted by fellows, replicas synced DiLoCo-style.

Theory of operation.

Placing. A job is ``job.json`` (``training.JobConfig``). The leader plans it (leader op
``job-plan``): one pipeline with the planner's ``kind="train"`` request, then, while the
job asks for more replicas (or ``replicas: "auto"`` and more fit), another pipeline on the
cards still unused. One replica's plan keeps the planner's ``plan_id``; several get one
``plan_id`` over all of theirs. A submit pinned to a ``plan_id`` that the leader's current
view no longer gives is refused at once as ``plan-changed`` (409) with what changed, as a
pinned load is. Otherwise the job is recorded ``pending`` and the leader orders every
stage's fellow to take its stage (``train-prepare``): the fellow checks its own live view
first (the card still offered, enough memory free) and builds the stage, or refuses with
why. A refusal releases everything; the job stays ``pending`` with the reason, and the
leader tries again later: a pinned job only on its own placement (its reason is then
``the cluster changed since the plan was shown: ...``; it never starts elsewhere), an
unpinned one on whatever the swarm now gives.

Running. The leader drives the job (``_Driver``). It opens one sealed control stream to
every stage; each stage opens one to the next stage of its replica, and activations flow
down those and their gradients back up, micro-batch by micro-batch in the order the
schedule (1F1B or GPipe) gives each stage. The driver holds each replica's data stream:
inputs go to the first stage, targets to the last. After the backwards each stage
reports its squared gradient norm (and a tied-embedding gradient, which the driver adds
up for both copies); the driver answers with the clip coefficient and every stage steps
its own optimizer. With one replica this is exactly ``LocalTrainPipeline``.

Between replicas the driver keeps each stage's ``OuterSync`` and runs the rounds
asynchronously, by the rule of ``training.virtual.VirtualSwarm``: each replica trains in
its own task, takes its step budget (``step_budgets`` by measured speed: the fastest
``inner_steps``), and sends its compressed pseudo-gradients tagged with the version it is
anchored on. A round closes when every member has sent or at its deadline, with whatever
arrived; a late delta is down-weighted by its staleness, or dropped beyond the bound. A
replica whose delta was fresh waits for its round to close while the others should send
within about one of its steps (so equal speeds give ``training.LocalRun`` round for
round); otherwise it trains on and applies each update before its next step. A replica
whose fellow drops or fails is paused: it leaves the rounds and the others go on. Every
``retry_s`` the driver places a paused replica again (same cut, cards nobody trains on);
after the next round closes its stages take the keepers' global parameters and version
and it trains from there. The job fails only when no replica is left and none is being
placed again; a job of one replica instead waits ``pending`` for cards and resumes from
its latest checkpoint. Checkpoints gather every stage's shard (parameters, optimizer,
sync state) with the data positions into a ``CheckpointStore``, copied to two more
fellows (``train_copies``); ``resume`` continues from the latest one with the same loss
trajectory, fetching from those fellows what the leader's own copy lacks. Progress
(step, loss, tokens/s, replicas, bytes) lives in the job record; the fellow whose
``job_submit`` streams follows it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm import wire
from p2pswarm.agent.pins import ShownPlans
from p2pswarm.agent.planning import fellow_id
from p2pswarm.agent.streams import send_best_effort
from p2pswarm.agent.train_copies import TrainCopies
from p2pswarm.control.server import current_emitter
from p2pswarm.errors import (
    ConfigError,
    PlacementError,
    RemoteProtocolError,
    SwarmError,
    TransportError,
)
from p2pswarm.planner import plan_message
from p2pswarm.planner.wording import card_label, gb
from p2pswarm.wire.training import TrainCtl, TrainError, TrainOpen, TrainTensor

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent
    from p2pswarm.agent.leadership import Leadership
    from p2pswarm.training.job import JobConfig
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.training")

_JOB_ID = re.compile(r"job-[0-9a-f]{8}")
STATES = ("pending", "running", "finished", "failed", "cancelled")
TERMINAL = ("finished", "failed", "cancelled")
CHANGED = "the cluster changed since the plan was shown: "
MAX_AUTO_REPLICAS = 8  # "replicas": "auto" plans at most this many pipelines
FOLLOW_POLL_S = 0.5  # how often a streaming job_submit asks the leader for the record
LOSSES_KEPT = 1000  # per-step losses a job record carries
ROUNDS_KEPT = 200  # sync rounds a job record carries
SAME_SPEED = 0.9  # replicas measured within this fraction of the fastest get its budget
WAIT_STEPS = 1.5  # a replica waits for its round while the rest should send within this


class ReplicaLost(PlacementError):
    """No replica of a running job is left training."""


def _exclude_cards(request: dict[str, Any]) -> list[str]:
    exclude = request.get("exclude_cards") or []
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise ConfigError("exclude_cards must be a list of \"FELLOW:INDEX\" strings")
    return list(exclude)


def _job_config(config: Any) -> JobConfig:
    from p2pswarm.training.job import JobConfig

    if not isinstance(config, dict):
        raise ConfigError("a job needs \"config\": the contents of job.json")
    return JobConfig.from_dict(config)


def _model_message(job: JobConfig) -> dict[str, Any]:
    from p2pswarm.models.files import read_model_config

    if job.model.init_config is not None:
        return {"name": "scratch", "config": dict(job.model.init_config)}
    name, config = read_model_config(str(job.model.name))
    return {"name": name, "config": config}


def _card_key(stage: dict[str, Any]) -> str:
    """How ``exclude`` names a plan stage's card."""
    which = "cpu" if stage["kind"] == "cpu" else str(stage["index"])
    return f"{stage['fellow_id']}:{which}"


# --- the leader's record of a job ----------------------------------------------------------


@dataclass
class Job:
    job_id: str
    config: dict[str, Any]
    plan_id: str
    pinned: bool
    stages: int | None
    resume: bool = False
    state: str = "pending"
    reason: str = ""
    step: int = 0
    loss: float | None = None
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    replicas: int = 0
    bytes_sent: int = 0
    samples: int = 0
    checkpoint: str = ""
    checkpoint_step: int = 0
    copies: dict[str, list[str]] = field(default_factory=dict)  # shard -> fellows holding it
    placement: list[list[dict[str, Any]]] = field(default_factory=list)
    rejoins: int = 0
    paused_times: int = 0  # a lone replica lost a fellow and the job waited to resume
    rounds: list[dict[str, Any]] = field(default_factory=list)
    replica_steps: dict[str, int] = field(default_factory=dict)  # local steps per replica
    maximize: str | None = None
    exclude_cards: list[str] = field(default_factory=list)  # cards the user left out
    scope: trio.CancelScope | None = None
    driver: Any = None  # the _Driver while it runs
    cancel_asked: bool = False

    def record(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "state": self.state, "reason": self.reason,
                "step": self.step, "steps": int(self.config.get("steps", 0)),
                "loss": self.loss, "losses": self.losses[-LOSSES_KEPT:],
                "tokens_per_s": self.tokens_per_s, "replicas": self.replicas,
                "bytes_sent": self.bytes_sent, "samples": self.samples,
                "plan_id": self.plan_id, "pinned": self.pinned,
                "model": self.config.get("model"), "checkpoint": self.checkpoint,
                "checkpoint_copies": self.copies,
                "seq_len": int(self.config.get("seq_len", 0)), "rejoins": self.rejoins,
                "paused_times": self.paused_times,
                "rounds": self.rounds[-ROUNDS_KEPT:], "replica_steps": self.replica_steps,
                "stages": [[{k: s[k] for k in ("stage", "fellow", "layers", "card")}
                            for s in replica] for replica in self.placement]}


# --- a fellow's side: one stage of one replica ---------------------------------------------


class TrainHost:
    """One stage of a job this fellow holds, from ``train-prepare`` to release."""

    def __init__(self, body: dict[str, Any], job: JobConfig, stage: Any, sync: Any) -> None:
        self.job_id = str(body["job_id"])
        self.replica = int(body["replica"])
        self.index = int(body["stage"])
        self.n_stages = int(body["n_stages"])
        self.card_key = f"{body['card_kind']}:{body['card_index']}"
        self.need_bytes = int(body["need_bytes"])
        self.next_addr = str(body.get("next_addr", ""))
        self.schedule = str(body.get("schedule", "1f1b"))
        self.generation = int(body.get("generation", 0))  # which placement of the replica
        self.job = job
        self.stage = stage  # training.TrainStage
        self.sync = sync  # training.LocalSync
        self.limiter = trio.CapacityLimiter(1)
        self.upstream: SecureStream | None = None
        self.upstream_ready = trio.Event()
        self.done = trio.Event()

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.job_id, self.replica, self.index)


async def _send(stream: SecureStream, msg: Any) -> None:
    await stream.send_frame(wire.encode(msg))


async def _receive(stream: SecureStream, expected: type, who: str) -> Any:
    frame = await stream.receive_frame()
    (msg,) = wire.decode(frame, max_bytes=len(frame) + 1)
    if isinstance(msg, TrainError):
        raise TransportError(f"stage {msg.stage} on {msg.fellow}: {msg.reason}")
    if not isinstance(msg, expected):
        raise RemoteProtocolError("unexpected-message",
                                  f"{who} sent {type(msg).__name__}, not {expected.__name__}")
    return msg


def _tensor_bytes(t: Any) -> bytes:
    from p2pswarm.runtime.frame import encode_tensor

    return bytes(encode_tensor(t.detach().contiguous().cpu()))


def _tensor(blob: bytes) -> Any:
    from p2pswarm.runtime.frame import decode_tensor

    return decode_tensor(bytearray(blob))


def _build_host(body: dict[str, Any]) -> TrainHost:
    """The stage an order asks for, built on this fellow (torch)."""
    from p2pswarm.training.replica import job_stage_model, synced_tensors
    from p2pswarm.training.source import open_job_model
    from p2pswarm.training.stage import TrainStage
    from p2pswarm.training.sync import LocalSync

    job = _job_config(body["config"])
    start, end = (int(x) for x in body["layers"])
    device = "cpu" if body["card_kind"] == "cpu" else f"cuda:{int(body['card_index'])}"
    source = open_job_model(job.model, job.seed)
    try:
        model = job_stage_model(source, job, start, end, device)
    except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory and kin
        raise PlacementError(f"stage {body['stage']} could not be built on {device}: "
                             f"{exc}") from exc
    stage = TrainStage(model, job.optimizer)
    sync = LocalSync(synced_tensors(stage), job.sync,
                     noise_seed=(job.seed * 1_000_003 + int(body["replica"])) * 64
                     + int(body["stage"]))
    return TrainHost(body, job, stage, sync)


# --- the leader's side: one replica's links ------------------------------------------------


@dataclass
class _Link:
    stage: int
    fellow: str
    addr: str
    stream: SecureStream | None = None

    async def send(self, msg: Any) -> None:
        assert self.stream is not None
        await _send(self.stream, msg)

    async def receive(self, expected: type) -> Any:
        assert self.stream is not None
        return await _receive(self.stream, expected, f"stage {self.stage} on {self.fellow}")


@dataclass
class _Replica:
    index: int
    links: list[_Link]
    stream: Any = None  # training.SampleStream
    steps: int = 0  # optimizer steps taken (the learning-rate schedule's position)
    samples_unsent: int = 0
    steps_unsent: int = 0
    paused: str = ""
    generation: int = 0  # how many times the replica was placed again
    joining: bool = False  # placed again, links open: joins at the next round boundary
    placing: bool = False
    # asynchronous rounds (several replicas)
    version: int = 0  # the global version its stages are anchored on
    in_round: int = 0  # local steps taken of this round's budget
    rounds_done: int = 0  # budgets sent, or rounds caught up to (its place in the job)
    sent_version: int = -1  # the version its last fresh delta was anchored on
    budget: int = 0  # local steps this round (by measured speed)
    step_s: float = 0.0  # measured seconds per step (moving average); 0: not yet measured
    running: bool = False  # its training task is alive
    finished: bool = False  # trained to the job's end and sent everything
    lock: trio.Lock = field(default_factory=trio.Lock)  # one command sequence at a time

    @property
    def name(self) -> str:
        return f"replica-{self.index}"


class Training:
    """Jobs (leader ops), hosted training stages (orders, streams) and the control ops
    ``job_plan``, ``job_submit``, ``jobs``, ``job_cancel`` of one agent."""

    def __init__(self, agent: Agent, leadership: Leadership) -> None:
        self.agent = agent
        self.leadership = leadership
        self.hosts: dict[tuple[str, int, int], TrainHost] = {}
        self.jobs: dict[str, Job] = {}  # jobs this agent leads, by id
        self.step_timeout_s = 120.0  # the most the driver waits for one stage's step
        self.open_timeout_s = 30.0
        self.retry_s = 5.0  # a pending job tries its fellows again this often
        # simulations only: the virtual seconds one step of a hosted stage takes (compute
        # runs inline and takes none); 0 in the real world
        self.simulated_step_s = 0.0
        self.shown = ShownPlans(agent.name)  # job plans this leader has shown
        agent.control_ops.update({"job_plan": self._op_plan, "job_submit": self._op_submit,
                                  "jobs": self._op_jobs, "job_cancel": self._op_cancel,
                                  "job_export": self._op_export})
        leadership.leader_ops.update({"job-plan": self.plan, "job-submit": self._leader_submit,
                                      "jobs": self._leader_jobs,
                                      "job-cancel": self._leader_cancel,
                                      "job-config": self._leader_config})
        leadership.order_ops.update({"train-prepare": self._order_prepare,
                                     "train-release": self._order_release})
        agent.on_stream(TrainOpen, self._on_train_open)
        self.copies = TrainCopies(agent)

    async def run(self, fn: Any, limiter: trio.CapacityLimiter | None = None) -> Any:
        return await self.agent.compute.run(fn, limiter)

    # --- control ops (the CLI's own agent) ------------------------------------------------

    @staticmethod
    def _body(request: dict[str, Any]) -> dict[str, Any]:
        config = request.get("config")
        _job_config(config)  # a bad job.json is refused here, before the leader is asked
        stages = request.get("stages")
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int)
                                   or stages < 1):
            raise ConfigError(f"stages must be a whole number of at least 1, got {stages!r}")
        return {"config": config, "stages": stages}

    async def _op_plan(self, request: dict[str, Any]) -> Any:
        exclude = _exclude_cards(request)
        maximize = request.get("maximize")
        if maximize not in (None, "seq_len", "speed"):
            raise ConfigError(f"maximize {maximize!r} must be \"seq_len\", \"speed\" or null")
        return await self.leadership.ask_op("job-plan", {**self._body(request),
                                                      "exclude_cards": exclude,
                                                      "maximize": maximize})

    async def _op_submit(self, request: dict[str, Any]) -> Any:
        resume = request.get("resume")
        if resume and request.get("config") is None:
            body: dict[str, Any] = {"config": None, "stages": request.get("stages")}
        else:
            body = self._body(request)
        plan_id = request.get("plan_id")
        if plan_id is not None and not isinstance(plan_id, str):
            raise ConfigError("plan_id must be a string")
        maximize = request.get("maximize")
        if maximize not in (None, "seq_len"):
            raise ConfigError(f"maximize {maximize!r} for a job must be \"seq_len\" or null")
        return await self.submit(body["config"], plan_id=plan_id or None,
                                 stages=body["stages"], resume=str(resume or ""),
                                 follow=current_emitter() is not None, maximize=maximize,
                                 exclude_cards=_exclude_cards(request))

    async def _op_jobs(self, request: dict[str, Any]) -> Any:
        return await self.list_jobs()

    async def _op_cancel(self, request: dict[str, Any]) -> Any:
        job_id = request.get("job_id")
        if not isinstance(job_id, str) or not job_id:
            raise ConfigError("job_cancel needs a \"job_id\"")
        return await self.leadership.ask_op("job-cancel", {"job_id": job_id})

    async def _op_export(self, request: dict[str, Any]) -> Any:
        job_id = request.get("job_id")
        out = request.get("out")
        if not isinstance(job_id, str) or not job_id:
            raise ConfigError("job_export needs a \"job_id\"")
        if not isinstance(out, str) or not out:
            raise ConfigError("job_export needs an \"out\" directory")
        return (await self.export(job_id, out)).to_dict()

    async def export(self, job_id: str, out: str) -> Any:
        """Export job ``job_id``'s latest checkpoint into ``out`` on this fellow (a Hugging
        Face directory, or LoRA adapters): the leader's copy where this fellow leads, the
        shards fetched from the fellows holding copies where it lacks them or leads not."""
        import shutil
        import tempfile

        from p2pswarm.training.checkpoint import CheckpointStore
        from p2pswarm.training.job_export import check_out_dir, export_checkpoint

        out_dir = check_out_dir(out)  # refused before anything is fetched
        info = await self.leadership.ask_op("job-config", {"job_id": job_id})
        config = _job_config(info["config"])
        if config.checkpoint.dir is None:
            raise ConfigError(f"job {job_id} names no checkpoint.dir: it keeps no checkpoint "
                              "to export")
        staging: Path | None = None
        if self.leadership.is_leader():
            where = Path(config.checkpoint.dir)
        else:  # fetch the shards from the fellows holding copies into a scratch store
            root = self.copies.root.parent if self.agent.home is not None else None
            staging = where = Path(tempfile.mkdtemp(prefix=".export-", dir=root))
        try:
            store = CheckpointStore(where, keep=max(1, config.checkpoint.keep))
            if staging is None and info["state"] not in TERMINAL:
                # the job still writes here: read its newest checkpoint as it is (restoring
                # could race a checkpoint being written and point "latest" back at an older one)
                step = store.latest()
            else:
                step = await self.copies.restore(job_id, store)
            if step is None:
                raise ConfigError(
                    f"job {job_id} has no checkpoint yet (state {info['state']}, step "
                    f"{info['step']}; it writes one every "
                    f"{config.checkpoint.interval_steps} steps)")
            exported = await self.run(lambda: export_checkpoint(store, out_dir, step=step))
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        log.info("job %s: checkpoint %d exported to %s", job_id, exported.step, exported.path)
        return exported

    async def submit(self, config: dict[str, Any] | None, *, plan_id: str | None = None,
                     stages: int | None = None, resume: str = "",
                     follow: bool = False, maximize: str | None = None,
                     exclude_cards: list[str] | None = None) -> dict[str, Any]:
        """Submit a job to the leader; with ``follow``, stream its record (control events
        ``{"job": record}``) until it ends, and return the last one. ``maximize="seq_len"``
        trains at the longest sequence length that fits now."""
        from p2pswarm.control.server import emit

        record: dict[str, Any] = await self.leadership.ask_op("job-submit", {
            "config": config, "plan_id": plan_id, "stages": stages, "resume": resume,
            "maximize": maximize, "exclude_cards": exclude_cards or []})
        if not follow:
            return record
        emit({"job": record})
        while record["state"] not in TERMINAL:
            await trio.sleep(FOLLOW_POLL_S)
            try:
                jobs = await self.leadership.ask_op("jobs", {})
            except (PlacementError, TransportError) as exc:
                log.info("following job %s: %s", record["job_id"], exc)
                continue
            now = next((j for j in jobs if j["job_id"] == record["job_id"]), None)
            if now is None:
                raise PlacementError(f"the leader no longer knows job {record['job_id']} "
                                     "(a new leader?); resume it with --resume")
            if now != record:
                record = now
                emit({"job": record})
        return record

    async def list_jobs(self) -> list[dict[str, Any]]:
        return list(await self.leadership.ask_op("jobs", {}))

    # --- the leader: plans ------------------------------------------------------------------

    async def plan(self, body: dict[str, Any]) -> dict[str, Any]:
        """The job's plan on this leader's view: one pipeline per replica."""
        job = _job_config(body.get("config"))
        model = _model_message(job)
        exclude = list(body.get("exclude_cards") or [])
        wanted = job.replicas
        plans: list[dict[str, Any]] = []
        for r in range(wanted or MAX_AUTO_REPLICAS):
            message = {"model": model, **job.plan_request(), "stages": body.get("stages"),
                       "maximize": body.get("maximize"), "exclude": sorted(exclude)}
            try:
                plan = await self.agent.planning.plan(message)
            except PlacementError:
                if r == 0 or wanted:
                    raise
                break
            if not plan.get("fits"):
                if r == 0:
                    return plan  # says why; nothing to run
                if wanted:
                    raise PlacementError(f"only {r} of the {wanted} replicas asked for fit: "
                                         f"{plan['layout']['limit']['sentence']}")
                break
            plans.append(plan)
            exclude += [_card_key(s) for s in plan["stages"]]
        out = dict(plans[0])
        out["replicas"] = [{"replica": i, "plan_id": p["plan_id"], "stages": p["stages"],
                            "strip_text": p["layout"]["strip_text"]}
                           for i, p in enumerate(plans)]
        if len(plans) > 1:
            joined = ",".join(p["plan_id"] for p in plans)
            out["plan_id"] = hashlib.sha256(f"job|{joined}".encode()).hexdigest()[:16]
            out["summary"] = (f"{len(plans)} replicas, synced every {job.sync.inner_steps} "
                              f"steps ({job.sync.codec}). Replica 0: {plans[0]['summary']}")
        out["job"] = {"steps": job.steps, "seq_len": job.seq_len, "mode": job.mode,
                      "replicas": len(plans)}
        return self.shown.remember(out)  # type: ignore[no-any-return]

    # --- the leader: jobs -------------------------------------------------------------------

    async def _leader_submit(self, body: dict[str, Any]) -> dict[str, Any]:
        resume = str(body.get("resume") or "")
        config = body.get("config")
        if resume:
            config = self._resume_config(resume, config)
        _job_config(config)
        expected = body.get("plan_id")
        maximize = body.get("maximize") if body.get("maximize") == "seq_len" else None
        exclude = [str(e) for e in body.get("exclude_cards") or []]
        try:
            plan = await self.plan({"config": config, "stages": body.get("stages"),
                                    "maximize": maximize, "exclude_cards": exclude})
        except PlacementError as exc:
            if not expected:
                raise
            raise PlacementError(f"plan {expected} no longer holds, and no plan does: "
                                 f"{exc}") from exc
        self.shown.check_pin(str(expected) if expected else None, plan)
        if not plan.get("fits"):
            raise PlacementError(f"plan {plan['plan_id']} does not fit: "
                                 f"{plan['layout']['limit']['sentence']}")
        busy = [j for j in self.jobs.values() if j.state in ("pending", "running")]
        if resume and any(j.job_id == resume for j in busy):
            raise PlacementError(f"job {resume} is still {self.jobs[resume].state}")
        job_id = resume if resume in self.jobs or _JOB_ID.fullmatch(resume) \
            else f"job-{self.agent.rng.getrandbits(32):08x}"
        config = dict(config)  # type: ignore[arg-type]
        if maximize:  # the job runs at the sequence length the plan found
            config["seq_len"] = int(plan["request"]["seq_len"])
        job = Job(job_id, config, str(plan["plan_id"]), pinned=bool(expected),
                  stages=body.get("stages"), resume=bool(resume),
                  reason="waiting for its fellows to take their stages", maximize=maximize,
                  exclude_cards=exclude)
        self.jobs[job_id] = job
        self.agent.spawn(self._drive, job)
        return job.record()

    def _resume_config(self, resume: str, config: Any) -> dict[str, Any]:
        if isinstance(config, dict):
            return config
        known = self.jobs.get(resume)
        if known is not None:
            return known.config
        raise ConfigError(f"the leader does not know job {resume}: give its job.json "
                          "(--config) or its checkpoint directory")

    async def _leader_jobs(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        return [j.record() for j in self.jobs.values()]

    async def _leader_config(self, body: dict[str, Any]) -> dict[str, Any]:
        job = self.jobs.get(str(body.get("job_id")))
        if job is None:
            raise ConfigError(f"no job {body.get('job_id')!r}; jobs: "
                              f"{', '.join(self.jobs) or 'none'}")
        return {"config": job.config, "state": job.state, "step": job.step,
                "checkpoint_step": job.checkpoint_step}

    async def _leader_cancel(self, body: dict[str, Any]) -> dict[str, Any]:
        job = self.jobs.get(str(body.get("job_id")))
        if job is None:
            raise ConfigError(f"no job {body.get('job_id')!r}; jobs: "
                              f"{', '.join(self.jobs) or 'none'}")
        if job.state in TERMINAL:
            raise PlacementError(f"job {job.job_id} is already {job.state}")
        job.cancel_asked = True
        if job.scope is not None:
            job.scope.cancel()
        return job.record()

    async def _drive(self, job: Job) -> None:
        """Place the job (waiting while pending), train it, release its stages."""
        driver: _Driver | None = None
        with trio.CancelScope() as scope:
            job.scope = scope
            if job.cancel_asked:
                scope.cancel()
            try:
                placement = await self._place(job)
                while True:
                    driver = job.driver = _Driver(self, job, placement)
                    try:
                        await driver.run()
                        break
                    except ReplicaLost as exc:
                        if len(placement) != 1:
                            raise
                        with trio.CancelScope(shield=True):
                            await driver.close()
                        driver = job.driver = None
                        placement = await self._wait_to_resume(job, exc)
                job.state, job.reason = "finished", ""
            except SwarmError as exc:
                job.state, job.reason = "failed", str(exc)
                log.warning("job %s failed: %s", job.job_id, exc)
        if scope.cancelled_caught or (job.cancel_asked and job.state not in TERMINAL):
            job.state, job.reason = "cancelled", "cancelled by request"
        with trio.CancelScope(shield=True):
            if driver is not None:
                await driver.close()
            await self._release_job(job)

    async def _place(self, job: Job) -> list[list[dict[str, Any]]]:
        """Each replica's stages with their fellows' addresses, once every fellow took
        its stage; the job stays pending (with why) until then."""
        while True:
            try:
                plan = await self.plan({"config": job.config, "stages": job.stages,
                                        "maximize": job.maximize,
                                        "exclude_cards": job.exclude_cards})
                if job.maximize and not job.pinned:
                    job.config["seq_len"] = int(plan["request"]["seq_len"])
                if job.pinned and plan["plan_id"] != job.plan_id:
                    raise PlacementError(CHANGED + "; ".join(self.shown.changes(job.plan_id, plan)))
                if not plan.get("fits"):
                    raise PlacementError(plan["layout"]["limit"]["sentence"])
                job.plan_id = plan["plan_id"]
                placement = self._placement(plan)
                refusals = await self._prepare(job, placement, None, job.paused_times)
                if not refusals:
                    job.placement = placement
                    return placement
                await self._release_job(job)
                raise PlacementError((CHANGED if job.pinned else "waiting for fellows: ")
                                     + "; ".join(refusals))
            except PlacementError as exc:
                reason = str(exc)
                if job.pinned and not reason.startswith(CHANGED):
                    reason = CHANGED + reason
                job.state, job.reason = "pending", reason
                log.info("job %s pending: %s", job.job_id, exc)
            await trio.sleep(self.retry_s)

    async def _wait_to_resume(self, job: Job, lost: ReplicaLost) -> list[list[dict[str, Any]]]:
        """A lone replica lost a fellow: the job waits ``pending`` until cards take its
        stages again (a pinned job: its own plan; otherwise any free cards, on the cut
        it trained with), then resumes from its latest checkpoint (or from the start
        when it has written none yet). Without a checkpoint directory it fails."""
        cfg = _job_config(job.config)
        if cfg.checkpoint.dir is None:
            raise PlacementError(f"{lost}; the job names no checkpoint.dir to resume from")
        if job.checkpoint:
            job.resume = True
            whence = f"resume from its checkpoint of step {job.checkpoint_step}"
        else:
            job.resume = False
            job.step, job.loss, job.losses, job.samples = 0, None, [], 0
            whence = "start again (it wrote no checkpoint yet)"
        gone = sorted({s["fellow"] for s in (job.placement or [[]])[0] if s["addr"] in str(lost)})
        paused = (f"lost {', '.join(gone)}: " if gone else "") + f"{lost}; waiting for " \
            f"cards to {whence}"
        job.state, job.reason = "pending", paused
        job.paused_times += 1
        log.warning("job %s: %s", job.job_id, paused)
        if job.pinned:
            return await self._place(job)
        while True:
            await trio.sleep(self.retry_s)
            try:
                stages = await self._replacement(job, 0)
                refusals = await self._prepare(job, [stages], None, job.paused_times)
                if not refusals:
                    job.placement = [stages]
                    return [stages]
                await self._release_job(job, 0, sorted({s["addr"] for s in stages}),
                                        job.paused_times)
                why = "; ".join(refusals)
            except PlacementError as exc:
                why = str(exc)
            job.reason = f"{paused} ({why})"
            log.info("job %s still pending: %s", job.job_id, why)

    def _placement(self, plan: dict[str, Any]) -> list[list[dict[str, Any]]]:
        cards = {(c["fellow_id"], c["kind"], c["index"]): c for c in plan["cards"] if c["used"]}
        out = []
        for replica in plan["replicas"]:
            stages = []
            for s in replica["stages"]:
                member = self.agent.fellow(s["fellow_id"])
                if member is None or member.state not in ("alive", "suspect"):
                    raise PlacementError(f"stage {s['stage']}'s fellow {s['fellow']} is not "
                                         "connected")
                seg = (cards.get((s["fellow_id"], s["kind"], s["index"])) or {}).get(
                    "segments", {})
                need = sum(v for k, v in seg.items()
                           if k not in ("other_programs", "free", "does_not_fit"))
                stages.append({"stage": s["stage"], "fellow_id": s["fellow_id"],
                               "fellow": member.name, "addr": member.addr,
                               "layers": list(s["layers"]), "card_kind": s["kind"],
                               "card_index": s["index"],
                               "card": card_label(s["kind"], s["index"], s["name"]),
                               "need_bytes": need})
            out.append(stages)
        return out

    async def _replacement(self, job: Job, replica: int) -> list[dict[str, Any]]:
        """Cards for a paused replica, on this leader's view now: the planner places one
        pipeline on the cards nobody trains on (the replica's own fellow, alive again, or
        free ones); the replica keeps the job's cut, so its stages still sync with the
        other replicas' stages."""
        cfg = _job_config(job.config)
        old = job.placement[replica]
        message = {"model": _model_message(cfg), **cfg.plan_request(), "stages": len(old),
                   "maximize": None, "exclude": sorted(job.exclude_cards)}
        plan = plan_message(message, self._view_for_training())
        if not plan.get("fits"):
            raise PlacementError(plan["layout"]["limit"]["sentence"])
        if len(plan["stages"]) != len(old):
            raise PlacementError(f"the free cards give {len(plan['stages'])} stages, the job "
                                 f"is cut in {len(old)}")
        stages = self._placement({**plan, "replicas": [{"stages": plan["stages"]}]})[0]
        for new, was in zip(stages, old):
            new["layers"] = list(was["layers"])
        return stages

    def _view_for_training(self) -> Any:
        """The leader's view with each fellow's ``training`` flag from the leader's own
        record (the fellows holding live stages of its jobs), not from gossip: a fellow
        restarted after a crash may still be gossiped with the flag its old self set."""
        from dataclasses import replace

        from p2pswarm.planner import ClusterView

        busy: set[str] = set()
        for job in self.jobs.values():
            if job.state in TERMINAL or job.driver is None:
                continue  # a pending job holds no stages
            idle = {r.index for r in job.driver.replicas if r.paused and not r.joining} \
                if job.driver is not None else set()
            busy.update(s["fellow_id"] for i, stages in enumerate(job.placement)
                        if i not in idle for s in stages)
        busy.update(fellow_id(self.agent.node_id) for _ in self.hosts)
        view = self.agent.planning.view()
        fellows = tuple(replace(f, training=f.id in busy) for f in view.fellows)
        return ClusterView(fellows, view.default_link, view.local_link, view.links)


    async def _prepare(self, job: Job, placement: list[list[dict[str, Any]]],
                       replicas: list[int] | None = None, generation: int = 0) -> list[str]:
        """Order every stage of ``replicas`` (default: all) onto its fellow; the refusals."""
        refusals: list[str] = []

        async def one(r: int, s: dict[str, Any], n_stages: int, next_addr: str) -> None:
            body = {"job_id": job.job_id, "replica": r, "stage": s["stage"],
                    "n_stages": n_stages, "fellow_id": s["fellow_id"], "layers": s["layers"],
                    "card_kind": s["card_kind"], "card_index": s["card_index"],
                    "need_bytes": s["need_bytes"], "next_addr": next_addr,
                    "config": job.config, "generation": generation}
            try:
                with trio.fail_after(self.open_timeout_s):
                    await self.leadership.order_op(s["addr"], "train-prepare", body)
            except SwarmError as exc:
                refusals.append(f"{s['fellow']}: {exc}")
            except trio.TooSlowError:
                refusals.append(f"{s['fellow']}: no answer within {self.open_timeout_s:g} s")

        async with trio.open_nursery() as nursery:
            for r, stages in enumerate(placement):
                if replicas is not None and r not in replicas:
                    continue
                for i, s in enumerate(stages):
                    nxt = stages[i + 1]["addr"] if i + 1 < len(stages) else ""
                    nursery.start_soon(one, r, s, len(stages), nxt)
        return sorted(refusals)

    async def _release_job(self, job: Job, replica: int | None = None,
                           addrs: list[str] | None = None, generation: int | None = None
                           ) -> None:
        """Order the job's stages (of one replica, up to one placement of it) released."""
        if addrs is None:
            addrs = sorted({s["addr"] for r, stages in enumerate(job.placement)
                            for s in stages if replica is None or r == replica})
        if not job.placement and replica is None:
            # a failed prepare: every fellow that may hold a stage
            addrs = sorted({m.addr for m in (self.agent.membership.members()
                                              if self.agent.membership else ())
                            if m.state in ("alive", "suspect")})

        async def one(addr: str) -> None:
            try:
                with trio.fail_after(self.open_timeout_s):
                    await self.leadership.order_op(addr, "train-release",
                                                {"job_id": job.job_id, "replica": replica,
                                                 "generation": generation})
            except (SwarmError, trio.TooSlowError) as exc:
                log.info("release of %s on %s: %s", job.job_id, addr, exc)

        async with trio.open_nursery() as nursery:
            for addr in addrs:
                nursery.start_soon(one, addr)

    # --- a fellow's orders ----------------------------------------------------------------

    async def _order_prepare(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            key = (str(body["job_id"]), int(body["replica"]), int(body["stage"]))
            kind, index, need = str(body["card_kind"]), int(body["card_index"]), \
                int(body["need_bytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed train-prepare order ({exc})") from None
        if body.get("fellow_id") != fellow_id(self.agent.node_id):
            raise PlacementError(f"{self.agent.name} got the order for stage {key[2]}, which "
                                 "the plan gives another fellow")
        old = self.hosts.get(key)
        if old is not None:
            if old.generation >= int(body.get("generation", 0)):
                raise PlacementError(f"{self.agent.name} already holds stage {key[2]} of "
                                     f"replica {key[1]} of {key[0]}")
            self.hosts.pop(key).done.set()  # an earlier placement the leader moved on from
        cards = self.agent.serving._live_cards()
        card = next((c for c in cards if c.kind == kind and c.index == index), None)
        label = card_label(kind, index, getattr(card, "name", ""))
        if card is None:
            raise PlacementError(f"refuses stage {key[2]}: its {label} is not offered any more")
        promised = sum(h.need_bytes for h in self.hosts.values()
                       if h.card_key == f"{kind}:{index}")
        available = card.free_bytes - promised
        if available < need:
            raise PlacementError(f"refuses stage {key[2]}: its {label} has {gb(available)} "
                                 f"free now, the stage needs {gb(need)}")
        if self.agent.serving.hosted and kind != "cpu":
            raise PlacementError(f"refuses stage {key[2]}: it is serving a load")
        host = await self.run(lambda: _build_host(body))
        if key in self.hosts:
            raise PlacementError(f"stage {key[2]} of {key[0]} was taken twice")
        self.hosts[key] = host
        self._publish()
        return {"ok": True}

    async def _order_release(self, body: dict[str, Any]) -> dict[str, Any]:
        job_id, replica = str(body.get("job_id")), body.get("replica")
        generation = body.get("generation")
        dropped = [k for k, h in self.hosts.items()
                   if k[0] == job_id and (replica is None or k[1] == replica)
                   and (generation is None or h.generation <= int(generation))]
        for key in dropped:
            host = self.hosts.pop(key)
            host.done.set()
        if dropped:
            self._publish()
        return {"released": [list(k[1:]) for k in dropped]}

    def _publish(self) -> None:
        training = bool(self.hosts)
        if bool(self.agent.extra_metadata.get("training")) != training:
            if training:
                self.agent.extra_metadata["training"] = True
            else:
                self.agent.extra_metadata.pop("training", None)
            self.agent.publish_metadata()

    # --- a fellow's streams ---------------------------------------------------------------

    async def _on_train_open(self, msg: TrainOpen, stream: SecureStream) -> None:
        host = self.hosts.get((msg.job_id, msg.replica, msg.stage))
        if host is None:
            await send_best_effort(stream, TrainError(msg.stage, self.agent.name,
                                              f"holds no stage {msg.stage} of replica "
                                              f"{msg.replica} of {msg.job_id}"))
            return None
        if msg.role == "data":
            host.upstream = stream
            host.upstream_ready.set()
            await host.done.wait()
            return None
        if msg.role != "control":
            raise RemoteProtocolError("bad-role", f"role {msg.role!r}")
        downstream: SecureStream | None = None
        try:
            if host.next_addr:
                downstream = await self.agent.open_secure(host.next_addr)
                await _send(downstream, TrainOpen(host.job_id, host.replica, host.index + 1,
                                                  "data"))
            await _send(stream, TrainCtl("ok"))
            await self._serve_stage(host, stream, downstream)
        except (SwarmError, trio.TooSlowError) as exc:
            reason = str(exc) if isinstance(exc, SwarmError) else "a neighbour fell silent"
            log.warning("%s: stage %d of %s: %s", self.agent.name, host.index, host.job_id,
                        reason)
            await send_best_effort(stream, TrainError(host.index, self.agent.name, reason[:500]))
        finally:
            host.done.set()
            if downstream is not None:
                with trio.CancelScope(shield=True):
                    await downstream.aclose()
        return None

    async def _serve_stage(self, host: TrainHost, control: SecureStream,
                           downstream: SecureStream | None) -> None:
        """Answer the driver's commands until it says stop."""
        while True:
            msg = await _receive(control, TrainCtl, "the driver")
            op = msg.op
            if op == "stop":
                return
            if op == "step":
                await self._stage_step(host, control, downstream, msg)
                continue
            if op == "take":
                encoded, _, version = await self.run(host.sync.take_delta, host.limiter)
                await _send(control, TrainCtl("delta", version, blob=encoded.to_bytes()))
            elif op == "update":
                from p2pswarm.training.codec import Encoded

                update = Encoded.from_bytes(msg.blob)
                await self.run(lambda: host.sync.apply(update, msg.step), host.limiter)
                await _send(control, TrainCtl("ok", msg.step))
            elif op == "params":
                from p2pswarm.training.sync import flatten

                flat = await self.run(lambda: flatten(host.sync.tensors), host.limiter)
                await _send(control, TrainCtl("params", blob=_tensor_bytes(flat)))
            elif op == "state":
                from p2pswarm.training.checkpoint import shard_bytes

                blob = await self.run(lambda: shard_bytes(
                    {"stage": host.stage.state_dict(), "sync": host.sync.state_dict()}),
                    host.limiter)
                await _send(control, TrainCtl("state", blob=blob))
            elif op == "load":
                from p2pswarm.training.checkpoint import read_shard_bytes

                def load() -> None:
                    state = read_shard_bytes(msg.blob)
                    host.stage.load_state_dict(state["stage"])
                    host.sync.load_state_dict(state["sync"])

                await self.run(load, host.limiter)
                await _send(control, TrainCtl("ok"))
            elif op == "reset":
                import torch

                from p2pswarm.training.sync import JoinState

                state = JoinState(msg.step, _tensor(msg.blob).float(), torch.zeros(0))
                await self.run(lambda: host.sync.reset(state), host.limiter)
                await _send(control, TrainCtl("ok", msg.step))
            elif op == "tied":
                weight = dict(host.stage.named_trainable)[host.stage.tied_name]
                await _send(control, TrainCtl("tied", blob=_tensor_bytes(weight)))
            elif op == "tied-weight":
                import torch

                weight = dict(host.stage.named_trainable)[host.stage.tied_name]
                value = _tensor(msg.blob)
                with torch.no_grad():
                    weight.copy_(value.to(weight.device, weight.dtype))
                await _send(control, TrainCtl("ok"))
            else:
                raise RemoteProtocolError("bad-op", f"unknown training op {op!r}")

    async def _stage_step(self, host: TrainHost, control: SecureStream,
                          downstream: SecureStream | None, msg: TrainCtl) -> None:
        from p2pswarm.training.schedule import stage_ops

        stage, n_micro, step = host.stage, msg.count, msg.step
        first, last = stage.is_first, stage.is_last
        inputs: dict[int, Any] = {}
        targets: dict[int, Any] = {}
        for _ in range(n_micro * (int(first) + int(last))):
            t = await _receive(control, TrainTensor, "the driver")
            (inputs if t.kind == "input" else targets)[t.micro] = _tensor(t.tensor)
        losses: list[float] = []
        for op in stage_ops(host.schedule, host.index, host.n_stages, n_micro):
            m = op.micro
            if op.kind == "F":
                if first:
                    x = inputs.pop(m)
                else:
                    x = _tensor((await self._upstream_receive(host)).tensor)
                out = await self.run(lambda: stage.forward(m, x, targets.get(m)), host.limiter)
                if last:
                    losses.append(float(out))
                else:
                    assert downstream is not None
                    await _send(downstream, TrainTensor("activation", step, m,
                                                        _tensor_bytes(out)))
            else:
                g = None
                if not last:
                    assert downstream is not None
                    g = _tensor((await _receive(downstream, TrainTensor,
                                                "the next stage")).tensor)
                grad_in = await self.run(lambda: stage.backward(m, g, loss_scale=1.0 / n_micro),
                                         host.limiter)
                if not first:
                    assert host.upstream is not None
                    await _send(host.upstream, TrainTensor("gradient", step, m,
                                                           _tensor_bytes(grad_in)))
        tied = stage.tied_grad()
        sq = _grad_sq_without_tied(stage)
        loss_sum = sum(losses)
        if not math.isfinite(loss_sum) or not math.isfinite(sq):
            raise PlacementError(f"stage {host.index}: the loss or gradients are not finite "
                                 "(lower lr.peak)")
        await _send(control, TrainCtl("report", step, int(tied is not None), sq, loss_sum))
        if tied is not None:
            await _send(control, TrainTensor("tied", step, 0, _tensor_bytes(tied)))
        apply = await _receive(control, TrainCtl, "the driver")
        if apply.op != "apply":
            raise RemoteProtocolError("bad-op", f"expected apply, got {apply.op!r}")
        if tied is not None:
            total = _tensor((await _receive(control, TrainTensor, "the driver")).tensor)
            stage.set_tied_grad(total)
        await self.run(lambda: stage.step(msg.value, apply.value), host.limiter)
        if self.simulated_step_s:
            await trio.sleep(self.simulated_step_s)
        await _send(control, TrainCtl("ok", step))

    async def _upstream_receive(self, host: TrainHost) -> TrainTensor:
        if host.upstream is None:
            with trio.fail_after(self.open_timeout_s):
                await host.upstream_ready.wait()
        assert host.upstream is not None
        with trio.fail_after(self.step_timeout_s):
            return await _receive(host.upstream, TrainTensor,  # type: ignore[no-any-return]
                                  "the stage before")


def _grad_sq_without_tied(stage: Any) -> float:
    total = 0.0
    for name, p in stage.named_trainable:
        if p.grad is None or name == stage.tied_name:
            continue
        total += float(p.grad.detach().float().pow(2).sum())
    return total


async def _together(fns: list[Any]) -> None:
    """Run ``fns`` concurrently; the first failure cancels the rest and is raised as
    itself (not as an exception group), so a caller's ``except SwarmError`` sees it."""
    errors: list[BaseException] = []

    async def guard(fn: Any, scope: trio.CancelScope) -> None:
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


@asynccontextmanager
async def _all_locks(locks: list[trio.Lock]) -> AsyncIterator[None]:
    """Hold every lock, taken in the given order."""
    async with AsyncExitStack() as stack:
        for lock in locks:
            await stack.enter_async_context(lock)
        yield



# --- the driver: one job on the leader -----------------------------------------------------


class _Driver:
    def __init__(self, training: Training, job: Job,
                 placement: list[list[dict[str, Any]]]) -> None:
        self.training = training
        self.agent = training.agent
        self.job = job
        self.cfg = _job_config(job.config)
        self.replicas = [_Replica(i, [_Link(s["stage"], s["fellow"], s["addr"])
                                      for s in stages], generation=job.paused_times)
                         for i, stages in enumerate(placement)]
        self.keepers: list[Any] = []
        self.store: Any = None
        self.started_s = 0.0
        self.tokens = 0
        self._buckets: dict[int, list[float]] = {}  # job step -> the replicas' losses there
        self._wake = trio.Event()  # something the round-closer should look at happened
        self._closed = trio.Event()  # set (and replaced) when a round closes
        self._late: list[dict[str, Any]] = []  # late contributions of the open round
        self._nursery: trio.Nursery | None = None
        self._checkpointed = 0

    @property
    def active(self) -> list[_Replica]:
        return [r for r in self.replicas if not r.paused]

    @property
    def synced(self) -> bool:
        return len(self.replicas) > 1

    async def run(self) -> None:
        from p2pswarm.training.checkpoint import CheckpointStore
        from p2pswarm.training.data import SampleStream
        from p2pswarm.training.run import job_data

        cfg, job = self.cfg, self.job
        data = await self.training.run(lambda: job_data(cfg))
        for r in self.replicas:
            r.stream = SampleStream(data.train, cfg.seq_len, seed=cfg.seed, stream=r.index)
        async with trio.open_nursery() as nursery:
            for r in self.replicas:
                nursery.start_soon(self._open, r)
        if self.synced:
            await self._make_keepers()
        if cfg.checkpoint.dir is not None:
            self.store = CheckpointStore(cfg.checkpoint.dir, keep=cfg.checkpoint.keep)
        if job.resume:
            await self._resume()
        job.state, job.reason = "running", ""
        job.replicas = len(self.active)
        self.started_s = trio.current_time()
        if not self.synced:
            await self._train()
            return
        failed: list[SwarmError] = []  # raised as itself, not in an exception group
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._place_again_loop)
            try:
                await self._rounds(nursery)
            except SwarmError as exc:
                failed.append(exc)
            nursery.cancel_scope.cancel()
        if failed:
            raise failed[0]

    async def _train(self) -> None:
        cfg, job = self.cfg, self.job
        while job.step < cfg.steps:
            if not self.active:
                raise ReplicaLost("; ".join(r.paused for r in self.replicas))
            losses: dict[int, float] = {}

            async def one(r: _Replica) -> None:
                try:
                    with trio.fail_after(self.training.step_timeout_s):
                        losses[r.index] = await self._step(r)
                except (SwarmError, trio.TooSlowError) as exc:
                    await self._pause(r, exc)

            async with trio.open_nursery() as nursery:
                for r in self.active:
                    nursery.start_soon(one, r)
            if not losses:
                continue
            job.step += 1
            per_step = cfg.micro_batch * cfg.micro_batches
            job.samples += per_step * len(losses)
            self.tokens += per_step * cfg.seq_len * len(losses)
            job.loss = sum(losses[i] for i in sorted(losses)) / len(losses)
            job.losses.append(job.loss)
            if self.store is not None and job.step % cfg.checkpoint.interval_steps == 0:
                await self._checkpoint()
            elapsed = trio.current_time() - self.started_s
            job.tokens_per_s = self.tokens / elapsed if elapsed > 0 else 0.0
            job.replicas = len(self.active)

    async def _open(self, r: _Replica) -> None:
        try:
            await self._open_links(r)
        except (SwarmError, trio.TooSlowError) as exc:
            await self._pause(r, exc)

    async def _open_links(self, r: _Replica) -> None:
        """Control streams to every stage, last first (each opens its data stream on)."""
        with trio.fail_after(self.training.open_timeout_s):
            for link in reversed(r.links):
                link.stream = await self.agent.open_secure(link.addr)
                await link.send(TrainOpen(self.job.job_id, r.index, link.stage, "control"))
                await link.receive(TrainCtl)

    async def _pause(self, r: _Replica, exc: BaseException) -> None:
        why = str(exc) if isinstance(exc, SwarmError) else "a stage fell silent"
        r.paused = f"{r.name} paused: {why}"
        r.joining = False
        log.warning("job %s: %s", self.job.job_id, r.paused)
        for keeper in self.keepers:
            keeper.leave(r.name)
        await self._close_links(r)
        # released in the background: a dead fellow's silence must not hold the others up
        addrs = sorted({s["addr"] for s in self.job.placement[r.index]})
        self.agent.spawn(self.training._release_job, self.job, r.index, addrs, r.generation)

    # --- rejoin: a paused replica placed again ----------------------------------------------

    async def _place_again_loop(self) -> None:
        """Every ``retry_s``, try to place each paused replica again (on its fellow, alive
        again, or on free cards); it joins the rounds at the next round boundary."""
        while True:
            await trio.sleep(self.training.retry_s)
            for r in self.replicas:
                if r.paused and not r.joining:
                    await self._place_again(r)

    async def _place_again(self, r: _Replica) -> None:
        r.placing = True
        try:
            stages = await self.training._replacement(self.job, r.index)
            generation = r.generation + 1
            placement = [stages if i == r.index else [] for i in range(len(self.replicas))]
            refusals = await self.training._prepare(self.job, placement, [r.index],
                                                    generation)
            if refusals:
                await self.training._release_job(self.job, r.index,
                                                 sorted({s["addr"] for s in stages}),
                                                 generation)
                raise PlacementError("; ".join(refusals))
            r.generation = generation
            self.job.placement[r.index] = stages
            r.links = [_Link(s["stage"], s["fellow"], s["addr"]) for s in stages]
            await self._open_links(r)
            r.joining = True
            self._poke()
            log.info("job %s: %s placed again on %s", self.job.job_id, r.name,
                     ", ".join(s["fellow"] for s in stages))
        except (SwarmError, trio.TooSlowError) as exc:
            why = str(exc) if isinstance(exc, SwarmError) else "a stage fell silent"
            log.info("job %s: %s not placed again yet: %s", self.job.job_id, r.name, why)
            await self._close_links(r)
        finally:
            r.placing = False

    async def _close_links(self, r: _Replica) -> None:
        for link in r.links:
            if link.stream is not None:
                stream, link.stream = link.stream, None
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(1.0):
                        await send_best_effort(stream, TrainCtl("stop"))
                    await stream.aclose()

    async def close(self) -> None:
        for r in self.replicas:
            await self._close_links(r)

    async def _step(self, r: _Replica, position: int | None = None) -> float:
        """One optimizer step of replica ``r``; ``position`` is its place in the
        learning-rate schedule (default: the steps it has taken)."""
        from p2pswarm.training.stage import clip_coefficient

        cfg = self.cfg
        step = r.steps
        batch = r.stream.next_micro_batches(cfg.micro_batches, cfg.micro_batch)
        inputs, targets = batch[..., :-1], batch[..., 1:]
        n_micro = batch.shape[0]
        lr = cfg.lr.lr_at(r.steps if position is None else position)
        first, last = r.links[0], r.links[-1]
        for link in r.links:
            await link.send(TrainCtl("step", step, n_micro, lr))
        for m in range(n_micro):
            await first.send(TrainTensor("input", step, m, _tensor_bytes(inputs[m])))
        for m in range(n_micro):
            await last.send(TrainTensor("target", step, m, _tensor_bytes(targets[m])))
        reports: dict[int, TrainCtl] = {}
        tied: dict[int, Any] = {}

        async def report(link: _Link) -> None:
            msg = await link.receive(TrainCtl)
            if msg.op != "report":
                raise RemoteProtocolError("bad-op", f"expected report, got {msg.op!r}")
            reports[link.stage] = msg
            if msg.count:
                tied[link.stage] = _tensor((await link.receive(TrainTensor)).tensor)

        await _together([lambda link=link: report(link) for link in r.links])
        total_sq = sum(reports[s].value for s in sorted(reports))
        tied_sum = None
        if len(tied) == 2:
            a, b = (tied[s] for s in sorted(tied))
            tied_sum = a + b
            total_sq += float(tied_sum.float().pow(2).sum())
        coef = clip_coefficient([total_sq], cfg.optimizer.grad_clip)
        for link in r.links:
            await link.send(TrainCtl("apply", step, value=coef))
            if link.stage in tied:
                await link.send(TrainTensor("tied", step, 0, _tensor_bytes(
                    tied_sum if tied_sum is not None else tied[link.stage])))
        for link in r.links:
            await link.receive(TrainCtl)
        r.steps += 1
        r.samples_unsent += n_micro * cfg.micro_batch
        r.steps_unsent += 1
        return reports[last.stage].value2 / n_micro

    async def _make_keepers(self) -> None:
        from p2pswarm.training.sync import OuterSync

        r = self.active[0] if self.active else self.replicas[0]
        for link in r.links:
            await link.send(TrainCtl("params"))
            params = _tensor((await link.receive(TrainCtl)).blob)
            keeper = OuterSync(params, self.cfg.sync)
            for replica in self.replicas:
                keeper.join(replica.name)
            self.keepers.append(keeper)

    # --- asynchronous rounds (several replicas) ---------------------------------------------

    async def _rounds(self, nursery: trio.Nursery) -> None:
        """Every replica trains in its own task; this one closes each stage's round when
        every member has sent or at the round's deadline, with whatever arrived (as
        ``training.virtual.VirtualSwarm``), admits replicas placed again, checkpoints."""
        self._nursery = nursery
        self._checkpointed = self.job.step
        for i, loss in enumerate(self.job.losses):  # a resumed job's record goes on
            self._buckets[i + 1] = [loss]
        now = trio.current_time()
        for keeper in self.keepers:
            keeper.deadline = now + self.cfg.sync.round_deadline_s
        for r in self.active:
            r.running = True
            nursery.start_soon(self._replica_loop, r)
        keeper = self.keepers[0]
        while True:
            if not any(r.running for r in self.replicas) and any(
                    r.joining for r in self.replicas):
                await self._admit()  # no round would close to let it in
            now = trio.current_time()
            if not any(r.running for r in self.replicas):
                if any(r.finished for r in self.replicas):
                    await self._close_round(now)  # what the last budgets sent
                    return
                if not any(r.joining or r.placing for r in self.replicas):
                    raise ReplicaLost("every replica lost a fellow: " + "; ".join(
                        r.paused for r in self.replicas))
            if keeper.ready(now) or now >= keeper.next_deadline():
                await self._close_round(now)
                continue
            with trio.move_on_at(keeper.next_deadline()):
                await self._wake.wait()
            self._wake = trio.Event()

    def _poke(self) -> None:
        self._wake.set()

    async def _close_round(self, now: float) -> None:
        results = [keeper.close_round(now) for keeper in self.keepers]
        first = results[0]
        if first is None:
            return  # nothing arrived: the deadline moved on
        self.job.rounds.append({
            "step": self.job.step, "version": first.version, "closed_at_s": round(now, 3),
            "replicas": list(dict.fromkeys(a.replica for a in first.applied)),
            "dropped": list(dict.fromkeys(a.replica for a in first.dropped)),
            "late": self._late})
        self._late = []
        closed, self._closed = self._closed, trio.Event()
        closed.set()
        await self._admit()
        due = self.cfg.checkpoint.interval_steps
        if self.store is not None and self.job.step // due > self._checkpointed // due:
            async with _all_locks([r.lock for r in self.replicas]):
                await self._checkpoint()
            self._checkpointed = self.job.step

    def _budget(self, r: _Replica) -> int:
        """Local steps this round: the fastest replica takes ``inner_steps``, a slower one
        what it manages in the same time (``training.sync.step_budgets``)."""
        from p2pswarm.training.sync import step_budgets

        inner = self.cfg.sync.inner_steps
        if not self.cfg.sync.speed_aware or r.step_s <= 0:
            return inner
        speeds = {x.name: 1.0 / x.step_s for x in self.replicas
                  if x.running and x.step_s > 0}
        fastest = max(speeds.values())
        # within a tenth of the fastest counts as as fast: jitter must not halve a budget
        even = {n: fastest if v >= SAME_SPEED * fastest else v for n, v in speeds.items()}
        return step_budgets(even, inner)[r.name]

    def _position(self, r: _Replica) -> float:
        """Where the replica stands in the job: its rounds done (budgets sent, or rounds
        closed since, whichever is more), plus its share of the current one."""
        inner = self.cfg.sync.inner_steps
        return r.rounds_done * inner + r.in_round * inner / max(1, r.budget)

    def _worth_waiting(self, r: _Replica) -> bool:
        """Whether every replica yet to send this round should send within about one of
        ``r``'s steps (or is not measured yet): then the round closes soon and ``r`` waits
        for it, so that equally fast replicas train exactly as one process would;
        otherwise ``r`` trains on and applies the update when it comes."""
        version = self.keepers[0].version
        for x in self.replicas:
            if x is r or not x.running or x.sent_version == version:
                continue
            if x.step_s <= 0 or r.step_s <= 0:
                return True
            if max(0, x.budget - x.in_round) * x.step_s > WAIT_STEPS * r.step_s:
                return False
        return True

    async def _replica_loop(self, r: _Replica) -> None:
        """Catch up on the updates, take this round's budget of steps, send the deltas;
        wait for the round only while it is open (never past its deadline)."""
        cfg = self.cfg
        try:
            while True:
                async with r.lock:
                    await self._catch_up(r)
                r.budget, r.in_round = self._budget(r), 0
                if self._position(r) >= cfg.steps or self.job.step >= cfg.steps:
                    break  # its own end, or the furthest replica's (a slow one stops)
                while r.in_round < r.budget and self._position(r) < cfg.steps:
                    async with r.lock:
                        await self._catch_up(r)  # a round that closed meanwhile
                        began = trio.current_time()
                        with trio.fail_after(self.training.step_timeout_s):
                            loss = await self._step(r, min(int(self._position(r)),
                                                           cfg.steps - 1))
                    took = trio.current_time() - began
                    r.step_s = took if r.step_s <= 0 else 0.5 * r.step_s + 0.5 * took
                    r.in_round += 1
                    self._count(r, loss)
                async with r.lock:
                    version, fresh = await self._contribute(r)
                r.rounds_done += 1
                if fresh:
                    r.sent_version = version
                if fresh and self._worth_waiting(r):
                    while self.keepers[0].version <= version:
                        await self._closed.wait()
            async with r.lock:
                if r.samples_unsent:
                    await self._contribute(r)
            r.finished = True
        except (SwarmError, trio.TooSlowError) as exc:
            await self._pause(r, exc)
        finally:
            r.running = False
            for keeper in self.keepers:
                keeper.leave(r.name)
            self._poke()

    def _count(self, r: _Replica, loss: float) -> None:
        """A replica's step into the job's record: the job's step is the furthest
        replica's place; each step's loss is the mean of the replicas' losses there."""
        cfg, job = self.cfg, self.job
        at = min(cfg.steps, max(1, math.ceil(self._position(r) - 1e-9)))
        self._buckets.setdefault(at, []).append(loss)
        job.step = max(job.step, at)
        job.losses = [sum(v) / len(v) for _, v in sorted(self._buckets.items())]
        job.loss = job.losses[-1]
        per_step = cfg.micro_batch * cfg.micro_batches
        job.samples += per_step
        self.tokens += per_step * cfg.seq_len
        elapsed = trio.current_time() - self.started_s
        job.tokens_per_s = self.tokens / elapsed if elapsed > 0 else 0.0
        job.replicas = len(self.active)
        job.replica_steps = {x.name: x.steps for x in self.replicas}

    async def _contribute(self, r: _Replica) -> tuple[int, bool]:
        """Send each stage's delta to its keeper; (the version it is anchored on, whether
        it is fresh: for the round still open)."""
        from p2pswarm.training.codec import Encoded, make_codec

        codec = make_codec(self.cfg.sync.codec, **self.cfg.sync.codec_kwargs())
        deltas = []
        for link in r.links:
            await link.send(TrainCtl("take"))
            msg = await link.receive(TrainCtl)
            deltas.append((Encoded.from_bytes(msg.blob), msg.step))
        now = trio.current_time()
        version = deltas[0][1]
        verdict = None
        for keeper, (encoded, v) in zip(self.keepers, deltas):
            verdict = keeper.contribute(r.name, v, codec.decode(encoded), r.samples_unsent,
                                        now)
            self.job.bytes_sent += encoded.nbytes
        assert verdict is not None
        if verdict.staleness:
            decay = self.cfg.sync.staleness_decay ** verdict.staleness
            self._late.append({"replica": r.name, "staleness": verdict.staleness,
                               "samples": r.samples_unsent,
                               "weight": 0.0 if not verdict.accepted else decay,
                               "dropped": not verdict.accepted})
            log.info("job %s: %s sent %d round(s) late: %s", self.job.job_id, r.name,
                     verdict.staleness, "dropped" if not verdict.accepted
                     else f"weighed {decay:g}")
        r.samples_unsent = r.steps_unsent = 0
        self._poke()
        return version, verdict.accepted and verdict.staleness == 0

    async def _catch_up(self, r: _Replica) -> None:
        """Apply the updates the replica has not had (or, when the keepers no longer hold
        them, start it over from the global parameters)."""
        target = self.keepers[0].version
        if r.version >= target:
            return
        missed = [keeper.updates_since(r.version) for keeper in self.keepers]
        if any(m is None for m in missed):
            await self._send_global_state(r)
            r.samples_unsent = r.steps_unsent = 0
        else:
            for i in range(target - r.version):
                for link, updates in zip(r.links, missed):
                    assert updates is not None
                    await link.send(TrainCtl("update", r.version + i + 1,
                                             blob=updates[i].to_bytes()))
                    await link.receive(TrainCtl)
                    self.job.bytes_sent += updates[i].nbytes
        r.version = target
        r.rounds_done = max(r.rounds_done, target)
        await self._copy_tied(r)

    async def _send_global_state(self, r: _Replica) -> None:
        """Every stage of replica ``r`` takes its keeper's global parameters and version."""
        for link, keeper in zip(r.links, self.keepers):
            state = keeper.join(r.name)
            await link.send(TrainCtl("reset", state.version, blob=_tensor_bytes(state.params)))
            await link.receive(TrainCtl)
            self.job.bytes_sent += state.nbytes

    async def _admit(self) -> None:
        """After a round closes (or when no replica is training): replicas placed again
        take the keepers' current global parameters and version and start training in
        the round that opens now."""
        for r in self.replicas:
            if not r.joining:
                continue
            try:
                with trio.fail_after(self.training.step_timeout_s):
                    await self._send_global_state(r)
                    await self._copy_tied(r)
            except (SwarmError, trio.TooSlowError) as exc:
                await self._pause(r, exc)
                continue
            r.joining, r.paused = False, ""
            r.samples_unsent = r.steps_unsent = 0
            r.version, r.in_round, r.step_s = self.keepers[0].version, 0, 0.0
            r.rounds_done, r.sent_version = r.version, -1
            r.running, r.finished = True, False
            self.job.rejoins += 1
            assert self._nursery is not None
            self._nursery.start_soon(self._replica_loop, r)
            log.info("job %s: %s rejoined at step %d", self.job.job_id, r.name,
                     self.job.step)

    async def _copy_tied(self, r: _Replica) -> None:
        """The last stage's tied head takes the first stage's synced embedding."""
        if len(r.links) < 2 or not self._tied():
            return
        first, last = r.links[0], r.links[-1]
        await first.send(TrainCtl("tied"))
        weight = (await first.receive(TrainCtl)).blob
        await last.send(TrainCtl("tied-weight", blob=weight))
        await last.receive(TrainCtl)

    def _tied(self) -> bool:
        model = _model_message(self.cfg)["config"]
        return bool(model.get("tie_word_embeddings")) and self.cfg.lora is None

    # --- checkpoints ----------------------------------------------------------------------

    async def _checkpoint(self) -> None:
        from p2pswarm.training.checkpoint import read_shard_bytes

        if len(self.active) != len(self.replicas):
            log.info("job %s: checkpoint at step %d skipped, a replica is paused",
                     self.job.job_id, self.job.step)
            return
        shards: dict[str, dict[str, Any]] = {}
        for r in self.replicas:
            for link in r.links:
                await link.send(TrainCtl("state"))
                state = read_shard_bytes((await link.receive(TrainCtl)).blob)
                shards[f"{r.name}.stage-{link.stage}"] = {
                    **state, "data_position": r.stream.position, "pipeline_steps": r.steps,
                    "samples_unsent": r.samples_unsent, "steps_unsent": r.steps_unsent}
        for s, keeper in enumerate(self.keepers):
            shards[f"keeper.stage-{s}"] = keeper.state_dict()
        cut = [link_layers[0] for link_layers in
               (s["layers"] for s in self.job.placement[0][1:])]
        meta = {"step": self.job.step, "samples": self.job.samples,
                "bytes_sent": self.job.bytes_sent, "losses": self.job.losses, "cut": cut,
                "replicas": len(self.replicas), "job": self.cfg.to_dict(),
                "job_id": self.job.job_id}
        path = await self.training.run(lambda: self.store.write(self.job.step, shards, meta))
        self.job.checkpoint = str(path)
        self.job.checkpoint_step = self.job.step
        self.job.copies = await self.training.copies.spread(
            self.job.job_id, self.job.step, path, self.cfg.checkpoint.copies)
        thin = sorted(n for n, h in self.job.copies.items() if len(h) < self.cfg.checkpoint.copies)
        if thin:
            log.warning("job %s: checkpoint %d has fewer than %d copies on fellows of %s",
                        self.job.job_id, self.job.step, self.cfg.checkpoint.copies,
                        ", ".join(thin))

    async def _resume(self) -> None:
        from p2pswarm.training.checkpoint import shard_bytes
        from p2pswarm.training.run import _comparable

        if self.store is None:
            raise ConfigError("the job names no checkpoint.dir to resume from")
        step = await self.training.copies.restore(self.job.job_id, self.store)
        if step is None:
            raise ConfigError(f"no complete checkpoint of {self.job.job_id} in "
                              f"{self.cfg.checkpoint.dir} or on any connected fellow")
        meta = self.store.manifest(step)["meta"]
        if _comparable(meta["job"]) != _comparable(self.cfg.to_dict()):
            raise ConfigError("the checkpoint was written by a different job.json; resume "
                              "with the job it was trained with")
        cut = [s["layers"][0] for s in self.job.placement[0][1:]]
        if list(meta["cut"]) != cut or int(meta["replicas"]) != len(self.replicas):
            raise PlacementError(
                f"the checkpoint was trained as {meta['replicas']} replicas cut at "
                f"{meta['cut']}; the swarm now gives {len(self.replicas)} cut at {cut}")
        for r in self.replicas:
            for link in r.links:
                state = self.store.read(step, f"{r.name}.stage-{link.stage}")
                await link.send(TrainCtl("load", blob=shard_bytes(
                    {"stage": state["stage"], "sync": state["sync"]})))
                await link.receive(TrainCtl)
                r.stream.position = int(state["data_position"])
                r.version = r.rounds_done = int(state["sync"]["version"])
                r.steps = int(state["pipeline_steps"])
                r.samples_unsent = int(state["samples_unsent"])
                r.steps_unsent = int(state["steps_unsent"])
            await self._copy_tied(r)
        for s, keeper in enumerate(self.keepers):
            keeper.load_state_dict(self.store.read(step, f"keeper.stage-{s}"), float(step))
        self.job.step = int(meta["step"])
        self.job.samples = int(meta["samples"])
        self.job.bytes_sent = int(meta["bytes_sent"])
        self.job.losses = [float(x) for x in meta["losses"]]
        self.job.loss = self.job.losses[-1] if self.job.losses else None


__all__ = ["CHANGED", "Job", "STATES", "TERMINAL", "TrainHost", "Training"]
