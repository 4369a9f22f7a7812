"""The plan: a pure function of (model profile, cluster view, request).

``plan()`` decides which cards may be used and why the others may not, searches a
placement (see ``placement``), then writes down per card the segments that add up to
its memory, the stages, the sentence naming what limits the plan, an estimate, a
summary, and the ``plan_id``.

No I/O, no clock, no randomness. The view is sorted on construction and every list in
the plan is ordered by ids and positions, never by arrival, so the same inputs in any
order give a byte-identical plan. The ``plan_id`` is 16 hex characters of SHA-256 over
a canonical JSON encoding of the planner version, the profile, the resolved request
and the placement with each used card's byte claims; free memory itself is not part of
it, so a pinned plan survives memory noise and changes when the placement does.

Segments add up to the card's total: ``other_programs + claims + free == total`` when
the plan fits the card; when it runs past the card's end, ``free`` is 0 and the
segments add up to ``total + does_not_fit``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any

from p2pswarm.cards import CARD_KINDS
from p2pswarm.errors import ConfigError, PlacementError
from p2pswarm.planner import wording
from p2pswarm.planner.cluster import CardView, ClusterView, Fellow
from p2pswarm.planner.costs import PREFILL_CHUNK_TOKENS, Claims, CostModel
from p2pswarm.planner.pin import Pin
from p2pswarm.planner.placement import Placement, Search, Slot, most_tokens, pipeline_order
from p2pswarm.planner.plan_values import (
    PLANNER_VERSION,
    SEGMENT_NAMES,
    CardPlan,
    Estimate,
    Limit,
    Plan,
    PlannedModel,
    Segments,
    StagePlan,
)
from p2pswarm.planner.profile import AUTO, AUTO_LADDER, ModelProfile
from p2pswarm.planner.request import GRANULARITY_TOKENS, PlanRequest, resolve, serving_dtype

# a trained cut kept by default is worth a sentence when the fastest plan beats it by this
MUCH_FASTER = 1.5
# the default settles for a balanced placement this close to the fastest
ALIKE_TIME = 0.01

# --- who may be used ---------------------------------------------------------------------


def _resolve_excludes(view: ClusterView, exclude: tuple[str, ...]) -> set[tuple[str, str, int]]:
    """``fellow:index`` / ``fellow:cpu`` -> {(fellow id, kind, index)}; fellow by id or name."""
    out = set()
    for item in exclude:
        who, _, which = item.rpartition(":")
        fellow = view.fellow(who) or next((f for f in view.fellows if f.name == who), None)
        if fellow is None:
            raise ConfigError(f"--exclude {item}: no fellow {who!r} in the cluster; fellows: "
                              f"{', '.join(f.name for f in view.fellows) or 'none'}")
        if which == "cpu":  # the CPU card, whatever index its inventory gave it
            card = next((c for c in fellow.cards if c.kind == "cpu"), None)
        elif which.isdigit():
            card = next((c for c in fellow.cards if c.kind == "cuda" and c.index == int(which)),
                        None)
        else:
            raise ConfigError(f"--exclude {item}: give a GPU index or cpu, e.g. {who}:0")
        if card is None:
            have = ", ".join(f"{who}:{c.index if c.kind == 'cuda' else 'cpu'}"
                             for c in fellow.cards)
            raise ConfigError(f"--exclude {item}: {fellow.name} has no such card; it has "
                              f"{have or 'no cards'}")
        out.add((fellow.id, card.kind, card.index))
    return out


def _static_reason(fellow: Fellow, card: CardView, request: PlanRequest,
                   excluded: set[tuple[str, str, int]]) -> str | None:
    """Reasons that do not depend on the context: flags, the user, the floor."""
    if not fellow.connected:
        return wording.NOT_CONNECTED
    if fellow.training:
        return wording.TRAINING
    if (fellow.id, card.kind, card.index) in excluded:
        return wording.LEFT_OUT_BY_YOU
    floor = request.floor_bytes(card.kind)
    if card.free_bytes < floor:
        # name the program to blame when the card would clear the floor without it
        if card.held_by_others and card.free_bytes + card.held_by_others[0].held_bytes >= floor:
            holder = card.held_by_others[0]
            return wording.held_by(holder.held_bytes, holder.name)
        return wording.below_floor(card.free_bytes, floor)
    return None


# --- the plan ----------------------------------------------------------------------------


def _tokens_of(request: PlanRequest) -> int:
    tokens = request.context if request.kind == "serve" else request.seq_len
    return int(tokens or 0)


def _with_tokens(request: PlanRequest, tokens: int) -> PlanRequest:
    return (replace(request, context=tokens) if request.kind == "serve"
            else replace(request, seq_len=tokens))


def _exclude_keys(excluded: set[tuple[str, str, int]]) -> tuple[str, ...]:
    """Exclusions as ``fellow_id:index`` / ``fellow_id:cpu``: one written with a fellow's
    name and one written with its id are then the same request, and the same plan_id."""
    return tuple(sorted(f"{fid}:{'cpu' if kind == 'cpu' else index}"
                        for fid, kind, index in excluded))


def _usable(view: ClusterView, r: PlanRequest, excluded: set[tuple[str, str, int]]
            ) -> tuple[list[Slot], dict[tuple[str, str, int], str]]:
    """The cards a plan may use, and why each other card may not."""
    reasons: dict[tuple[str, str, int], str] = {}
    usable: list[Slot] = []
    for fellow in view.fellows:
        for card in fellow.cards:
            why = _static_reason(fellow, card, r, excluded)
            if why is None:
                usable.append(Slot(fellow.id, card))
            else:
                reasons[(fellow.id, card.kind, card.index)] = why
    return usable, reasons


@dataclass(frozen=True, slots=True)
class _Setting:
    """What both ways of planning share: the model, the view, the resolved request, the
    usable slots in pipeline order and the reasons of the cards left out."""

    profile: ModelProfile
    view: ClusterView
    r: PlanRequest
    slots: tuple[Slot, ...]
    reasons: dict[tuple[str, str, int], str]
    excluded: frozenset[tuple[str, str, int]]
    dtypes: tuple[str, ...] | None = None  # each slot's weights dtype (auto); None: the request's

    def search_at(self, tokens: int) -> Search:
        pair_fellows = {x for (a, b), _ in self.view.links for x in (a, b)}
        return Search(CostModel(self.profile, _with_tokens(self.r, tokens), tokens),
                      self.slots, self.view.link, lambda f: f in pair_fellows, self.dtypes)

    @property
    def auto(self) -> bool:
        return self.r.weights_dtype == AUTO

    def with_levels(self, levels: list[int]) -> _Setting:
        return replace(self, dtypes=tuple(AUTO_LADDER[k] for k in levels))

    def most_tokens(self) -> int:
        stages = self.r.stages
        return most_tokens(lambda t: self.search_at(t).holding(stages) is not None,
                           self.profile.max_context, GRANULARITY_TOKENS)


MAX_PLAN_CARDS = 256


def _setting(profile: ModelProfile, view: ClusterView, request: PlanRequest,
             extra: tuple[Slot, ...] = ()) -> _Setting:
    r = resolve(request, profile)
    excluded = _resolve_excludes(view, r.exclude)
    r = replace(r, exclude=_exclude_keys(excluded))
    usable, reasons = _usable(view, r, excluded)
    if len(usable) > MAX_PLAN_CARDS:  # the searches grow with cards x layers x stages
        raise ConfigError(f"{len(usable):,} cards are usable; the planner searches at most "
                          f"{MAX_PLAN_CARDS:,} (a room of 32 machines with 8 GPUs each): "
                          "leave some out with --exclude or raise --floor")
    have = {(s.fellow_id, s.card.kind, s.card.index) for s in usable}
    usable += [s for s in extra if (s.fellow_id, s.card.kind, s.card.index) not in have]
    return _Setting(profile, view, r, pipeline_order(usable), reasons, frozenset(excluded))


def plan(profile: ModelProfile, view: ClusterView, request: PlanRequest) -> Plan:
    """Plan ``request`` for ``profile`` on ``view``. Raises ConfigError for a request that
    cannot apply (unknown card to exclude, too many stages) and PlacementError when a
    fixed stage count exceeds the usable cards; a placement that does not fit is a plan
    with ``fits`` False, not an error."""
    setting = _setting(profile, view, request)
    r, slots = setting.r, setting.slots
    if r.stages is not None and r.stages > len(slots):
        raise PlacementError(
            f"--stages {r.stages} needs {r.stages} usable cards but the cluster has "
            f"{len(slots)}: use --stages {max(1, len(slots))} or free more cards"
        )
    if setting.auto:
        setting = _auto_dtypes(setting)
    most = setting.most_tokens()
    if r.maximize in ("context", "seq_len") and most > 0:
        r = _with_tokens(r, most)
        setting = replace(setting, r=r)
    tokens = _tokens_of(r)
    search = setting.search_at(tokens)

    # The default and `--maximize speed` both take the fastest placement that fits; only
    # a model trained on a cut keeps that cut by default (its weights learnt that split).
    placement: Placement | None = None
    fastest = search.fastest(r.stages)
    faster_by = 1.0
    cut = profile.trained_cut
    if r.maximize is None and cut is not None and r.stages in (None, len(cut) + 1):
        on_cut = search.fastest(cut=cut)
        if on_cut is not None:
            placement = on_cut[0]
            if fastest is not None and fastest[1] > 0:
                faster_by = on_cut[1] / fastest[1]
    if placement is None and fastest is not None:
        placement = fastest[0] if r.maximize is not None else _settled(search, r, fastest)
    fits = placement is not None
    if placement is None:
        placement = _best_effort(search, r.stages)
    elif setting.auto:
        promoted = _promoted(setting, placement, tokens)
        if promoted != setting:
            setting = promoted
            search = setting.search_at(tokens)
            most = setting.most_tokens()
    return _written(setting, search, placement, fits, most, faster_by)


# --- auto: each stage's weights dtype -------------------------------------------------


def _levels(setting: _Setting) -> list[int]:
    dtypes = setting.dtypes or (AUTO_LADDER[0],) * len(setting.slots)
    return [AUTO_LADDER.index(d) for d in dtypes]


def _auto_dtypes(setting: _Setting) -> _Setting:
    """Each usable card's weights dtype under ``auto``: all start in the serving dtype;
    while nothing fits, the slowest card that the best-effort placement runs past its
    end takes the next dtype of the ladder (f16, int8, int4), one card at a time. Cards
    that hold their share keep theirs, and fast cards keep theirs longest: a Pi may go
    to int4 while a 3090 stays f16."""
    r = setting.r
    tokens = _tokens_of(r)
    levels = [0] * len(setting.slots)
    current = setting.with_levels(levels)
    top = len(AUTO_LADDER) - 1
    for _ in range(len(levels) * top):
        search = current.search_at(tokens)
        if search.holding(r.stages) is not None:
            break
        start = 0
        over: list[int] = []
        placement = _best_effort(search, r.stages)
        for pos, (i, n) in enumerate(placement):
            card = search.slots[i].card
            need = search.models[i].claims(card.kind, n, start == 0,
                                           pos == len(placement) - 1, start=start).total
            start += n
            if need > card.free_bytes and levels[i] < top:
                over.append(i)
        if not over:
            break
        slowest = min(over, key=lambda i: (search.slots[i].card.mem_bandwidth,
                                           search.slots[i].card.flops, i))
        levels[slowest] += 1
        current = current.with_levels(levels)
    return current


def _promoted(setting: _Setting, placement: Placement, tokens: int) -> _Setting:
    """Each stage of a placement that fits back in the first dtype of the ladder its
    card holds with the same layers (the search may have lowered it for a share the
    placement did not give it)."""
    levels = _levels(setting)
    for pos, (i, n) in enumerate(placement):
        for level in range(levels[i]):
            lowered = list(levels)
            lowered[i] = level
            trial = setting.with_levels(lowered)
            if trial.search_at(tokens).fits(placement):
                levels, setting = lowered, trial
                break
    return setting


def plan_pinned(profile: ModelProfile, view: ClusterView, request: PlanRequest,
                pin: Pin) -> Plan | None:
    """The pinned placement ``pin`` as it stands on ``view`` now, or None when it no
    longer holds: a card it uses is gone, left out by the request, or its fellow is not
    connected or training, or the card's free memory no longer covers its stage's claims.

    The floor is not asked again: memory that moved within the plan's own headroom (the
    ``free`` segment of each of its cards) keeps the plan. A maximised context is the one
    the pin was planned at. The result's ``plan_id`` equals the pinned plan's exactly when
    the model, the request and the placement are the ones it was made of: the caller
    compares them, and a pin shown for another request never passes."""
    fellows = {f.id: f for f in view.fellows}
    extra = []
    for s in pin.stages:
        fellow = fellows.get(s.fellow_id)
        card = None if fellow is None else next(
            (c for c in fellow.cards if (c.kind, c.index) == (s.kind, s.index)), None)
        if fellow is None or card is None or not fellow.connected or fellow.training:
            return None
        extra.append(Slot(fellow.id, card))
    setting = _setting(profile, view, request, tuple(extra))
    if setting.auto:  # each pinned stage in the dtype it was shown with
        by_card = {s.card: s.weights_dtype for s in pin.stages}
        dtypes = [by_card.get((s.fellow_id, s.card.kind, s.card.index)) or AUTO_LADDER[0]
                  for s in setting.slots]
        if any(d not in AUTO_LADDER for d in dtypes):
            return None
        setting = replace(setting, dtypes=tuple(dtypes))
    if setting.r.maximize in ("context", "seq_len"):
        if not 0 < pin.tokens <= profile.max_context:
            return None
        setting = replace(setting, r=_with_tokens(setting.r, pin.tokens))
    position = {(s.fellow_id, s.card.kind, s.card.index): k
                for k, s in enumerate(setting.slots)}
    placement, start = [], 0
    for s in pin.stages:
        key = s.card
        if key in setting.excluded or s.layers[0] != start or s.layers[1] <= start:
            return None
        placement.append((position[key], s.layers[1] - start))
        start = s.layers[1]
    if start != profile.n_layers or len({s.card for s in pin.stages}) != len(pin.stages):
        return None
    search = setting.search_at(_tokens_of(setting.r))
    if not search.fits(tuple(placement)):
        return None
    return _written(setting, search, tuple(placement), True, setting.most_tokens())


def _settled(search: Search, r: PlanRequest, fastest: tuple[Placement, float]) -> Placement:
    """The default placement: the fastest that fits, settled. Among placements within
    ``ALIKE_TIME`` of the fastest, the fewest roomiest cards with layers in proportion to
    room come first, then the fastest's own cards split that way: each card then keeps
    headroom alike, so free memory that wanders neither reorders identical cards nor
    breaks a shown plan, where an exact minimum would fill some card to its last layer."""
    best, least = fastest
    bound = least * (1 + ALIKE_TIME)
    for candidate in (search.fewest_cards(r.stages),
                      search.proportional(sorted(i for i, _ in best))):
        if candidate is not None and search.time_s(candidate) <= bound:
            return candidate
    return best


def _written(setting: _Setting, search: Search, placement: Placement, fits: bool,
             most: int, faster_by: float = 1.0) -> Plan:
    """The plan of ``placement``: cards with their segments, stages, limit, estimate,
    summary and ``plan_id``."""
    profile, view, r, slots = setting.profile, setting.view, setting.r, setting.slots
    tokens = _tokens_of(r)
    if profile.recurrent and r.kind == "serve":
        limit = _state_limit(setting, fits, tokens)
    else:
        limit = _limit(profile, r, setting.search_at, most, fits, tokens, slots,
                       {f.id: f.name for f in view.fellows})
    stage_plans, cards = _cards_and_stages(view, search, placement, setting.reasons, r)
    estimate = _estimate(search, placement, r)
    notes = tuple(f"the speed of {c.label} is an estimate (never benchmarked): run "
                  f"`p2pswarm bench` on {c.fellow}" for c in cards
                  if c.used and not c.speed_measured)
    summary = _summary(profile, r, fits, stage_plans, cards, limit, estimate, notes)
    if faster_by >= MUCH_FASTER:
        summary += (f" The model keeps the cut it was trained with; the fastest plan that "
                    f"fits (--maximize speed) would be {faster_by:.1f}x faster.")
    plan_id = _plan_id(profile, r, fits, cards, stage_plans)
    return Plan(plan_id=plan_id, kind=r.kind, fits=fits, model=PlannedModel.of(profile), request=r,
                cards=cards, stages=stage_plans, limit=limit, summary=summary,
                estimate=estimate, notes=notes)


def _best_effort(search: Search, stages: int | None) -> Placement:
    """For a plan that does not fit: the usable cards, layers in proportion to room,
    each card's overflow then shows as ``does_not_fit``."""
    n = len(search.slots)
    if n == 0:
        return ()
    chosen = sorted(search.by_room()[:min(stages or n, search.layers)])
    return search.proportional(chosen, caps=False) or ()


