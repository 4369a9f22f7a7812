"""Live moves: a faster place for a running load's stages, found and taken live.

A load keeps the placement it came up on. When a fellow joins whose card is markedly
faster than the card a stage runs on (or such a card frees up), the leader's watch
(``failover``) finds it here and the load's record says so (``faster``: the estimate now
and after, and which stage would go where); ``p2pswarm load --move PLAN_ID`` asks the
leader (``LoadMove``) to take those moves through the failover machinery: the stage is
prepared and loaded on its new card, every stage learns the new route, and the old
fellow releases it; a session in flight loses that stage's stream and resumes on the new
route by replaying its tokens, so no session is dropped.

The estimate is the planner's view of decoding: each token reads every weight once, so a
stage costs about its bytes over its card's memory bandwidth, and a token the sum over
the stages. A move is proposed when it cuts that sum by at least ``MARKEDLY``. Pure: the
view and the orders in, the proposal out.

The faster placement may also have another cut (``recut_proposal``): when a fast card
joins a swarm of slow ones, the planner's fastest plan usually has fewer stages, the fast
card taking most layers. The leader plans the load's request again on its view (no fixed
stage count; ``recut``) and proposes that plan, with its
``plan_id``, when its token is markedly faster by the same estimate and faster than the
whole-stage moves. The view holds the running load's memory as taken, so the plan found
fits beside it: a move holds both placements at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from p2pswarm.planner.cluster import CardView, ClusterView, Fellow
from p2pswarm.planner.plan import Plan
from p2pswarm.planner.plan_values import StagePlan
from p2pswarm.planner.wording import gb

if TYPE_CHECKING:
    from p2pswarm.agent.serving.records import StageOrder

MARKEDLY = 0.75  # a move is worth proposing when a token takes at most this of its time now
FASTER_CARD = 1.2  # a stage moves only to a card at least this much faster than its own


@dataclass(frozen=True, slots=True)
class StageMove:
    stage: int
    fellow: Fellow
    card: CardView


class PlannedStageDoc(TypedDict):
    """A plan's stage as a proposal and a re-cut show it (``planned_stage_doc``)."""

    stage: int
    layers: list[int]
    fellow: str
    fellow_id: str
    card: str


class StageMoveDoc(TypedDict):
    stage: int
    to: str
    to_id: str
    card: str


class _ProposalSaid(TypedDict):
    """A proposal as the load's record shows it (``faster``)."""

    ms_per_token_now: float
    ms_per_token_after: float
    speedup: float
    moves: list[StageMoveDoc]


class ProposalDoc(_ProposalSaid, total=False):
    """... and a new cut's plan."""

    plan_id: str
    stages: list[PlannedStageDoc]
    plan_ms_per_token: float


@dataclass(frozen=True, slots=True)
class Proposal:
    now_s: float  # estimated seconds a token takes on the load as it runs
    after_s: float  # ... after the moves
    moves: tuple[StageMove, ...]
    plan: Plan | None = None  # a new cut: the planner's plan, taken whole

    def to_dict(self) -> ProposalDoc:
        now_ms, after_ms = round(self.now_s * 1e3, 3), round(self.after_s * 1e3, 3)
        speedup = round(self.now_s / self.after_s, 2) if self.after_s else 0.0
        moves: list[StageMoveDoc] = [{"stage": m.stage, "to": m.fellow.name,
                                      "to_id": m.fellow.id, "card": m.card.name}
                                     for m in self.moves]
        plan = self.plan
        if plan is None:
            return {"ms_per_token_now": now_ms, "ms_per_token_after": after_ms,
                    "speedup": speedup, "moves": moves}
        if not plan.estimate.time_per_token_s:
            return {"ms_per_token_now": now_ms, "ms_per_token_after": after_ms,
                    "speedup": speedup, "moves": moves, "plan_id": plan.plan_id,
                    "stages": plan_stages(plan)}
        return {"ms_per_token_now": now_ms, "ms_per_token_after": after_ms,
                "speedup": speedup, "moves": moves, "plan_id": plan.plan_id,
                "stages": plan_stages(plan),
                "plan_ms_per_token": round(plan.estimate.time_per_token_s * 1e3, 3)}


def planned_stage_doc(stage: StagePlan) -> PlannedStageDoc:
    """A plan's stage as a proposal and a move show it: layers, fellow, card."""
    return {"stage": stage.index, "layers": [stage.layers[0], stage.layers[1]],
            "fellow": stage.fellow, "fellow_id": stage.fellow_id, "card": stage.name}


def plan_stages(plan: Plan) -> list[PlannedStageDoc]:
    """A plan's stages as a proposal and a move show them."""
    return [planned_stage_doc(s) for s in plan.stages]


def _card(view: ClusterView, fellow_id: str, card_key: str) -> CardView | None:
    fellow = view.fellow(fellow_id)
    return next((c for c in fellow.cards if c.key == card_key), None) if fellow else None


def spare_cards(view: ClusterView, need_bytes: int,
                busy: set[str]) -> list[tuple[Fellow, CardView]]:
    """Cards that could take a stage needing ``need_bytes``: a connected fellow's, not
    training, not lost nor running a stage of the load (``busy``: fellow ids; a release
    order names a whole load, so one fellow holds one stage of it), with that much free;
    the fastest first (decoding reads every weight once a token: memory bandwidth), then
    by fellow id and card, so the choice is the same
    whatever order the swarm was heard in."""
    out = []
    for fellow in view.fellows:
        if not fellow.connected or fellow.training or fellow.id in busy:
            continue
        for card in fellow.cards:
            if card.free_bytes < need_bytes:
                continue
            out.append((fellow, card))
    out.sort(key=lambda fc: (-fc[1].mem_bandwidth, fc[0].id, fc[1].sort_key))
    return out


