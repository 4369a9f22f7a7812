"""The leader's record of a load it leads: typed inside serving, a document at the edge.

A ``LeaderLoad`` is what ``Loads`` keeps in its table for each load this agent leads
(brought up here, adopted from its fellows, or re-cut into). Failover, copies and the
watch change it in place while they hold the load's lock (a stage moved, the load
waiting for a card, a faster placement seen, copies made ahead), so it is a small
mutable class rather than a frozen value; the table says which record is current
(``serial``), so a move that outlived an unload can tell, without comparing identities.

Its document (``to_doc``: the ``loads`` listing, a ``LoadDone`` reply) keeps the keys a
plain map had, in the order they were set: the optional ones go through the methods
below, which remember that order. A driver reads it back as a ``LoadRecord``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias, TypedDict

from p2pswarm.agent.serving.doc_fields import DocFields
from p2pswarm.agent.serving.moves import PlannedStageDoc, Proposal, planned_stage_doc
from p2pswarm.agent.serving.records import planned_runtime_doc, route_dict, runtime_doc
from p2pswarm.planner.plan_values import StagePlan
from p2pswarm.wire.loads import RouteHop, RuntimeBlock
from p2pswarm.wire.orders import pack_doc


class AdoptedDoc(TypedDict):
    at: float
    term: int
    leader: str


# "from" is a keyword: the functional form
StageMovedDoc = TypedDict("StageMovedDoc", {
    "at": float, "stage": int, "layers": list[int], "from": str, "from_id": str, "to": str,
    "to_id": str, "card": str, "why": str, "took_s": float})


class LoadRecutDoc(TypedDict):
    at: float
    recut: bool
    from_plan: str
    to_plan: str
    stages_before: int
    stages: list[PlannedStageDoc]
    ms_per_token_now: float
    ms_per_token_after: float
    why: str
    took_s: float


class CopyTakenDoc(TypedDict):
    bytes: int
    fetched_bytes: int
    took_s: float
    at: float


class _CopyAheadSaid(TypedDict):
    stage: int
    fellow: str
    fellow_id: str
    state: str  # "copying" | "held"


class CopyAheadDoc(_CopyAheadSaid, total=False):
    since: float  # copying: since when
    bytes: int  # held: what it took (``CopyTaken``)
    fetched_bytes: int
    took_s: float
    at: float


@dataclass(frozen=True, slots=True)
class Adopted:
    """When, in which term and by which leader a load was adopted from its fellows."""

    at: float  # wall-clock seconds
    term: int
    leader: str

    def to_doc(self) -> AdoptedDoc:
        return {"at": self.at, "term": self.term, "leader": self.leader}


@dataclass(frozen=True, slots=True)
class StageMoved:
    """One stage of a load moved to another fellow's card (lost, or to a faster one)."""

    at: float  # wall-clock seconds
    stage: int
    layers: tuple[int, int]
    from_name: str
    from_id: str
    to_name: str
    to_id: str
    card: str
    why: str
    took_s: float

    def to_doc(self) -> StageMovedDoc:
        return {"at": self.at, "stage": self.stage, "layers": list(self.layers),
                "from": self.from_name, "from_id": self.from_id, "to": self.to_name,
                "to_id": self.to_id, "card": self.card, "why": self.why,
                "took_s": self.took_s}


@dataclass(frozen=True, slots=True)
class LoadRecut:
    """A load re-cut live into another plan (``recut``)."""

    at: float  # wall-clock seconds
    from_plan: str
    to_plan: str
    stages_before: int
    stages: tuple[StagePlan, ...]  # the new plan's stages
    ms_per_token_now: float
    ms_per_token_after: float
    why: str
    took_s: float

    def to_doc(self) -> LoadRecutDoc:
        return {"at": self.at, "recut": True, "from_plan": self.from_plan,
                "to_plan": self.to_plan, "stages_before": self.stages_before,
                "stages": [planned_stage_doc(s) for s in self.stages],
                "ms_per_token_now": self.ms_per_token_now,
                "ms_per_token_after": self.ms_per_token_after, "why": self.why,
                "took_s": self.took_s}


Move: TypeAlias = "StageMoved | LoadRecut"


@dataclass(frozen=True, slots=True)
class CopyTaken:
    """What copying a stage's tensors ahead to a fellow took (``copies``)."""

    held_bytes: int
    fetched_bytes: int
    took_s: float
    at: float  # wall-clock seconds

    def to_doc(self) -> CopyTakenDoc:
        return {"bytes": self.held_bytes, "fetched_bytes": self.fetched_bytes,
                "took_s": self.took_s, "at": self.at}


@dataclass(frozen=True, slots=True)
class CopyAhead:
    """A copy of a stage's tensors ahead on a fellow outside its route: being made
    (``since``), or held (with what it took, when this leader ordered it)."""

    stage: int
    fellow: str
    fellow_id: str
    since: float | None = None  # wall-clock seconds it is copying since; None: held
    taken: CopyTaken | None = None

    def to_doc(self) -> CopyAheadDoc:
        if self.since is not None:
            return {"stage": self.stage, "fellow": self.fellow, "fellow_id": self.fellow_id,
                    "state": "copying", "since": self.since}
        taken = self.taken
        if taken is None:
            return {"stage": self.stage, "fellow": self.fellow, "fellow_id": self.fellow_id,
                    "state": "held"}
        return {"stage": self.stage, "fellow": self.fellow, "fellow_id": self.fellow_id,
                "state": "held", "bytes": taken.held_bytes,
                "fetched_bytes": taken.fetched_bytes, "took_s": taken.took_s,
                "at": taken.at}


