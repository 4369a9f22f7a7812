"""A job's state as a document: what the leader copies to fellows, what a new leader reads.

A copy is a ``JobSnapshot``: the job's record (config, placement, progress, checkpoint)
and, while a driver runs it, where its rounds stand (``RoundsState``): the keepers' global
version and each replica's data position, optimizer steps (its place in the learning-rate
schedule), rounds done, placement generation and whether it was paused. ``to_doc`` is the
document a copy carries and a fellow keeps on disk; ``from_doc`` reads one back into the
value, checking every field's type and bound first: the document came over the network,
and a bad one is refused with one line (``RemoteProtocolError``), never half applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from p2pswarm.agent.training.doc_fields import TEXT, DocFields
from p2pswarm.agent.training.job_paths import JOB_ID
from p2pswarm.agent.training.job_record import (
    LOSSES_KEPT,
    ROUNDS_KEPT,
    STATES,
    Job,
    Running,
    job_config,
)
from p2pswarm.agent.training.placed import (
    MAX_REPLICAS,
    MAX_STAGES,
    StageDoc,
    placement_from_doc,
    placement_to_doc,
)
from p2pswarm.agent.training.round_entry import RoundDoc, RoundEntry
from p2pswarm.errors import ConfigError, RemoteProtocolError
from p2pswarm.wire.orders import pack_doc, unpack_doc

MOVES_KEPT = 20  # "moved" lines a job record carries


class ReplicaStateDoc(TypedDict):
    """A ``ReplicaState``'s document."""

    index: int
    paused: bool
    generation: int
    steps: int
    position: int
    rounds_done: int


class RoundsStateDoc(TypedDict):
    """A ``RoundsState``'s document."""

    version: int
    replicas: list[ReplicaStateDoc]


class JobSnapshotDoc(TypedDict):
    """A ``JobSnapshot``'s document: what a copy carries and a fellow keeps on disk."""

    leader: str
    job_id: str
    config: object  # ``JobConfig.to_dict``: the job.json, read back with ``job_config``
    plan_id: str
    pinned: bool
    stages: int | None
    resume: bool
    state: str
    reason: str
    step: int
    loss: float | None
    losses: list[float]
    tokens_per_s: float
    replicas: int
    bytes_sent: int
    samples: int
    checkpoint: str
    checkpoint_step: int
    copies: dict[str, list[str]]
    placement: list[list[StageDoc]]
    rejoins: int
    paused_times: int
    generation: int
    rounds: list[RoundDoc]
    replica_steps: dict[str, int]
    maximize: str | None
    exclude_cards: list[str]
    moves: list[str]
    rounds_state: RoundsStateDoc | None


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """Where one replica stood when the copy was made."""

    index: int
    paused: bool
    generation: int
    steps: int  # optimizer steps taken: its place in the learning-rate schedule
    position: int  # its data stream's position
    rounds_done: int

    def to_doc(self) -> ReplicaStateDoc:
        return {"index": self.index, "paused": self.paused, "generation": self.generation,
                "steps": self.steps, "position": self.position,
                "rounds_done": self.rounds_done}

    @classmethod
    def from_doc(cls, doc: object) -> ReplicaState:
        if not isinstance(doc, dict):
            raise _bad("rounds_state")
        f = _fields(doc)
        return cls(f.whole("index", MAX_REPLICAS - 1), f.flag("paused"),
                   f.whole("generation", 2**32 - 1), f.whole("steps"), f.whole("position"),
                   f.whole("rounds_done"))


@dataclass(frozen=True, slots=True)
class RoundsState:
    """Where a job's rounds stood: the keepers' version and every replica's place."""

    version: int
    replicas: tuple[ReplicaState, ...]

    def to_doc(self) -> RoundsStateDoc:
        return {"version": self.version, "replicas": [r.to_doc() for r in self.replicas]}

    @classmethod
    def from_doc(cls, copy: Mapping[str, Any]) -> RoundsState | None:
        """The ``rounds_state`` of a copy's document (None: no driver ran it)."""
        f = _fields(copy).optional_map("rounds_state")
        if f is None:
            return None
        replicas = tuple(ReplicaState.from_doc(r) for r in f.items("replicas", MAX_REPLICAS))
        if [r.index for r in replicas] != list(range(len(replicas))):
            raise _bad("rounds_state")
        return cls(f.whole("version"), replicas)


