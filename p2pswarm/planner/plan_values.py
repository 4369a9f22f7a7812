"""The plan's values: per card its segments, the stages, the limit, the estimate, the
model planned, and the plan itself; each with its document (``to_dict``) and the way back
(``from_doc``), which checks every field and raises ``ConfigError`` on a bad one, since
a plan document may come from the network or a file.

``plan`` (the planning function) writes these values; everything else reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from p2pswarm.errors import ConfigError
from p2pswarm.planner import wording
from p2pswarm.planner.costs import PREFILL_CHUNK_TOKENS
from p2pswarm.planner.profile import (
    AUTO,
    AUTO_LADDER,
    INT4_GROUP,
    RUNTIME_KV,
    RUNTIME_WEIGHTS,
    ModelProfile,
)
from p2pswarm.planner.request import (
    GRANULARITY_TOKENS,
    PlanRequest,
    request_from_dict,
    serving_dtype,
)

PLANNER_VERSION = "1"

T = TypeVar("T")

SEGMENT_NAMES = ("other_programs", "weights", "embeddings_head_buffers", "kv_cache",
                 "activations", "optimizer", "lora", "workspace", "free", "does_not_fit")


# --- reading a plan document back (``from_doc``): every field checked, ConfigError if not


def _field(doc: Mapping[str, Any], key: str, kind: type[T], where: str) -> T:
    value = doc.get(key) if isinstance(doc, Mapping) else None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"a plan document's {where}: \"{key}\" is not a {kind.__name__}")
    return value


def _optional(doc: Mapping[str, Any], key: str, kind: type[T], where: str) -> T | None:
    return None if doc.get(key) is None else _field(doc, key, kind, where)


def _map(doc: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = doc.get(key)
    if not isinstance(value, Mapping):
        raise ConfigError(f"a plan document's {where}: \"{key}\" is not a map")
    return value


def _layers(doc: Mapping[str, Any], where: str) -> tuple[int, int]:
    pair = _field(doc, "layers", list, where)
    if len(pair) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair):
        raise ConfigError(f"a plan document's {where}: \"layers\" is not [start, end]")
    return (pair[0], pair[1])


def _maps(doc: Mapping[str, Any], key: str, where: str) -> list[Mapping[str, Any]]:
    items = _field(doc, key, list, where)
    if not all(isinstance(item, Mapping) for item in items):
        raise ConfigError(f"a plan document's {where}: \"{key}\" holds a non-map")
    return items


@dataclass(frozen=True, slots=True)
class Segments:
    other_programs: int = 0
    weights: int = 0
    embeddings_head_buffers: int = 0
    kv_cache: int = 0
    activations: int = 0
    optimizer: int = 0
    lora: int = 0
    workspace: int = 0
    free: int = 0
    does_not_fit: int = 0  # how far the plan runs past the card's end

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def claims_dict(self) -> dict[str, int]:
        return {k: v for k, v in self.to_dict().items()
                if k not in ("other_programs", "free", "does_not_fit")}

    @property
    def claim_bytes(self) -> int:
        """What a stage allocates: its weights, embeddings/head/buffers and KV cache."""
        return self.weights + self.embeddings_head_buffers + self.kv_cache

    @property
    def need_bytes(self) -> int:
        """What must be free for it: every claim (activations and workspace too)."""
        return sum(self.claims_dict().values())

    @staticmethod
    def from_doc(doc: Mapping[str, Any]) -> Segments:
        return Segments(**{f.name: _field(doc, f.name, int, "segments") for f in fields(Segments)})


@dataclass(frozen=True, slots=True)
class CardPlan:
    fellow_id: str
    fellow: str
    index: int
    kind: str
    name: str
    total_bytes: int
    free_bytes: int
    used: bool
    reason: str | None  # why a card is left out; None when used
    layers: tuple[int, int] | None  # [start, end)
    stage: int | None
    segments: Segments
    speed_measured: bool

    @property
    def label(self) -> str:
        return wording.fellows_card(self.fellow, self.kind, self.index, self.name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fellow_id": self.fellow_id, "fellow": self.fellow, "index": self.index,
            "kind": self.kind, "name": self.name, "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes, "used": self.used, "reason": self.reason,
            "layers": list(self.layers) if self.layers else None, "stage": self.stage,
            "segments": self.segments.to_dict(), "speed_measured": self.speed_measured,
        }

    @staticmethod
    def from_doc(doc: Mapping[str, Any]) -> CardPlan:
        w = "card"
        return CardPlan(
            _field(doc, "fellow_id", str, w), _field(doc, "fellow", str, w),
            _field(doc, "index", int, w), _field(doc, "kind", str, w),
            _field(doc, "name", str, w), _field(doc, "total_bytes", int, w),
            _field(doc, "free_bytes", int, w), _field(doc, "used", bool, w),
            _optional(doc, "reason", str, w),
            None if doc.get("layers") is None else _layers(doc, w),
            _optional(doc, "stage", int, w),
            Segments.from_doc(_map(doc, "segments", w)),
            _field(doc, "speed_measured", bool, w))


@dataclass(frozen=True, slots=True)
class StagePlan:
    index: int
    fellow_id: str
    fellow: str
    card_index: int
    kind: str
    name: str
    layers: tuple[int, int]
    time_s: float  # one decode step (serve) or one micro-batch (train) through it
    # this stage's weights dtype and why, in words ("int4: f16 needs 4.1 GB, ..."); ""
    # in a document from before stages had their own (the request's dtype then)
    weights_dtype: str = ""
    dtype_reason: str = ""

    @property
    def label(self) -> str:
        return wording.fellows_card(self.fellow, self.kind, self.card_index, self.name)

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.index, "fellow_id": self.fellow_id, "fellow": self.fellow,
                "index": self.card_index, "kind": self.kind, "name": self.name,
                "layers": list(self.layers), "time_s": self.time_s,
                "weights_dtype": self.weights_dtype, "dtype_reason": self.dtype_reason}

    @staticmethod
    def from_doc(doc: Mapping[str, Any]) -> StagePlan:
        """``to_dict`` back: the document names the stage ``stage`` and its card ``index``."""
        w = "stage"
        return StagePlan(
            index=_field(doc, "stage", int, w), fellow_id=_field(doc, "fellow_id", str, w),
            fellow=_field(doc, "fellow", str, w), card_index=_field(doc, "index", int, w),
            kind=_field(doc, "kind", str, w), name=_field(doc, "name", str, w),
            layers=_layers(doc, w), time_s=_field(doc, "time_s", float, w),
            weights_dtype=_optional(doc, "weights_dtype", str, w) or "",
            dtype_reason=_optional(doc, "dtype_reason", str, w) or "")


@dataclass(frozen=True, slots=True)
class Limit:
    sentence: str
    quantity: str  # "context" | "seq_len" | "sessions" (a recurrent model served)
    requested: int
    holds: int  # the most the usable cards hold, exact at 256 tokens (0: nothing fits)
    fits: bool
    limited_by: str  # "card" | "model" | "layers" | "nothing"
    card: dict[str, Any] | None  # the card that fills first, when limited_by == "card"

    def to_dict(self) -> dict[str, Any]:
        return {"sentence": self.sentence, "quantity": self.quantity,
                "requested": self.requested, "holds": self.holds, "fits": self.fits,
                "limited_by": self.limited_by, "card": self.card,
                "granularity_tokens": GRANULARITY_TOKENS}

    @staticmethod
    def from_doc(doc: Mapping[str, Any]) -> Limit:
        w = "limit"
        card = doc.get("card")
        if card is not None and not isinstance(card, dict):
            raise ConfigError("a plan document's limit: \"card\" is not a map")
        return Limit(sentence=_field(doc, "sentence", str, w),
                     quantity=_field(doc, "quantity", str, w),
                     requested=_field(doc, "requested", int, w),
                     holds=_field(doc, "holds", int, w), fits=_field(doc, "fits", bool, w),
                     limited_by=_field(doc, "limited_by", str, w),
                     card=dict(card) if card is not None else None)


@dataclass(frozen=True, slots=True)
class Estimate:
    kind: str
    stage_times_s: tuple[float, ...]
    hop_times_s: tuple[float, ...]
    bottleneck_stage: int | None
    time_per_token_s: float  # serve: one decode step; train: one micro-batch
    tokens_per_s: float
    prefill_tokens_per_s: float = 0.0
    time_per_step_s: float = 0.0
    tokens_per_step: int = 0
    total_time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "stages": [{"stage": i, "time_s": t} for i, t in enumerate(self.stage_times_s)],
            "hops": [{"from_stage": i, "to_stage": i + 1, "time_s": t}
                     for i, t in enumerate(self.hop_times_s)],
            "bottleneck_stage": self.bottleneck_stage, "tokens_per_s": self.tokens_per_s,
        }
        if self.kind == "serve":
            data.update(time_per_token_s=self.time_per_token_s,
                        prefill_tokens_per_s=self.prefill_tokens_per_s)
        else:
            data.update(time_per_microbatch_s=self.time_per_token_s,
                        time_per_step_s=self.time_per_step_s,
                        tokens_per_step=self.tokens_per_step, total_time_s=self.total_time_s)
        return data

    @staticmethod
    def from_doc(doc: Mapping[str, Any], kind: str) -> Estimate:
        """``to_dict`` back; ``kind`` (the plan's) says which times the document holds."""
        w = "estimate"
        stages = tuple(_field(s, "time_s", float, w) for s in _maps(doc, "stages", w))
        hops = tuple(_field(h, "time_s", float, w) for h in _maps(doc, "hops", w))
        bottleneck = _optional(doc, "bottleneck_stage", int, w)
        tokens_per_s = _field(doc, "tokens_per_s", float, w)
        if kind == "serve":
            return Estimate(kind, stages, hops, bottleneck,
                            _field(doc, "time_per_token_s", float, w), tokens_per_s,
                            prefill_tokens_per_s=_field(doc, "prefill_tokens_per_s", float, w))
        return Estimate(kind, stages, hops, bottleneck,
                        _field(doc, "time_per_microbatch_s", float, w), tokens_per_s,
                        time_per_step_s=_field(doc, "time_per_step_s", float, w),
                        tokens_per_step=_field(doc, "tokens_per_step", int, w),
                        total_time_s=_field(doc, "total_time_s", float, w))


@dataclass(frozen=True, slots=True)
class PlannedModel:
    """What a plan says of its model (the document's ``model``): the profile it was planned
    with, summed up."""

    name: str
    model_type: str
    layers: int
    params: int
    max_context: int
    recurrent: bool

    @staticmethod
    def of(profile: ModelProfile) -> PlannedModel:
        return PlannedModel(profile.name, profile.model_type, profile.n_layers,
                            profile.total_params(), profile.max_context, profile.recurrent)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "model_type": self.model_type, "layers": self.layers,
                "params": self.params, "max_context": self.max_context,
                "recurrent": self.recurrent}

    @staticmethod
    def from_doc(doc: Mapping[str, Any]) -> PlannedModel:
        w = "model"
        return PlannedModel(_field(doc, "name", str, w), _field(doc, "model_type", str, w),
                            _field(doc, "layers", int, w), _field(doc, "params", int, w),
                            _field(doc, "max_context", int, w),
                            _field(doc, "recurrent", bool, w))