MAX_SESSIONS_SEARCHED = 1 << 20


def _state_limit(setting: _Setting, fits: bool, tokens: int) -> Limit:
    """The limit of a recurrent model served: its state per session does not grow with the
    context, so the context is unbounded and what the cards bound is the sessions."""
    profile, r = setting.profile, setting.r
    state = profile.n_layers * profile.state_bytes_per_sequence_layer(serving_dtype(r))

    def holds(sessions: int) -> bool:
        more = replace(setting, r=replace(r, sequences=sessions))
        return more.search_at(tokens).holding(r.stages) is not None

    most = 0
    if holds(1):  # double, then halve the gap: holding is monotone in the sessions
        low, high = 1, 2
        while high <= MAX_SESSIONS_SEARCHED and holds(high):
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if holds(mid) else (low, mid)
        most = low
    head = (f"Context unbounded: {profile.name} keeps a state of {wording.mb(state)} per "
            f"session, whatever its length (no KV cache)")
    asked = f"{r.sequences} session{'s' if r.sequences != 1 else ''}"
    tail = (f"the cards hold {most:,} sessions" if most else "the cards hold no session")
    if not fits:
        tail = f"{asked} do not fit; {tail}"
    return Limit(sentence=f"{head}; {tail}.", quantity="sessions", requested=r.sequences,
                 holds=most, fits=fits, limited_by="cards" if most else "nothing", card=None)


