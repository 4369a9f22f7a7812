"""A fleet rehearsal: the fleet training plan on a fleet file, played in virtual time with
real training code, against the best single pipeline.

What is real and what is scaled:

- The plan is the planner's, for the job's model (the 1.1B Llama shape unless given) on
  the fleet file: its replicas, each replica's step time, samples per step and round
  (``inner_steps``), and every fellow's all-reduce bytes and seconds a round on its own
  links and its access point's airtime (``planner.sync_cost``).
- The learning is real: every replica is a ``training.replica.Replica`` of a small
  Llama (the model of ``simulations/bench_training.py``) stepping a real optimizer on the
  shipped corpus; rounds close by ``training.sync.OuterSync`` (int8 deltas, plain
  averaging weighted by samples unless ``outer`` says otherwise), as in
  ``training.virtual.VirtualSwarm``, which this subclasses. A round closes when every
  replica has sent, or at its deadline (the plan's round: its compute, then its
  all-reduce) with whoever has sent. Each replica's batch is its
  planned samples per step divided by ``SAMPLE_SCALE`` (at least one), so batch ratios
  between devices are the plan's while the CPU cost stays small.
- Time is the plan's: a replica's step takes its planned ``step_s`` of virtual time; its
  part of the all-reduce takes its fellows' planned seconds (half to send its delta,
  half for the update after the round closes), queued behind other replicas on the same
  access point. The bytes reported per fellow are the plan's for the full-size model.
- Churn (``drops="W3"``): each fellow behind an access point drops off the network as
  the W3 WiFi profile's roaming outages do (``sim.profiles``: 2-10 s, once every 10
  minutes, at a random phase). A replica pauses while any of its fellows is away, then
  redoes the micro-batch in flight; an outage longer than ``REPLACED_AFTER_S`` (the
  fellow declared dead) tears its pipeline down and the whole step in flight is redone
  (``stages_kept``: a what-if where the fellow comes back still holding its stage).
  A transfer is held up by an outage of its fellows for as long as it lasts.
- The figure: every arm's time to the target is its first held-out evaluation at or
  below it (the single pipeline evaluated every step, the fleet's global model at
  every round close), the target the single pipeline's loss after its last step.
- The ceilings (``ceilings``): what the lead can be at most if learning goes by
  optimizer steps (the plan's rounds; the fastest replica's step rate) or by samples
  (the plan's tokens/s). The small model learns by steps: a single pipeline taking a
  smaller batch (``single_batch``) gets to its loss sooner, which is why the fleet's
  8x tokens/s show here as 2-3x.
- Tuning what-ifs, the same effort for both arms: each arm's learning rate, the single
  pipeline's batch, and how the keeper weighs deltas (``WEIGHTINGS``).

It does not run the agents' transport and membership (the harness does that, at far
higher CPU cost per fellow): it rehearses the plan's schedule with real learning.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from p2pswarm.errors import ConfigError
from p2pswarm.models.tokenizer import ByteTokenizer
from p2pswarm.planner import cluster_from_dict, fleet_plan_message
from p2pswarm.planner.cluster import ClusterView
from p2pswarm.training.codec import Encoded
from p2pswarm.training.data import TokenData, corpus_files
from p2pswarm.training.job import JobConfig
from p2pswarm.training.replica import Contribution, Replica
from p2pswarm.training.source import ScratchModel
from p2pswarm.training.virtual import FellowPlan, LinkModel, RoundRecord, VirtualSwarm

SAMPLE_SCALE = 8  # planned samples per step / samples per step rehearsed
PEAK_LR = 3e-3  # the inner learning rate of both arms unless told (constant)
# how the keeper weighs each replica's delta: by its samples (what OuterSync does), or, as
# what-ifs, by its local steps or by samples x steps (its progress and its batch)
WEIGHTINGS = ("samples", "steps", "samples-steps")
REPLACED_AFTER_S = 8.0  # suspicion at N = 38 on the wifi preset (5 x log10 N x 1 s): step redone
W3_OUTAGE_EVERY_S = 600.0
W3_OUTAGE_S = (2.0, 10.0)
SMALL_MODEL = {"model_type": "llama", "vocab_size": 259, "hidden_size": 64,
               "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
               "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 256,
               "eos_token_id": 257, "pad_token_id": 258}
SMALL_SEQ_LEN = 64
# TinyLlama-1.1B's published shape: the model the plan is made for by default
LLAMA_1B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
            "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
            "num_key_value_heads": 4, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "hidden_act": "silu"}


@dataclass(frozen=True, slots=True)
class RehearsedReplica:
    name: str
    fellows: tuple[str, ...]
    step_s: float  # one step, as planned
    micro_batches: int
    samples_per_step: int  # as planned
    batch: int  # samples per step rehearsed
    sync_s: float  # its part of the all-reduce a round, on its fellows' links
    air_s: tuple[tuple[str, float], ...]  # (access point, its members' airtime a round)
    sent_bytes: int  # what its fellows send a round, as planned


@dataclass(frozen=True, slots=True)
class FleetSchedule:
    """What the rehearsal takes from a fleet plan."""

    plan_id: str
    inner_steps: int
    round_compute_s: float
    round_comm_s: float  # the busiest fellow's all-reduce a round, as planned
    replicas: tuple[RehearsedReplica, ...]
    fellow_bytes: tuple[tuple[str, int], ...]  # (fellow, bytes it sends a round)
    wifi_fellows: tuple[str, ...]  # behind an access point: these drop under W3
    sentence: str


def schedule_of(plan: Mapping[str, Any], view: ClusterView, replicas: int | None = None
                ) -> FleetSchedule:
    """The rehearsal's schedule from a fleet plan's dict (its first ``replicas`` only)."""
    rnd = plan["fleet"]["round"] or {}
    traffic = {f["fellow"]: f for f in rnd.get("fellows") or ()}
    by_name = {f.name: f for f in view.fellows}
    aps = {ap.name: ap for ap in view.access_points}
    out = []
    for r in plan["replicas"][:replicas]:
        names = tuple(dict.fromkeys(s["fellow"] for s in r["stages"]))
        air: dict[str, float] = {}
        for n in names:
            fellow = by_name.get(n)
            ap = view.access_point(fellow.id) if fellow else None
            t = traffic.get(n)
            if ap is not None and t is not None:
                air[ap.name] = air.get(ap.name, 0.0) + (
                    t["sent_bytes"] + t["received_bytes"]) / aps[ap.name].capacity_bytes_s
        samples = int(r["micro_batch"]) * int(r["micro_batches"])
        out.append(RehearsedReplica(
            name=f"replica-{r['replica']}", fellows=names, step_s=float(r["step_s"]),
            micro_batches=int(r["micro_batches"]), samples_per_step=samples,
            batch=max(1, round(samples / SAMPLE_SCALE)),
            sync_s=max((traffic[n]["seconds"] for n in names if n in traffic), default=0.0),
            air_s=tuple(sorted(air.items())),
            sent_bytes=sum(traffic[n]["sent_bytes"] for n in names if n in traffic)))
    wifi = tuple(sorted(f.name for f in view.fellows if view.access_point(f.id) is not None))
    return FleetSchedule(
        plan_id=str(plan["plan_id"]), inner_steps=int(rnd.get("inner_steps") or 10),
        round_compute_s=float(rnd.get("compute_s") or 0.0),
        round_comm_s=float(rnd.get("comm_s") or 0.0), replicas=tuple(out),
        fellow_bytes=tuple((f["fellow"], f["sent_bytes"]) for f in rnd.get("fellows") or ()),
        wifi_fellows=wifi, sentence=str(plan["fleet"]["sentence"]))


def w3_outages(fellows: Sequence[str], until_s: float, rng: random.Random,
               every_s: float = W3_OUTAGE_EVERY_S) -> dict[str, list[tuple[float, float]]]:
    """Each fellow's roaming outages (start, end) up to ``until_s``, as W3 has them
    (once every ``every_s``, at a random phase)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for name in fellows:
        t = rng.uniform(0.0, every_s)
        spans = []
        while t < until_s:
            spans.append((t, t + rng.uniform(*W3_OUTAGE_S)))
            t += every_s
        out[name] = spans
    return out


