"""The fleet training plan: DiLoCo replicas of different shapes over the whole cluster.

A training job need not be one pipeline. Replicas train apart and meet once a round
(``inner_steps`` local steps of the fastest, then their compressed pseudo-gradients
averaged, weighted by samples, by a sharded all-reduce: no fellow is a hub), so every
group of cards that holds the model can run one: a server alone, two desktops, five
Raspberry Pis.

How the plan is made (pure and deterministic, like ``plan``):

1. The usable cards (``plan``'s reasons for the others) stand in pipeline order.
2. Replicas are formed one after another, fastest first: the cost model's fastest
   pipeline on the cards still free (``Search.fastest`` at one sequence a micro-batch)
   names a replica's cards; its layers are then split to balance the stages' times
   (``balanced_split``), since a filled pipeline runs at its slowest stage.
3. ``micro_batch: auto`` (the default; a number still wins): each replica's
   micro-batch is the largest power of two up to
   ``MAX_AUTO_MICRO_BATCH`` that its cards' free memory holds, then scaled by speed: the
   fastest replica keeps its own, a replica half as fast gets half (rounded down to a
   power of two, never past what fits), so every replica's step takes about as long and
   each takes its full budget of steps per round; one whose step would still outlast a
   round (the others held to small batches by their memory) takes a smaller batch. Its
   pipeline is filled: at least as many micro-batches a step as it has stages. A fixed
   micro-batch is used as given.
4. The round: compute is ``inner_steps`` steps of the fastest replica; communication
   is the sharded all-reduce of every stage's delta and update, encoded with the job's
   codecs (``sync_cost.round_traffic``): each fellow sends and receives about twice its
   stage's compressed delta, whatever the number of replicas, on its own links and its
   access point's shared airtime. ``inner_steps: auto`` (the default; a number still
   wins) takes the fewest steps, at least ``MIN_AUTO_INNER_STEPS``, that make the
   round's communication at most ``COMM_SHARE`` of its compute on the given links.
   Replicas overlap sync with training, so the fleet's tokens/s is the replicas' sum,
   scaled down only when a round's communication outlasts its compute.
5. ``replicas: auto`` keeps the number of replicas (fastest first) that gives the most
   tokens/s by that estimate, less any whose one step outlasts the round (it would only
   ever send late), each left out with its reason. No fixed cap.

Every replica is also written as a single-pipeline ``Plan`` (its own ``plan_id``, on its
own request: its micro-batch, and the cards of the replicas before it left out), so a
pinned job re-checks each replica as a pinned load is re-checked.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from p2pswarm.errors import ConfigError
from p2pswarm.planner import wording
from p2pswarm.planner.cluster import ClusterView
from p2pswarm.planner.costs import CostModel
from p2pswarm.planner.fleet_request import FleetRequest, fleet_request_from_dict
from p2pswarm.planner.fleet_round import (
    COMM_SHARE,
    MIN_AUTO_INNER_STEPS,
    RoundEstimate,
    round_estimate,
    round_flows,
    synced_params,
)
from p2pswarm.planner.placement import Search, Slot
from p2pswarm.planner.plan import (
    PLANNER_VERSION,
    CardPlan,
    Plan,
    Segments,
    _exclude_keys,
    _resolve_excludes,
    _setting,
    _usable,
    _written,
    plan,
)
from p2pswarm.planner.profile import ModelProfile
from p2pswarm.planner.request import PlanRequest, resolve
from p2pswarm.planner.sync_cost import round_traffic

MAX_AUTO_MICRO_BATCH = 128  # the design's scale: server 128, desktop 64, laptop 32, Pi 8
DEFAULT_INNER_STEPS = 50  # the round auto batches are shaped for, before it is sized
# auto: micro-batches a step per stage; 1F1B then idles (k - 1) / (FILL k + k - 1) of a step
FILL = 8
EXTRA_STAGES = 2  # more cards a replica may take than its fastest pipeline uses
POOL = 16  # free cards, fastest first, a replica's pipeline is searched among

CardKey = tuple[str, str, int]  # (fellow id, kind, index)


@dataclass(frozen=True, slots=True)
class SampleMemory:
    """Why a replica holds the batch it holds: its tightest stage's memory."""

    fellow: str  # the stage whose card holds the fewest samples
    free_bytes: int
    fixed_bytes: int  # weights, gradients, optimizer state, buffers: any batch
    sample_bytes: int  # one more sequence a micro-batch (activations, logits)
    holds: int  # sequences a micro-batch its free memory holds

    def to_dict(self) -> dict[str, Any]:
        return {"fellow": self.fellow, "free_bytes": self.free_bytes,
                "fixed_bytes": self.fixed_bytes, "sample_bytes": self.sample_bytes,
                "holds": self.holds}


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    index: int
    plan: Plan  # this replica as a single pipeline, on its own request
    micro_batch: int
    micro_batches: int
    memory_micro_batch: int  # the largest power of two its cards hold
    step_s: float  # one optimizer step: the filled pipeline's time
    tokens_per_step: int
    sync_bytes: int  # per round: what its fellows send in the all-reduce
    memory: SampleMemory | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0

    @property
    def stages(self) -> int:
        return len(self.plan.stages)

    def to_dict(self) -> dict[str, Any]:
        return {"replica": self.index, "plan_id": self.plan.plan_id,
                "stages": [s.to_dict() for s in self.plan.stages],
                "strip_text": self.plan.strip_text, "micro_batch": self.micro_batch,
                "micro_batches": self.micro_batches,
                "memory_micro_batch": self.memory_micro_batch, "step_s": self.step_s,
                "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s,
                "sync_bytes_per_round": self.sync_bytes,
                "memory": self.memory.to_dict() if self.memory else None,
                "request": self.plan.request.to_dict()}


