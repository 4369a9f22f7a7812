"""The WiFi-dropout harness: a scenario run on real agents in virtual time, judged.

Theory of operation. ``run_scenario`` builds a ``VirtualSwarm`` of real ``Agent``s on
one ``MemoryNetwork``, gives each fellow the radio of its profile (loss on everything it
sends and hears, the profile's delay on its links), and runs one trio program under a
jumping virtual clock with trio's scheduler seeded (``seeded_scheduler``), so the run is
a function of the scenario and its seed. A director task turns the scenario into one
timeline of typed actions (``p2pswarm.sim.actions``: starts, scripted events, events
drawn at rates, roaming outages), all drawn up front from generators seeded by the
scenario's seed, and the ``Director`` (``p2pswarm.sim.director``) performs them in order
on this run, which is its virtual ``World``; each thing the world does, it tells the
oracle. Every agent's world (``AgentWorld``) has the oracle as its event sink: each
membership and election event reaches it with the virtual time.

Alongside, small tasks measure: the leader is asked for a plan of a fixed request every
``plan.every_s`` (the plan's ``plan_id`` must not change unless a card or fellow really
changed); a few fellows' views are sampled every ``sample_every_s``; after a leader is
killed, every fellow's election status is polled until all agree on a new leader
(failover time). Traffic comes from each agent's own counters.

Variants. ``ours`` runs the scenario's preset. ``baseline`` runs memberlist's LAN
defaults (``p2pswarm.sim.baseline``), a config like any preset, its machines' tunings
included. A variant may also swap the membership machine for a subclass (a planted bug,
to show the oracle catches it). Each variant is handed to the agents as their world
(``AgentWorld``): its config, the machine it builds, the oracle as its event sink.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import trio

from p2pswarm import effects as fx
from p2pswarm.agent import Agent
from p2pswarm.agent.world import AgentWorld, MembershipFactory, Services
from p2pswarm.config import SwarmConfig, preset
from p2pswarm.errors import ConfigError, SwarmError
from p2pswarm.membership.machine import Membership
from p2pswarm.membership.updates import Updates
from p2pswarm.planner import BUILTIN_MODELS, REFERENCE_CONFIGS
from p2pswarm.sim.actions import TimedAction, build_timeline
from p2pswarm.sim.baseline import memberlist_config, missing_switches
from p2pswarm.sim.director import Director
from p2pswarm.sim.metrics import summary
from p2pswarm.sim.oracle import Oracle
from p2pswarm.sim.profiles import Profile, link_delay, link_loss, profile
from p2pswarm.sim.scenario import Scenario
from p2pswarm.sim.virtual import Fellow, JumpClock, VirtualSwarm, cpu_card, seeded_scheduler
from p2pswarm.transport.memory import Bernoulli, LinkModel

ProgressFn = Callable[[float, float], None]  # (virtual now, virtual end)
VIEW_OBSERVERS = 16  # fellows whose whole view is sampled
FAILOVER_POLL_S = 0.05
FAILOVER_GIVE_UP_S = 120.0


# --- variants ---------------------------------------------------------------------------


class NeverRefutes(Membership):
    """A planted bug: a fellow that never refutes a suspicion of itself. The oracle's
    refutation check catches it: others hold it suspect or dead while they can reach it."""

    def _refute(self, *args: Any, **kwargs: Any) -> None:
        return None


class _UpdatesThatNeverDeclare(Updates):
    __slots__ = ()

    def declare_dead(self, node: bytes, now: float, out: list[fx.Effect]) -> None:
        return None


class NeverDeclaresDead(Membership):
    """A planted bug: a fellow whose own evidence never makes it declare another dead (its
    suspicions time out into nothing). The oracle's detection check catches it: a crashed
    fellow is never seen as dead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._updates.__class__ = _UpdatesThatNeverDeclare  # every path to a verdict


# every planted bug the oracle must catch (tests/test_sim_plants.py runs each)
PLANTED: dict[str, type[Membership]] = {"never-refutes": NeverRefutes,
                                        "never-declares-dead": NeverDeclaresDead}


@dataclass(frozen=True)
class Variant:
    name: str
    config: SwarmConfig  # the machines' tunings included
    membership: MembershipFactory = Membership  # builds each agent's membership machine