@dataclass(frozen=True, slots=True)
class JobSnapshot:
    """A job copy as a value: the leader that made it, the job's record and, while a
    driver ran it, where its rounds stood. ``to_doc`` is the document a copy carries
    (``JobKeep.state``); ``from_doc`` reads one back, checked."""

    leader: str
    job: Job
    rounds: RoundsState | None

    @classmethod
    def of(cls, job: Job, driver: Running | None, leader: str) -> JobSnapshot:
        """``job`` and, while ``driver`` runs it, where its rounds stand; ``leader`` names
        the leader that makes the copy."""
        rounds = None
        if driver is not None and driver.replicas and all(r.data is not None
                                                          for r in driver.replicas):
            rounds = RoundsState(
                driver.keepers[0].version if driver.keepers else 0,
                # a new leader puts every replica on the global state: its data goes on
                # from where its last delta left
                tuple(ReplicaState(r.index, bool(r.paused), r.generation, r.steps,
                                   r.kept_position, r.rounds_done)
                      for r in driver.replicas))
        return cls(leader, job, rounds)

    def to_doc(self) -> JobSnapshotDoc:
        job = self.job
        return {
            "leader": self.leader, "job_id": job.job_id, "config": job.config.to_dict(),
            "plan_id": job.plan_id,
            "pinned": job.pinned, "stages": job.stages, "resume": job.resume,
            "state": job.state, "reason": job.reason[:TEXT], "step": job.step,
            "loss": job.loss, "losses": job.losses[-LOSSES_KEPT:],
            "tokens_per_s": job.tokens_per_s, "replicas": job.replicas,
            "bytes_sent": job.bytes_sent, "samples": job.samples,
            "checkpoint": job.checkpoint[:TEXT], "checkpoint_step": job.checkpoint_step,
            "copies": job.copies, "placement": placement_to_doc(job.placement, job.config),
            "rejoins": job.rejoins, "paused_times": job.paused_times,
            "generation": job.generation,
            "rounds": [r.to_doc() for r in job.rounds[-ROUNDS_KEPT:]],
            "replica_steps": job.replica_steps, "maximize": job.maximize,
            "exclude_cards": job.exclude_cards, "moves": job.moves[-MOVES_KEPT:],
            "rounds_state": None if self.rounds is None else self.rounds.to_doc()}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> JobSnapshot:
        """A copy's document read back: every field's type and bound checked first, so a
        bad one is refused (``RemoteProtocolError``), never half applied."""
        job, rounds = _job(doc), RoundsState.from_doc(doc)
        if rounds is not None and len(rounds.replicas) != len(job.placement):
            raise _bad("rounds_state")
        return cls(str(doc.get("leader", ""))[:64], job, rounds)

    def packed(self) -> bytes:
        """The copy as it travels and is kept (``JobKeep.state``)."""
        return pack_doc(self.to_doc())

    @classmethod
    def read(cls, state: bytes) -> JobSnapshot:
        """A copy as it travels and is kept (``JobKeep.state``)."""
        return cls.from_doc(unpack_doc(state))


# --- reading a copy back ----------------------------------------------------------------------


@dataclass
class Handed:
    """A job taken over: where its rounds stood, the keepers' outer state, and what the
    driver is to do with them."""

    rounds: RoundsState | None
    outer: tuple[bytes, ...]
    from_leader: str
    lost: dict[int, str] = field(default_factory=dict)  # replica -> why it is not placed
    generation: int = 0  # the placement generation the replicas were ordered back with
    restore_rounds: bool = False


def _fields(doc: Mapping[str, Any]) -> DocFields:
    return DocFields(doc, "bad-job-copy", "a job copy")


def _bad(what: str) -> RemoteProtocolError:
    return _fields({}).bad(what)


def _job(doc: Mapping[str, Any]) -> Job:
    """A copy's job (its record, ready to be driven again), checked in the order the
    fields were always checked, so the first fault named stays the same."""
    f = _fields(doc)
    job_id = f.text("job_id", 64)
    if not JOB_ID.fullmatch(job_id):
        raise f.bad("job_id")
    config = f.optional_map("config")
    if config is None:
        raise f.bad("config")
    state = f.text("state", 16)
    if state not in STATES:
        raise f.bad("state")
    stages = f.optional_whole("stages", 65535)
    maximize = doc.get("maximize")
    if maximize not in (None, "seq_len"):
        raise f.bad("maximize")
    exclude = f.texts("exclude_cards", 1024, 96)
    moves = f.texts("moves", MOVES_KEPT, TEXT)
    replica_steps = f.counts("replica_steps", MAX_REPLICAS)
    rounds = [RoundEntry.from_doc(r) for r in f.items("rounds", ROUNDS_KEPT)]
    pinned, resume = f.flag("pinned"), f.flag("resume")
    try:
        cfg = job_config(config.doc)
    except ConfigError as exc:
        raise RemoteProtocolError("bad-job-copy", f"a job copy's config: {exc}") from None
    return Job(job_id, cfg, f.text("plan_id", 64), pinned=pinned,
               stages=stages, resume=resume, state=state, reason=f.text("reason"),
               step=f.whole("step"), loss=f.optional_real("loss"),
               losses=f.reals("losses", LOSSES_KEPT), tokens_per_s=f.real("tokens_per_s"),
               replicas=f.whole("replicas", MAX_REPLICAS), bytes_sent=f.whole("bytes_sent"),
               samples=f.whole("samples"), checkpoint=f.text("checkpoint"),
               checkpoint_step=f.whole("checkpoint_step"),
               copies=f.holders("copies", MAX_REPLICAS * MAX_STAGES + MAX_STAGES),
               placement=placement_from_doc(f.items("placement", MAX_REPLICAS), cfg),
               rejoins=f.whole("rejoins"), paused_times=f.whole("paused_times", 2**32 - 1),
               rounds=rounds,
               generation=f.whole("generation", 2**32 - 1) if "generation" in doc else 0,
               replica_steps=replica_steps, maximize=maximize, exclude_cards=exclude,
               moves=moves)


__all__ = ["MOVES_KEPT", "Handed", "JobSnapshot", "ReplicaState", "RoundsState"]
