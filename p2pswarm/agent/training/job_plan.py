"""A leader's job plan, read once into a value.

The job plan is a document (``jobs.job_plan``, ``jobs.fleet_job_plan``): it is what the
leader shows, pins and sends, so it stays one. What the leader acts on (whether it fits
and why not, its ``plan_id``, the cards it uses, each replica's stages and its own batch
under a fleet plan) is read from it here, once, with the planner's ``from_doc`` for its
parts, so placing a job reads fields, not keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from p2pswarm.planner.plan import CardPlan, Limit, StagePlan


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


@dataclass(frozen=True, slots=True)
class PlannedReplica:
    """One replica of a job plan: its pipeline's stages and, under a fleet plan
    (``micro_batch: "auto"``), the batch the planner sized for it (None where the
    document gives none: the job's own)."""

    plan_id: str
    stages: tuple[StagePlan, ...]
    micro_batch: int | None
    micro_batches: int | None

    @staticmethod
    def from_doc(doc: Mapping[str, Any]) -> PlannedReplica:
        def whole(key: str) -> int | None:
            value = doc.get(key)
            return int(value) if isinstance(value, int) else None

        return PlannedReplica(str(doc.get("plan_id", "")),
                              tuple(StagePlan.from_doc(s) for s in doc.get("stages") or ()),
                              whole("micro_batch"), whole("micro_batches"))


@dataclass(frozen=True, slots=True)
class JobPlan:
    """What a leader acts on in a job plan document."""

    plan_id: str
    fits: bool
    limit: Limit | None  # why it does not fit further (a plan's layout limit)
    seq_len: int | None  # the sequence length planned for (``maximize: seq_len``)
    auto_batch: bool  # a fleet plan: each replica has its own batch
    cards: tuple[CardPlan, ...]  # the cards it uses
    replicas: tuple[PlannedReplica, ...]
    fleet_sentence: str = ""  # a fleet plan's own account of what fits, and why not more
    inner_steps: int | None = None  # a fleet plan's round, sized to the links

    @staticmethod
    def from_doc(doc: Mapping[str, Any]) -> JobPlan:
        """A job plan document, or a single plan that does not fit (no replicas)."""
        layout_limit = _mapping(doc.get("layout")).get("limit")
        seq_len = _mapping(doc.get("request")).get("seq_len")
        return JobPlan(
            plan_id=str(doc.get("plan_id", "")), fits=bool(doc.get("fits")),
            limit=Limit.from_doc(layout_limit) if isinstance(layout_limit, Mapping) else None,
            seq_len=None if seq_len is None else int(seq_len),
            auto_batch=_mapping(doc.get("job")).get("micro_batch") == "auto",
            cards=tuple(CardPlan.from_doc(c) for c in doc.get("cards") or ()
                        if _mapping(c).get("used")),
            replicas=tuple(PlannedReplica.from_doc(_mapping(r))
                           for r in doc.get("replicas") or ()),
            fleet_sentence=str(_mapping(doc.get("fleet")).get("sentence", "")),
            inner_steps=_round_steps(doc))

    @property
    def why_not(self) -> str:
        """The sentence saying why it does not fit."""
        return self.limit.sentence if self.limit is not None else ""


def _round_steps(doc: Mapping[str, Any]) -> int | None:
    steps = _mapping(_mapping(doc.get("fleet")).get("round")).get("inner_steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        return None
    return steps


__all__ = ["JobPlan", "PlannedReplica"]