def _limit(profile: ModelProfile, r: PlanRequest, search_at: Any, most: int, fits: bool,
           tokens: int, slots: tuple[Slot, ...], names: dict[str, str]) -> Limit:
    n_usable, free_usable = len(slots), sum(s.card.free_bytes for s in slots)
    quantity = "context" if r.kind == "serve" else "seq_len"
    if r.kind == "serve":
        head = f"Context {wording.tokens(tokens)} tokens"
        if r.sequences > 1:
            head += f" for {r.sequences} sequences"
    else:
        head = (f"Sequence length {wording.tokens(tokens)} tokens, "
                f"micro-batch {r.micro_batch}")
    if not fits:
        head += " does not fit"
    if most == 0:
        if n_usable == 0:
            tail = "no card is usable: see each card's reason"
        else:
            dtype = AUTO_LADDER[-1] if r.weights_dtype == AUTO else serving_dtype(r)
            need = (profile.n_layers * profile.layer_weight_bytes(dtype)
                    + profile.embed_bytes(dtype))
            tail = (f"the cards hold none: the weights alone need {wording.gb(need)} "
                    f"({dtype}) and the "
                    f"{n_usable} usable card{'s' if n_usable != 1 else ''} have "
                    f"{wording.gb(free_usable)} free")
        return Limit(sentence=f"{head}; {tail}.", quantity=quantity, requested=tokens,
                     holds=0, fits=fits, limited_by="nothing", card=None)
    holds = f"the cards hold {wording.tokens(most)}"
    if most + GRANULARITY_TOKENS > profile.max_context:
        return Limit(sentence=f"{head}; {holds}, limited by the model's maximum context.",
                     quantity=quantity, requested=tokens, holds=most, fits=fits,
                     limited_by="model", card=None)
    search = search_at(most)
    held = search.holding(r.stages)
    assert held is not None  # `most` is where something holds
    if len(held) == profile.n_layers and len(search.slots) > profile.n_layers:
        return Limit(sentence=f"{head}; {holds}, limited by layers: each of the "
                              f"{profile.n_layers} layers already has a card of its own.",
                     quantity=quantity, requested=tokens, holds=most, fits=fits,
                     limited_by="layers", card=None)
    # the card that fills first as the context grows, with the layers it holds at `most`
    more = search_at(most + GRANULARITY_TOKENS).models
    best: tuple[float, int] | None = None
    chosen = held[0][0]
    for pos, (i, n) in enumerate(held):
        card = search.slots[i].card
        first, last = pos == 0, pos == len(held) - 1
        now = search.models[i].claims(card.kind, n, first, last).total
        growth = more[i].claims(card.kind, n, first, last).total - now
        room_tokens = ((card.free_bytes - now) / growth) if growth > 0 else float("inf")
        if best is None or (room_tokens, pos) < best:
            best, chosen = (room_tokens, pos), i
    slot = search.slots[chosen]
    fellow = names[slot.fellow_id]
    label = wording.fellows_card(fellow, slot.card.kind, slot.card.index, slot.card.name)
    return Limit(sentence=f"{head}; {holds}, limited by {label}.", quantity=quantity,
                 requested=tokens, holds=most, fits=fits, limited_by="card",
                 card={"fellow_id": slot.fellow_id, "fellow": fellow,
                       "index": slot.card.index, "kind": slot.card.kind,
                       "name": slot.card.name})