def outage_cost_s(outages: Sequence[tuple[float, float]], start: float, end: float,
                  step_s: float, micro_batches: int, stages_kept: bool = False) -> float:
    """Time the outages that begin in (start, end] cost a replica whose step in flight
    began at ``start``: each outage, then the micro-batch in flight redone; the whole
    step when the outage outlasts the suspicion time and the replica's pipeline is torn
    down (as the agent does: it pauses the replica and places it again). With
    ``stages_kept`` (a what-if: the fellow comes back still holding its stage and the
    pipeline waits for it) only the micro-batch is redone."""
    lost = 0.0
    for a, b in outages:
        if start < a <= end:
            replaced = b - a > REPLACED_AFTER_S and not stages_kept
            redo = step_s if replaced else step_s / max(1, micro_batches)
            lost += (b - a) + min(redo, a - start)
    return lost


@dataclass
class _Lane:
    """A replica's links: busy until ``free_at``."""

    free_at: float = 0.0
    step_from: float = 0.0  # when its step in flight started (or last resumed)
    paused_s: float = 0.0  # time lost to outages: paused and work redone
    outages: list[tuple[float, float]] = field(default_factory=list)


class FleetSwarm(VirtualSwarm):
    """``VirtualSwarm`` with the fleet plan's replicas: their own batches and step times,
    the all-reduce's seconds on their own links and access points, and outages."""

    def __init__(self, job: JobConfig, source: Any, data: TokenData,
                 schedule: FleetSchedule, *, rng: random.Random,
                 eval_batches: Sequence[torch.Tensor] = (),
                 outages: Mapping[str, list[tuple[float, float]]] | None = None,
                 stages_kept: bool = False, weighting: str = "samples") -> None:
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}")
        self.schedule = schedule
        self.stages_kept = stages_kept
        self.weighting = weighting
        self.planned = {r.name: r for r in schedule.replicas}
        self.lanes = {r.name: _Lane(outages=sorted(
            span for n in r.fellows for span in (outages or {}).get(n, ())))
            for r in schedule.replicas}
        self.ap_free: dict[str, float] = {}
        self.contributions = dict.fromkeys(self.planned, 0)
        fellows = [FellowPlan(r.name, speed=1.0 / r.step_s) for r in schedule.replicas]
        super().__init__(job, source, data, fellows, rng=rng,
                         link=LinkModel(bandwidth_bps=1e15, rtt_s=0.0),
                         eval_batches=eval_batches)

    def _build(self, name: str, index: int) -> Replica:
        r = self.planned[name]
        return Replica.build(name, self.job, self.source, self.data.train, self.cut,
                             stream=index, micro_batch=r.batch, micro_batches=1)

    # --- outages ----------------------------------------------------------------------------

    def _on_step(self, data: tuple[str, int]) -> None:
        name, incarnation = data
        f = self.fellows[name]
        lane = self.lanes[name]
        r = self.planned[name]
        if f.replica is not None and f.incarnation == incarnation and lane.outages:
            lost = outage_cost_s(lane.outages, lane.step_from, self.now, r.step_s,
                                 r.micro_batches, self.stages_kept)
            if lost > 0:  # paused, then what was in flight redone: the step ends later
                lane.paused_s += lost
                lane.step_from = self.now
                self._at(self.now + lost, "step", data)
                return
        lane.step_from = self.now
        super()._on_step(data)

    # --- the all-reduce on the replica's own links ------------------------------------------

    def _transfer(self, name: str) -> float:
        """Half a round's all-reduce for replica ``name`` from now: when it is done."""
        r, lane = self.planned[name], self.lanes[name]
        start = max(self.now, lane.free_at)
        for ap, _ in r.air_s:
            start = max(start, self.ap_free.get(ap, 0.0))
        end = start + r.sync_s / 2
        for ap, air in r.air_s:
            self.ap_free[ap] = start + air / 2
            end = max(end, start + air / 2)
        for a, b in lane.outages:  # a transfer waits out its fellows' outages
            if start <= a < end:
                end += b - a
        lane.free_at = end
        return end

    def _budget_done(self, f: Any) -> None:
        assert f.replica is not None
        self._catch_up(f)
        contribution = f.replica.take_contribution()
        self.contributions[f.plan.name] += 1
        self._at(self._transfer(f.plan.name), "contribution", contribution)

    def _on_contribution(self, c: Contribution) -> RoundRecord | None:
        """The keeper weighs a delta by its samples (``OuterSync``); the what-if
        weightings hand it another number instead, so the same round-closing code runs
        (the round's sample counts in its records then carry that number)."""
        return super()._on_contribution(self._weighed(c))

    def _weighed(self, c: Contribution) -> Contribution:
        if self.weighting == "samples":
            return c
        steps = max(1, c.samples // self.planned[c.replica].batch)
        weight = steps if self.weighting == "steps" else steps * c.samples
        return Contribution(c.replica, weight, c.stages)

    def _flush(self) -> None:
        """``VirtualSwarm._flush`` with the contributions weighed as the rounds' are."""
        if self.weighting == "samples":
            super()._flush()
            return
        for f in self.fellows.values():
            if f.replica is None or f.replica.samples_unsent == 0:
                continue
            self._catch_up(f)
            c = self._weighed(f.replica.take_contribution())
            for s, keeper in enumerate(self.keepers):
                _, decoded, version = c.stages[s]
                keeper.contribute(c.replica, version, decoded, c.samples, self.now)
        self._close()

    def _send_update(self, f: Any, version: int, updates: list[Encoded]) -> None:
        """Over the fellow's own links and access point (offline ones get theirs late)."""
        self._at(self._transfer(f.plan.name), "update",
                 (f.plan.name, f.incarnation, version, updates))

    def _round_loss(self, version: int) -> float | None:
        """Every round's held-out loss: time to target is read off these."""
        return self.evaluate() if self.eval_batches else None


# --- the rehearsal ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunFigures:
    name: str
    curve: tuple[tuple[float, float], ...]  # (virtual s, held-out loss) at each round close
    rounds: int
    time_to_target_s: float | None
    final_loss: float | None
    paused_s: float  # all replicas' time lost to outages
    max_round_gap_s: float
    bytes_per_fellow: tuple[tuple[str, int], ...]  # as planned, over the rounds it sent

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "curve": [list(p) for p in self.curve],
                "rounds": self.rounds, "time_to_target_s": self.time_to_target_s,
                "final_loss": self.final_loss, "paused_s": self.paused_s,
                "max_round_gap_s": self.max_round_gap_s,
                "bytes_per_fellow": dict(self.bytes_per_fellow)}


