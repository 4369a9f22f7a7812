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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from p2pswarm.planner.cluster import CardView, ClusterView, Fellow

if TYPE_CHECKING:
    from p2pswarm.agent.serving.records import StageOrder

MARKEDLY = 0.75  # a move is worth proposing when a token takes at most this of its time now
FASTER_CARD = 1.2  # a stage moves only to a card at least this much faster than its own


@dataclass(frozen=True, slots=True)
class StageMove:
    stage: int
    fellow: Fellow
    card: CardView


@dataclass(frozen=True, slots=True)
class Proposal:
    now_s: float  # estimated seconds a token takes on the load as it runs
    after_s: float  # ... after the moves
    moves: tuple[StageMove, ...]

    def to_dict(self) -> dict[str, object]:
        return {"ms_per_token_now": round(self.now_s * 1e3, 3),
                "ms_per_token_after": round(self.after_s * 1e3, 3),
                "speedup": round(self.now_s / self.after_s, 2) if self.after_s else 0.0,
                "moves": [{"stage": m.stage, "to": m.fellow.name, "to_id": m.fellow.id,
                           "card": m.card.name} for m in self.moves]}


def _card(view: ClusterView, fellow_id: str, card_key: str) -> CardView | None:
    fellow = view.fellow(fellow_id)
    return next((c for c in fellow.cards if c.key == card_key), None) if fellow else None


def spare_cards(view: ClusterView, need_bytes: int,
                busy: set[str]) -> list[tuple[Fellow, CardView]]:
    """Cards that could take a stage needing ``need_bytes``: a connected fellow's, not
    training, not lost nor running a stage of the load (``busy``: fellow ids; a release
    order names a whole load, so one fellow holds one stage of it), with that much free; the fastest first (decoding reads every weight once a
    token: memory bandwidth), then by fellow id and card, so the choice is the same
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


def moved_order(order: StageOrder, fellow: Fellow, card: CardView) -> StageOrder:
    """The same stage (layers, runtime, claims) on another fellow's card."""
    return dataclasses.replace(order, fellow_id=fellow.id, card_kind=card.kind,
                               card_index=card.index, card_name=card.name,
                               progress_addr="", ticket="")


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
           "moved_order", "spare_cards"]