def _dtype_reason(search: Search, i: int, n: int, pos: int, start: int, last: bool,
                  r: PlanRequest) -> str:
    """Why stage ``pos`` (``n`` layers on slot ``i``) has its weights dtype, in words:
    ``int4: f16 needs 4.1 GB, int8 2.6 GB, this card has 2.2 GB free``."""
    model, card = search.models[i], search.slots[i].card
    dtype = model.weights_dtype
    if r.kind == "train":
        return f"{dtype}: a training plan keeps one weights dtype on every stage"
    if r.weights_dtype != AUTO:
        return f"{dtype}: asked for, on every stage"
    free = wording.gb(card.free_bytes)
    level = AUTO_LADDER.index(dtype)
    if level == 0:
        need = model.claims(card.kind, n, pos == 0, last, start=start).total
        return f"{dtype}: needs {wording.gb(need)}, this card has {free} free"
    needs = [wording.gb(model.with_dtype(d).claims(card.kind, n, pos == 0, last,
                                                   start=start).total)
             for d in AUTO_LADDER[:level]]
    higher = ", ".join(f"{d} {need}" if k else f"{d} needs {need}"
                       for k, (d, need) in enumerate(zip(AUTO_LADDER, needs)))
    return f"{dtype}: {higher}, this card has {free} free"