@dataclass(frozen=True, slots=True)
class Plan:
    plan_id: str
    kind: str
    fits: bool
    model: PlannedModel
    request: PlanRequest  # resolved: every default filled in
    cards: tuple[CardPlan, ...]  # every card, pipeline order grouped by fellow
    stages: tuple[StagePlan, ...]
    limit: Limit
    summary: str
    estimate: Estimate
    notes: tuple[str, ...]
    # a plan with a LoRA adapter on top (``p2pswarm.agent.adapter.adapted_plan``): the
    # adapter's SHA-256 and the plan_id of the base plan; "" without one
    adapter: str = ""
    base_plan_id: str = ""

    @property
    def strip_text(self) -> str:
        return " | ".join(f"{s.layers[0]}-{s.layers[1] - 1} {s.label}" for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan_id": self.plan_id,
            "planner_version": PLANNER_VERSION,
            "kind": self.kind,
            "fits": self.fits,
            "model": self.model.to_dict(),
            "request": self.request.to_dict(),
            "layout": {
                "limit": self.limit.to_dict(),
                "strip": [{"stage": s.index, "layers": list(s.layers), "fellow": s.fellow,
                           "fellow_id": s.fellow_id, "card": wording.card_label(
                               s.kind, s.card_index, s.name),
                           "weights_dtype": self.stage_dtype(s.index)} for s in self.stages],
                "strip_text": self.strip_text,
            },
            "cards": [c.to_dict() for c in self.cards],
            "stages": [s.to_dict() for s in self.stages],
            "summary": self.summary,
            "estimate": self.estimate.to_dict(),
            "notes": list(self.notes),
            "runtime": self.runtime(),
            **({"base_plan_id": self.base_plan_id, "adapter": self.adapter}
               if self.adapter else {}),
        }

    @staticmethod
    def from_doc(doc: Mapping[str, Any]) -> Plan:
        """A serving or training plan's ``to_dict`` back (a fleet's is another document):
        every field checked, ConfigError if one is missing or of another type. What the
        document derives (``runtime``, the strip, the model's parameter sum) is not read
        back but derived again."""
        w = "top"
        if not isinstance(doc, Mapping):
            raise ConfigError("a plan document must be a map")
        kind = _field(doc, "kind", str, w)
        layout = _map(doc, "layout", w)
        adapter = _optional(doc, "adapter", str, w) or ""
        return Plan(
            plan_id=_field(doc, "plan_id", str, w), kind=kind, fits=_field(doc, "fits", bool, w),
            model=PlannedModel.from_doc(_map(doc, "model", w)),
            request=request_from_dict(_map(doc, "request", w)),
            cards=tuple(CardPlan.from_doc(c) for c in _maps(doc, "cards", w)),
            stages=tuple(StagePlan.from_doc(s) for s in _maps(doc, "stages", w)),
            limit=Limit.from_doc(_map(layout, "limit", "layout")),
            summary=_field(doc, "summary", str, w),
            estimate=Estimate.from_doc(_map(doc, "estimate", w), kind),
            notes=tuple(_field({"n": n}, "n", str, "notes") for n in _field(doc, "notes", list, w)),
            adapter=adapter,
            base_plan_id=_field(doc, "base_plan_id", str, w) if adapter else "")

    def stage_dtype(self, stage: int) -> str:
        """Stage ``stage``'s weights dtype: its own (``auto``), else the request's."""
        own = self.stages[stage].weights_dtype if 0 <= stage < len(self.stages) else ""
        if own in RUNTIME_WEIGHTS:
            return own
        return serving_dtype(self.request)

    @property
    def weights_text(self) -> str:
        """The weights dtype in words: ``f16``, or ``auto: int8 on 4 stages`` /
        ``auto: f16 on 2 stages, int4 on 1``."""
        if self.request.weights_dtype != AUTO:
            return serving_dtype(self.request)
        counts: dict[str, int] = {}
        for s in self.stages:
            counts[self.stage_dtype(s.index)] = counts.get(self.stage_dtype(s.index), 0) + 1
        parts = [f"{d} on {counts[d]} stage{'s' if counts[d] != 1 else ''}"
                 for d in AUTO_LADDER if d in counts]
        return "auto: " + ", ".join(parts) if parts else "auto"

    def runtime(self, stage: int | None = None) -> dict[str, Any]:
        """The runtime's names for what a stage of this plan allocates (the fields of
        ``p2pswarm.runtime.spec.StageSpec`` besides the layer range and the device): of
        stage ``stage``, or (None) of the plan's first stage; stages differ only in their
        weights dtype (``auto``)."""
        r = self.request
        dtype, quant = RUNTIME_WEIGHTS[self.stage_dtype(0 if stage is None else stage)]
        data: dict[str, Any] = {"dtype": dtype, "quant": quant, "quant_group_size": INT4_GROUP,
                                "prefill_chunk_tokens": PREFILL_CHUNK_TOKENS}
        if r.kind == "serve":
            data.update(kv_dtype=RUNTIME_KV[r.kv_dtype], max_context_tokens=r.context,
                        max_sessions=r.sequences)
        return data