@dataclass(frozen=True, slots=True)
class FleetPlan:
    plan_id: str
    fits: bool
    profile: ModelProfile
    request: PlanRequest
    fleet: FleetRequest
    replicas: tuple[ReplicaPlan, ...]
    cards: tuple[tuple[CardPlan, int | None], ...]  # every card, with its replica
    round: RoundEstimate | None
    tokens_per_s: float  # the fleet's, sync included
    single_pipeline_tokens_per_s: float  # the best one pipeline, for comparison
    sentence: str
    summary: str

    def to_dict(self) -> dict[str, Any]:
        """The first replica's plan (so a reader of single plans still finds its
        fields) with the fleet's cards, replicas, round and estimate."""
        out = self.replicas[0].plan.to_dict() if self.replicas else {}
        p = self.profile
        out.update({
            "plan_id": self.plan_id, "planner_version": PLANNER_VERSION, "kind": "train",
            "fits": self.fits,
            "model": {"name": p.name, "model_type": p.model_type, "layers": p.n_layers,
                      "params": p.total_params(), "max_context": p.max_context},
            "request": self.request.to_dict(),
            "cards": [{**c.to_dict(), "replica": r} for c, r in self.cards],
            "replicas": [r.to_dict() for r in self.replicas],
            "fleet": {**self.fleet.to_dict(), "replicas_planned": len(self.replicas),
                      "tokens_per_s": self.tokens_per_s,
                      "single_pipeline_tokens_per_s": self.single_pipeline_tokens_per_s,
                      "speedup": (self.tokens_per_s / self.single_pipeline_tokens_per_s
                                  if self.single_pipeline_tokens_per_s > 0 else 0.0),
                      "round": self.round.to_dict() if self.round else None,
                      "sentence": self.sentence},
            "summary": self.summary,
        })
        if not self.replicas:
            out.setdefault("stages", [])
            out.setdefault("layout", {"limit": {"sentence": self.sentence, "fits": False},
                                      "strip": [], "strip_text": ""})
            out.setdefault("estimate", {})
            out.setdefault("notes", [])
        return out


# --- one replica: its layers, its batch, its time -------------------------------------------