def _cards_and_stages(view: ClusterView, search: Search, placement: Placement,
                      reasons: dict[tuple[str, str, int], str],
                      r: PlanRequest) -> tuple[tuple[StagePlan, ...], tuple[CardPlan, ...]]:
    names = {f.id: f.name for f in view.fellows}
    slots = search.slots
    used: dict[tuple[str, str, int], tuple[int, int, int, Claims]] = {}
    stage_plans = []
    start = 0
    for pos, (i, n) in enumerate(placement):
        slot, model = slots[i], search.models[i]
        last = pos == len(placement) - 1
        claims = model.claims(slot.card.kind, n, pos == 0, last, start=start)
        used[(slot.fellow_id, slot.card.kind, slot.card.index)] = (pos, start, start + n, claims)
        stage_plans.append(StagePlan(
            index=pos, fellow_id=slot.fellow_id, fellow=names[slot.fellow_id],
            card_index=slot.card.index, kind=slot.card.kind, name=slot.card.name,
            layers=(start, start + n), time_s=model.stage_time_s(slot.card, n, last),
            weights_dtype=model.weights_dtype,
            dtype_reason=_dtype_reason(search, i, n, pos, start, last, r)))
        start += n
    slot_pos = {(s.fellow_id, s.card.kind, s.card.index): k for k, s in enumerate(slots)}
    # a card left out: the smallest stage in the most compact dtype it may take
    least = search.model.with_dtype(AUTO_LADDER[-1]) if r.weights_dtype == AUTO \
        else search.model
    need = {kind: least.stage_need_bytes(kind) for kind in CARD_KINDS}
    cards = []
    for fellow in view.fellows:
        for card in fellow.cards:
            key = (fellow.id, card.kind, card.index)
            other = card.total_bytes - card.free_bytes
            if key in used:
                pos, a, b, claims = used[key]
                claimed = claims.total
                segments = Segments(
                    other_programs=other, weights=claims.weights,
                    embeddings_head_buffers=claims.embeddings_head_buffers,
                    kv_cache=claims.kv_cache, activations=claims.activations,
                    optimizer=claims.optimizer, lora=claims.lora, workspace=claims.workspace,
                    free=max(0, card.free_bytes - claimed),
                    does_not_fit=max(0, claimed - card.free_bytes))
                cards.append(CardPlan(fellow.id, fellow.name, card.index, card.kind, card.name,
                                      card.total_bytes, card.free_bytes, True, None, (a, b),
                                      pos, segments, card.speed_measured))
                continue
            reason = reasons.get(key)
            if reason is None:
                reason = (wording.stage_needs(need[card.kind])
                          if card.free_bytes < need[card.kind] else wording.NOT_NEEDED)
            cards.append(CardPlan(fellow.id, fellow.name, card.index, card.kind, card.name,
                                  card.total_bytes, card.free_bytes, False, reason, None, None,
                                  Segments(other_programs=other, free=card.free_bytes),
                                  card.speed_measured))
    # pipeline order grouped by fellow: fellows by their first stage, then by their place
    # in the pipeline order, then by id; in a fellow, used cards by stage, then the rest
    first_stage: dict[str, int] = {}
    first_slot: dict[str, int] = {}
    for c in cards:
        key = (c.fellow_id, c.kind, c.index)
        if c.stage is not None:
            first_stage[c.fellow_id] = min(first_stage.get(c.fellow_id, c.stage), c.stage)
        if key in slot_pos:
            first_slot[c.fellow_id] = min(first_slot.get(c.fellow_id, slot_pos[key]),
                                          slot_pos[key])
    big = 1 << 30
    cards.sort(key=lambda c: (first_stage.get(c.fellow_id, big), first_slot.get(c.fellow_id, big),
                              c.fellow_id, c.stage if c.stage is not None else big,
                              slot_pos.get((c.fellow_id, c.kind, c.index), big),
                              CARD_KINDS.index(c.kind), c.index))
    return tuple(stage_plans), tuple(cards)


