"""``GET /metrics``: the agent in Prometheus' text format, read at scrape time.

One custom collector (``SwarmCollector``) reads the counts the agent already keeps when a
scrape comes, so nothing in the agent pushes metrics anywhere: the traffic counters
(``agent.counters``), the membership machine's counts and probe round trips, the
election's status, the event ring's count per kind (leader changes, deaths), the loop
lag, the generations' tally and admission queues, the leader's loads, and, on the leader
only, its jobs' records (a job is the leader's: every fellow reporting it would count it
as many times). Families are named ``p2pswarm_*``; a counter that Prometheus shows as
``*_total`` counts since this agent started.

The route sits behind the same ``--http-token`` guard as the JSON API.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from p2pswarm.errors import SwarmError
from p2pswarm.http.swarm_view import Rates, replica_rates

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent

STATES = ("alive", "suspect", "dead", "left")
LEADER_KINDS = ("leader", "elected")  # event kinds that name a new leader on this side
LABEL_CHARS = 120  # a label value is a name or a reason, never a document


def _label(value: object) -> str:
    return str(value)[:LABEL_CHARS]


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    return float(value)


class SwarmCollector(Collector):
    """Every family of one agent; ``jobs`` is set by the scrape (the leader's records)."""

    def __init__(self, agent: Agent, http_errors: Counter[str]) -> None:
        self.agent = agent
        self.http_errors = http_errors
        self.jobs: Sequence[Mapping[str, Any]] = ()
        self._token_rates = Rates()

    def collect(self) -> Iterator[Metric]:
        yield from self._membership()
        yield from self._election()
        yield from self._transport()
        yield from self._serving()
        yield from self._training()

    # --- membership --------------------------------------------------------------------

    def _membership(self) -> Iterable[Metric]:
        agent = self.agent
        members = GaugeMetricFamily("p2pswarm_members", "Fellows this agent knows, by state "
                                    "(itself included)", labels=["state"])
        states: Counter[str] = Counter(str(m.state) for m in agent.members())
        for state in (*STATES, *sorted(set(states) - set(STATES))):
            members.add_metric([state], states.get(state, 0))
        yield members
        membership = agent.membership
        stats = membership.counters() if membership is not None else {}
        for key, name, doc in (
                ("suspicions_raised", "suspicions", "Suspicions this agent raised"),
                ("refutations", "refutations", "Suspicions of this agent it refuted (false "
                                               "suspicions)"),
                ("probes", "probes", "Probes sent"),
                ("probes_failed", "probes_failed", "Probes that failed, helpers included"),
                ("dead_declared", "dead_declared", "Fellows this agent declared dead")):
            yield CounterMetricFamily(f"p2pswarm_membership_{name}", doc,
                                      value=stats.get(key, 0))
        yield GaugeMetricFamily("p2pswarm_membership_health", "Local health score (0 is "
                                "healthy; Lifeguard's awareness)",
                                value=membership.health_score if membership else 0)
        rtt = HistogramMetricFamily("p2pswarm_membership_probe_rtt_seconds",
                                    "Round trip of direct probes acknowledged")
        if membership is not None:
            trips = membership.probe_round_trips
            rtt.add_metric([], [("+Inf" if b == float("inf") else repr(b), n)
                                for b, n in trips.cumulative()], trips.sum_s)
        else:
            rtt.add_metric([], [("+Inf", 0)], 0.0)
        yield rtt

    # --- election ----------------------------------------------------------------------

    def _election(self) -> Iterable[Metric]:
        agent = self.agent
        status = agent.election.status() if agent.election is not None else None
        yield GaugeMetricFamily("p2pswarm_election_term", "The election term this agent is in",
                                value=status.term if status else 0)
        yield GaugeMetricFamily("p2pswarm_election_is_leader", "1 while this agent leads",
                                value=1 if status and status.role == "leader" else 0)
        yield GaugeMetricFamily("p2pswarm_election_has_leader", "1 while this side has a "
                                "leader", value=1 if status and status.leader_id else 0)
        yield GaugeMetricFamily("p2pswarm_election_electorate", "Fellows a majority is "
                                "counted of", value=status.electorate if status else 0)
        kinds = agent.event_ring.kinds
        yield CounterMetricFamily("p2pswarm_election_leader_changes", "Times this agent "
                                  "saw a new leader (itself included)",
                                  value=sum(kinds.get(k, 0) for k in LEADER_KINDS))
        events = CounterMetricFamily("p2pswarm_events", "Membership, election and load "
                                     "events, by kind", labels=["kind"])
        for kind, n in sorted(kinds.items()):
            events.add_metric([_label(kind)], n)
        yield events
        refused = CounterMetricFamily("p2pswarm_election_refused", "Election messages "
                                      "refused, by reason", labels=["reason"])
        for reason, n in sorted((agent.election.refused if agent.election else {}).items()):
            refused.add_metric([_label(reason)], n)
        yield refused

    # --- transport ---------------------------------------------------------------------

    def _transport(self) -> Iterable[Metric]:
        c = self.agent.counters
        for name, doc, pair in (
                ("bytes", "Datagram bytes", (c.bytes_in, c.bytes_out)),
                ("datagrams", "Datagrams", (c.datagrams_in, c.datagrams_out)),
                ("streams", "Secure streams", (c.streams_in, c.streams_out)),
                ("frames", "Stream frames", (c.frames_in, c.frames_out))):
            family = CounterMetricFamily(f"p2pswarm_transport_{name}", doc,
                                         labels=["direction"])
            family.add_metric(["in"], pair[0])
            family.add_metric(["out"], pair[1])
            yield family
        drops = CounterMetricFamily("p2pswarm_transport_drops", "What was dropped, by "
                                    "reason", labels=["reason"])
        for reason, n in sorted(c.drops.items()):
            drops.add_metric([_label(reason)], n)
        yield drops
        refused = CounterMetricFamily("p2pswarm_refused", "Well-formed requests and orders "
                                      "refused, by reason", labels=["reason"])
        for reason, n in sorted(c.refused.items()):
            refused.add_metric([_label(reason)], n)
        yield refused
        http = CounterMetricFamily("p2pswarm_http_refused", "HTTP requests answered with an "
                                   "error, by its code (plan-changed, refused, unauthorized, "
                                   "...)", labels=["code"])
        for code, n in sorted(self.http_errors.items()):
            http.add_metric([_label(code)], n)
        yield http
        lag = self.agent.loop_lag
        yield GaugeMetricFamily("p2pswarm_loop_lag_max_seconds", "The latest this agent's "
                                "timer ever rang (its own CPU busy)", value=lag.max_s)
        late = CounterMetricFamily("p2pswarm_loop_late", "Timer rings later than a bound",
                                   labels=["over_seconds"])
        late.add_metric(["0.1"], lag.over_0_1_s)
        late.add_metric(["1"], lag.over_1_s)
        yield late

    # --- serving -----------------------------------------------------------------------

    def _serving(self) -> Iterable[Metric]:
        serving = self.agent.serving
        tally = serving.driver.tally
        tokens = CounterMetricFamily("p2pswarm_serving_tokens", "Tokens generated through "
                                     "this agent, by load", labels=["plan_id"])
        for plan_id, n in tally.tokens.items():
            tokens.add_metric([_label(plan_id)], n)
        yield tokens
        rates = self._token_rates.look(self.agent_now(), dict(tally.tokens))
        speed = GaugeMetricFamily("p2pswarm_serving_tokens_per_second", "Tokens per second "
                                  "generated through this agent lately, by load",
                                  labels=["plan_id"])
        for plan_id, rate in rates.items():
            speed.add_metric([_label(plan_id)], rate)
        yield speed
        yield SummaryMetricFamily("p2pswarm_serving_first_token_seconds", "Time to the "
                                  "first token of generations through this agent",
                                  count_value=tally.first_tokens,
                                  sum_value=tally.first_token_s_sum)
        queue = GaugeMetricFamily("p2pswarm_serving_queue_depth", "Generations waiting for "
                                  "a slot on this agent, by load", labels=["plan_id"])
        running = GaugeMetricFamily("p2pswarm_serving_sessions_running", "Generations "
                                    "running through this agent, by load", labels=["plan_id"])
        admission = serving.driver.admission
        plan_ids = sorted(set(tally.tokens) | set(serving.loads))
        for plan_id in plan_ids:
            queue.add_metric([_label(plan_id)], admission.waiting(plan_id))
            running.add_metric([_label(plan_id)], admission.running(plan_id))
        yield queue
        yield running
        moves = GaugeMetricFamily("p2pswarm_serving_failovers", "Stage moves (failovers "
                                  "and re-cuts) of each load this agent leads, as its record "
                                  "keeps them", labels=["plan_id"])
        for plan_id, load in sorted(serving.loads.items()):
            moves.add_metric([_label(plan_id)], len(load.moves))
        yield moves
        stages = GaugeMetricFamily("p2pswarm_serving_stages_held", "Stages this agent holds, "
                                   "by state", labels=["state"])
        for state, n in sorted(Counter(str(h.get("state")) for h in
                                       serving.held_stages()).items()):
            stages.add_metric([_label(state)], n)
        yield stages

    @staticmethod
    def agent_now() -> float:
        try:
            return trio.current_time()
        except RuntimeError:  # collected outside the agent's loop (a test)
            return 0.0

    # --- training (the leader's jobs) --------------------------------------------------

    def _training(self) -> Iterable[Metric]:
        labels = ["job_id"]
        loss = GaugeMetricFamily("p2pswarm_training_loss", "The job's latest loss",
                                 labels=labels)
        step = GaugeMetricFamily("p2pswarm_training_step", "Steps the job has taken",
                                 labels=labels)
        speed = GaugeMetricFamily("p2pswarm_training_tokens_per_second", "The job's tokens "
                                  "per second", labels=labels)
        per_replica = GaugeMetricFamily("p2pswarm_training_replica_tokens_per_second",
                                        "Tokens per second per replica (the job's, shared by "
                                        "local steps)", labels=["job_id", "replica"])
        round_s = GaugeMetricFamily("p2pswarm_training_round_seconds", "Mean time between "
                                    "the job's recent sync rounds", labels=labels)
        rounds = GaugeMetricFamily("p2pswarm_training_rounds", "Sync rounds closed (the "
                                   "newest round's version)", labels=labels)
        sent = CounterMetricFamily("p2pswarm_training_bytes_sent", "Bytes the job's sync "
                                   "sent", labels=labels)
        per_round = GaugeMetricFamily("p2pswarm_training_bytes_per_round", "Sync bytes per "
                                      "round closed", labels=labels)
        running = GaugeMetricFamily("p2pswarm_training_jobs", "Jobs this leader keeps, by "
                                    "state", labels=["state"])
        states: Counter[str] = Counter()
        for job in self.jobs:
            job_id = [_label(job.get("job_id", ""))]
            states[str(job.get("state"))] += 1
            if job.get("loss") is not None:
                loss.add_metric(job_id, _number(job.get("loss")))
            step.add_metric(job_id, _number(job.get("step")))
            speed.add_metric(job_id, _number(job.get("tokens_per_s")))
            for r in replica_rates(job):
                per_replica.add_metric([*job_id, _label(r["replica"])], r["tokens_per_s"])
            closed = [r for r in job.get("rounds") or [] if isinstance(r, dict)]
            times = [_number(r.get("closed_at_s")) for r in closed]
            if len(times) >= 2:
                round_s.add_metric(job_id, (times[-1] - times[0]) / (len(times) - 1))
            version = _number(closed[-1].get("version")) if closed else 0.0
            rounds.add_metric(job_id, version)
            bytes_sent = _number(job.get("bytes_sent"))
            sent.add_metric(job_id, bytes_sent)
            if version > 0:
                per_round.add_metric(job_id, bytes_sent / version)
        for state, n in sorted(states.items()):
            running.add_metric([_label(state)], n)
        yield from (loss, step, speed, per_replica, round_s, rounds, sent, per_round, running)


class Metrics:
    """The registry of one agent's HTTP server and the scrape that fills it."""

    def __init__(self, agent: Agent, http_errors: Counter[str]) -> None:
        self.agent = agent
        self.collector = SwarmCollector(agent, http_errors)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)

    async def scrape(self) -> bytes:
        from prometheus_client import generate_latest

        jobs: list[Mapping[str, Any]] = []
        if self.agent.leadership.is_leader():  # the leader answers from its own records
            try:
                jobs = list(await self.agent.training.list_jobs())
            except SwarmError:  # the jobs are missing from this scrape, not the rest
                jobs = []
        self.collector.jobs = jobs
        return generate_latest(self.registry)


__all__ = ["Metrics", "SwarmCollector"]