def balanced_split(model: CostModel, search: Search, chosen: Sequence[int]) -> list[int] | None:
    """Layers over the slots ``chosen`` (in order) that make the slowest stage as fast
    as it can be, each within what its card holds; None when they cannot hold it."""
    k, layers = len(chosen), search.layers
    if k == 0 or k > layers:
        return None
    caps = [search.cap(i, j == 0, j == k - 1) for j, i in enumerate(chosen)]
    if min(caps) < 1 or sum(caps) < layers:
        return None
    times = [[model.stage_time_s(search.slots[i].card, n, j == k - 1)
              for n in range(caps[j] + 1)] for j, i in enumerate(chosen)]
    candidates = sorted({t for row in times for t in row[1:]})

    def most_within(limit: float) -> list[int] | None:
        most = []
        for j in range(k):
            n = max((n for n in range(1, caps[j] + 1) if times[j][n] <= limit), default=0)
            if n == 0:
                return None
            most.append(n)
        return most if sum(most) >= layers else None

    lo, hi = 0, len(candidates) - 1
    if most_within(candidates[hi]) is None:
        return None
    while lo < hi:  # the least stage-time bound that still places every layer
        mid = (lo + hi) // 2
        if most_within(candidates[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    parts = most_within(candidates[lo])
    assert parts is not None
    extra = sum(parts) - layers
    for j in range(k):  # give back what is over, first stages first, each keeping one
        take = min(extra, parts[j] - 1)
        parts[j] -= take
        extra -= take
    return parts


def step_time_s(model: CostModel, search: Search, chosen: Sequence[int], parts: Sequence[int],
                micro_batches: int) -> float:
    """One optimizer step of a filled pipeline: the first micro-batch through every stage
    and hop, then one more every slowest stage or hop (1F1B steady state)."""
    k = len(chosen)
    stages = [model.stage_time_s(search.slots[i].card, n, j == k - 1)
              for j, (i, n) in enumerate(zip(chosen, parts))]
    hops = [search.hop_s(chosen[j], chosen[j + 1]) for j in range(k - 1)]
    return sum(stages) + sum(hops) + (micro_batches - 1) * max(stages + hops)


def _pow2_floor(x: float) -> int:
    n = 1
    while n * 2 <= x:
        n *= 2
    return n


@dataclass(frozen=True, slots=True)
class _Draft:
    keys: tuple[CardKey, ...]  # the replica's cards, pipeline order
    memory_batch: int
    micro_batches: int


class _Fleet:
    """The pieces every replica is measured with."""

    def __init__(self, profile: ModelProfile, view: ClusterView, r: PlanRequest,
                 fleet: FleetRequest, slots: tuple[Slot, ...]) -> None:
        self.profile, self.view, self.r, self.fleet = profile, view, r, fleet
        self.slots = slots
        self.tokens = int(r.seq_len or 0)
        self._models: dict[tuple[int, int], CostModel] = {}
        self._searches: dict[tuple[tuple[CardKey, ...], int, int], Search] = {}
        self.pair_fellows = {x for (a, b), _ in view.links for x in (a, b)}

    def fills(self, stages: int) -> list[int]:
        """Micro-batches a step to try, fewest first: auto may fill the pipeline (up to
        ``FILL`` per stage) so its bubble is small; a fixed micro-batch keeps the
        request's."""
        if not self.fleet.auto_batch:
            return [self.r.micro_batches]
        least = self.r.micro_batches
        return sorted({max(least, FILL * stages), max(least, 2 * stages),
                       max(least, stages), least})

    def model(self, batch: int, micro_batches: int) -> CostModel:
        key = (batch, micro_batches)
        if key not in self._models:
            request = replace(self.r, micro_batch=batch, micro_batches=micro_batches)
            self._models[key] = CostModel(self.profile, request, self.tokens)
        return self._models[key]

    def search(self, keys: tuple[CardKey, ...], batch: int, micro_batches: int) -> Search:
        key = (keys, batch, micro_batches)
        if key not in self._searches:
            wanted = set(keys)
            slots = [s for s in self.slots if _key(s) in wanted]
            self._searches[key] = Search(self.model(batch, micro_batches), slots,
                                         self.view.link, lambda f: f in self.pair_fellows)
        return self._searches[key]

    def split(self, keys: tuple[CardKey, ...], batch: int, m: int) -> list[int] | None:
        search = self.search(keys, batch, m)
        return balanced_split(search.model, search, list(range(len(keys))))

    def memory_batch(self, keys: tuple[CardKey, ...], m: int) -> int:
        """The largest power of two (up to the cap) these cards hold at ``m``
        micro-batches a step; 0: not even one. A fixed micro-batch: it or 0."""
        if not self.fleet.auto_batch:
            return self.r.micro_batch if self.split(keys, self.r.micro_batch, m) else 0
        best, batch = 0, 1
        while batch <= MAX_AUTO_MICRO_BATCH and self.split(keys, batch, m) is not None:
            best, batch = batch, batch * 2
        return best

    def shape(self, keys: tuple[CardKey, ...]) -> tuple[int, int]:
        """(memory's micro-batch, micro-batches a step) of a replica on ``keys``: the
        most tokens/s over the fills, the largest batch each holds (on a tie, the fewer
        micro-batches, so the larger micro-batch); (0, 0) when none holds."""
        best: tuple[float, int, int] = (0.0, 0, 0)
        for m in self.fills(len(keys)):
            batch = self.memory_batch(keys, m)
            if batch:
                rate = self.tokens_per_s(keys, batch, m)
                if rate > best[0]:
                    best = (rate, batch, m)
        return best[1], best[2]

    def step(self, keys: tuple[CardKey, ...], batch: int, m: int) -> tuple[float, list[int]]:
        search = self.search(keys, batch, m)
        parts = self.split(keys, batch, m)
        assert parts is not None
        return step_time_s(search.model, search, list(range(len(keys))), parts, m), parts

    def tokens_per_s(self, keys: tuple[CardKey, ...], batch: int, m: int) -> float:
        step, _ = self.step(keys, batch, m)
        return m * batch * self.tokens / step if step > 0 else 0.0


def _key(slot: Slot) -> CardKey:
    return (slot.fellow_id, slot.card.kind, slot.card.index)


def _exclude_name(key: CardKey) -> str:
    fellow, kind, index = key
    return f"{fellow}:{'cpu' if kind == 'cpu' else index}"


def _drafts(f: _Fleet) -> tuple[list[_Draft], list[CardKey]]:
    """Replicas fastest first on the cards still free, until none holds the model; the
    cards no replica could take. A replica's cards are the fastest pipeline's, or that
    of up to ``EXTRA_STAGES`` more stages when the room they add (a fuller pipeline, a
    larger batch) gives more tokens/s per card."""
    free = [_key(s) for s in f.slots]
    drafts: list[_Draft] = []
    batch1 = 1 if f.fleet.auto_batch else f.r.micro_batch
    cards = {_key(s): s.card for s in f.slots}

    def speed(key: CardKey) -> tuple[float, float, CardKey]:
        return (-cards[key].flops, -cards[key].mem_bandwidth, key)

    fixed = f.r.stages  # --stages: every replica has exactly that many
    while free:
        # the fastest pipeline lies on fast cards: search the POOL fastest free cards
        # first (and twice as many while none holds the model), not the whole fleet
        pool = POOL
        while True:
            chosen = set(sorted(free, key=speed)[:pool])
            search = f.search(tuple(k for k in free if k in chosen), batch1,
                              f.r.micro_batches)
            found = search.fastest(fixed)
            if found is not None or pool >= len(free):
                break
            pool *= 2
        if found is None:
            break
        k = len(found[0])
        best: tuple[float, int, _Draft] | None = None
        most = k if fixed else min(k + EXTRA_STAGES, len(search.slots), f.profile.n_layers)
        for stages in range(k, most + 1):
            placed = found if stages == k else search.fastest(stages)
            if placed is None:
                continue
            keys = tuple(_key(search.slots[i]) for i, _ in placed[0])
            batch, m = f.shape(keys)
            if batch == 0:
                continue
            per_card = f.tokens_per_s(keys, batch, m) / len(keys)
            if best is None or per_card > best[0] * (1 + 1e-9):
                best = (per_card, stages, _Draft(keys, batch, m))
        if best is None:  # held at the request's micro-batches, yet no batch fits
            break
        drafts.append(best[2])
        taken = set(best[2].keys)
        free = [k for k in free if k not in taken]
    return drafts, free


def _batches(f: _Fleet, drafts: Sequence[_Draft]) -> list[int]:
    """Each replica's micro-batch: memory's, then scaled by speed (``auto``)."""
    if not f.fleet.auto_batch or not drafts:
        return [d.memory_batch for d in drafts]
    speeds = [f.tokens_per_s(d.keys, d.memory_batch, d.micro_batches) for d in drafts]
    fastest = max(speeds)
    # the roomiest replica's batch is the scale; each gets its share by speed
    scale = max(d.memory_batch * d.micro_batches for d in drafts)
    batches = [min(d.memory_batch,
                   _pow2_floor(max(1.0, scale * s / fastest / d.micro_batches)))
               for d, s in zip(drafts, speeds)]
    # a replica whose step would outlast a round (the others held to small batches by
    # their memory) takes a smaller batch, so it still sends every round
    steps = [f.step(d.keys, b, d.micro_batches)[0] for d, b in zip(drafts, batches)]
    round_s = (f.fleet.inner_steps or DEFAULT_INNER_STEPS) * min(steps)
    for i, d in enumerate(drafts):
        while batches[i] > 1 and steps[i] > round_s:
            batches[i] //= 2
            steps[i] = f.step(d.keys, batches[i], d.micro_batches)[0]
    return batches


def _flows(f: _Fleet, replicas: Sequence[ReplicaPlan]) -> dict[tuple[str, str], int]:
    return round_flows(f.profile, f.r, f.fleet, [rp.plan for rp in replicas])


def _round(f: _Fleet, replicas: Sequence[ReplicaPlan]) -> RoundEstimate | None:
    return round_estimate(f.profile, f.r, f.fleet, f.view, [rp.plan for rp in replicas],
                          [rp.step_s for rp in replicas])


def _fleet_tokens_per_s(replicas: Sequence[ReplicaPlan], rnd: RoundEstimate | None) -> float:
    total = sum(r.tokens_per_s for r in replicas)
    if rnd is None or len(replicas) < 2 or rnd.comm_s <= rnd.compute_s:
        return total
    return total * rnd.compute_s / rnd.comm_s  # rounds wait on the network


# --- the fleet plan -----------------------------------------------------------------------


def plan_fleet(profile: ModelProfile, view: ClusterView, request: PlanRequest,
               fleet: FleetRequest) -> FleetPlan:
    """The fleet training plan of ``request`` (kind train) on ``view``."""
    if request.kind != "train":
        raise ConfigError("a fleet plan is a training plan: kind must be \"train\"")
    r = resolve(request, profile)
    excluded = _resolve_excludes(view, r.exclude)
    r = replace(r, exclude=_exclude_keys(excluded))
    if r.maximize == "seq_len":  # the longest sequence one pipeline of the cards holds
        r = replace(r, seq_len=int(plan(profile, view, r).request.seq_len or r.seq_len or 0))
    _, reasons = _usable(view, r, excluded)
    setting = _setting(profile, view, replace(r, maximize=None))
    f = _Fleet(profile, view, replace(r, maximize=None), fleet, setting.slots)
    drafts, _ = _drafts(f)
    batches = _batches(f, drafts)

    def written(picked: Sequence[int]) -> list[ReplicaPlan]:
        out: list[ReplicaPlan] = []
        before: list[str] = []
        for i, d in enumerate(picked):
            draft, batch = drafts[d], batches[d]
            m = draft.micro_batches
            step, parts = f.step(draft.keys, batch, m)
            own = replace(f.r, micro_batch=batch, micro_batches=m,
                          exclude=tuple(sorted({*f.r.exclude, *before})))
            one = _replica_plan(profile, view, own, draft.keys, parts)
            out.append(ReplicaPlan(index=i, plan=one, micro_batch=batch, micro_batches=m,
                                   memory_micro_batch=draft.memory_batch, step_s=step,
                                   tokens_per_step=m * batch * f.tokens, sync_bytes=0,
                                   memory=_sample_memory(f, draft.keys, parts, batch, m)))
            before += [_exclude_name(k) for k in draft.keys]
        return out

    dropped: dict[int, str] = {}  # draft -> why its replica is left out
    picked = list(range(len(drafts) if fleet.replicas is None
                        else min(len(drafts), fleet.replicas)))
    replicas = written(picked)
    if fleet.replicas is None and len(replicas) > 1:
        # replicas: auto: as many (fastest first) as raise the fleet's tokens/s, and none
        # whose one step outlasts a round (it would only ever send late)
        best_n, best_rate = 1, replicas[0].tokens_per_s
        for n in range(2, len(replicas) + 1):
            rate = _fleet_tokens_per_s(replicas[:n], _round(f, replicas[:n]))
            if rate > best_rate * (1 + 1e-9):
                best_n, best_rate = n, rate
        best_round = _round(f, replicas[:best_n])
        assert best_round is not None
        compute = best_round.compute_s
        kept = [i for i in range(best_n) if replicas[i].step_s <= compute]
        for i in range(len(replicas)):
            if i >= best_n:
                dropped[i] = ("not needed: its replica would add more sync time than "
                              "tokens/s")
            elif i not in kept:
                dropped[i] = (f"not needed: its replica takes "
                              f"{wording.seconds(replicas[i].step_s)} a step, longer than a "
                              f"round ({wording.seconds(compute)})")
        if kept != picked:
            picked = kept
            replicas = written(picked)
    rnd = _round(f, replicas)
    if rnd is not None and len(replicas) > 1:  # what each replica's fellows send
        sent = {t.fellow_id: t.sent_bytes
                for t in round_traffic(_flows(f, replicas), view).fellows}
        replicas = [replace(rp, sync_bytes=sum(sent.get(x, 0) for x in
                                               {st.fellow_id for st in rp.plan.stages}))
                    for rp in replicas]
    rate = _fleet_tokens_per_s(replicas, rnd)
    single = _single_pipeline_rate(f, profile, view, r)
    unkept = {k: dropped.get(i, "not needed: the replicas asked for are placed")
              for i, d in enumerate(drafts) if i not in picked for k in d.keys}
    cards = _fleet_cards(view, f, replicas, unkept, reasons)
    fits = bool(replicas) and (fleet.replicas is None or len(replicas) == fleet.replicas)
    sentence = _sentence(profile, r, fleet, replicas, drafts, fits, rnd, rate, single)
    summary = _summary(profile, r, replicas, cards, sentence)
    plan_id = _plan_id(profile, r, fleet, fits, replicas, rnd)
    return FleetPlan(plan_id=plan_id, fits=fits, profile=profile, request=r, fleet=fleet,
                     replicas=tuple(replicas), cards=tuple(cards), round=rnd,
                     tokens_per_s=rate, single_pipeline_tokens_per_s=single,
                     sentence=sentence, summary=summary)


def _replica_plan(profile: ModelProfile, view: ClusterView, own: PlanRequest,
                  keys: tuple[CardKey, ...], parts: Sequence[int]) -> Plan:
    """The replica as a single pipeline, on its own request."""
    setting = _setting(profile, view, own)
    position = {_key(s): k for k, s in enumerate(setting.slots)}
    placement = tuple((position[k], n) for k, n in zip(keys, parts))
    search = setting.search_at(int(own.seq_len or 0))
    assert search.fits(placement)
    return _written(setting, search, placement, True, setting.most_tokens())


def _sample_memory(f: _Fleet, keys: tuple[CardKey, ...], parts: Sequence[int], batch: int,
                   m: int) -> SampleMemory | None:
    """The replica's tightest stage: its free memory, what it holds at any batch, and
    what one more sequence a micro-batch (``m`` in flight) adds."""
    cards = {_key(s): s.card for s in f.slots}
    one, two = f.model(1, m), f.model(2, m)
    names = {x.id: x.name for x in f.view.fellows}
    tightest: SampleMemory | None = None
    k = len(keys)
    for j, (key, n) in enumerate(zip(keys, parts)):
        card = cards[key]
        at_one = one.claims(card.kind, n, j == 0, j == k - 1).total
        sample = max(1, two.claims(card.kind, n, j == 0, j == k - 1).total - at_one)
        fixed = max(0, at_one - sample)
        holds = max(0, (card.free_bytes - fixed) // sample)
        if tightest is None or holds < tightest.holds:
            tightest = SampleMemory(fellow=names.get(key[0], key[0]),
                                    free_bytes=card.free_bytes, fixed_bytes=fixed,
                                    sample_bytes=sample, holds=holds)
    return tightest


def _single_pipeline_rate(f: _Fleet, profile: ModelProfile, view: ClusterView,
                          r: PlanRequest) -> float:
    """The best single-pipeline plan: the planner's default and fastest one pipeline
    (``plan``, ``--maximize speed``), each at the fleet's own batch rule."""
    best = 0.0
    for maximize in (None, "speed"):
        single = plan(profile, view, replace(r, maximize=maximize))
        if single.fits:
            keys = tuple((s.fellow_id, s.kind, s.card_index) for s in single.stages)
            batch, m = f.shape(keys)
            if batch:
                best = max(best, f.tokens_per_s(keys, batch, m))
    return best


def _fleet_cards(view: ClusterView, f: _Fleet, replicas: Sequence[ReplicaPlan],
                 unkept: Mapping[CardKey, str], reasons: Mapping[CardKey, str]
                 ) -> list[tuple[CardPlan, int | None]]:
    by_key: dict[CardKey, tuple[CardPlan, int]] = {}
    for rp in replicas:
        for c in rp.plan.cards:
            if c.used:
                by_key[(c.fellow_id, c.kind, c.index)] = (c, rp.index)
    need = f.model(1 if f.fleet.auto_batch else f.r.micro_batch,
                   f.r.micro_batches).stage_need_bytes
    out: list[tuple[CardPlan, int | None]] = []
    for fellow in view.fellows:
        for card in fellow.cards:
            key = (fellow.id, card.kind, card.index)
            if key in by_key:
                out.append(by_key[key])
                continue
            reason = reasons.get(key)
            if reason is None:
                reason = unkept.get(key)
            if reason is None:
                stage = need(card.kind)
                rest = ("the cards left after the replicas hold no replica of their own"
                        if replicas else "the usable cards together hold no replica")
                reason = (wording.stage_needs(stage) if card.free_bytes < stage else
                          f"not used: {rest}")
            other = card.total_bytes - card.free_bytes
            out.append((CardPlan(fellow.id, fellow.name, card.index, card.kind, card.name,
                                 card.total_bytes, card.free_bytes, False, reason, None,
                                 None, Segments(other_programs=other, free=card.free_bytes),
                                 card.speed_measured), None))
    big = 1 << 30
    out.sort(key=lambda cr: (big if cr[1] is None else cr[1],
                             cr[0].stage if cr[0].stage is not None else big,
                             cr[0].fellow_id, cr[0].kind, cr[0].index))
    return out


def _bytes(n: int) -> str:
    return wording.gb(n) if n >= 10**8 else f"{n / 1e6:,.1f} MB"


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.2f}"


def _sentence(profile: ModelProfile, r: PlanRequest, fleet: FleetRequest,
              replicas: Sequence[ReplicaPlan], drafts: Sequence[_Draft], fits: bool,
              rnd: RoundEstimate | None, rate: float, single: float) -> str:
    if not replicas:
        return (f"Sequence length {wording.tokens(int(r.seq_len or 0))} tokens; no group of "
                f"usable cards holds {profile.name} for training: see each card's reason.")
    head = (f"{len(replicas)} replica{'s' if len(replicas) != 1 else ''} at sequence length "
            f"{wording.tokens(int(r.seq_len or 0))}")
    if fleet.replicas is not None and len(replicas) < fleet.replicas:
        return (f"{head}: only {len(replicas)} of the {fleet.replicas} replicas asked for "
                f"fit on the usable cards.")
    text = f"{head}: estimated {_rate(rate)} tokens/s together"
    if single > 0:
        text += f", {rate / single:.1f}x the best single pipeline ({_rate(single)} tokens/s)"
    if rnd is not None and len(replicas) > 1:
        sized = " (sized to the links)" if rnd.inner_steps_auto else ""
        text += (f"; a round is {rnd.inner_steps} steps{sized}, {rnd.compute_s:,.0f} s of "
                 f"compute, and its all-reduce ({rnd.codec}) {rnd.comm_s:,.0f} s "
                 f"({rnd.comm_fraction:.2f} of the compute, set by {rnd.limit}); the "
                 f"busiest fellow, {rnd.busiest_fellow}, sends "
                 f"{_bytes(rnd.busiest_bytes)}, {rnd.busiest_over_delta:.1f}x one "
                 "replica's compressed delta")
    return text + "."


def _summary(profile: ModelProfile, r: PlanRequest, replicas: Sequence[ReplicaPlan],
             cards: Sequence[tuple[CardPlan, int | None]], sentence: str) -> str:
    how = "LoRA adapters" if r.method == "lora" else "all weights"
    parts = [f"Training {how} of {profile.name}: {sentence}"]
    for rp in replicas[:4]:
        fellows = sorted({s.fellow for s in rp.plan.stages})
        parts.append(f"Replica {rp.index}: {len(rp.plan.stages)} stage"
                     f"{'s' if rp.stages != 1 else ''} on {', '.join(fellows[:3])}"
                     f"{' and more' if len(fellows) > 3 else ''}, micro-batch "
                     f"{rp.micro_batch} x {rp.micro_batches}, {_rate(rp.tokens_per_s)} "
                     "tokens/s.")
    if len(replicas) > 4:
        parts.append(f"And {len(replicas) - 4} more replicas.")
    left = [c for c, rep in cards if rep is None]
    if left:
        parts.append(f"{len(left)} card{'s' if len(left) != 1 else ''} left out.")
    return " ".join(parts)


def _plan_id(profile: ModelProfile, r: PlanRequest, fleet: FleetRequest, fits: bool,
             replicas: Sequence[ReplicaPlan], rnd: RoundEstimate | None) -> str:
    # the round as planned: inner_steps auto and the number it chose are one plan, so a
    # job whose leader fixed the number before placing keeps its plan_id
    sized = fleet if fleet.inner_steps is not None or rnd is None else replace(
        fleet, inner_steps=rnd.inner_steps)
    canonical = {"planner": PLANNER_VERSION, "fleet": sized.to_dict(),
                 "profile": profile.to_dict(), "request": r.to_dict(), "fits": fits,
                 "replicas": [x.plan.plan_id for x in replicas]}
    encoded = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(encoded.encode()).hexdigest()[:16]


def fleet_plan_message(message: Mapping[str, Any], view: ClusterView) -> dict[str, Any]:
    """``{"model": {"name", "config"}, **training request, replicas, micro_batch (an
    int or "auto"), inner_steps, codec...}`` planned on ``view``, as the plan's dict."""
    from p2pswarm.planner.profile import profile_from_config
    from p2pswarm.planner.request import request_from_dict

    model = message.get("model")
    if not isinstance(model, Mapping) or not isinstance(model.get("config"), Mapping):
        raise ConfigError("a plan request needs \"model\": {\"name\", \"config\"}")
    profile = profile_from_config(model["config"], str(model.get("name") or "model"))
    fleet, rest = fleet_request_from_dict({k: v for k, v in message.items() if k != "model"})
    request = request_from_dict({**rest, "kind": "train"})
    return plan_fleet(profile, view, request, fleet).to_dict()


__all__ = ["COMM_SHARE", "MAX_AUTO_MICRO_BATCH", "MIN_AUTO_INNER_STEPS", "FleetPlan",
           "FleetRequest", "ReplicaPlan", "RoundEstimate", "SampleMemory", "balanced_split",
           "fleet_plan_message", "fleet_request_from_dict", "plan_fleet", "synced_params"]