def _estimate(search: Search, placement: Placement, r: PlanRequest) -> Estimate:
    model = search.model
    if not placement:
        return Estimate(kind=r.kind, stage_times_s=(), hop_times_s=(), bottleneck_stage=None,
                        time_per_token_s=0.0, tokens_per_s=0.0)
    k = len(placement)
    stage_times = tuple(search.models[i].stage_time_s(search.slots[i].card, n, pos == k - 1)
                        for pos, (i, n) in enumerate(placement))
    hops = tuple(search.hop_s(placement[j][0], placement[j + 1][0]) for j in range(k - 1))
    total = search.time_s(placement)
    bottleneck = max(range(k), key=lambda j: (stage_times[j], -j))
    if r.kind == "serve":
        prefill = sum(search.models[i].prefill_time_s(search.slots[i].card, n, pos == k - 1)
                      for pos, (i, n) in enumerate(placement))
        prefill += sum(model.hop_time_s(search.link(search.slots[placement[j][0]].fellow_id,
                                                    search.slots[placement[j + 1][0]].fellow_id),
                                        prefill=True) for j in range(k - 1))
        chunk_tokens = r.sequences * min(PREFILL_CHUNK_TOKENS, model.tokens)
        return Estimate(kind="serve", stage_times_s=stage_times, hop_times_s=hops,
                        bottleneck_stage=bottleneck, time_per_token_s=total,
                        tokens_per_s=r.sequences / total if total > 0 else 0.0,
                        prefill_tokens_per_s=chunk_tokens / prefill if prefill > 0 else 0.0)
    # a step pushes micro_batches through the pipeline; after the first, one finishes
    # every bottleneck-stage time (1F1B steady state)
    step = total + (r.micro_batches - 1) * stage_times[bottleneck]
    tokens_per_step = r.micro_batches * r.micro_batch * model.tokens
    return Estimate(kind="train", stage_times_s=stage_times, hop_times_s=hops,
                    bottleneck_stage=bottleneck, time_per_token_s=total,
                    tokens_per_s=tokens_per_step / step if step > 0 else 0.0,
                    time_per_step_s=step, tokens_per_step=tokens_per_step,
                    total_time_s=step * r.steps)


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.2f}"


