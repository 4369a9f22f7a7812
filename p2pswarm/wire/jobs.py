"""Training jobs' calls to the leader and the leader's orders to fellows (tags 150-179),
and the local control API's training ops (tags 250-269).

A fellow asks the leader to plan a job (``JobPlanAsk``), submit one (``JobSubmit``), list
its jobs (``JobsAsk``), cancel one (``JobCancel``) or show one's config (``JobConfigAsk``).
The leader orders a fellow to take a stage of a job (``TrainPrepare``) and to let go of
stages (``TrainRelease``). Each carries ``term`` (stamped by the leadership layer; it
closes the fields a message was born with, and fields appended since follow it) and is
answered by its own reply type or ``CallFailed``.

So that a job outlives its leader, the leader hands a few fellows a copy of each job's
record and driver state after every sync round (``JobKeep`` and its ``JobOuterChunk``
frames, answered ``JobKept``); a new leader asks every fellow which copies it keeps
(``JobsKeptAsk`` -> ``JobsKept``) and fetches the newest whole (``JobCopyAsk`` ->
``JobKeep`` and its chunks).

A job's config (``job.json``), a plan and a job's record are nested documents that
``training.JobConfig``, the planner and the CLI read; they travel as ``Doc``.

The local control API's training ops (the CLI's, the HTTP API's: ``job_plan``,
``job_submit``, ``jobs``, ``job_cancel``, ``job_export``) are typed requests too (tags
250-254), made from a plain request map at the edge (``agent.training.control_ask``) or
decoded as sent (``control.requests.typed_op``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from p2pswarm.wire.codec import message, struct
from p2pswarm.wire.orders import Doc
from p2pswarm.wire.schema import U16, U32, U64, Items, Size

JobId = Annotated[str, Size(1, 64)]
MaybeJobId = Annotated[str, Size(0, 64)]  # "" when there is none
CardKey = Annotated[str, Size(1, 96)]  # "FELLOW:INDEX" or "FELLOW:cpu"
Maximize = Annotated[str, Size(0, 16)]  # "", "seq_len" or "speed"
PlanId = Annotated[str, Size(0, 64)]  # "" when not pinned
FellowId = Annotated[str, Size(1, 64)]
UpstreamId = Annotated[str, Size(0, 64)]  # a fellow id, or "" for none
CardKind = Annotated[str, Size(1, 16)]
Address = Annotated[str, Size(0, 128)]  # "" for the last stage
LocalPath = Annotated[str, Size(1, 4096)]  # a directory on the asking fellow's disk
MAX_CARDS = 1024
MAX_JOBS = 4096
MAX_STAGES = 1024
MAX_KEPT_JOBS = 64  # job copies one fellow keeps (and lists)
OUTER_KEEP_BYTES = 256 * 1024 * 1024  # the most outer state one copy carries (all stages)
OUTER_CHUNK_BYTES = 16 * 1024 * 1024  # outer state travels in frames of at most this


# --- calls to the leader -------------------------------------------------------------------


@message(150)
@dataclass(frozen=True, slots=True)
class JobPlanAsk:
    """Plan a job: one pipeline per replica on the leader's current view."""

    config: Doc  # job.json
    stages: U16 | None = None  # how many stages each pipeline takes (None: the planner's)
    maximize: Maximize = ""
    exclude_cards: Annotated[tuple[CardKey, ...], Items(MAX_CARDS)] = ()
    term: U64 = 0


@message(151)
@dataclass(frozen=True, slots=True)
class JobPlanShown:
    plan: Doc


@message(152)
@dataclass(frozen=True, slots=True)
class JobSubmit:
    """Place and run a job (or ``resume`` one from its latest checkpoint); pinned to
    ``plan_id`` when one is given."""

    config: Doc | None = None  # None: resume a job the leader knows, with its own config
    plan_id: PlanId = ""
    stages: U16 | None = None
    resume: MaybeJobId = ""
    maximize: Maximize = ""
    exclude_cards: Annotated[tuple[CardKey, ...], Items(MAX_CARDS)] = ()
    term: U64 = 0


@message(153)
@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job's record as the leader keeps it (state, progress, placement)."""

    record: Doc


@message(154)
@dataclass(frozen=True, slots=True)
class JobsAsk:
    term: U64 = 0


@message(155)
@dataclass(frozen=True, slots=True)
class JobList:
    records: Annotated[tuple[Doc, ...], Items(MAX_JOBS)]


@message(156)
@dataclass(frozen=True, slots=True)
class JobCancel:
    job_id: JobId
    term: U64 = 0


@message(157)
@dataclass(frozen=True, slots=True)
class JobConfigAsk:
    job_id: JobId
    term: U64 = 0


@message(158)
@dataclass(frozen=True, slots=True)
class JobConfigShown:
    config: Doc
    state: Annotated[str, Size(1, 16)]
    step: U64
    checkpoint_step: U64


# --- the leader's orders -------------------------------------------------------------------