@dataclass(frozen=True, slots=True)
class OuterOptimizer:
    lr: float
    momentum: float  # Nesterov
    codec: str = "int8"


# DiLoCo's outer optimizer (Douillard et al. 2023), the job's default
DILOCO = OuterOptimizer(lr=0.7, momentum=0.9)
# plain averaging of the replicas' deltas, weighted by samples
AVERAGE = OuterOptimizer(lr=1.0, momentum=0.0)
# one pipeline syncs with nobody: outer lr 1, no momentum and lossless deltas leave its
# training exactly what it is alone; its "rounds" only say when to evaluate
ALONE = OuterOptimizer(lr=1.0, momentum=0.0, codec="fp32")


def _job(schedule: FleetSchedule, seed: int, deadline_s: float,
         outer: OuterOptimizer, lr: float = PEAK_LR) -> JobConfig:
    return JobConfig.from_dict({
        "model": {"config": SMALL_MODEL}, "seq_len": SMALL_SEQ_LEN, "micro_batch": 8,
        "lr": {"peak": lr, "schedule": "constant"}, "seed": seed,
        "sync": {"inner_steps": schedule.inner_steps, "codec": outer.codec,
                 "outer_lr": outer.lr, "outer_momentum": outer.momentum,
                 "round_deadline_s": deadline_s}})