def _params_text(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n:,}"


def _summary(profile: ModelProfile, r: PlanRequest, fits: bool,
             stages: tuple[StagePlan, ...], cards: tuple[CardPlan, ...], limit: Limit,
             estimate: Estimate, notes: tuple[str, ...]) -> str:
    dtypes = sorted({s.weights_dtype for s in stages}, key=AUTO_LADDER.index) \
        if r.weights_dtype == AUTO and stages else []
    chosen = len(dtypes) > 1 or dtypes[:1] not in ([], [AUTO_LADDER[0]])
    if not chosen:
        weights = f"{serving_dtype(r)} weights"
    elif len(dtypes) == 1:
        weights = f"{dtypes[0]} weights (auto)"
    else:
        weights = "weights " + ", ".join(
            f"{d} on {n} stage{'s' if n != 1 else ''}"
            for d in dtypes for n in [sum(s.weights_dtype == d for s in stages)])
    what = (f"{profile.name} ({_params_text(profile.total_params())} parameters, "
            f"{weights}")
    what += f", {r.kv_dtype} KV cache)" if r.kind == "serve" else ")"
    if r.kind == "train":
        how = "LoRA adapters" if r.method == "lora" else "all weights"
        what = f"Training {how} of {what}"
    fellows = sorted({s.fellow_id for s in stages})
    parts = [f"{what} {'runs' if fits else 'would run'} in {len(stages)} "
             f"stage{'s' if len(stages) != 1 else ''} on {len(fellows)} "
             f"fellow{'s' if len(fellows) != 1 else ''}: "
             + "; ".join(f"layers {s.layers[0]}-{s.layers[1] - 1} on {s.label}"
                         + (f" ({s.weights_dtype})" if chosen else "") for s in stages)
             + "."] if stages else [f"{what}: no usable card."]
    lowered = [s for s in stages if chosen and s.weights_dtype != AUTO_LADDER[0]]
    if lowered:
        parts.append("Weights: " + "; ".join(f"stage {s.index} {s.dtype_reason}"
                                             for s in lowered[:4])
                     + (f"; and {len(lowered) - 4} more stages" if len(lowered) > 4 else "")
                     + ".")
    parts.append(limit.sentence)
    if not fits:
        over = sorted((c for c in cards if c.segments.does_not_fit > 0),
                      key=lambda c: (-c.segments.does_not_fit, c.fellow_id, c.kind, c.index))
        if over:
            more = f"; and {len(over) - 3} more cards" if len(over) > 3 else ""
            parts.append("It does not fit: " + "; ".join(
                f"{c.label} would run {wording.gb(c.segments.does_not_fit)} past its end"
                for c in over[:3]) + more + ".")
    elif estimate.bottleneck_stage is not None:
        slow = stages[estimate.bottleneck_stage]
        if r.kind == "serve":
            parts.append(f"Estimated {estimate.tokens_per_s:.1f} tokens/s "
                         f"({wording.seconds(estimate.time_per_token_s)} per token), prefill "
                         f"{_rate(estimate.prefill_tokens_per_s)} tokens/s; slowest stage "
                         f"{slow.index} on {slow.label}.")
        else:
            parts.append(f"Estimated {wording.seconds(estimate.time_per_step_s)} per step "
                         f"({estimate.tokens_per_s:,.0f} tokens/s); slowest stage "
                         f"{slow.index} on {slow.label}.")
    left = [c for c in cards if not c.used]
    if left:
        counts: dict[str, int] = {}
        for c in left:
            kind = c.reason or ""
            kind = "held by other programs" if "(not p2pswarm)" in kind else \
                "below the floor" if "floor" in kind else \
                "too little free for a stage" if "a stage needs" in kind else \
                "not needed" if kind == wording.NOT_NEEDED else kind
            counts[kind] = counts.get(kind, 0) + 1
        parts.append(f"{len(left)} card{'s' if len(left) != 1 else ''} left out ("
                     + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + ").")
    if notes:
        parts.append("Some speeds are estimates: run `p2pswarm bench` on "
                     + ", ".join(sorted({c.fellow for c in cards
                                         if c.used and not c.speed_measured})) + ".")
    return " ".join(parts)


def _plan_id(profile: ModelProfile, r: PlanRequest, fits: bool, cards: tuple[CardPlan, ...],
             stages: tuple[StagePlan, ...]) -> str:
    by_key = {(c.fellow_id, c.kind, c.index): c for c in cards}
    placement = []
    for s in stages:
        c = by_key[(s.fellow_id, s.kind, s.card_index)]
        stage: dict[str, Any] = {"fellow_id": s.fellow_id, "kind": s.kind,
                                 "index": s.card_index, "layers": list(s.layers),
                                 "claims": c.segments.claims_dict()}
        if r.weights_dtype == AUTO:  # the choice itself, not only the bytes it led to
            stage["weights_dtype"] = s.weights_dtype
        placement.append(stage)
    canonical = {"planner": PLANNER_VERSION, "profile": profile.to_dict(),
                 "request": r.to_dict(), "fits": fits, "placement": placement}
    encoded = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(encoded.encode()).hexdigest()[:16]


__all__ = [
    "PLANNER_VERSION",
    "SEGMENT_NAMES",
    "CardPlan",
    "Estimate",
    "Limit",
    "Plan",
    "Segments",
    "StagePlan",
    "plan",
    "plan_pinned",
]
