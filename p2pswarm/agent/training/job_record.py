"""The leader's record of one job: its config, its placement, its progress, and the
driver running it (while one does). ``Job.report`` is its record, what ``jobs`` lists
(``JobReport``, one document form, read back by the fellow that follows the job)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import trio

from p2pswarm.agent.training.doc_fields import TEXT, DocFields
from p2pswarm.agent.training.placed import MAX_NAME, MAX_REPLICAS, MAX_STAGES, Placement
from p2pswarm.agent.training.round_entry import RoundDoc, RoundEntry
from p2pswarm.errors import ConfigError
from p2pswarm.training.job import JobConfig, ModelSpec

if TYPE_CHECKING:
    from p2pswarm.agent.training.replica import Replica
    from p2pswarm.agent.training.runtime import StageKeeper

STATES = ("pending", "running", "finished", "failed", "cancelled")
TERMINAL = ("finished", "failed", "cancelled")
LOSSES_KEPT = 1000  # per-step losses a job record carries
ROUNDS_KEPT = 200  # sync rounds a job record carries
MAX_MOVES = 4096  # "moved" lines a record read back may carry
MAX_SHARDS = 256 * 1024 + 1024  # shards a record's checkpoint copies may name
REASON_CHARS = 1 << 20  # a record's reason is not cut (a copy's is, to TEXT)


def job_config(config: Any) -> JobConfig:
    """``config`` (the contents of job.json) as a checked ``JobConfig``."""
    if not isinstance(config, dict):
        raise ConfigError("a job needs \"config\": the contents of job.json")
    return JobConfig.from_dict(config)


class StageRowDoc(TypedDict):
    """A ``StageRow``'s document."""

    stage: int
    fellow: str
    layers: list[int]  # [start, end)
    card: str


class JobReportDoc(TypedDict):
    """A ``JobReport``'s document: the wire's ``JobRecord``, the CLI's and the HTTP API's
    JSON, keys in this order."""

    job_id: str
    state: str
    reason: str
    step: int
    steps: int
    loss: float | None
    losses: list[float]
    tokens_per_s: float
    replicas: int
    bytes_sent: int
    samples: int
    plan_id: str
    pinned: bool
    model: object  # ``ModelSpec.to_dict``: the model's name, or {"config": ...} for scratch
    checkpoint: str
    checkpoint_dir: str
    checkpoint_copies: dict[str, list[str]]
    seq_len: int
    rejoins: int
    paused_times: int
    rounds: list[RoundDoc]
    replica_steps: dict[str, int]
    moved: str
    moves: list[str]
    stages: list[list[StageRowDoc]]


@dataclass(frozen=True, slots=True)
class StageRow:
    """One stage of a replica as a job's record lists it."""

    stage: int
    fellow: str
    layers: tuple[int, int]  # [start, end)
    card: str

    def to_doc(self) -> StageRowDoc:
        return {"stage": self.stage, "fellow": self.fellow, "layers": list(self.layers),
                "card": self.card}

    @staticmethod
    def from_doc(doc: object) -> StageRow:
        if not isinstance(doc, dict):
            raise _fields({}).bad("stages")
        f = _fields(doc)
        layers = f.items("layers", 2)
        if len(layers) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                       for x in layers):
            raise f.bad("layers")
        return StageRow(f.whole("stage"), f.text("fellow", MAX_NAME),
                        (layers[0], layers[1]), f.text("card", MAX_NAME))