def first_at(curve: Sequence[tuple[float, float]], target: float | None) -> float | None:
    """When a loss curve first comes to ``target`` or below."""
    if target is None:
        return None
    return next((t for t, loss in curve if loss <= target), None)


def time_to_loss_s(curve: Sequence[tuple[float, float]], loss: float) -> float | None:
    """When a finely evaluated curve first comes to ``loss``, linear between the two
    evaluations around it; None if it never does."""
    before: tuple[float, float] | None = None
    for t, value in curve:
        if value <= loss:
            if before is None or before[1] == value:
                return t
            t0, v0 = before
            return t0 + (t - t0) * (v0 - loss) / (v0 - value)
        before = (t, value)
    return None


def lead_by_round(single: Sequence[tuple[float, float]], run: Sequence[tuple[float, float]]
                  ) -> list[float | None]:
    """At each of a run's round closes, how many times longer the single pipeline took to
    the loss the run's global model had then (None past the single pipeline's run)."""
    out: list[float | None] = []
    for t, loss in run:
        alone = time_to_loss_s(single, loss)
        out.append(alone / t if alone is not None and t > 0 else None)
    return out


def round_deadline_s(schedule: FleetSchedule) -> float:
    """How long after the last close a round closes with whatever has arrived: the
    plan's round, its compute and then its all-reduce (or one step of the slowest
    replica, if longer). A replica held up past it (a Pi's step redone after a drop) sends
    into the next round at a staleness discount instead of holding everyone up."""
    return max(schedule.round_compute_s + schedule.round_comm_s,
               max(r.step_s for r in schedule.replicas))