@dataclass(eq=False, slots=True)
class LeaderLoad:
    """A load this agent leads. Change the optional fields through the methods."""

    plan_id: str
    model: dict[str, Any]  # the model's public identity (``public_model``)
    runtime: RuntimeBlock  # what every stage of it allocates
    stages: tuple[RouteHop, ...]  # the route, in pipeline order
    serial: int = 0  # which record of the plan the leader's table holds (``Loads.lead``)
    load_s: float | None = None  # how long its bring-up took (None: not brought up here)
    adapter: dict[str, Any] | None = None  # ``public_adapter``; None: no adapter
    adopted: Adopted | None = None  # None: brought up by this agent
    moves: tuple[Move, ...] = ()  # the last moves of its stages, the oldest first
    waiting: str = ""  # why a lost stage waits for a card ("": it does not)
    faster: Proposal | None = None  # the markedly faster placement seen (``moves``)
    copies: tuple[CopyAhead, ...] = ()  # its stages' copies ahead (``copies``)
    recut_from: tuple[str, ...] = ()  # the plan_ids it went by before live re-cuts
    _order: list[str] = field(default_factory=list)  # the optional keys, as they were set

    def _note(self, key: str, present: bool) -> None:
        """Keep ``key``'s place in the document as a plain map would: set last when it
        appears, dropped when it goes."""
        if not present:
            if key in self._order:
                self._order.remove(key)
        elif key not in self._order:
            self._order.append(key)

    def _present(self, key: str) -> bool:
        value = getattr(self, key)
        return value is not None if key in ("load_s", "adapter", "adopted", "faster") \
            else bool(value)

    # --- changes ---------------------------------------------------------------------

    def set_load_s(self, seconds: float) -> None:
        self.load_s = seconds
        self._note("load_s", True)

    def set_adapter(self, adapter: dict[str, Any]) -> None:
        self.adapter = adapter
        self._note("adapter", True)

    def set_adopted(self, adopted: Adopted) -> None:
        self.adopted = adopted
        self._note("adopted", True)

    def set_moves(self, moves: tuple[Move, ...]) -> None:
        self.moves = moves
        self._note("moves", bool(moves))

    def add_move(self, move: Move, kept: int) -> None:
        """Record a move, keeping the last ``kept``."""
        self.set_moves((*self.moves, move)[-kept:])

    def set_waiting(self, why: str) -> None:
        """Why a lost stage waits for a card; "" when nothing waits."""
        self.waiting = why
        self._note("waiting", bool(why))

    def set_faster(self, faster: Proposal | None) -> None:
        self.faster = faster
        self._note("faster", faster is not None)

    def set_copies(self, copies: tuple[CopyAhead, ...]) -> None:
        self.copies = copies
        self._note("copies", bool(copies))

    def set_recut_from(self, plan_ids: tuple[str, ...]) -> None:
        self.recut_from = plan_ids
        self._note("recut_from", bool(plan_ids))

    # --- reading ---------------------------------------------------------------------

    @property
    def fellow_ids(self) -> tuple[str, ...]:
        return tuple(h.fellow_id for h in self.stages)

    @property
    def addrs(self) -> set[str]:
        return {h.addr for h in self.stages}

    # --- the edge --------------------------------------------------------------------

    def to_doc(self) -> dict[str, Any]:
        """The record as the ``loads`` listing and the leader's replies show it."""
        # a load brought up here shows its runtime as its plan listed it; one adopted,
        # as its fellows keep it
        runtime = runtime_doc(self.runtime) if self.adopted is not None \
            else planned_runtime_doc(self.runtime)
        doc: dict[str, Any] = {"plan_id": self.plan_id, "model": self.model,
                               "runtime": runtime,
                               "stages": [route_dict(h) for h in self.stages]}
        for key in self._order:
            if self._present(key):
                doc[key] = self._shown(key)
        return doc

    def _shown(self, key: str) -> Any:
        if key == "adopted":
            return self.adopted.to_doc() if self.adopted is not None else None
        if key == "faster":
            return self.faster.to_dict() if self.faster is not None else None
        if key == "moves":
            return [m.to_doc() for m in self.moves]
        if key == "copies":
            return [c.to_doc() for c in self.copies]
        value = getattr(self, key)
        return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True, slots=True)
class LoadAsked:
    """What a load was asked as: the plan request, the model's identity and the whole
    adapter (None: none). A live re-cut plans it again (``recut``); its keepers keep it
    (``to_doc``; read back, checked, by ``loads.asked_from_doc``). A load brought up by a
    re-cut names the bring-up it replaces, ``(plan_id, generation)``: a leader that
    adopts it knows that one gone even when the leader that re-cut it could not say so."""

    request: dict[str, Any]
    model: dict[str, Any]
    adapter: dict[str, Any] | None = None
    replaces: tuple[str, str] | None = None

    def replanned(self) -> LoadAsked:
        """As a load is planned again: its request less its stage count, so the plan is
        the fastest that fits (a model trained on a cut keeps that cut, as a plain
        ``plan`` does)."""
        return replace(self, request={**self.request, "stages": None})

    @property
    def adapter_named(self) -> Any:
        """The adapter the request names (its sha256; None: none), as the request says it."""
        return DocFields(self.request, "the load's request").value("adapter", None)

    def to_doc(self) -> bytes:
        """As the load's keepers keep it (the model travels with the stage orders)."""
        replaces = {} if self.replaces is None else {"replaces": list(self.replaces)}
        return pack_doc({"request": self.request, "adapter": self.adapter, **replaces})


__all__ = ["Adopted", "AdoptedDoc", "CopyAhead", "CopyAheadDoc", "CopyTakenDoc", "LoadRecutDoc",
           "StageMovedDoc", "CopyTaken", "LeaderLoad", "LoadAsked", "LoadRecut", "Move",
           "StageMoved"]