@message(159)
@dataclass(frozen=True, slots=True)
class TrainPrepare:
    """Take stage ``stage`` (layers ``layer_start:layer_end``) of replica ``replica`` of a
    job on card ``card_kind:card_index``, which needs ``need_bytes`` free; ``next_addr``
    is the next stage's fellow; ``generation`` counts the replica's placements."""

    job_id: JobId
    replica: U16
    stage: U16
    n_stages: U16
    fellow_id: FellowId
    layer_start: U32
    layer_end: U32
    card_kind: CardKind
    card_index: U16
    need_bytes: U64
    next_addr: Address
    config: Doc
    generation: U32 = 0
    term: U64 = 0
    prev_fellow: UpstreamId | None = None  # who alone may feed this stage ("" for stage 0)


@message(160)
@dataclass(frozen=True, slots=True)
class TrainPrepared:
    """The stage is built and waits for the driver."""


@message(161)
@dataclass(frozen=True, slots=True)
class TrainRelease:
    """Let go of the job's stages (of one replica; of its placements up to
    ``generation``)."""

    job_id: JobId
    replica: U16 | None = None
    generation: U32 | None = None
    term: U64 = 0


@struct
@dataclass(frozen=True, slots=True)
class StageKey:
    replica: U16
    stage: U16


@message(162)
@dataclass(frozen=True, slots=True)
class TrainReleased:
    released: Annotated[tuple[StageKey, ...], Items(MAX_STAGES)]


# --- copies of a job's state on fellows (a new leader takes the job over) -------------------


@message(170)
@dataclass(frozen=True, slots=True)
class JobKeep:
    """The leader's copy of job ``job_id``: its record and driver state (``state``, a
    document ``agent.training.job_state`` reads) and, for a job of several replicas, the
    size of each stage keeper's outer state (``outer_bytes``; empty when it is not
    copied), which follows as ``JobOuterChunk`` frames on the same stream, ``outer_sha256``
    over all of it. ``seq`` orders one leader's copies of a job; a copy of a later term
    wins over any earlier."""

    job_id: JobId
    seq: U64
    state: Doc
    outer_bytes: Annotated[tuple[U64, ...], Items(MAX_STAGES)] = ()
    outer_sha256: Annotated[str, Size(0, 64)] = ""
    term: U64 = 0


@message(171)
@dataclass(frozen=True, slots=True)
class JobKept:
    job_id: JobId
    seq: U64


@message(172)
@dataclass(frozen=True, slots=True)
class JobsKeptAsk:
    """Which job copies do you keep? (A new leader asks every fellow.)"""

    term: U64 = 0


@struct
@dataclass(frozen=True, slots=True)
class KeptCopy:
    job_id: JobId
    term: U64
    seq: U64
    state: Annotated[str, Size(1, 16)]  # the job's state in that copy


@message(173)
@dataclass(frozen=True, slots=True)
class JobsKept:
    copies: Annotated[tuple[KeptCopy, ...], Items(MAX_KEPT_JOBS)]


@message(174)
@dataclass(frozen=True, slots=True)
class JobCopyAsk:
    """Send your copy of job ``job_id`` (answered with ``JobKeep``, whose ``term`` is the
    term of the leader that made the copy)."""

    job_id: JobId
    term: U64 = 0


@message(175)
@dataclass(frozen=True, slots=True)
class JobOuterChunk:
    """Bytes ``offset:offset + len(data)`` of a job copy's outer state (after ``JobKeep``)."""

    job_id: JobId
    seq: U64
    offset: U64
    data: Annotated[bytes, Size(1, OUTER_CHUNK_BYTES)]


# --- the local control API's training ops (tags 250-254) -------------------------------------


@message(250)
@dataclass(frozen=True, slots=True)
class JobPlanRequest:
    """``job_plan``: the leader's plan for ``config`` (job.json, its launch fields moved
    into the request's own fields)."""

    config: Doc
    stages: U16 | None = None
    maximize: Maximize = ""  # "", "seq_len" or "speed"
    exclude_cards: Annotated[tuple[CardKey, ...], Items(MAX_CARDS)] = ()


@message(251)
@dataclass(frozen=True, slots=True)
class JobSubmitRequest:
    """``job_submit``: run ``config`` (None: ``resume`` a job with its own config)."""

    config: Doc | None = None
    plan_id: PlanId = ""
    stages: U16 | None = None
    resume: MaybeJobId = ""
    maximize: Maximize = ""  # "" or "seq_len"
    exclude_cards: Annotated[tuple[CardKey, ...], Items(MAX_CARDS)] = ()


@message(252)
@dataclass(frozen=True, slots=True)
class JobsRequest:
    """``jobs``: the leader's job records."""


@message(253)
@dataclass(frozen=True, slots=True)
class JobCancelRequest:
    job_id: JobId


@message(254)
@dataclass(frozen=True, slots=True)
class JobExportRequest:
    """``job_export``: job ``job_id``'s latest checkpoint into directory ``out``."""

    job_id: JobId
    out: LocalPath


__all__ = ["OUTER_CHUNK_BYTES", "OUTER_KEEP_BYTES", "JobCancel", "JobCancelRequest",
           "JobConfigAsk", "JobConfigShown", "JobCopyAsk", "JobExportRequest", "JobKeep",
           "JobKept", "JobList", "JobOuterChunk", "JobPlanAsk", "JobPlanRequest",
           "JobPlanShown", "JobRecord", "JobSubmit", "JobSubmitRequest", "JobsAsk",
           "JobsKept", "JobsKeptAsk", "JobsRequest", "KeptCopy", "StageKey", "TrainPrepare",
           "TrainPrepared", "TrainRelease", "TrainReleased"]