def variant_for(scenario: Scenario, name: str, planted: str | None = None) -> Variant:
    if name == "ours":
        v = Variant("ours", preset(scenario.preset))
    elif name == "baseline":
        v = Variant("baseline", memberlist_config(scenario.nodes))
    else:
        raise ConfigError(f"unknown variant {name!r}: use ours or baseline")
    if planted is not None:
        if planted not in PLANTED:
            raise ConfigError(f"unknown planted bug {planted!r}: use one of "
                              f"{', '.join(PLANTED)}")
        v = Variant(f"{v.name}+{planted}", v.config, PLANTED[planted])
    return v


def plan_message(request: dict[str, Any]) -> dict[str, Any]:
    """A scenario's plan request as the agent's plan op takes it."""
    message = dict(request)
    model = message.get("model")
    if isinstance(model, str):
        config = BUILTIN_MODELS.get(model) or REFERENCE_CONFIGS.get(model)
        if config is None:
            raise ConfigError(f"unknown model {model!r} in the scenario's plan request")
        message["model"] = {"name": model, "config": dict(config)}
    return message


def _link_model(a: Profile, b: Profile) -> LinkModel:
    loss = link_loss(a, b)
    return LinkModel(delay=link_delay(a, b), loss=Bernoulli(loss) if loss > 0 else None)


class StallGuard(trio.abc.Instrument):
    """Ends a run whose virtual time stops moving: some task is busy at one instant (a
    deadline that never advances), which would otherwise spin forever."""

    def __init__(self, limit: int = 200_000) -> None:
        self.limit = limit
        self.scope: trio.CancelScope | None = None
        self.stuck_at: float | None = None
        self._t = -1.0
        self._n = 0

    def before_io_wait(self, timeout: float) -> None:
        t = trio.current_time()
        if t != self._t:
            self._t, self._n = t, 0
            return
        self._n += 1
        if self._n == self.limit and self.scope is not None:
            self.stuck_at = t
            self.scope.cancel()


# --- one run ----------------------------------------------------------------------------