def _data() -> TokenData:
    tok = ByteTokenizer()
    tokens = torch.cat([torch.tensor(tok.encode(p.read_text(encoding="utf-8")))
                        for p in corpus_files()])
    return TokenData.split(tokens, 0.05, SMALL_SEQ_LEN)


def _run(name: str, schedule: FleetSchedule, seed: int, until_s: float,
         target: float | None, outages: Mapping[str, list[tuple[float, float]]] | None,
         data: TokenData, outer: OuterOptimizer, stages_kept: bool = False,
         lr: float = PEAK_LR, weighting: str = "samples") -> RunFigures:
    job = _job(schedule, seed, round_deadline_s(schedule), outer, lr)
    torch.manual_seed(seed)
    swarm = FleetSwarm(job, ScratchModel(SMALL_MODEL, seed), data, schedule,
                       rng=random.Random(seed),
                       eval_batches=data.holdout_batches(SMALL_SEQ_LEN, 8)[:4],
                       outages=outages, stages_kept=stages_kept, weighting=weighting)
    hit: list[float] = []

    def reached(record: RoundRecord) -> bool:
        if target is not None and record.eval_loss is not None and record.eval_loss <= target:
            hit.append(record.closed_at_s)
            return True
        return False

    report = swarm.run(until_s=until_s, stop_when=reached)
    sent = dict(schedule.fellow_bytes)
    by_fellow: dict[str, int] = {}
    for r in schedule.replicas:
        for n in r.fellows:
            by_fellow[n] = sent.get(n, 0) * swarm.contributions[r.name]
    curve = tuple((rec.closed_at_s, rec.eval_loss) for rec in report.rounds
                  if rec.eval_loss is not None)
    return RunFigures(
        name=name, curve=curve, rounds=len(report.rounds),
        time_to_target_s=hit[0] if hit else None,
        final_loss=curve[-1][1] if curve else report.final_loss,
        paused_s=sum(lane.paused_s for lane in swarm.lanes.values()),
        max_round_gap_s=report.max_round_gap_s,
        bytes_per_fellow=tuple(sorted(by_fellow.items())))


