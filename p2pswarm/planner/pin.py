"""A pinned placement: the stages a shown plan put where, to be checked again later.

``load --plan-id`` asks for exactly the plan that was shown. The leader plans again; when
free memory moved and the new plan comes out different, the shown placement itself is
re-evaluated on the current view (``plan.plan_pinned``): if every card it uses is still
there and still holds its stage's claims, the pin holds. ``pin_from_plan`` reads that
placement back from a plan's dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2pswarm.cards import CARD_KINDS

if TYPE_CHECKING:
    from p2pswarm.planner.plan_values import Plan

MAX_PINNED_STAGES = 4096  # more stages than any model has layers: a plan dict gone wrong


@dataclass(frozen=True, slots=True)
class PinnedStage:
    fellow_id: str
    kind: str
    index: int
    layers: tuple[int, int]  # [start, end)
    weights_dtype: str = ""  # the stage's own (``auto``); "" where the request's holds

    @property
    def card(self) -> tuple[str, str, int]:
        return (self.fellow_id, self.kind, self.index)


@dataclass(frozen=True, slots=True)
class Pin:
    """The stages of a shown plan in pipeline order, and the context (serving) or
    sequence length (training) it was planned at."""

    stages: tuple[PinnedStage, ...]
    tokens: int

    @staticmethod
    def of(plan: Plan) -> Pin | None:
        """The placement of ``plan`` (what ``pin_from_plan`` reads of its dict), or None
        when it has none."""
        r = plan.request
        tokens = r.context if r.kind == "serve" else r.seq_len
        if not plan.stages or tokens is None:
            return None
        return Pin(tuple(PinnedStage(s.fellow_id, s.kind, s.card_index, s.layers,
                                     s.weights_dtype) for s in plan.stages), tokens)


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def pin_from_plan(plan: Mapping[str, Any]) -> Pin | None:
    """The placement of a plan's dict (``Plan.to_dict()``), or None when it has none or
    is not shaped like one."""
    stages = plan.get("stages")
    request = plan.get("request")
    if not isinstance(stages, list) or not stages or len(stages) > MAX_PINNED_STAGES \
            or not isinstance(request, Mapping):
        return None
    tokens = _whole(request.get("context" if request.get("kind") == "serve" else "seq_len"))
    if tokens is None:
        return None
    out = []
    for s in stages:
        if not isinstance(s, Mapping):
            return None
        layers, index = s.get("layers"), _whole(s.get("index"))
        if not isinstance(s.get("fellow_id"), str) or s.get("kind") not in CARD_KINDS \
                or index is None or not isinstance(layers, list) or len(layers) != 2:
            return None
        start, end = _whole(layers[0]), _whole(layers[1])
        if start is None or end is None:
            return None
        dtype = s.get("weights_dtype", "")
        if not isinstance(dtype, str) or len(dtype) > 16:
            return None
        out.append(PinnedStage(s["fellow_id"], s["kind"], index, (start, end), dtype))
    return Pin(tuple(out), tokens)


__all__ = ["Pin", "PinnedStage", "pin_from_plan"]