@dataclass(frozen=True, slots=True)
class JobReport:
    """A job's record, as the leader lists it (``jobs``) and answers a submit or a cancel
    with: its state, progress, plan, checkpoint and where its stages run. ``to_doc`` is the
    record's document (the wire's ``JobRecord``, the CLI's and the HTTP API's JSON), exactly
    as it always was; ``from_doc`` reads one back, checked (it came from the leader)."""

    job_id: str
    state: str
    reason: str
    step: int
    steps: int
    loss: float | None
    losses: tuple[float, ...]
    tokens_per_s: float
    replicas: int
    bytes_sent: int
    samples: int
    plan_id: str
    pinned: bool
    model: ModelSpec
    checkpoint: str
    checkpoint_dir: str
    checkpoint_copies: dict[str, list[str]]  # shard -> fellows holding it
    seq_len: int
    rejoins: int
    paused_times: int
    rounds: tuple[RoundEntry, ...]
    replica_steps: dict[str, int]
    moves: tuple[str, ...]  # one line per leader that took it over
    stages: tuple[tuple[StageRow, ...], ...]  # per replica

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL

    def to_doc(self) -> JobReportDoc:
        return {"job_id": self.job_id, "state": self.state, "reason": self.reason,
                "step": self.step, "steps": self.steps,
                "loss": self.loss, "losses": list(self.losses),
                "tokens_per_s": self.tokens_per_s, "replicas": self.replicas,
                "bytes_sent": self.bytes_sent, "samples": self.samples,
                "plan_id": self.plan_id, "pinned": self.pinned,
                "model": self.model.to_dict(), "checkpoint": self.checkpoint,
                "checkpoint_dir": self.checkpoint_dir,
                "checkpoint_copies": self.checkpoint_copies,
                "seq_len": self.seq_len, "rejoins": self.rejoins,
                "paused_times": self.paused_times,
                "rounds": [r.to_doc() for r in self.rounds],
                "replica_steps": self.replica_steps,
                "moved": self.moves[-1] if self.moves else "", "moves": list(self.moves),
                "stages": [[s.to_doc() for s in replica] for replica in self.stages]}

    @staticmethod
    def from_doc(doc: Mapping[str, Any]) -> JobReport:
        f = _fields(doc)
        state = f.text("state", 16)
        if state not in STATES:
            raise f.bad("state")
        return JobReport(
            f.text("job_id", 64), state, f.text("reason", REASON_CHARS), f.whole("step"),
            f.whole("steps"), f.optional_number("loss"),
            tuple(f.numbers("losses", LOSSES_KEPT)), f.number("tokens_per_s"),
            f.whole("replicas"), f.whole("bytes_sent"), f.whole("samples"),
            f.text("plan_id", 64), f.flag("pinned"), _model(f),
            f.text("checkpoint"), f.text("checkpoint_dir"),
            f.holders("checkpoint_copies", MAX_SHARDS), f.whole("seq_len"),
            f.whole("rejoins"), f.whole("paused_times"),
            tuple(RoundEntry.from_doc(r) for r in f.items("rounds", ROUNDS_KEPT)),
            f.counts("replica_steps", MAX_REPLICAS), tuple(f.texts("moves", MAX_MOVES)),
            tuple(tuple(StageRow.from_doc(s) for s in _list(f, replica, MAX_STAGES))
                  for replica in f.items("stages", MAX_REPLICAS)))


def _fields(doc: Mapping[str, Any]) -> DocFields:
    return DocFields(doc, "bad-job-record", "a job record")


def _list(f: DocFields, value: object, high: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > high:
        raise f.bad("stages")
    return value


def _model(f: DocFields) -> ModelSpec:
    """The record's model: a name, or the config a model starts from scratch with."""
    name = f.doc.get("model")
    if name is None or isinstance(name, str) and len(name) <= TEXT:
        return ModelSpec(name=name)
    config = f.optional_map("model")
    scratch = config.doc.get("config") if config is not None else None
    if not isinstance(scratch, dict) or not all(isinstance(k, str) for k in scratch):
        raise f.bad("model")
    return ModelSpec(init_config=tuple(sorted(scratch.items())))


class Running(Protocol):
    """The driver of a running job, as the job's record and its placer see it."""

    @property
    def synced(self) -> bool: ...

    @property
    def replicas(self) -> list[Replica]: ...

    @property
    def keepers(self) -> list[StageKeeper]: ...


@dataclass
class Job:
    """The leader's record of one job."""

    job_id: str
    config: JobConfig
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
    # where this leader keeps the job's checkpoints: the submitter's own checkpoint.dir
    # when its user is local to this disk, else set from this leader's state directory
    # (``Training.checkpoint_dir``); never taken from a copy
    checkpoint_dir: str = ""
    copies: dict[str, list[str]] = field(default_factory=dict)  # shard -> fellows holding it
    placement: Placement = ()
    rejoins: int = 0
    paused_times: int = 0  # a lone replica lost a fellow and the job waited to resume
    # the newest placement generation given any of its replicas: one counter for the job,
    # so a late release of an older placement never drops a newer one (``next_generation``)
    generation: int = 0
    rounds: list[RoundEntry] = field(default_factory=list)
    replica_steps: dict[str, int] = field(default_factory=dict)  # local steps per replica
    maximize: str | None = None
    exclude_cards: list[str] = field(default_factory=list)  # cards the user left out
    moves: list[str] = field(default_factory=list)  # one line per leader that took it over
    scope: trio.CancelScope | None = None
    driver: Running | None = None  # while it runs
    cancel_asked: bool = False
    term: int = 0  # the term this agent drives it in
    handed: str = ""  # why this agent stopped driving it: it no longer leads

    def next_generation(self) -> int:
        """The generation for a new placement of any of the job's replicas."""
        self.generation += 1
        return self.generation

    def report(self) -> JobReport:
        """Its record, as ``jobs`` lists it."""
        return JobReport(
            self.job_id, self.state, self.reason, self.step, self.config.steps, self.loss,
            tuple(self.losses[-LOSSES_KEPT:]), self.tokens_per_s, self.replicas,
            self.bytes_sent, self.samples, self.plan_id, self.pinned, self.config.model,
            self.checkpoint, self.checkpoint_dir, self.copies, self.config.seq_len,
            self.rejoins, self.paused_times, tuple(self.rounds[-ROUNDS_KEPT:]),
            self.replica_steps, tuple(self.moves),
            tuple(tuple(StageRow(s.stage, s.fellow, s.layers, s.card) for s in r.stages)
                  for r in self.placement))


__all__ = ["LOSSES_KEPT", "ROUNDS_KEPT", "STATES", "TERMINAL", "Job", "JobReport", "Running",
           "StageRow", "job_config"]