def rehearse(cluster: Mapping[str, Any], *, model: Mapping[str, Any] | None = None,
             seq_len: int = 512, bandwidth: float | None = None,
             latency: float | None = None, single_steps: int = 40, seed: int = 0,
             drops: bool = True, drop_every_s: float = W3_OUTAGE_EVERY_S,
             outer: OuterOptimizer = AVERAGE, stages_kept: bool = False,
             lr: float = PEAK_LR, fleet_lr: float | None = None,
             single_batch: int | None = None, weighting: str = "samples") -> dict[str, Any]:
    """The rehearsal's figures: the fleet plan against its best single pipeline (the plan
    asked for one replica), both trained in virtual time; with ``drops``, the fleet once
    more with the WiFi fellows dropping as W3 has them.

    Tuning, the same for both arms unless told: ``lr`` is both arms' inner learning rate
    (``fleet_lr`` the fleet's alone); ``single_batch`` the single pipeline's samples per
    step rehearsed (default its plan's over ``SAMPLE_SCALE``), its step time scaled in
    proportion (a compute-bound step); ``weighting`` one of ``WEIGHTINGS``."""
    if weighting not in WEIGHTINGS:
        raise ConfigError(f"weighting must be one of {', '.join(WEIGHTINGS)}, "
                          f"got {weighting!r}")
    for name, value in (("lr", lr), ("fleet_lr", fleet_lr)):
        if value is not None and not 0 < value < 1:
            raise ConfigError(f"{name} must be a learning rate between 0 and 1, got {value}")
    if single_batch is not None and not 1 <= single_batch <= 1024:
        raise ConfigError(f"the single pipeline's batch must be from 1 to 1024, "
                          f"got {single_batch}")
    data_dict = json.loads(json.dumps(cluster))
    if bandwidth is not None or latency is not None:
        default = dict(data_dict.get("links", {}).get("default") or {})
        if bandwidth is not None:
            default["bandwidth_bytes_s"] = bandwidth
        if latency is not None:
            default["latency_s"] = latency
        data_dict["links"] = {**data_dict.get("links", {}), "default": default}
    view = cluster_from_dict(data_dict)
    message = {"model": {"name": "model", "config": dict(model or LLAMA_1B)},
               "kind": "train", "seq_len": seq_len, "weights_dtype": "bf16"}
    fleet_plan = fleet_plan_message({**message, "replicas": "auto"}, view)
    single_plan = fleet_plan_message({**message, "replicas": 1}, view)
    fleet = schedule_of(fleet_plan, view)
    single = schedule_of(single_plan, view)
    # the single pipeline syncs with nobody: its rounds only say when to evaluate, every
    # step, so its time to the target is read as finely as it can be
    single = replace(single, inner_steps=1, replicas=tuple(
        replace(r, sync_s=0.0, air_s=()) for r in single.replicas))
    if single_batch is not None:
        single = replace(single, replicas=tuple(
            replace(r, batch=single_batch, step_s=r.step_s * single_batch / r.batch,
                    samples_per_step=round(r.samples_per_step * single_batch / r.batch))
            for r in single.replicas))
    tuning = Tuning(lr=lr, fleet_lr=lr if fleet_lr is None else fleet_lr,
                    weighting=weighting)
    # one thread: the steps are small, and on a busy machine more threads only contend
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _rehearse(fleet, single, single_steps, seed, drops, drop_every_s, outer,
                         stages_kept, tuning)
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True, slots=True)
class Tuning:
    lr: float  # the single pipeline's inner learning rate
    fleet_lr: float  # the fleet replicas'
    weighting: str


