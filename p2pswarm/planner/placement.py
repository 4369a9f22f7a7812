"""Searching placements: which cards run which contiguous layer ranges.

The plan space. Usable cards stand in one canonical pipeline order (``pipeline_order``:
fellows from slowest to fastest, so the fastest fellow used runs the head; a fellow's
cards together). A placement picks some of them, keeps that order, and gives each
picked card a contiguous, non-empty range of layers; the ranges cover ``[0, L)``.

Searches over that space, all pure and deterministic:

- ``fewest_cards``: the default's first choice when it is within 1 % of the fastest (see
  ``plan._settled``). The fewest cards (largest room first) that hold the model, layers
  in proportion to each card's room, so every card fills alike. Free memory counts only
  where it matters: a room is counted up to what the whole model would claim
  (``useful_room``), and rooms are compared in bands (``settled_rooms``): rooms within
  an eighth of each other are alike, so free memory that wobbles decides neither the
  order nor the split; ties fall to the faster card, then to the pipeline order (for
  identical cards: fellow ids).
- ``fastest``: ``maximize speed``, and what the default measures itself against. The
  exact minimum of the cost model's time per token by dynamic programming over (card,
  layers placed so far): a stage's cost depends only on its card, its layer count and
  whether it is first or last, and a hop only on the two cards' fellows, so prefixes
  compose. O(cards x layers x capacity).
- ``most_tokens``: ``maximize context``/``seq_len``. Whether some placement fits is
  monotone in the context, and for a given context decided in O(cards) (or
  O(cards x stages) with a fixed stage count) from each card's layer capacity, so a
  binary search at a 256-token granularity finds the exact maximum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from p2pswarm.planner.cluster import CardView, Link
from p2pswarm.planner.costs import CostModel

INF = math.inf
# Rooms within 1/ROOM_BAND of the largest of their band count as equal: the free memory
# of an idle machine moves by hundreds of MB, and that must not reorder identical cards.
ROOM_BAND = 8

# (slot position in the pipeline order, layers) per stage, in order
Placement = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Slot:
    """A usable card at its place in the pipeline order."""

    fellow_id: str
    card: CardView


def pipeline_order(slots: Sequence[Slot]) -> tuple[Slot, ...]:
    """Fellows slowest first (the fastest fellow used ends the pipeline and runs the head),
    ties by fellow id; within a fellow, slower cards first, then kind and index."""
    def card_speed(c: CardView) -> tuple[float, float]:
        return (c.mem_bandwidth, c.flops)

    fastest: dict[str, tuple[float, float]] = {}
    for s in slots:
        speed = card_speed(s.card)
        if s.fellow_id not in fastest or speed > fastest[s.fellow_id]:
            fastest[s.fellow_id] = speed
    return tuple(sorted(slots, key=lambda s: (fastest[s.fellow_id], s.fellow_id,
                                              card_speed(s.card), s.card.sort_key)))


def split_in_proportion(total: int, weights: Sequence[int],
                        caps: Sequence[int]) -> list[int] | None:
    """``total`` layers split in proportion to ``weights``, each part in [1, cap].

    Largest-remainder rounding in exact integer arithmetic, then moves of single layers
    toward the proportional target until every part is within its cap.
    """
    k = len(weights)
    if k == 0 or k > total or sum(min(c, total) for c in caps) < total or min(caps) < 1:
        return None
    w = [max(0, x) for x in weights]
    wsum = sum(w)
    if wsum == 0:
        w, wsum = [1] * k, k
    # target_i = total * w_i / wsum; compare remainders as integers total*w_i - a_i*wsum
    parts = [min(caps[i], max(1, total * w[i] // wsum)) for i in range(k)]

    def surplus(i: int) -> int:  # > 0: part i is below its target
        return total * w[i] - parts[i] * wsum

    while sum(parts) < total:
        i = max((i for i in range(k) if parts[i] < caps[i]), key=lambda i: (surplus(i), -i))
        parts[i] += 1
    while sum(parts) > total:
        i = min((i for i in range(k) if parts[i] > 1), key=lambda i: (surplus(i), i))
        parts[i] -= 1
    return parts


def settled_rooms(rooms: Sequence[int]) -> list[int]:
    """Each room replaced by the largest room of its band, so that only material
    differences in free memory order cards or weigh their layers.

    Walking from the largest room down, a room starts a new band when it is more than
    ``1/ROOM_BAND`` below the first room of the current band; a negative room (not even
    the fixed buffers fit) counts as 0. Ties are then broken by position.
    """
    clamped = [max(0, r) for r in rooms]
    out = list(clamped)
    head: int | None = None
    for i in sorted(range(len(clamped)), key=lambda i: (-clamped[i], i)):
        if head is None or clamped[i] * ROOM_BAND < head * (ROOM_BAND - 1):
            head = clamped[i]
        out[i] = head
    return out


class Search:
    """Placements of one model at one context on a fixed list of usable slots."""

    def __init__(self, model: CostModel, slots: Sequence[Slot],
                 link: Callable[[str, str], Link], has_pair_links: Callable[[str], bool],
                 dtypes: Sequence[str] | None = None) -> None:
        self.model = model  # the request's: hops, and every slot without a dtype of its own
        self.slots = tuple(slots)
        self.layers = model.profile.n_layers
        self.link = link
        self.has_pair_links = has_pair_links
        # each slot's own weights dtype (``auto``): its stage's bytes and time follow it
        self.models = tuple(model.with_dtype(d) for d in dtypes) if dtypes is not None \
            else (model,) * len(self.slots)
        # capacity[i][(first, last)]: most layers slot i holds in that position
        self.capacity = [{(f, la): m.capacity(s.card, f, la)
                          for f in (False, True) for la in (False, True)}
                         for s, m in zip(self.slots, self.models)]

    def cap(self, i: int, first: bool, last: bool) -> int:
        return self.capacity[i][(first, last)]

    def fits(self, placement: Placement) -> bool:
        start = 0
        for pos, (i, n) in enumerate(placement):
            if n < 1 or n > self.cap(i, start == 0, pos == len(placement) - 1):
                return False
            start += n
        return start == self.layers

    def time_s(self, placement: Placement) -> float:
        """Time per token (serve) or per micro-batch (train) of a placement, summed left
        to right exactly as ``fastest`` sums it."""
        total, prev = 0.0, None
        for pos, (i, n) in enumerate(placement):
            if prev is not None:
                total = total + self.hop_s(prev, i)
            total = total + self.models[i].stage_time_s(self.slots[i].card, n,
                                                        pos == len(placement) - 1)
            prev = i
        return total

    def hop_s(self, a: int, b: int) -> float:
        return self.model.hop_time_s(self.link(self.slots[a].fellow_id, self.slots[b].fellow_id))

    # --- default: fewest cards, layers in proportion to room -----------------------------

    def room(self, i: int, first: bool, last: bool) -> int:
        card = self.slots[i].card
        return card.free_bytes - self.models[i].fixed_bytes(card.kind, first, last)

    def useful_room(self, i: int, first: bool, last: bool) -> int:
        """Room up to what the whole model's layers would claim: more free memory than
        that changes nothing, so it orders and weighs nothing either."""
        return min(self.room(i, first, last), self.layers * self.models[i].layer_bytes)

    def by_room(self) -> list[int]:
        """Slot positions, the materially roomiest first; among alike rooms the faster
        card, then pipeline order (for identical cards: fellow id)."""
        rooms = settled_rooms([self.useful_room(i, False, False)
                               for i in range(len(self.slots))])

        def key(i: int) -> tuple[int, float, float, int]:
            card = self.slots[i].card
            return (-rooms[i], -card.mem_bandwidth, -card.flops, i)

        return sorted(range(len(self.slots)), key=key)

    def fewest_cards(self, stages: int | None = None) -> Placement | None:
        order = self.by_room()
        counts = [stages] if stages else range(1, min(len(order), self.layers) + 1)
        for k in counts:
            if k > len(order):
                return None
            chosen = sorted(order[:k])
            placement = self.proportional(chosen)
            if placement is not None:
                return placement
        return None

    def proportional(self, chosen: Sequence[int], caps: bool = True) -> Placement | None:
        """Layers over ``chosen`` (pipeline order) in proportion to room. Without
        ``caps`` the split ignores what fits (the best effort of a plan that does not)."""
        k = len(chosen)
        positions = [(j == 0, j == k - 1) for j in range(k)]
        rooms = settled_rooms([self.useful_room(i, f, la)
                               for i, (f, la) in zip(chosen, positions)])
        limits = ([self.cap(i, f, la) for i, (f, la) in zip(chosen, positions)] if caps
                  else [self.layers] * k)
        parts = split_in_proportion(self.layers, rooms, limits)
        if parts is None:
            return None
        return tuple(zip(chosen, parts))

    # --- maximize speed: exact DP --------------------------------------------------------

    def fastest(self, stages: int | None = None,
                cut: tuple[int, ...] | None = None) -> tuple[Placement, float] | None:
        """The placement with the least ``time_s`` among those that fit, with exactly
        ``stages`` stages if given, or exactly the stage boundaries ``cut`` if given."""
        L, C = self.layers, len(self.slots)
        S = stages if stages else 1
        bounds = None if cut is None else sorted({0, *cut, L})
        next_bound = {} if bounds is None else dict(pairwise(bounds))
        # best[i][s][l]: least time with layers [0, l) placed in s+1 stages (or any number
        # when stages is None), the last stage on slot i; back[i][s][l]: (prev slot, start)
        best = [[[INF] * (L + 1) for _ in range(S)] for _ in range(C)]
        back: list[list[list[tuple[int, int] | None]]] = [
            [[None] * (L + 1) for _ in range(S)] for _ in range(C)]
        done: list[tuple[str, list[list[tuple[float, int]]]]] = []  # finished fellows
        global_min: list[list[tuple[float, int]]] = [[(INF, -1)] * (L + 1) for _ in range(S)]
        current: list[list[tuple[float, int]]] = [[(INF, -1)] * (L + 1) for _ in range(S)]
        current_fellow: str | None = None

        def fold() -> None:
            if current_fellow is None:
                return
            done.append((current_fellow, current))
            for s in range(S):
                g = global_min[s]
                for m in range(L + 1):
                    if current[s][m][0] < g[m][0]:
                        g[m] = current[s][m]

        for i in range(C):
            slot = self.slots[i]
            if slot.fellow_id != current_fellow:
                fold()
                current_fellow = slot.fellow_id
                current = [[(INF, -1)] * (L + 1) for _ in range(S)]
            local_hop = self.model.hop_time_s(self.link(slot.fellow_id, slot.fellow_id))
            pair_links = self.has_pair_links(slot.fellow_id)
            default_hop = (None if pair_links or not done else
                           self.model.hop_time_s(self.link(done[0][0], slot.fellow_id)))
            other_hops = ([self.model.hop_time_s(self.link(f, slot.fellow_id)) for f, _ in done]
                          if pair_links else [])
            caps = self.capacity[i]
            times = {False: [0.0] * (L + 1), True: [0.0] * (L + 1)}
            for last in (False, True):
                most = max(caps[(False, last)], caps[(True, last)])
                for n in range(1, most + 1):
                    times[last][n] = self.models[i].stage_time_s(slot.card, n, last)
            row = best[i]
            for s in range(S):
                prev_s = s - 1 if stages else 0
                for start in range(L):
                    if bounds is not None and start not in next_bound:
                        continue
                    if start == 0:
                        if stages and s != 0:
                            continue
                        entry, prev = 0.0, -1
                    else:
                        if stages and s == 0:
                            continue
                        entry, prev = current[prev_s][start]
                        entry = entry + local_hop
                        if pair_links:
                            for (_, agg), hop in zip(done, other_hops):
                                c, j = agg[prev_s][start]
                                if c + hop < entry:
                                    entry, prev = c + hop, j
                        elif default_hop is not None:
                            c, j = global_min[prev_s][start]
                            if c + default_hop < entry:
                                entry, prev = c + default_hop, j
                        if entry == INF:
                            continue
                    first = start == 0
                    costs, pointers, step = row[s], back[i][s], (prev, start)
                    if bounds is not None:
                        ends = [next_bound[start]]
                    else:  # every stage that ends before L, as far as the card holds
                        ends = []
                        most = min(caps[(first, False)], L - start - 1)
                        for end, took in zip(range(start + 1, start + most + 1),
                                             times[False][1:most + 1]):
                            cost = entry + took
                            if cost < costs[end]:
                                costs[end] = cost
                                pointers[end] = step
                        ends.append(L)  # and the stage that ends the model
                    for end in ends:
                        n, last = end - start, end == L
                        if (last and stages and s != S - 1) or n > caps[(first, last)]:
                            continue
                        cost = entry + times[last][n]
                        if cost < costs[end]:
                            costs[end] = cost
                            pointers[end] = step
            for s in range(S):
                cur = current[s]
                for m in range(1, L + 1):
                    if row[s][m] < cur[m][0]:
                        cur[m] = (row[s][m], i)
        end_s = S - 1
        winner, best_cost = -1, INF
        for i in range(C):
            if best[i][end_s][L] < best_cost:
                winner, best_cost = i, best[i][end_s][L]
        if winner < 0:
            return None
        stages_rev: list[tuple[int, int]] = []
        i, s, end = winner, end_s, L
        while i >= 0:
            pointer = back[i][s][end]
            assert pointer is not None
            prev, start = pointer
            stages_rev.append((i, end - start))
            i, end = prev, start
            s = s - 1 if stages else 0
        return tuple(reversed(stages_rev)), best_cost

    # --- maximize context: does anything fit? ---------------------------------------------

    def holding(self, stages: int | None = None) -> Placement | None:
        """Some placement that fits (the cards at capacity, trimmed in proportion), or
        None. Decides feasibility exactly in O(cards), or O(cards x stages)."""
        L, C = self.layers, len(self.slots)
        if stages == 1 or stages is None:
            singles = [i for i in range(C) if self.cap(i, True, True) >= L]
            if singles:
                return ((singles[0], L),)
            if stages == 1 or L == 1:
                return None
        # run[s] = (layers, chosen slots) of the best open pipeline with first stage and
        # s further middle stages so far; with stages None only s = 0 (count is free)
        width = (stages - 1) if stages else 1
        run: list[tuple[int, tuple[int, ...]] | None] = [None] * width
        best: tuple[int, tuple[int, ...]] | None = None
        for j in range(C):
            cap_last = self.cap(j, False, True)
            target = run[width - 1] if stages else run[0]
            if cap_last >= 1 and target is not None:
                total = target[0] + cap_last
                if best is None or total > best[0]:
                    best = (total, target[1] + (j,))
            cap_mid = self.cap(j, False, False)
            new = list(run)
            if cap_mid >= 1:
                if stages:
                    for s in range(1, width):
                        before = run[s - 1]
                        if before is not None:
                            cand = (before[0] + cap_mid, before[1] + (j,))
                            now = new[s]
                            if now is None or cand[0] > now[0]:
                                new[s] = cand
                elif run[0] is not None:
                    new[0] = (run[0][0] + cap_mid, run[0][1] + (j,))
            cap_first = self.cap(j, True, False)
            if cap_first >= 1 and (new[0] is None or cap_first > new[0][0]):
                new[0] = (cap_first, (j,))
            run = new
        if best is None or best[0] < L:
            return None
        chosen = list(best[1])
        if len(chosen) > L:  # more cards than layers: keep the middle cards that hold most
            middle = sorted(chosen[1:-1], key=lambda i: (-self.cap(i, False, False), i))
            chosen = [chosen[0], *sorted(middle[:L - 2]), chosen[-1]]
        k = len(chosen)
        caps = [self.cap(i, j == 0, j == k - 1) for j, i in enumerate(chosen)]
        parts = split_in_proportion(L, caps, caps)
        return None if parts is None else tuple(zip(chosen, parts))


def most_tokens(fits_at: Callable[[int], bool], max_tokens: int, step: int) -> int:
    """Largest multiple of ``step`` up to ``max_tokens`` at which ``fits_at`` holds
    (0 if not even ``step``), for a ``fits_at`` that is monotone."""
    lo, hi = 0, max_tokens // step  # fits at lo*step (lo=0 trivially); search (lo, hi]
    if hi == 0 or not fits_at(step):
        return 0
    lo = 1
    if fits_at(hi * step):
        return hi * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits_at(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step


__all__ = [
    "Placement",
    "Search",
    "Slot",
    "most_tokens",
    "pipeline_order",
    "split_in_proportion",
]
