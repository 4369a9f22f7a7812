"""``GET /api/swarm``: the whole swarm as this fellow sees it, for the dashboard page.

One document built from the agent's public views, each read as its own op or view
returns it: ``status`` (fellows, their cards, health, last heard, the leader and its
term), the loads (``loads``: the leader's answer, or this fellow's view), the jobs (the
leader's job records) and the event ring (``agent.event_ring``), with the loads' moves
merged in as events. Live figures are rates between two looks: the view keeps a few
samples of the counts it turns into tokens per second.

Every part is bounded (losses, rounds, events), so the page costs the same after weeks
of training; a part the leader cannot answer now comes back empty with a note, never as
an error: the page is what a person looks at while the swarm is in trouble.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm.errors import SwarmError

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent

LEADER_ASK_S = 1.0  # the most one look waits for the leader's loads or jobs
LOSSES_SHOWN = 400  # the newest losses a job's curve plots
ROUNDS_SHOWN = 20
EVENTS_SHOWN = 60
MOVES_SHOWN = 10
RATE_WINDOW_S = 10.0  # a rate is taken over the looks of the last this-many seconds
SAMPLES_KEPT = 64


@dataclass(frozen=True, slots=True)
class Sample:
    at_s: float
    counts: Mapping[str, float]


class Rates:
    """Per-key rates of growing counts, from the samples of the last ``RATE_WINDOW_S``."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[Sample] = deque(maxlen=SAMPLES_KEPT)

    def look(self, now_s: float, counts: Mapping[str, float]) -> dict[str, float]:
        """Note ``counts`` at ``now_s``; each key's growth per second over the window (a
        key the window's first look lacked grew from 0; a count that went down, 0)."""
        self._samples.append(Sample(now_s, dict(counts)))
        while len(self._samples) > 2 and now_s - self._samples[1].at_s >= self.window_s:
            self._samples.popleft()
        first = self._samples[0]
        span = now_s - first.at_s
        out = {}
        for key, value in counts.items():
            grew = value - first.counts.get(key, 0.0)
            out[key] = round(grew / span, 3) if span > 0 and grew > 0 else 0.0
        return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def fellow_rows(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each fellow of ``status``: name, state, cards, last heard, and whether it leads."""
    leader = _dict(status.get("leader"))
    out = []
    for m in _list(status.get("members")):
        row = _dict(m)
        out.append({
            "id": row.get("id"), "name": row.get("name"), "addr": row.get("addr"),
            "state": row.get("state"), "incarnation": row.get("incarnation"),
            "last_heard_s": row.get("last_heard_s"),
            # this fellow has been itself since it started, whatever its record says
            "in_state_s": status.get("uptime_s") if row.get("self") else row.get("in_state_s"),
            "self": bool(row.get("self")), "leader": row.get("id") == leader.get("id"),
            "cards": [{k: c.get(k) for k in ("index", "kind", "name", "total_bytes",
                                            "free_bytes", "held_by_others") if k in c}
                      for c in map(_dict, _list(row.get("cards")))]})
    return out


def load_rows(loads: Sequence[Any], rates: Mapping[str, float],
              tokens: Mapping[str, int]) -> list[dict[str, Any]]:
    out = []
    for load in map(_dict, loads):
        plan_id = str(load.get("plan_id", ""))
        model = _dict(load.get("model"))
        out.append({
            "plan_id": plan_id, "model": model.get("name", ""),
            "state": load.get("state", "loaded"), "term": load.get("term"),
            "stages": [{k: s.get(k) for k in ("stage", "fellow", "fellow_id", "layers", "card",
                                            "state") if k in s}
                       for s in map(_dict, _list(load.get("stages")))],
            "tokens_per_s": rates.get(plan_id, 0.0), "tokens": tokens.get(plan_id, 0),
            "moves": [_dict(m) for m in _list(load.get("moves"))[-MOVES_SHOWN:]]})
    return out


def replica_rates(job: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Tokens per second per replica: the job's rate shared by each replica's local
    steps (each replica's batch is the same shape), or evenly while none are counted."""
    rate = _number(job.get("tokens_per_s")) or 0.0
    steps = {str(k): int(v) for k, v in _dict(job.get("replica_steps")).items()
             if _number(v) is not None}
    if not steps:  # replicas in lockstep: each takes every step
        n = max(1, len(_list(job.get("stages"))))
        return [{"replica": f"replica {i}", "steps": None,
                 "tokens_per_s": round(rate / n, 3)} for i in range(n)]
    total = sum(steps.values())
    return [{"replica": name, "steps": n,
             "tokens_per_s": round(rate * n / total, 3) if total else 0.0}
            for name, n in sorted(steps.items())]


def _model_name(model: Any) -> str:
    """A job's model as its record names it: a name, or a config trained from scratch."""
    if isinstance(model, str):
        return model
    return "a model from scratch" if isinstance(model, dict) else ""


def job_rows(jobs: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for job in map(_dict, jobs):
        losses = [x for x in (_number(v) for v in _list(job.get("losses"))) if x is not None]
        first = max(0, len(losses) - LOSSES_SHOWN)
        out.append({
            "job_id": job.get("job_id"), "state": job.get("state"), "reason": job.get("reason"),
            "model": _model_name(job.get("model")),
            "step": job.get("step"), "steps": job.get("steps"), "loss": job.get("loss"),
            "losses": losses[first:], "losses_from_step": first + 1,
            "tokens_per_s": job.get("tokens_per_s"), "replicas": replica_rates(job),
            "bytes_sent": job.get("bytes_sent"),
            "rounds": _list(job.get("rounds"))[-ROUNDS_SHOWN:],
            "checkpoint": job.get("checkpoint"), "checkpoint_step": job.get("checkpoint_step"),
            "checkpoint_copies": _dict(job.get("checkpoint_copies")),
            "moves": _list(job.get("moves"))[-MOVES_SHOWN:]})
    return out


def move_events(loads: Sequence[Any], wall_now_s: float) -> list[dict[str, Any]]:
    """The loads' moves (stored with wall-clock times) as events."""
    out = []
    for load in map(_dict, loads):
        for move in map(_dict, _list(load.get("moves"))[-MOVES_SHOWN:]):
            at = _number(move.get("at"))
            if at is None:
                continue
            if move.get("recut"):
                detail = (f"load {load.get('plan_id')} re-cut into plan {move.get('to_plan')}: "
                          f"{move.get('why', '')}")
            else:
                detail = (f"load {load.get('plan_id')} stage {move.get('stage')} moved from "
                          f"{move.get('from')} to {move.get('to')}: {move.get('why', '')}")
            out.append({"kind": "move", "fellow_id": str(move.get("to_id", "")),
                        "fellow": str(move.get("to", "")), "detail": detail[:300], "term": 0,
                        "ago_s": round(max(0.0, wall_now_s - at), 3)})
    return out


class SwarmView:
    """Builds ``/api/swarm`` for one agent; keeps the samples its rates need."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.load_rates = Rates()
        self._last: dict[str, tuple[float, list[Any]]] = {}  # part -> (when, last answer)

    async def _leader_part(self, what: str, ask: Any, now_s: float,
                           out: dict[str, tuple[list[Any], str]]) -> None:
        """The leader's answer for ``what``; when it does not come within
        ``LEADER_ASK_S`` (a leader just lost, before anyone knows), the last answer with a
        note saying how old it is, so the rest of the page keeps its pace."""
        try:
            with trio.fail_after(LEADER_ASK_S):
                answer = list(await ask())
            self._last[what] = (now_s, answer)
            out[what] = (answer, "")
        except (SwarmError, trio.TooSlowError) as exc:
            why = str(exc) or "the leader did not answer in time"
            at, last = self._last.get(what, (now_s, []))
            age = f" (shown as of {now_s - at:.0f} s ago)" if last else ""
            out[what] = (last, f"{what} unknown now: {why}{age}")

    async def document(self, wall_now_s: float) -> dict[str, Any]:
        agent = self.agent
        now = trio.current_time()
        status = agent.status()
        parts: dict[str, tuple[list[Any], str]] = {}
        async with trio.open_nursery() as nursery:  # both asks at once
            nursery.start_soon(self._leader_part, "loads", agent.serving.list_loads, now, parts)
            nursery.start_soon(self._leader_part, "jobs", agent.training.list_jobs, now, parts)
        loads, loads_note = parts["loads"]
        jobs, jobs_note = parts["jobs"]
        tokens = dict(agent.serving.driver.tally.tokens)
        rates = self.load_rates.look(now, tokens)
        events: list[dict[str, Any]] = [e.to_doc(now) for e in agent.event_ring.events()]
        events += move_events(loads, wall_now_s)
        events.sort(key=lambda e: float(e["ago_s"]))
        election = agent.election.status() if agent.election is not None else None
        return {
            "self": status.get("self"), "preset": status.get("preset"),
            "uptime_s": status.get("uptime_s"), "health": status.get("health"),
            "leader": status.get("leader"), "leader_note": status.get("leader_note"),
            "term": election.term if election is not None else 0,
            "role": status.get("role"),
            "electorate": election.electorate if election is not None else 0,
            "sees": election.sees if election is not None else 0,
            "fellows": fellow_rows(status),
            "loads": load_rows(loads, rates, tokens), "loads_note": loads_note,
            "jobs": job_rows(jobs), "jobs_note": jobs_note,
            "events": events[:EVENTS_SHOWN],
        }


__all__ = ["Rates", "SwarmView", "fellow_rows", "job_rows", "load_rows", "move_events",
           "replica_rates"]