def ceilings(fleet: FleetSchedule, single: FleetSchedule,
             fleet_curve: Sequence[tuple[float, float]]) -> dict[str, float | None]:
    """What the fleet's lead can be at most, by two bounds on learning.

    If progress goes by optimizer steps whatever the batch (a task whose critical batch
    is below the single pipeline's), an average of replicas' deltas at the same learning
    rate moves the global model no further than its fastest replica moves alone:

    - ``fastest``: the single pipeline's step time over the fastest replica's;
    - ``steps``: the plan's rounds, ``inner_steps`` single-pipeline steps' time over the
      fleet's median time between round closes (``round_s``, read off ``fleet_curve``).

    If progress goes by samples whatever the step count (a batch far below the critical
    batch, a 1B model's regime, with the learning rate scaled to the global batch):

    - ``samples``: the fleet's samples/s over the single pipeline's, as rehearsed."""
    one = single.replicas[0]
    gaps = sorted(b - a for a, b in itertools.pairwise([0.0, *(t for t, _ in fleet_curve)]))
    round_s = gaps[len(gaps) // 2] if gaps else None
    return {
        "round_s": round_s,
        "steps": fleet.inner_steps * one.step_s / round_s if round_s else None,
        "fastest": one.step_s / min(r.step_s for r in fleet.replicas),
        "samples": sum(r.batch / r.step_s for r in fleet.replicas) / (one.batch / one.step_s),
    }


def _rehearse(fleet: FleetSchedule, single: FleetSchedule, single_steps: int, seed: int,
              drops: bool, drop_every_s: float, outer: OuterOptimizer,
              stages_kept: bool, tuning: Tuning) -> dict[str, Any]:
    data = _data()
    until = single_steps * single.replicas[0].step_s
    alone = _run("single pipeline", single, seed, until, None, None, data, ALONE,
                 lr=tuning.lr)
    target = alone.final_loss
    runs = [alone, _run("fleet", fleet, seed, until, target, None, data, outer,
                        lr=tuning.fleet_lr, weighting=tuning.weighting)]
    if drops:
        outages = w3_outages(fleet.wifi_fellows, until, random.Random(seed + 1),
                             drop_every_s)
        runs.append(_run("fleet, W3 drops", fleet, seed, until, target, outages, data,
                         outer, stages_kept, lr=tuning.fleet_lr,
                         weighting=tuning.weighting))
    # the same rule for every arm: the first held-out evaluation at or below the target
    alone = replace(alone, time_to_target_s=first_at(alone.curve, target))
    runs[0] = alone
    single_time = alone.time_to_target_s or until
    deadline = round_deadline_s(fleet)
    return {
        "plan_id": fleet.plan_id, "sentence": fleet.sentence,
        "replicas": [{"name": r.name, "fellows": list(r.fellows), "step_s": r.step_s,
                      "samples_per_step": r.samples_per_step, "rehearsed_batch": r.batch,
                      "sync_s": r.sync_s} for r in fleet.replicas],
        "single_pipeline": {"fellows": list(single.replicas[0].fellows),
                            "step_s": single.replicas[0].step_s,
                            "samples_per_step": single.replicas[0].samples_per_step,
                            "rehearsed_batch": single.replicas[0].batch},
        "single_steps": single_steps,
        "tuning": {"lr": tuning.lr, "fleet_lr": tuning.fleet_lr,
                   "weighting": tuning.weighting},
        # read off the fleet without drops: its median time between round closes
        "ceiling": ceilings(fleet, single, runs[1].curve),
        "inner_steps": fleet.inner_steps, "round_deadline_s": deadline,
        "outer": {"lr": outer.lr, "momentum": outer.momentum, "codec": outer.codec},
        "stages_kept": stages_kept,
        "target_loss": target, "single_time_s": single_time,
        "runs": [r.to_dict() for r in runs],
        "speedup": {r.name: (single_time / r.time_to_target_s if r.time_to_target_s
                             else None) for r in runs[1:]},
        # the same comparison at every round close: less at the mercy of where on the
        # single pipeline's flattening curve its last step happens to land
        "lead_by_round": {r.name: lead_by_round(alone.curve, r.curve) for r in runs[1:]},
    }


def markdown(result: Mapping[str, Any]) -> str:
    lines = ["# Fleet rehearsal", "", result["sentence"], "",
             "Target: the single pipeline's final held-out loss, "
             f"{result['target_loss']:.4f}, first reached at "
             f"{result['single_time_s']:,.0f} virtual s. Round deadline "
             f"{result['round_deadline_s']:,.0f} s.", "", *_ceiling_lines(result),
             "| run | rounds closed | time to target | faster than one pipeline | "
             "lead at each round close | "
             "longest gap between rounds | time lost to outages | busiest fellow's bytes |",
             "|---|---|---|---|---|---|---|---|"]
    single_curve = result["runs"][0]["curve"]
    single_end = single_curve[-1][0] if single_curve else 0.0
    for run in result["runs"]:
        t = run["time_to_target_s"]
        speed = result["speedup"].get(run["name"])
        per = run["bytes_per_fellow"]
        busiest = max(per.items(), key=lambda kv: kv[1]) if per else ("-", 0)
        leads = result.get("lead_by_round", {}).get(run["name"])
        lead = ", ".join(
            (f"> {single_end / t:.1f}x" if x is None else f"{x:.1f}x")  # past its run
            for x, (t, _) in zip(leads, run["curve"])) if leads else "-"
        lines.append(
            f"| {run['name']} | {run['rounds']} | "
            f"{'-' if t is None else f'{t:,.0f} s'} | "
            f"{'-' if speed is None else f'{speed:.1f}x'} | {lead} | "
            f"{run['max_round_gap_s']:,.0f} s | "
            f"{run['paused_s']:,.0f} s | {busiest[0]} {busiest[1] / 1e9:.1f} GB |")
    return "\n".join(lines) + "\n"


def _ceiling_lines(result: Mapping[str, Any]) -> list[str]:
    ceiling, tuning = result.get("ceiling"), result.get("tuning")
    if not ceiling or not tuning:
        return []
    single = result["single_pipeline"]
    steps = ceiling["steps"]
    return [
        f"Tuning: inner lr {tuning['lr']:g} (fleet {tuning['fleet_lr']:g}), constant; "
        f"deltas weighed by {tuning['weighting']}; the single pipeline rehearses "
        f"{single['rehearsed_batch']} samples a step, {single['step_s']:,.0f} s a step.",
        "",
        "Ceilings on the fleet's lead: "
        + ("-" if steps is None else f"{steps:.1f}x")
        + f" if learning goes by steps ({result['inner_steps']} steps a round, "
        + ("-" if ceiling["round_s"] is None else f"{ceiling['round_s']:,.0f} s")
        + " between round closes; the fastest replica alone steps "
        + f"{ceiling['fastest']:.1f}x as often as the single pipeline), "
        + f"{ceiling['samples']:.1f}x if it goes by samples.",
        ""]


def write_plot(result: Mapping[str, Any], path: Path) -> str | None:
    """Loss against virtual time, one line a run; a note when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in result["runs"]:
        xs = [p[0] / 3600 for p in run["curve"]]
        ax.plot(xs, [p[1] for p in run["curve"]], marker="o", label=run["name"])
    ax.axhline(result["target_loss"], color="grey", linestyle=":", label="target")
    ax.set_xlabel("virtual hours")
    ax.set_ylabel("held-out loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


__all__ = ["ALONE", "AVERAGE", "DILOCO", "PEAK_LR", "SAMPLE_SCALE", "WEIGHTINGS",
           "FleetSchedule", "FleetSwarm", "OuterOptimizer", "RehearsedReplica", "RunFigures",
           "Tuning", "ceilings", "first_at", "lead_by_round", "markdown", "outage_cost_s",
           "rehearse", "round_deadline_s", "schedule_of", "time_to_loss_s", "w3_outages",
           "write_plot"]
