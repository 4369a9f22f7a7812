"""Where a job's replicas were placed, as values: each replica's stages with their
fellows and cards, and the batch shape it trains with.

The batch shape is resolved once, here, when a replica is placed: the one its plan sized
for it (a fleet plan, ``micro_batch: "auto"``), else the job's. Past this point nothing
says "auto" or 0 for "the job's".

Documents (a job copy's ``placement``) are read and written only by ``to_doc`` and
``from_doc``: a list per replica of its stages, each stage carrying its replica's batch
keys only where they differ from the job's (as copies always did).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from p2pswarm.errors import RemoteProtocolError
from p2pswarm.training.job import JobConfig

MAX_REPLICAS = 256
MAX_STAGES = 1024
MAX_INT = 2**63 - 1
MAX_BATCH = 2**20
MAX_NAME = 256  # the longest fellow id, name, address or card label a copy may carry
BATCH_KEYS = ("micro_batch", "micro_batches")  # a replica's own shape, on its stages


StageDoc = dict[str, int | str | list[int]]  # one stage in a copy's placement


def _bad() -> RemoteProtocolError:
    return RemoteProtocolError("bad-job-copy", "a job copy's placement is malformed")


def _whole(value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad()
    return value


def _whole_at(doc: Mapping[str, object], key: str, *, low: int = 0, high: int) -> int:
    return _whole(doc.get(key), low, high)


def _name_at(doc: Mapping[str, object], key: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise _bad()
    return value


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What one optimizer step of a replica is: ``micro_batches`` micro-batches of
    ``micro_batch`` sequences each (both at least 1)."""

    micro_batch: int
    micro_batches: int

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.micro_batches < 1:
            raise ValueError(f"a batch shape is at least 1 x 1, got {self.micro_batch} x "
                             f"{self.micro_batches}")

    @property
    def sequences(self) -> int:
        """Sequences per optimizer step."""
        return self.micro_batch * self.micro_batches

    @classmethod
    def of_job(cls, job: JobConfig) -> BatchShape:
        """The job's own shape (``job.json``; with ``"auto"``, its fallback)."""
        return cls(job.micro_batch, job.micro_batches)

    def to_doc(self) -> dict[str, int]:
        return {"micro_batch": self.micro_batch, "micro_batches": self.micro_batches}


@dataclass(frozen=True, slots=True)
class StagePlacement:
    """One stage of a replica: its layers on one fellow's card, and what it claims there."""

    stage: int
    fellow_id: str
    fellow: str
    addr: str
    layers: tuple[int, int]  # [start, end)
    card_kind: str
    card_index: int
    card: str  # the card's label ("GTX 1050 Ti #0")
    need_bytes: int

    def at(self, fellow: str, addr: str) -> StagePlacement:
        """This stage with its fellow's name and address as they are now."""
        return replace(self, fellow=fellow, addr=addr)

    def to_doc(self) -> StageDoc:
        return {"stage": self.stage, "fellow_id": self.fellow_id, "fellow": self.fellow,
                "addr": self.addr, "layers": list(self.layers), "card_kind": self.card_kind,
                "card_index": self.card_index, "card": self.card,
                "need_bytes": self.need_bytes}

    @classmethod
    def from_doc(cls, doc: Any) -> StagePlacement:
        """A stage from a copy (RemoteProtocolError when malformed)."""
        if not isinstance(doc, dict):
            raise _bad()
        layers = doc.get("layers")
        if not isinstance(layers, list) or len(layers) != 2:
            raise _bad()
        whole, name = partial(_whole_at, doc, high=MAX_INT), partial(_name_at, doc)
        return cls(whole("stage"), name("fellow_id"), name("fellow"), name("addr"),
                   (_whole(layers[0], 0, MAX_INT), _whole(layers[1], 0, MAX_INT)),
                   name("card_kind"), whole("card_index"), name("card"), whole("need_bytes"))


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    """One replica: its stages in pipeline order and the batch shape it trains with."""

    stages: tuple[StagePlacement, ...]
    batch: BatchShape

    @property
    def addrs(self) -> list[str]:
        """Its fellows' addresses, sorted, once each."""
        return sorted({s.addr for s in self.stages})

    @property
    def cut(self) -> list[int]:
        """The first layer of every stage but the first: where it is cut."""
        return [s.layers[0] for s in self.stages[1:]]

    def with_stages(self, stages: tuple[StagePlacement, ...]) -> ReplicaPlacement:
        return replace(self, stages=stages)

    def to_doc(self, job_batch: BatchShape) -> list[StageDoc]:
        """Its stages as a copy carries them: the batch keys on each stage where the
        replica's shape is not the job's."""
        own = self.batch.to_doc() if self.batch != job_batch else {}
        return [{**s.to_doc(), **own} for s in self.stages]

    @classmethod
    def from_doc(cls, doc: Any, job_batch: BatchShape) -> ReplicaPlacement:
        """A replica from a copy: its stages, its shape where they carry one, else the
        job's (RemoteProtocolError when malformed)."""
        if not isinstance(doc, list) or len(doc) > MAX_STAGES:
            raise _bad()
        stages = tuple(StagePlacement.from_doc(s) for s in doc)
        for s in doc:  # every stage carries its replica's shape, or none does
            for key in BATCH_KEYS:
                if key in s:
                    _whole_at(s, key, low=1, high=MAX_BATCH)
        first = doc[0] if doc else {}
        own = {key: first[key] for key in BATCH_KEYS if key in first}
        batch = replace(job_batch, **own) if own else job_batch
        return cls(stages, batch)


Placement = tuple[ReplicaPlacement, ...]  # per replica


def placement_to_doc(placement: Placement, job: JobConfig) -> list[list[StageDoc]]:
    """A job's placement as a copy carries it."""
    job_batch = BatchShape.of_job(job)
    return [r.to_doc(job_batch) for r in placement]


def placement_from_doc(doc: Any, job: JobConfig) -> Placement:
    """A job's placement from a copy (RemoteProtocolError when malformed)."""
    if not isinstance(doc, list) or len(doc) > MAX_REPLICAS:
        raise _bad()
    job_batch = BatchShape.of_job(job)
    return tuple(ReplicaPlacement.from_doc(r, job_batch) for r in doc)


__all__ = ["BatchShape", "Placement", "ReplicaPlacement", "StagePlacement",
           "placement_from_doc", "placement_to_doc"]