class ScenarioRun:
    def __init__(self, scenario: Scenario, variant: Variant,
                 progress: ProgressFn | None = None) -> None:
        self.scenario = scenario
        self.variant = variant
        self.progress = progress
        n = scenario.nodes
        self.n = n
        self.rng = random.Random(f"director:{scenario.seed}")
        spec = scenario.training
        # a training job's stage compute runs inline; each step takes step_s of virtual time
        services = Services(training_step_s=spec.step_s,
                            training_step_timeout_s=10.0 * spec.step_s,
                            training_retry_s=2.0) if spec.job else Services()
        self.swarm = VirtualSwarm(n, seed=scenario.seed, config=variant.config,
                                  agent_factory=self._make_agent,
                                  inline_compute=bool(spec.job), services=services)
        self.net = self.swarm.net
        self.layout = scenario.profiles()
        self.profiles: list[Profile] = [profile(p) for p, _, _ in self.layout]
        for f, (_, priority, cpu_gb) in zip(self.swarm.fellows, self.layout):
            f.leader_priority = priority
            f.cards.cards = (cpu_card(cpu_gb),)
        self.cpu_gb = [gb for _, _, gb in self.layout]
        self.index_of = {f.identity.node_id: f.index for f in self.swarm.fellows}
        self.oracle = Oracle(n, scenario.checks, measure_from_s=scenario.warmup_s,
                             gossip_interval_s=variant.config.gossip.gossip_interval_s,
                             plan_grace_s=scenario.plan.grace_s)
        self.ever_started = [False] * n
        self.cut = [False] * n
        self.next_join = scenario.start if scenario.start is not None else n
        self.traffic = [[0, 0, 0, 0, 0] for _ in range(n)]  # d_out, b_out, d_in, b_in, streams
        self.offset: dict[int, list[int]] = {}
        self.partition_active = False
        self.guard = StallGuard()
        self.end_s = 0.0
        self.notes: list[str] = []
        self.training: dict[str, Any] = {}  # the training job's figures, if one ran
        if variant.name.startswith("baseline") and missing_switches():
            self.notes.append("this membership machine lacks the baseline switches "
                              f"{', '.join(missing_switches())}: left at our defaults")
        self._apply_profiles()

    # the network --------------------------------------------------------------------

    def _apply_profiles(self) -> None:
        counts: dict[str, int] = {}
        for p in self.profiles:
            counts[p.name] = counts.get(p.name, 0) + 1
        common = profile(max(sorted(counts), key=lambda k: counts[k]))
        default = _link_model(common, common)
        self.net.set_default(default)
        addrs = [f.addr for f in self.swarm.fellows]
        for i, p in enumerate(self.profiles):
            self.net.set_radio(addrs[i], p.radio)
            if p.radio is not None:
                self.net.watch_radio(addrs[i], functools.partial(self._bad_stay, i))
        if len(counts) > 1:
            for i, a in enumerate(self.profiles):
                for j, b in enumerate(self.profiles):
                    if i != j and (a.name != common.name or b.name != common.name):
                        model = _link_model(a, b)
                        if model != default:
                            self.net.set_link(addrs[i], addrs[j], model)

    def _bad_stay(self, i: int, start: float, end: float) -> None:
        if end - start >= self.scenario.checks.blackout_min_s:
            self.oracle.blackout(i, start, end)

    def _make_agent(self, fellow: Fellow, world: AgentWorld) -> Agent:
        """The real agent in this run's world: the variant's machine, and every event it
        notes handed to the oracle."""
        index = fellow.index

        def on_event(event: fx.Event) -> None:
            self.on_event(agent, index, event)

        agent = Agent(replace(world, on_event=on_event, membership=self.variant.membership))
        return agent

    # events from agents ---------------------------------------------------------------

    def on_event(self, agent: Agent, index: int, event: fx.Event) -> None:
        subject = self.index_of.get(event.node_id, -1)
        version = 0
        if event.kind == fx.METADATA and agent.membership is not None:
            if subject == index:
                version = agent.membership.meta_version
            else:
                member = agent.membership.member(event.node_id)
                version = member.meta_version if member is not None else 0
        self.oracle.event(trio.current_time(), index, event.kind, subject,
                          event.incarnation, event.term, version,
                          bool(event.by) and event.by == agent.node_id)

    # the timeline ---------------------------------------------------------------------

    def timeline(self) -> list[TimedAction]:
        return build_timeline(self.scenario, self.profiles, self.next_join)

    async def director(self, nursery: trio.Nursery) -> None:
        director = Director(self, self.scenario, self.n, self.next_join, self.rng)
        await director.run(self.timeline(), nursery)

    # the world the director acts on (p2pswarm.sim.director.World) ----------------------

    def now(self) -> float:
        return trio.current_time()

    async def sleep_until(self, t: float) -> None:
        await trio.sleep_until(t)

    def running(self, i: int) -> bool:
        return self.swarm.fellows[i].agent is not None and self.oracle.running[i]

    def has_started(self, i: int) -> bool:
        return self.ever_started[i]

    def is_cut(self, i: int) -> bool:
        return self.cut[i]

    def _seeds(self, exclude: int) -> tuple[str, ...]:
        live = [i for i in range(self.n) if i != exclude and self.running(i) and not self.cut[i]]
        return tuple(self.swarm.fellows[i].addr for i in live[:3])

    def link_down(self, i: int) -> None:
        self.cut[i] = True
        self.net.down(self.swarm.fellows[i].addr)
        self.oracle.cut(i, trio.current_time())

    def link_up(self, i: int) -> None:
        self.cut[i] = False
        if self.running(i):
            self.net.up(self.swarm.fellows[i].addr)
        self.oracle.uncut(i, trio.current_time())

    def partition(self, groups: list[list[int]]) -> None:
        self.net.partition(*[{self.swarm.fellows[i].addr for i in g} for g in groups])
        self.oracle.partitioned(groups, trio.current_time())

    def heal(self) -> None:
        self.net.heal()
        self.oracle.healed(trio.current_time())

    def leader(self) -> int | None:
        return self.current_leader()

    def kill_leader(self, i: int, nursery: trio.Nursery) -> None:
        now = trio.current_time()
        old_id = self.swarm.fellows[i].identity.node_id
        self.crash(i)
        nursery.start_soon(self.watch_failover, now, i, old_id)

    def card_is_free(self, i: int) -> bool:
        card = self.swarm.fellows[i].cards.cards[0]
        return card.free_bytes >= card.total_bytes

    def set_card(self, i: int, free_gb: float | None) -> None:
        total = self.cpu_gb[i]
        self.swarm.fellows[i].cards.cards = (
            cpu_card(total, total if free_gb is None else min(total, free_gb)),)
        self.oracle.card_changed(i, trio.current_time())

    def note(self, text: str) -> None:
        self.notes.append(text)

    async def start(self, i: int) -> None:
        seeds = None if not self.ever_started[i] and i == 0 else self._seeds(i)
        if not self.ever_started[i] and i != 0 and not seeds:
            seeds = (self.swarm.fellows[0].addr,)
        self.cut[i] = False
        await self.swarm.start(i, seeds=seeds)
        self.ever_started[i] = True
        self.oracle.started(i, trio.current_time())
        if trio.current_time() >= self.scenario.warmup_s:
            self.offset[i] = [0, 0, 0, 0, 0]

    async def form(self) -> None:
        """Start the first fellows at once, each already knowing all the others."""
        starters = range(self.next_join)
        for i in starters:
            await self.swarm.start(i, seeds=())
            self.ever_started[i] = True
            self.oracle.started(i, trio.current_time())
        records = [self.swarm.fellows[i].agent.membership.self_record()  # type: ignore[union-attr]
                   for i in starters]
        for i in starters:
            agent = self.swarm.fellows[i].agent
            assert agent is not None
            agent.merge_records([r for k, r in zip(starters, records) if k != i], quiet=True)

    def crash(self, i: int) -> None:
        self._account(i)
        if self.cut[i]:
            self.cut[i] = False
        self.swarm.crash(i)
        self.oracle.crashed(i, trio.current_time())

    async def leave(self, i: int) -> None:
        agent = self.swarm.fellows[i].agent
        if agent is None:
            return
        self.oracle.left_swarm(i, trio.current_time())
        await self.swarm.leave(i)
        self._account_agent(i, agent)

    def _account(self, i: int) -> None:
        agent = self.swarm.fellows[i].agent
        if agent is not None:
            self._account_agent(i, agent)

    def _account_agent(self, i: int, agent: Agent) -> None:
        c = agent.counters
        now = (c.datagrams_out, c.bytes_out, c.datagrams_in, c.bytes_in, c.streams_out)
        base = self.offset.pop(i, None)
        if base is None:
            return  # stopped before measuring began
        for k in range(5):
            self.traffic[i][k] += now[k] - base[k]

    def _snapshot_offsets(self) -> None:
        for i, f in enumerate(self.swarm.fellows):
            if f.agent is not None:
                c = f.agent.counters
                self.offset[i] = [c.datagrams_out, c.bytes_out, c.datagrams_in, c.bytes_in,
                                  c.streams_out]

    # measurements ---------------------------------------------------------------------

    def current_leader(self) -> int | None:
        best: tuple[int, int] | None = None
        for i, f in enumerate(self.swarm.fellows):
            agent = f.agent
            if agent is None or agent.election is None or not self.oracle.running[i]:
                continue
            status = agent.election.status()
            if status.leader_id == agent.node_id and (best is None or status.term > best[0]):
                best = (status.term, i)
        return None if best is None else best[1]

    async def watch_failover(self, killed_at: float, old: int, old_id: bytes) -> None:
        give_up = killed_at + FAILOVER_GIVE_UP_S
        while trio.current_time() < min(give_up, self.scenario.duration_s):
            await trio.sleep(FAILOVER_POLL_S)
            leaders = set()
            for i, f in enumerate(self.swarm.fellows):
                if f.agent is None or f.agent.election is None or self.cut[i]:
                    continue
                if not self.oracle.running[i] or not f.agent.membership \
                        or not f.agent.membership.joined:
                    continue
                leaders.add(f.agent.election.status().leader_id)
                if len(leaders) > 1:
                    break
            if len(leaders) == 1:
                (leader,) = leaders
                if leader is not None and leader != old_id:
                    self.oracle.failover(killed_at, trio.current_time(), old,
                                         self.index_of.get(leader))
                    return
        self.oracle.failover(killed_at, None, old, None)

    async def plan_probe(self) -> None:
        probe = self.scenario.plan
        if probe.every_s <= 0:
            return
        message = plan_message(probe.request)
        await trio.sleep_until(self.scenario.warmup_s)
        while True:
            leader = self.current_leader()
            plan_id = None
            if leader is not None:
                agent = self.swarm.fellows[leader].agent
                assert agent is not None
                try:
                    result = await agent.planning.plan(message)
                    plan_id = str(result.get("plan_id"))
                except SwarmError as exc:
                    plan_id = f"error: {exc}"[:80]
            self.oracle.plan_sample(trio.current_time(), -1 if leader is None else leader,
                                    plan_id)
            await trio.sleep(probe.every_s)

    async def sample_views(self) -> None:
        every = self.scenario.sample_every_s
        if every <= 0:
            return
        while True:
            await trio.sleep(every)
            running = [i for i in range(self.n) if self.running(i)]
            step = max(1, len(running) // VIEW_OBSERVERS)
            observers = running[::step][:VIEW_OBSERVERS]
            running_ids = {self.swarm.fellows[i].identity.node_id for i in running}
            tally = {"alive": 0, "suspect": 0, "dead": 0, "left": 0, "missing": 0}
            for i in observers:
                agent = self.swarm.fellows[i].agent
                if agent is None or agent.membership is None:
                    continue
                seen = set()
                for m in agent.membership.members():
                    if m.node_id in running_ids and not m.is_self:
                        tally[m.state] += 1
                        seen.add(m.node_id)
                tally["missing"] += len(running_ids) - 1 - len(seen)
            total = max(1, sum(tally.values()))
            self.oracle.view_sample({
                "t": round(trio.current_time(), 3), "running": len(running),
                "cut": sum(self.cut), "leader": self.current_leader(),
                **{k: round(v / total, 5) for k, v in tally.items()}})

    async def train(self) -> None:
        """Give the leader the scenario's training job once warm, then follow the job's
        record until it ends (or its leader is gone): ``training`` in the result."""
        spec = self.scenario.training
        if not spec.job:
            return
        await trio.sleep_until(self.scenario.warmup_s)
        while (leader := self.current_leader()) is None:
            await trio.sleep(1.0)
        agent = self.swarm.fellows[leader].agent
        assert agent is not None
        self.training["leader"] = leader
        try:
            record = await agent.training.submit(dict(spec.job))
        except SwarmError as exc:
            self.training.update(state="refused", reason=str(exc))
            return
        job = agent.training.jobs[record["job_id"]]
        started = trio.current_time()
        timeline: list[list[Any]] = []
        self.training.update(started_s=round(started, 3), timeline=timeline)
        try:
            while True:
                timeline.append([round(trio.current_time(), 3), job.step, job.samples,
                                 job.loss, job.replicas])
                if job.state in ("finished", "failed", "cancelled"):
                    break
                if self.swarm.fellows[leader].agent is not agent:
                    self.training["reason"] = "its leader was stopped"
                    break
                await trio.sleep(min(self.scenario.sample_every_s, 5.0))
        finally:  # also when the run ends first: the figures so far
            self._training_figures(job, started, trio.current_time())

    def _training_figures(self, job: Any, started: float, now: float) -> None:
        spec = self.scenario.training
        took = now - started
        losses = job.losses
        if job.state in ("pending", "running") and not self.training.get("reason"):
            self.training["reason"] = "the run ended first"
        self.training.update(
            state=job.state, reason=self.training.get("reason") or job.reason,
            steps=job.step, of=int(spec.job.get("steps", 0)), seconds=round(took, 3),
            samples=job.samples,
            samples_per_s=round(job.samples / took, 4) if took > 0 else None,
            loss_first=losses[0] if losses else None,
            loss_end=sum(losses[-5:]) / len(losses[-5:]) if losses else None,  # last 5 steps
            replicas=job.replicas, rejoins=job.rejoins, paused_times=job.paused_times,
            bytes_sent=job.bytes_sent)

    async def report_progress(self) -> None:
        if self.progress is None:
            return
        end = self.scenario.duration_s
        step = max(1.0, end / 400)
        while True:
            self.progress(trio.current_time(), end)
            await trio.sleep(step)

    async def main(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.guard.scope = nursery.cancel_scope
            await nursery.start(self.swarm.run)
            nursery.start_soon(self.plan_probe)
            nursery.start_soon(self.sample_views)
            nursery.start_soon(self.report_progress)
            nursery.start_soon(self._offsets_at_warmup)
            nursery.start_soon(self.train)
            await self.director(nursery)
            self.end_s = trio.current_time()
            nursery.cancel_scope.cancel()
        if self.guard.stuck_at is not None:
            self.end_s = self.guard.stuck_at

    async def _offsets_at_warmup(self) -> None:
        await trio.sleep_until(self.scenario.warmup_s)
        self._snapshot_offsets()

    # the result -----------------------------------------------------------------------

    def result(self) -> dict[str, Any]:
        end = self.end_s
        for i in range(self.n):
            self._account(i)
        judged = self.oracle.finish(end)
        if self.guard.stuck_at is not None:
            judged["ok"] = False
            judged["failures"].insert(0, f"virtual time stopped at {self.guard.stuck_at:.3f} s: "
                                         "a task kept running at that instant (a deadline "
                                         "that never advances); the run was ended there")
        seconds = [self.oracle.run_seconds[i] for i in range(self.n)]
        rates: dict[str, list[float]] = {"datagrams_out": [], "bytes_out": [],
                                         "datagrams_in": [], "bytes_in": [],
                                         "streams_out": []}
        for i in range(self.n):
            if seconds[i] <= 0:
                continue
            for k, key in enumerate(rates):
                rates[key].append(self.traffic[i][k] / seconds[i])
        traffic: dict[str, Any] = {f"{k}_per_fellow_s": summary(v, 2)
                                   for k, v in rates.items()}
        traffic["_bytes_out_per_fellow_s"] = [round(v, 2) for v in rates["bytes_out"]]
        by_profile: dict[str, list[float]] = {}
        for i in range(self.n):
            if seconds[i] > 0:
                by_profile.setdefault(self.profiles[i].name, []).append(
                    self.traffic[i][1] / seconds[i])
        traffic["bytes_out_per_fellow_s_by_profile"] = {
            k: round(sum(v) / len(v), 2) for k, v in sorted(by_profile.items())}
        return {
            "scenario": self.scenario.to_dict(),
            "variant": self.variant.name,
            "preset": self.variant.config.preset,
            "seed": self.scenario.seed,
            "nodes": self.n,
            "duration_s": self.scenario.duration_s,
            "warmup_s": self.scenario.warmup_s,
            "profiles": {p: sum(1 for q in self.profiles if q.name == p)
                         for p in sorted({q.name for q in self.profiles})},
            **judged,
            "traffic": traffic,
            "network": dict(self.net.counters),
            "views": self.oracle.view_samples,
            "training": self.training or None,
            "notes": self.notes,
        }


def run_scenario(scenario: Scenario, variant: str = "ours", *, planted: str | None = None,
                 progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run ``scenario`` once (its own seed) and return the judged result."""
    wall0, cpu0 = time.perf_counter(), _cpu_s()
    result = play_scenario(scenario, variant, planted=planted, progress=progress).result()
    wall, cpu = time.perf_counter() - wall0, _cpu_s() - cpu0
    result["wall_s"] = round(wall, 2)
    result["cpu_s"] = round(cpu, 2)
    result["virtual_per_cpu_s"] = round(scenario.duration_s / cpu, 2) if cpu > 0 else None
    return result


def play_scenario(scenario: Scenario, variant: str = "ours", *, planted: str | None = None,
                  progress: ProgressFn | None = None) -> ScenarioRun:
    """Run ``scenario`` once (its own seed); the finished run's oracle holds every verdict."""
    v = variant_for(scenario, variant, planted)
    run = ScenarioRun(scenario, v, progress)
    with seeded_scheduler(scenario.seed), quiet_agents(), \
            one_torch_thread(bool(scenario.training.job)):
        trio.run(run.main, clock=JumpClock(), instruments=[run.guard])
    return run


@contextlib.contextmanager
def one_torch_thread(needed: bool) -> Iterator[None]:
    """Training stages on one torch thread for a run: the same arithmetic run after run."""
    if not needed:
        yield
        return
    import torch
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextlib.contextmanager
def quiet_agents() -> Iterator[None]:
    """Agents' log lines off for a run (the oracle has every event)."""
    logger = logging.getLogger("p2pswarm")
    saved = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(saved)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


__all__ = [
    "PLANTED",
    "NeverDeclaresDead",
    "NeverRefutes",
    "ScenarioRun",
    "Variant",
    "build_timeline",
    "plan_message",
    "run_scenario",
    "variant_for",
]
