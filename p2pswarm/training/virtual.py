"""Replicas training asynchronously in virtual time over one shared link.

Theory of operation. A discrete-event loop plays fellows of different speeds, each
running one replica (all stages of it; the keepers of every stage sit on one more
fellow). Gradients are real: every step event runs a real optimizer step of that
replica. Only time is simulated: a step of a fellow with ``speed`` s takes 1/s virtual
seconds, and every message crosses one shared medium (WiFi: transfers queue one after
another at ``bandwidth_bps``, plus half the round-trip time), so bytes cost time.

Each fellow takes its step budget (``round_rule.round_budgets`` by speed), then catches up on
updates it missed, sends its contribution and goes straight on training. The keepers
close a round when every member has sent or at the deadline, and send the update to
every member that is online, by the rule of ``training.round_rule`` that the
agent's driver runs too (here a fellow never waits for its round to close). Faults: a
fellow may miss a round (offline from one budget's end to the next: nothing sent,
updates missed, fetched on return), or be killed (its process and state gone; the round
stops waiting for it) and later rejoin (a fresh process pulls the current global
parameters and trains on). Nothing else stops or restarts: the job as a whole never
does.

Randomness (who misses a round) comes from an injected ``random.Random``.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from p2pswarm.errors import ConfigError
from p2pswarm.models.loader import TensorSource
from p2pswarm.training.codec import Encoded
from p2pswarm.training.data import TokenData
from p2pswarm.training.job import JobConfig
from p2pswarm.training.pipeline import LocalTrainPipeline
from p2pswarm.training.replica import Contribution, Replica, build_stages, synced_tensors
from p2pswarm.training.round_rule import round_budgets, round_closes
from p2pswarm.training.sync import OuterSync, flatten, write_flat


@dataclass(frozen=True, slots=True)
class LinkModel:
    bandwidth_bps: float = 20e6
    rtt_s: float = 0.030


class SharedLink:
    """One medium for everyone: a transfer starts when the previous one has finished."""

    def __init__(self, model: LinkModel) -> None:
        self.model = model
        self.free_at = 0.0
        self.bytes_sent = 0

    def send(self, now: float, nbytes: int) -> float:
        """Queue ``nbytes`` at ``now``; the virtual time they arrive."""
        start = max(now, self.free_at)
        self.free_at = start + nbytes * 8 / self.model.bandwidth_bps
        self.bytes_sent += nbytes
        return self.free_at + self.model.rtt_s / 2


@dataclass(frozen=True, slots=True)
class FellowPlan:
    name: str
    speed: float = 1.0  # local steps per virtual second
    miss_probability: float = 0.0  # chance of being offline for a round
    kill_at_s: float | None = None
    rejoin_at_s: float | None = None


@dataclass(frozen=True, slots=True)
class RoundRecord:
    version: int
    closed_at_s: float
    applied_samples: int
    dropped_samples: int
    bytes_sent: int  # all traffic so far
    computed_samples: int  # all samples trained on so far
    eval_loss: float | None


@dataclass(frozen=True, slots=True)
class SwarmReport:
    rounds: tuple[RoundRecord, ...]
    duration_s: float
    bytes_sent: int
    computed_samples: int
    useful_samples: int  # samples whose deltas went into the global model
    final_loss: float | None
    max_round_gap_s: float  # longest the global model went without an update
    max_delta_wait_s: float  # longest a delivered delta waited for its round to close
    rejoins: int
    rejoin_to_training_s: tuple[float, ...]  # rejoin -> training on the current global model
    rejoin_to_useful_s: tuple[float, ...]  # rejoin -> its first delta accepted
    global_restarts: int = 0  # the keepers' state is never reset; kept as a figure

    @property
    def useful_samples_per_s(self) -> float:
        return self.useful_samples / self.duration_s if self.duration_s > 0 else 0.0


@dataclass
class _Fellow:
    plan: FellowPlan
    index: int
    replica: Replica | None
    budget: int
    steps_in_budget: int = 0
    offline: bool = False
    incarnation: int = 0
    rejoined_at: float | None = None
    stream_position: int = 0


@dataclass(order=True)
class _Event:
    time: float
    seq: int
    kind: str = field(compare=False)
    data: Any = field(compare=False)


class VirtualSwarm:
    def __init__(self, job: JobConfig, source: TensorSource, data: TokenData,
                 fellows: Sequence[FellowPlan], *, rng: random.Random,
                 link: LinkModel | None = None, cut: Sequence[int] = (),
                 eval_batches: Sequence[torch.Tensor] = (), eval_every: int = 1) -> None:
        if not fellows:
            raise ConfigError("a swarm needs at least one fellow")
        self.job, self.source, self.data, self.cut = job, source, data, list(cut)
        self.rng = rng
        self.link = SharedLink(link or LinkModel())
        self.eval_batches = list(eval_batches)
        self.eval_every = eval_every
        speeds = {f.name: f.speed for f in fellows}
        budgets = round_budgets(speeds, job.sync.inner_steps, job.sync.speed_aware)
        self.fellows = {f.name: _Fellow(f, i, self._build(f.name, i), budgets[f.name])
                        for i, f in enumerate(fellows)}
        first = next(iter(self.fellows.values())).replica
        assert first is not None
        self.keepers = [OuterSync(flatten(synced_tensors(s)), job.sync) for s in first.stages]
        for name in self.fellows:
            for keeper in self.keepers:
                keeper.join(name)
        self._evaluator: LocalTrainPipeline | None = None
        self._events: list[_Event] = []
        self._seq = 0
        self.now = 0.0
        self.rounds: list[RoundRecord] = []
        self.computed_samples = 0
        self.useful_samples = 0
        self.dropped_samples = 0
        self.rejoins = 0
        self.rejoin_to_training: list[float] = []
        self.rejoin_to_useful: list[float] = []
        self._arrivals: list[float] = []
        self._max_delta_wait = 0.0
        self._last_close = 0.0
        self._max_gap = 0.0

    # --- building ------------------------------------------------------------------------

    def _build(self, name: str, index: int) -> Replica:
        return Replica.build(name, self.job, self.source, self.data.train, self.cut,
                             stream=index)

    @property
    def samples_per_step(self) -> int:
        return self.job.micro_batch * self.job.micro_batches

    # --- the loop ------------------------------------------------------------------------

    def _at(self, time: float, kind: str, data: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, _Event(time, self._seq, kind, data))

    def run(self, *, until_s: float | None = None, until_samples: int | None = None,
            stop_when: Callable[[RoundRecord], bool] | None = None) -> SwarmReport:
        """Play events until virtual time ``until_s``, ``until_samples`` trained, or
        ``stop_when`` says so after a round; then every live fellow sends what it has
        not sent and a last round closes."""
        if until_s is None and until_samples is None and stop_when is None:
            raise ConfigError("say when to stop: until_s, until_samples or stop_when")
        for f in self.fellows.values():
            self._at(1.0 / f.plan.speed, "step", (f.plan.name, f.incarnation))
            if f.plan.kill_at_s is not None:
                self._at(f.plan.kill_at_s, "kill", f.plan.name)
            if f.plan.rejoin_at_s is not None:
                self._at(f.plan.rejoin_at_s, "rejoin", f.plan.name)
        self._at(self.keepers[0].next_deadline(), "deadline")
        stopped = False
        while self._events and not stopped:
            event = heapq.heappop(self._events)
            if until_s is not None and event.time > until_s:
                self.now = until_s
                break
            self.now = event.time
            closed = getattr(self, f"_on_{event.kind}")(event.data)
            if until_samples is not None and self.computed_samples >= until_samples:
                stopped = True
            if closed is not None and stop_when is not None and stop_when(closed):
                return self._report()
        self._flush()
        return self._report()

    def _on_step(self, data: tuple[str, int]) -> None:
        name, incarnation = data
        f = self.fellows[name]
        if f.replica is None or f.incarnation != incarnation:
            return  # killed since this step was scheduled
        replica = f.replica
        progress = replica.version * self.job.sync.inner_steps + (
            f.steps_in_budget * self.job.sync.inner_steps / f.budget)
        replica.train_step(self.job.lr.lr_at(min(int(progress), self.job.steps - 1)))
        self.computed_samples += self.samples_per_step
        f.steps_in_budget += 1
        if f.steps_in_budget >= f.budget:
            f.steps_in_budget = 0
            self._budget_done(f)
        self._at(self.now + 1.0 / f.plan.speed, "step", data)

    def _budget_done(self, f: _Fellow) -> None:
        f.offline = self.rng.random() < f.plan.miss_probability
        if f.offline:
            return  # this round passes it by; its progress waits, unsent
        assert f.replica is not None
        self._catch_up(f)
        contribution = f.replica.take_contribution()
        arrival = self.link.send(self.now, contribution.nbytes)
        self._at(arrival, "contribution", contribution)

    def _catch_up(self, f: _Fellow) -> None:
        """Fetch the updates a fellow missed (or the whole state if they are gone)."""
        assert f.replica is not None
        behind = f.replica.version
        if behind >= self.keepers[0].version:
            return
        missed = [k.updates_since(behind) for k in self.keepers]
        if any(m is None for m in missed):
            states = [k.join(f.plan.name) for k in self.keepers]
            self.link.send(self.now, sum(s.nbytes for s in states))
            f.replica.reset(states)
            return
        per_stage: list[list[Encoded]] = [m for m in missed if m is not None]
        self.link.send(self.now, sum(e.nbytes for m in per_stage for e in m))
        for i in range(len(per_stage[0])):
            f.replica.apply([m[i] for m in per_stage], behind + i + 1)

    def _on_contribution(self, c: Contribution) -> RoundRecord | None:
        accepted = True
        for s, keeper in enumerate(self.keepers):
            _, decoded, version = c.stages[s]
            accepted = keeper.contribute(c.replica, version, decoded, c.samples, self.now
                                         ).accepted and accepted
        f = self.fellows[c.replica]
        if not accepted:
            self.dropped_samples += c.samples
        else:
            self._arrivals.append(self.now)
        if accepted and f.rejoined_at is not None:
            self.rejoin_to_useful.append(self.now - f.rejoined_at)
            f.rejoined_at = None
        if round_closes(self.keepers[0], self.now):
            return self._close()
        return None

    def _on_deadline(self, _: None) -> RoundRecord | None:
        if self.now < self.keepers[0].next_deadline():
            return None  # a deadline that has moved on
        record = self._close()
        if record is None:
            self._at(self.keepers[0].next_deadline(), "deadline")
        return record

    def _close(self) -> RoundRecord | None:
        results = [k.close_round(self.now) for k in self.keepers]
        if results[0] is None:
            return None
        updates = [r.update for r in results if r is not None]
        version = self.keepers[0].version
        self.useful_samples += results[0].samples
        self.dropped_samples += sum(a.samples for a in results[0].dropped)
        self._max_gap = max(self._max_gap, self.now - self._last_close)
        self._last_close = self.now
        if self._arrivals:
            self._max_delta_wait = max(self._max_delta_wait, self.now - min(self._arrivals))
            self._arrivals.clear()
        for f in self.fellows.values():
            if f.replica is not None and f.plan.name in self.keepers[0].members:
                self._send_update(f, version, updates)
        self._at(self.keepers[0].next_deadline(), "deadline")
        loss = self._round_loss(version)
        record = RoundRecord(version, self.now, results[0].samples,
                             sum(a.samples for a in results[0].dropped), self.link.bytes_sent,
                             self.computed_samples, loss)
        self.rounds.append(record)
        return record

    def _send_update(self, f: Any, version: int, updates: list[Encoded]) -> None:
        """The closed round's update on its way to ``f``'s replica (over the one link)."""
        if not f.offline:
            arrival = self.link.send(self.now, sum(u.nbytes for u in updates))
            self._at(arrival, "update", (f.plan.name, f.incarnation, version, updates))

    def _round_loss(self, version: int) -> float | None:
        """The held-out loss recorded with round ``version`` (None: not evaluated)."""
        if self.eval_batches and version % self.eval_every == 0:
            return self.evaluate()
        return None

    def _on_update(self, data: tuple[str, int, int, list[Encoded]]) -> None:
        name, incarnation, version, updates = data
        f = self.fellows[name]
        if f.replica is None or f.incarnation != incarnation or f.offline:
            return
        if f.replica.version >= version:
            return  # already caught up past it
        if f.replica.version < version - 1:
            self._catch_up(f)
            return
        f.replica.apply(updates, version)

    def _on_kill(self, name: str) -> None:
        f = self.fellows[name]
        if f.replica is None:
            return
        f.stream_position = f.replica.stream.position
        f.replica = None  # the process and everything it held are gone
        f.incarnation += 1
        for keeper in self.keepers:
            keeper.leave(name)

    def _on_rejoin(self, name: str) -> None:
        f = self.fellows[name]
        if f.replica is not None:
            return
        f.incarnation += 1
        replica = self._build(name, f.index)
        replica.stream.position = f.stream_position
        states = [k.join(name) for k in self.keepers]
        arrival = self.link.send(self.now, sum(s.nbytes for s in states))
        replica.reset(states)
        f.replica = replica
        f.steps_in_budget = 0
        f.offline = False
        f.rejoined_at = self.now
        self.rejoins += 1
        self.rejoin_to_training.append(arrival - self.now)
        self._at(arrival + 1.0 / f.plan.speed, "step", (name, f.incarnation))

    def _flush(self) -> None:
        for f in self.fellows.values():
            if f.replica is None or f.replica.samples_unsent == 0:
                continue
            self._catch_up(f)
            c = f.replica.take_contribution()
            self.link.send(self.now, c.nbytes)
            for s, keeper in enumerate(self.keepers):
                _, decoded, version = c.stages[s]
                keeper.contribute(c.replica, version, decoded, c.samples, self.now)
        self._close()

    # --- the global model ----------------------------------------------------------------

    def global_pipeline(self) -> LocalTrainPipeline:
        """A pipeline holding the keepers' current global parameters."""
        if self._evaluator is None:
            stages = build_stages(self.job, self.source, self.cut)
            self._evaluator = LocalTrainPipeline(stages, lr=self.job.lr)
        for stage, keeper in zip(self._evaluator.stages, self.keepers):
            write_flat(keeper.params, synced_tensors(stage))
        self._evaluator.copy_tied_weight()
        return self._evaluator

    def evaluate(self) -> float:
        return self.global_pipeline().evaluate(self.eval_batches)

    def _report(self) -> SwarmReport:
        final = self.evaluate() if self.eval_batches else None
        return SwarmReport(
            rounds=tuple(self.rounds), duration_s=self.now, bytes_sent=self.link.bytes_sent,
            computed_samples=self.computed_samples, useful_samples=self.useful_samples,
            final_loss=final, max_round_gap_s=self._max_gap,
            max_delta_wait_s=self._max_delta_wait, rejoins=self.rejoins,
            rejoin_to_training_s=tuple(self.rejoin_to_training),
            rejoin_to_useful_s=tuple(self.rejoin_to_useful))