def no_spare_reason(view: ClusterView, need_bytes: int, busy: set[str]) -> str:
    """Why ``spare_cards`` found none, fellow by fellow as it ruled them out: the words a
    waiting load shows (``no connected fellow has one`` hid that each connected fellow
    already ran a stage of the load while its cards had room)."""
    connected = [f for f in view.fellows if f.connected]
    running = [f.name for f in connected if f.id in busy]
    training = [f.name for f in connected if f.id not in busy and f.training]
    small = [f"{f.name} ({gb(max((c.free_bytes for c in f.cards), default=0))} at most)"
             for f in connected if f.id not in busy and not f.training]
    gone = len(view.fellows) - len(connected)
    parts = []
    if running:
        parts.append(f"{', '.join(running)} already run{'s' if len(running) == 1 else ''} a "
                     "stage of this load (a fellow holds one stage of a load)")
    if training:
        parts.append(f"{', '.join(training)} train{'s' if len(training) == 1 else ''}")
    if small:
        parts.append(f"too little free on {', '.join(small)}")
    if gone:
        parts.append(f"{gone} fellow{'s are' if gone != 1 else ' is'} not connected")
    said = "; ".join(parts) if parts else "the leader's view holds no fellow"
    return (f"no card can take it: {said}. It moves when a fellow joins or comes back "
            "(restart a lost one), or a card frees that much")


def moved_order(order: StageOrder, fellow: Fellow, card: CardView) -> StageOrder:
    """The same stage (layers, runtime, claims) on another fellow's card."""
    return dataclasses.replace(order, fellow_id=fellow.id, card_kind=card.kind,
                               card_index=card.index, card_name=card.name,
                               progress_addr="", ticket="")


def load_cost_s(view: ClusterView, orders: list[StageOrder]) -> float | None:
    """The estimated seconds a token takes on the load as placed; None when a stage's
    card is not in the view."""
    total = 0.0
    for order in orders:
        card = _card(view, order.fellow_id, order.card_key)
        if card is None:
            return None
        total += order.claim_bytes / card.mem_bandwidth
    return total


def plan_cost_s(view: ClusterView, plan: Plan) -> float | None:
    """The same estimate for a plan's placement: each stage's claim (weights, embeddings,
    head and buffers, KV cache: what it reads a token) over its card's bandwidth."""
    cards = {(c.fellow_id, c.kind, c.index): c for c in plan.cards if c.used}
    total = 0.0
    for s in plan.stages:
        used = cards.get((s.fellow_id, s.kind, s.card_index))
        card = _card(view, s.fellow_id, f"{s.kind}:{s.card_index}")
        if used is None or card is None:
            return None
        total += used.segments.claim_bytes / card.mem_bandwidth
    return total


def recut_proposal(view: ClusterView, orders: list[StageOrder], plan: Plan | None,
                   stage_moves: Proposal | None) -> Proposal | None:
    """The planner's ``plan`` for the load's request, when it places the load otherwise
    (another cut, or other cards), fits, and makes a token markedly faster than now and
    faster than the whole-stage moves ``stage_moves``; else ``stage_moves``."""
    if plan is None or not plan.fits or not plan.stages:
        return stage_moves
    placed = [(o.fellow_id, o.card_key, tuple(o.layers)) for o in orders]
    planned = [(s.fellow_id, f"{s.kind}:{s.card_index}", tuple(s.layers))
               for s in plan.stages]
    if planned == placed:
        return stage_moves
    now_s, after_s = load_cost_s(view, orders), plan_cost_s(view, plan)
    if now_s is None or after_s is None or after_s > MARKEDLY * now_s:
        return stage_moves
    if stage_moves is not None and stage_moves.after_s <= after_s:
        return stage_moves
    return Proposal(now_s, after_s, (), plan)


def faster_placement(view: ClusterView, orders: list[StageOrder]) -> Proposal | None:
    """Moves of whole stages to faster free cards outside the load, slowest stage first,
    when they make a token markedly faster; None otherwise (or when a stage's card is
    not in the view: the load is not whole, failover's business first)."""
    costs: dict[int, float] = {}
    for order in orders:
        card = _card(view, order.fellow_id, order.card_key)
        if card is None:
            return None
        costs[order.stage] = order.claim_bytes / card.mem_bandwidth
    now_s = sum(costs.values())
    busy = {o.fellow_id for o in orders}
    moves = []
    for order in sorted(orders, key=lambda o: (-costs[o.stage], o.stage)):
        spare = spare_cards(view, order.need_bytes, busy)
        if not spare:
            continue
        fellow, card = spare[0]
        cost = order.claim_bytes / card.mem_bandwidth
        if cost * FASTER_CARD > costs[order.stage]:
            continue
        costs[order.stage] = cost
        busy.add(fellow.id)
        moves.append(StageMove(order.stage, fellow, card))
    after_s = sum(costs.values())
    if not moves or after_s > MARKEDLY * now_s:
        return None
    return Proposal(now_s, after_s, tuple(sorted(moves, key=lambda m: m.stage)))


__all__ = ["FASTER_CARD", "MARKEDLY", "Proposal", "StageMove", "faster_placement",
           "load_cost_s", "moved_order", "plan_cost_s", "plan_stages", "planned_stage_doc",
           "PlannedStageDoc", "ProposalDoc", "StageMoveDoc", "recut_proposal",
           "spare_cards"]
