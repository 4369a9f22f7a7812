"""The leader's record of one job: its config, its placement, its progress, and the
driver running it (while one does). ``Job.record`` is what ``jobs`` lists."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import trio

from p2pswarm.agent.training.placed import Placement
from p2pswarm.agent.training.round_entry import RoundEntry
from p2pswarm.errors import ConfigError
from p2pswarm.training.job import JobConfig

if TYPE_CHECKING:
    from p2pswarm.agent.training.replica import Replica
    from p2pswarm.agent.training.runtime import StageKeeper

STATES = ("pending", "running", "finished", "failed", "cancelled")
TERMINAL = ("finished", "failed", "cancelled")
LOSSES_KEPT = 1000  # per-step losses a job record carries
ROUNDS_KEPT = 200  # sync rounds a job record carries


def job_config(config: Any) -> JobConfig:
    """``config`` (the contents of job.json) as a checked ``JobConfig``."""
    if not isinstance(config, dict):
        raise ConfigError("a job needs \"config\": the contents of job.json")
    return JobConfig.from_dict(config)


@dataclass(frozen=True, slots=True)
class JobHeadline:
    """What following a job reads from its record document (``Job.record``, as
    ``jobs`` lists it over the wire): which job, and whether it ended."""

    job_id: str
    state: str

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL

    @staticmethod
    def from_doc(record: Mapping[str, Any]) -> JobHeadline:
        job_id, state = record.get("job_id"), record.get("state")
        if not isinstance(job_id, str) or state not in STATES:
            raise ConfigError("a job record without its job_id or state")
        return JobHeadline(job_id, str(state))


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

    def record(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "state": self.state, "reason": self.reason,
                "step": self.step, "steps": self.config.steps,
                "loss": self.loss, "losses": self.losses[-LOSSES_KEPT:],
                "tokens_per_s": self.tokens_per_s, "replicas": self.replicas,
                "bytes_sent": self.bytes_sent, "samples": self.samples,
                "plan_id": self.plan_id, "pinned": self.pinned,
                "model": self.config.model.to_dict(), "checkpoint": self.checkpoint,
                "checkpoint_dir": self.checkpoint_dir,
                "checkpoint_copies": self.copies,
                "seq_len": self.config.seq_len, "rejoins": self.rejoins,
                "paused_times": self.paused_times,
                "rounds": [r.to_doc() for r in self.rounds[-ROUNDS_KEPT:]],
                "replica_steps": self.replica_steps,
                "moved": self.moves[-1] if self.moves else "", "moves": self.moves,
                "stages": [[{"stage": s.stage, "fellow": s.fellow, "layers": list(s.layers),
                             "card": s.card} for s in replica.stages]
                           for replica in self.placement]}


__all__ = ["LOSSES_KEPT", "ROUNDS_KEPT", "STATES", "TERMINAL", "Job", "JobHeadline", "Running",
           "job_config"]
