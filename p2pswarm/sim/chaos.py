"""Churn on real `p2pswarm join` processes while a model is loaded and a job trains.

Two swarms of the same size run side by side, on loopback: the *chaos* swarm, where
every few seconds one event hits one fellow (drawn from the seed), and the *calm* swarm,
where nothing happens. Both load the same model and train the same job (same seed), so
the chaos job's final loss is compared with an undisturbed run measured on the same
machine at the same moment.

Events: leave (`p2pswarm leave`), crash (SIGKILL), freeze (SIGSTOP for 1-20 s, then
SIGCONT), leader kill (SIGKILL of whoever leads now); a fellow that is down comes back
after 5-60 s from its own state directory, on its own address. Events stop when the
minutes are up or the chaos job has ended; every fellow that is down is then brought
back, the job is waited for, and the idle gossip of both swarms is measured.

Measured (``run`` returns them; ``verdict`` says which miss their target):

- leaders per term, from every fellow's log (target: 1 in every term);
- leader availability: over the moments when more than half of the fellows that ran in
  the last 5 minutes are up, how long until every running fellow names one leader
  (p50 / p99 / max; target p99 <= 10 s); a fellow still booting (its agent has not
  answered since it was started) is neither up nor asked; a spell longer than 10 s is
  reported whole: when, what each fellow said at its start and at its last poll, the
  events in it, and the longest the harness went without polling;
- the job: its state at the end (target: finished), restarts (a move that started it
  again from step 0, or a step that fell back to 0, once per fall: target 0), the final
  loss against the calm run's (target within 3 %): the loss of each job's newest checkpoint on the
  job's held-out data, the same batches for both (``held_out_loss``). The mean of the
  last training losses is reported beside it; it compares whatever batches each job's
  replicas stood at, so it is not the figure;
- checkpoints lost: checkpoints the job reported whose every shard no fellow's disk
  holds whole at the end (the newest one and any the retention still keeps; target 0);
- agents crashed: fellows that exited without being told to (target 0);
- idle gossip: bytes of datagrams sent per fellow per second over a quiet window at
  the end, chaos and calm swarms side by side, with the suspicions and refutations the
  window saw (target: within 10 % of the virtual figure for the same number of fellows,
  ``idle_gossip_reference``: the leader's beats are shared by fewer fellows in a smaller
  swarm, so 4 fellows send more each than 10).

The two swarms are formed together and load together (a busy machine took minutes for
each); a progress line comes every ``PROGRESS_EVERY_S``; a phase that fails or times out
ends the run with a report all the same (``failed`` names the phase).
"""

from __future__ import annotations

import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pswarm.errors import ControlError, SwarmError
from p2pswarm.sim.commands import ask_first
from p2pswarm.sim.field import followed_per_term, free_address, two_leaders
from p2pswarm.sim.processes import LocalSwarm, Say, local_swarm

RECENT_S = 300.0  # "the fellows that ran in the last 5 minutes"
# the README's steady-state idle gossip per fellow (simulations/bench_idle_gossip.py,
# 10 fellows, `local` preset, free RAM wandering): what a quiet swarm sends
IDLE_GOSSIP_B_S = 572.0
# ... and for the sizes the runs use (``--fellows N``): the leader beats its three
# deputies five times a second whatever the size, so a smaller swarm's mean per fellow
# is higher
IDLE_GOSSIP_BY_FELLOWS = {4: 907.0, 8: 627.0, 10: IDLE_GOSSIP_B_S}
PROGRESS_EVERY_S = 30.0  # a progress line this often while events run and jobs end
LOSS_TOLERANCE = 0.03
LONG_SPELL_S = 10.0  # a leaderless spell longer than the target: reported whole
GOSSIP_TOLERANCE = 0.10
FELLOW_MEMORY = "3GB"  # per fellow: the loaded model, the job and the planner's 1 GB floor
TERMINAL = ("finished", "failed", "cancelled")
LAST_LOSSES = 4  # the training loss at the end: the mean of the job's last losses
HELD_OUT_BATCHES = 8  # the final loss: the newest checkpoint on this many held-out batches


def job_config(*, model: str | dict[str, Any], steps: int, seed: int, seq_len: int,
               checkpoint_dir: Path, replicas: int = 2, inner_steps: int = 4,
               checkpoint_every: int = 8) -> dict[str, Any]:
    """A DiLoCo job of ``replicas`` replicas that checkpoints every ``checkpoint_every``
    steps, two copies of each shard on fellows besides the leader's own."""
    return {"model": model if isinstance(model, str) else {"config": model},
            "seq_len": seq_len, "micro_batch": 2, "micro_batches": 1, "steps": steps,
            "replicas": replicas, "seed": seed,
            "lr": {"peak": 3e-3, "schedule": "constant"},
            "sync": {"inner_steps": inner_steps, "codec": "fp16", "outer_lr": 1.0,
                     "outer_momentum": 0.0, "round_deadline_s": 60},
            "checkpoint": {"dir": str(checkpoint_dir), "interval_steps": checkpoint_every,
                           "keep": 2, "copies": 2}}


@dataclass
class Field:
    """One swarm of the run: its fellows, what is up, and (chaos only) its events."""

    swarm: LocalSwarm
    names: list[str]
    rng: random.Random
    addresses: dict[str, str] = field(default_factory=dict)
    up: dict[str, bool] = field(default_factory=dict)
    frozen: dict[str, float] = field(default_factory=dict)  # name -> thaw at
    back_at: dict[str, float] = field(default_factory=dict)  # name -> restart at
    last_up: dict[str, float] = field(default_factory=dict)
    told_to_stop: set[str] = field(default_factory=set)
    answered: set[str] = field(default_factory=set)  # agents that answered since their start
    unexpected_exits: list[str] = field(default_factory=list)
    events: list[tuple[float, str, str]] = field(default_factory=list)
    extra: tuple[str, ...] = ()
    view: dict[str, str] = field(default_factory=dict)  # what each fellow last said

    def start(self, name: str) -> None:
        seeds = tuple(self.addresses[n] for n in self.names if n != name)
        self.swarm.launch(name, seeds=seeds, listen=self.addresses[name], extra=self.extra)
        self.up[name] = True
        self.told_to_stop.discard(name)
        self.answered.discard(name)

    def running(self) -> list[str]:
        return [n for n in self.names if self.up[n] and n not in self.frozen]

    def ask(self, message: dict[str, Any], timeout_s: float = 10,
            streamed: bool = False) -> Any:
        """``message`` answered by the first running fellow that answers (``streamed``:
        an op that sends events before its answer, which are ignored)."""
        return ask_first((self.swarm.homes[n] for n in self.running()), message,
                         timeout_s=timeout_s, streamed=streamed)

    def leader_now(self) -> str | None:
        """The leader every running fellow names; a fellow whose agent has not answered
        since it was (re)started is still booting and is not asked. What each fellow
        said is left in ``view`` (to tell why there was none)."""
        seen = set()
        self.view = {}
        for name in self.running():
            try:
                leader = self.swarm.status(name).get("leader")
            except ControlError:
                if name in self.answered:
                    self.view[name] = "no answer"
                    return None
                continue
            self.answered.add(name)
            if not leader:
                self.view[name] = "none"
                return None
            self.view[name] = f"{leader['name']} (term {leader['term']})"
            seen.add((leader["name"], leader["term"]))
        return seen.pop()[0] if len(seen) == 1 else None

    def hit(self, now: float) -> None:
        live = self.running()
        if len(live) <= 1:
            return
        kind = self.rng.choice(["leave", "crash", "freeze", "leader"])
        name = self.rng.choice(live)
        if kind == "leader":
            name = self.leader_now() or name
            kind = "leader-kill"
        self.events.append((now, kind, name))
        process = self.swarm.processes[name]
        if kind == "freeze":
            process.send_signal(signal.SIGSTOP)
            self.frozen[name] = now + self.rng.uniform(1, 20)
            return
        self.told_to_stop.add(name)
        if kind == "leave":
            try:
                subprocess.run([sys.executable, "-m", "p2pswarm.cli", "leave", "--home",
                                str(self.swarm.homes[name])], capture_output=True, timeout=30)
            except subprocess.TimeoutExpired:  # a starved machine: leave by signal instead
                process.send_signal(signal.SIGTERM)
        else:
            process.send_signal(signal.SIGKILL)
        self.up[name] = False
        self.back_at[name] = now + self.rng.uniform(5, 60)

    def upkeep(self, now: float) -> None:
        for name, thaw in list(self.frozen.items()):
            if now >= thaw:
                self.swarm.processes[name].send_signal(signal.SIGCONT)
                del self.frozen[name]
        for name, at in list(self.back_at.items()):
            if now >= at:
                process = self.swarm.processes[name]
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                del self.back_at[name]
                self.start(name)
        for name in self.names:
            if self.up[name]:
                self.last_up[name] = now
                if self.swarm.processes[name].poll() is not None and \
                        name not in self.told_to_stop:
                    self.unexpected_exits.append(name)
                    self.up[name] = False
                    self.back_at[name] = now + 5

    def calm_down(self) -> None:
        """No more events: thaw every frozen fellow and bring back every one that is
        down, now."""
        for name in list(self.frozen):
            self.frozen[name] = 0.0
        for name in list(self.back_at):
            self.back_at[name] = 0.0
        self.upkeep(time.monotonic())

    def majority_up(self, now: float) -> bool:
        """More than half the fellows that ran in the last 5 minutes are up: running,
        and (started again) their agent has answered; one still booting (importing torch
        takes seconds) cannot vote yet."""
        recent = [n for n in self.names if now - self.last_up.get(n, -1e9) <= RECENT_S]
        up = [n for n in self.running() if n in self.answered]
        return 2 * len(up) > len(recent)


@dataclass
class JobWatch:
    """What the run saw of one job, polled from whichever fellow answers."""

    job_id: str
    last: dict[str, Any] = field(default_factory=dict)
    highest_step: int = 0
    last_step: int = 0
    fell_to_zero: int = 0  # times the step went back to 0 after it had passed it
    checkpoints: set[int] = field(default_factory=set)

    def poll(self, swarm: Field) -> None:
        try:
            jobs = swarm.ask({"op": "jobs"}, timeout_s=5)
        except SwarmError:
            return
        record = next((j for j in jobs if j.get("job_id") == self.job_id), None)
        if record is None:
            return
        step = int(record.get("step") or 0)
        if self.last_step > 0 and step == 0 and record.get("state") not in TERMINAL:
            self.fell_to_zero += 1  # once per fall, not once per poll that sees 0
        self.last_step = step
        self.highest_step = max(self.highest_step, step)
        if record.get("checkpoint_step"):
            self.checkpoints.add(int(record["checkpoint_step"]))
        self.last = record

    def ended(self) -> bool:
        return self.last.get("state") in TERMINAL

    def restarts(self) -> int:
        moves = self.last.get("moves") or []
        return self.fell_to_zero + sum("started again from step 0" in m for m in moves)

    def final_loss(self) -> float | None:
        losses = self.last.get("losses") or []
        return statistics.fmean(losses[-LAST_LOSSES:]) if losses else None


def held_out_loss(directory: Path, batches: int = HELD_OUT_BATCHES) -> dict[str, Any] | None:
    """The model at the newest complete checkpoint in ``directory`` (a job's
    ``checkpoint.dir``), measured on the job's held-out data: its step and loss, or None
    when the directory holds no checkpoint."""
    from p2pswarm.training.checkpoint import CheckpointStore
    from p2pswarm.training.job_export import export_checkpoint

    store = CheckpointStore(directory)
    if store.latest() is None:
        return None
    with tempfile.TemporaryDirectory() as scratch:
        exported = export_checkpoint(store, Path(scratch) / "model", holdout_batches=batches)
    return {"step": exported.step, "loss": exported.holdout_loss}


def newest_store(swarm: Field, job_id: str) -> Path:
    """Of the checkpoint directories a job's leaders wrote (each leader its own, in its
    home; the submitter's directory when it led), the one holding the newest checkpoint."""
    from p2pswarm.training.checkpoint import CheckpointStore

    stores = [swarm.swarm.root / "checkpoints"] + [
        home / "job-checkpoints" / job_id for home in swarm.swarm.homes.values()]
    return max(stores, key=lambda d: CheckpointStore(d).latest() or -1 if d.is_dir() else -1)


def _gap(chaos: float | None, calm: float | None) -> float | None:
    """How far the chaos run's loss is from the calm one's, as a fraction of it."""
    return abs(chaos - calm) / calm if chaos is not None and calm else None


def checkpoints_lost(swarm: Field, job_id: str, steps: set[int], keep: int) -> list[int]:
    """Of the checkpoints the job reported that its retention still keeps (the newest
    ``keep``), those no fellow's disk holds whole: a manifest somewhere, and every
    shard it names on some fellow's disk (its own store or its copies). The submitter's
    own checkpoint directory does not count: a fellow is lost with its disk, a swarm's
    checkpoints must not depend on one machine."""
    wanted = sorted(steps)[-keep:]
    roots = [p for home in swarm.swarm.homes.values()
             for p in (home / "checkpoint-copies" / job_id, home / "job-checkpoints" / job_id)]
    lost = []
    for step in wanted:
        dirs = [r / f"step-{step:08d}" for r in roots if (r / f"step-{step:08d}").is_dir()]
        shards: set[str] = set()
        for d in dirs:
            try:
                shards |= set(json.loads((d / "manifest.json").read_text())["shards"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
        if not shards or not all(any((d / f"{s}.pt").is_file() for d in dirs)
                                 for s in shards):
            lost.append(step)
    return lost


def written_steps(swarm: Field, job_id: str) -> set[int]:
    """The steps of ``job_id`` some fellow's disk holds a manifest of."""
    steps = set()
    for home in swarm.swarm.homes.values():
        for kind in ("checkpoint-copies", "job-checkpoints"):
            for d in (home / kind / job_id).glob("step-*"):
                if d.name[5:].isdigit() and (d / "manifest.json").is_file():
                    steps.add(int(d.name[5:]))
    return steps


def idle_window(swarm: Field, window_s: float) -> dict[str, float]:
    """Over ``window_s`` of quiet: the mean bytes of datagrams (membership and election:
    nothing else travels as a datagram) sent per fellow per second (``b_s``), and how
    quiet the swarm really was: suspicions raised and refutations made (a starved
    machine's fellows miss probes, and each suspicion is news that gossip spreads)."""
    def counts() -> dict[str, tuple[int, int, int]]:
        out = {}
        for name in swarm.running():
            try:
                status = swarm.swarm.status(name)
                m = status["membership"]
                out[name] = (int(status["counters"]["bytes_out"]),
                             int(m["suspicions_raised"]), int(m["refutations"]))
            except (ControlError, KeyError, TypeError, ValueError):
                continue
        return out

    before, began = counts(), time.monotonic()
    time.sleep(window_s)  # the measurement itself: a quiet window on the real clock
    after, elapsed = counts(), time.monotonic() - began
    both = [n for n in before if n in after]
    rates = [(after[n][0] - before[n][0]) / elapsed for n in both]
    return {"b_s": round(statistics.fmean(rates), 1) if rates else 0.0,
            "suspicions": sum(after[n][1] - before[n][1] for n in both),
            "refutations": sum(after[n][2] - before[n][2] for n in both),
            "window_s": round(elapsed, 1)}


def gossip_per_fellow(swarm: Field, window_s: float) -> float:
    """Mean bytes of datagrams sent per fellow per second over ``window_s`` of quiet."""
    return idle_window(swarm, window_s)["b_s"]


def idle_gossip_reference(fellows: int) -> float:
    """The virtual figure for a swarm of this size (like with like: the leader's beats
    are shared by fewer fellows in a smaller swarm); the README's 10-fellow one past
    the sizes measured."""
    return IDLE_GOSSIP_BY_FELLOWS.get(fellows, IDLE_GOSSIP_B_S)


def _form(swarms: tuple[Field, ...], timeout_s: float, say: Say) -> None:
    """Every fellow of every swarm started at once (their imports overlap instead of
    queueing), then waited for until each sees all its swarm alive under a leader."""
    for swarm in swarms:
        for name in swarm.names:
            swarm.start(name)
    began = time.monotonic()
    deadline = began + timeout_s
    for swarm in swarms:
        for name in swarm.names:
            swarm.swarm.wait_for(name, lambda s: s["leader"] is not None and sum(
                m["state"] == "alive" for m in s["members"]) == len(swarm.names),
                timeout_s=max(1.0, deadline - time.monotonic()),
                what="the swarm to form and elect a leader")
            swarm.answered.add(name)
        say(f"  a swarm of {len(swarm.names)} formed ({time.monotonic() - began:.0f} s)")


def _load(swarm: Field, model: str) -> None:
    """``model`` loaded for serving where the planner puts it; asked again (a few times)
    when the swarm's view moved under the plan (a busy machine makes its fellows flap)."""
    from p2pswarm.planner import BUILTIN_MODELS

    message = {"model": {"name": model, "config": BUILTIN_MODELS[model]}, "kind": "serve",
               "weights_dtype": "f32", "floors_bytes": {"cpu": "250MB"}}
    for attempt in range(5):
        try:
            swarm.ask({"op": "load", "request": message}, timeout_s=120, streamed=True)
            return
        except SwarmError:
            if attempt == 4:
                raise
            time.sleep(2.0)


def _both(work: Callable[[Field], Any], swarms: tuple[Field, ...]) -> list[Any]:
    """``work`` on every swarm at once, each in its own thread (their agents do the
    work; this process only waits); the first failure is raised once all are done."""
    with ThreadPoolExecutor(max_workers=len(swarms)) as pool:
        futures = [pool.submit(work, swarm) for swarm in swarms]
        return [f.result() for f in futures]


def _served(swarm: Field) -> str:
    """"yes", or why the load did not answer a short generation."""
    try:
        swarm.ask({"op": "generate", "prompt": "The swarm", "max_tokens": 4}, timeout_s=60,
                  streamed=True)
    except SwarmError as exc:
        return f"no: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return "yes"


def _waits(waits: list[float]) -> dict[str, float]:
    ordered = sorted(waits) or [0.0]
    return {"p50": round(statistics.median(ordered), 2),
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
            "max": round(ordered[-1], 2)}


def run(*, fellows: int, minutes: float, seed: int, say: Say, job: dict[str, Any],
        load_model: str | None = "tiny-llama", first_hit_s: float = 20.0,
        gap_s: tuple[float, float] = (5.0, 20.0), job_timeout_s: float = 600.0,
        idle_window_s: float = 30.0, keep: bool = False,
        form_timeout_s: float = 600.0) -> dict[str, Any]:
    """The chaos run and its calm twin side by side; the figures (see the module). A
    phase that fails or times out ends the run early: the report then names it under
    ``failed`` and carries what was measured up to there."""
    names = [f"f{i}" for i in range(fellows)]
    extra = ("--cpu-memory", FELLOW_MEMORY, "--log-level", "info")
    labels = ("chaos", "calm")
    watches = {label: JobWatch("") for label in labels}
    waits: list[float] = []
    spells: list[dict[str, Any]] = []
    failed = ""
    phase = "forming the swarms"
    events_s = job_s = 0.0
    served: dict[str, str] = {}
    lost: list[int] = []
    idle: dict[str, dict[str, float]] = {}
    held_out: dict[str, dict[str, Any] | None] = {}
    began = time.monotonic()

    def took() -> str:
        return f"{time.monotonic() - began:.0f} s"

    with local_swarm(say, keep=keep, start_timeout_s=120) as chaos_swarm, \
            local_swarm(say, keep=keep, start_timeout_s=120) as calm_swarm:
        chaos = Field(chaos_swarm, names, random.Random(seed),
                      {n: free_address() for n in names}, {n: False for n in names},
                      extra=extra)
        calm = Field(calm_swarm, names, random.Random(seed),
                     {n: free_address() for n in names}, {n: False for n in names},
                     extra=extra)
        both = (chaos, calm)
        try:
            say(f"starting two swarms of {fellows} fellows")
            _form(both, form_timeout_s, say)
            say(f"two swarms of {fellows} formed ({took()})")
            if load_model:
                phase = f"loading {load_model}"
                _both(lambda swarm: _load(swarm, load_model), both)
                say(f"{load_model} loaded on both ({took()})")
            phase = "submitting the job"

            def submit(swarm: Field) -> str:
                config = {**job, "checkpoint": {**job["checkpoint"],
                                                "dir": str(swarm.swarm.root / "checkpoints")}}
                record = swarm.ask({"op": "job_submit", "config": config}, timeout_s=120)
                return str(record["job_id"])

            for label, job_id in zip(labels, _both(submit, both)):
                watches[label] = JobWatch(job_id)
            say(f"job submitted to both ({job['steps']} steps, {took()})")
            phase = "events"
            events_s = _events(chaos, calm, watches, waits, spells, minutes * 60,
                               first_hit_s, gap_s, say)
            chaos.calm_down()
            say(f"events over after {events_s:.0f} s; waiting for both jobs to end")
            phase = "waiting for the jobs"
            job_s = events_s + _wait_for_jobs(both, watches, job_timeout_s, say)
            if load_model:
                phase = "serving at the end"
                served = dict(zip(labels, _both(_served, both)))
            phase = "measuring the final loss on held-out data"
            held_out = {label: held_out_loss(newest_store(swarm, watches[label].job_id))
                        for label, swarm in zip(labels, both)}
            phase = "measuring idle gossip"
            # the checkpoints the job wrote: those its record named, and every step with
            # a manifest on some fellow's disk (a round closes past the interval, not on it)
            chaos_job = watches["chaos"].job_id
            written = watches["chaos"].checkpoints | written_steps(chaos, chaos_job)
            lost = checkpoints_lost(chaos, chaos_job, written, int(job["checkpoint"]["keep"]))
            time.sleep(5.0)  # let the last joins and card updates spread before measuring
            idle = dict(zip(labels, _both(lambda swarm: idle_window(swarm, idle_window_s),
                                          both)))
        except (SwarmError, ControlError) as exc:
            failed = f"{phase}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            say(f"run ended early ({took()}), {failed}")
        finally:
            chaos.calm_down()  # no fellow left frozen: each must hear its stop
        terms = followed_per_term(chaos_swarm)
    losses = {label: w.final_loss() for label, w in watches.items()}
    train_gap = _gap(losses["chaos"], losses["calm"])
    gap = _gap(*((held_out.get(label) or {}).get("loss") for label in labels))
    return {
        "fellows": fellows, "minutes": minutes, "seed": seed, "failed": failed,
        "run_s": round(time.monotonic() - began, 1),
        "events": len(chaos.events), "events_s": round(events_s, 1),
        "events_by_kind": {k: sum(1 for _, kind, _ in chaos.events if kind == k)
                           for k in ("leave", "crash", "freeze", "leader-kill")},
        "terms": len(terms), "terms_with_two_leaders": two_leaders(terms),
        "leaderless_spells": len(waits), "leader_within_s": _waits(waits),
        "long_leaderless_spells": spells,
        "agents_crashed": chaos.unexpected_exits + calm.unexpected_exits,
        "job": {label: {"state": w.last.get("state"), "reason": w.last.get("reason", ""),
                        "step": w.last.get("step"), "samples": w.last.get("samples"),
                        "restarts": w.restarts(),
                        "moves": w.last.get("moves", []), "train_loss": losses[label],
                        "final_loss": (held_out.get(label) or {}).get("loss"),
                        "final_step": (held_out.get(label) or {}).get("step"),
                        "checkpoints_seen": sorted(w.checkpoints)}
                for label, w in watches.items()},
        "job_s": round(job_s, 1), "loss_gap": None if gap is None else round(gap, 4),
        "train_loss_gap": None if train_gap is None else round(train_gap, 4),
        "checkpoints_lost": lost, "served_at_end": served,
        "idle_gossip_b_s": {label: w["b_s"] for label, w in idle.items()},
        "idle_window": idle,
        "idle_gossip_reference_b_s": idle_gossip_reference(fellows),
    }


def idle(*, fellows: int, window_s: float, say: Say, settle_s: float = 20.0) -> dict[str, Any]:
    """One swarm of ``fellows`` real fellows, formed as the chaos run forms its swarms,
    left alone ``settle_s`` and then measured over ``window_s`` (``idle_window``)."""
    names = [f"f{i}" for i in range(fellows)]
    with local_swarm(say, start_timeout_s=120) as swarm:
        quiet = Field(swarm, names, random.Random(0), {n: free_address() for n in names},
                      {n: False for n in names},
                      extra=("--cpu-memory", FELLOW_MEMORY, "--log-level", "info"))
        began = time.monotonic()
        _form((quiet,), 600.0, say)
        formed_s = time.monotonic() - began
        time.sleep(settle_s)  # the joins and first inventories spread before measuring
        window = idle_window(quiet, window_s)
    return {"fellows": fellows, "formed_s": round(formed_s, 1), **window,
            "reference_b_s": idle_gossip_reference(fellows)}


def _events(chaos: Field, calm: Field, watches: dict[str, JobWatch], waits: list[float],
            spells: list[dict[str, Any]], seconds: float, first_hit_s: float,
            gap_s: tuple[float, float], say: Say) -> float:
    """Events on the chaos swarm until ``seconds`` are up or its job ended, the calm one
    kept as it is; each spell without a leader (with a majority up) into ``waits``, and
    one longer than ``LONG_SPELL_S`` into ``spells`` with what the fellows said at its
    start and at its last poll, the events in it, and the longest the harness went
    between two polls of the leader (a busy harness stretches a spell). Returns the
    seconds the events lasted."""
    begin = time.monotonic()
    end = begin + seconds
    next_hit = begin + first_hit_s
    next_poll = begin
    next_say = begin + PROGRESS_EVERY_S
    leaderless_since: float | None = None
    spell: dict[str, Any] = {}
    leader: str | None = None
    asked_at = begin
    while time.monotonic() < end and not watches["chaos"].ended():
        now = time.monotonic()
        chaos.upkeep(now)
        calm.upkeep(now)
        if now >= next_hit:
            chaos.hit(now)
            next_hit = now + chaos.rng.uniform(*gap_s)
        leader = chaos.leader_now()
        # this loop asks in turn (status, job polls, a leave's CLI, each with its
        # timeout): a spell lasts at least until it asks again
        asked = time.monotonic()
        asked_gap, asked_at = asked - asked_at, asked
        if chaos.majority_up(now) and leader is None:
            if leaderless_since is None:
                leaderless_since = now
                spell = {"at": time.strftime("%H:%M:%S"), "view": dict(chaos.view),
                         "events_before": len(chaos.events), "asked_every_max_s": 0.0}
            else:  # what they said last, and how long the harness went without asking
                spell["last_view"] = dict(chaos.view)
                spell["asked_every_max_s"] = round(max(spell["asked_every_max_s"],
                                                       asked_gap), 1)
        elif leaderless_since is not None:
            waits.append(now - leaderless_since)
            if waits[-1] > LONG_SPELL_S:  # kept whole, to tell why it lasted
                spell["s"] = round(waits[-1], 1)
                spell["asked_every_max_s"] = round(max(spell["asked_every_max_s"],
                                                       asked_gap), 1)
                spell["events"] = [f"{kind} {name}" for _, kind, name
                                   in chaos.events[int(spell.pop("events_before")):]]
                spells.append(spell)
                say(f"  no leader for {spell['s']} s from {spell['at']} (a majority "
                    f"up): at its start {spell['view']}, last "
                    f"{spell.get('last_view', spell['view'])}; events in it "
                    f"{spell['events']}; the harness asked at most "
                    f"{spell['asked_every_max_s']} s apart")
            leaderless_since = None
        if now >= next_poll:
            for label, swarm in (("chaos", chaos), ("calm", calm)):
                watches[label].poll(swarm)
            next_poll = now + 2.0
        if now >= next_say:
            say(f"  {now - begin:.0f} s of events: {len(chaos.events)} events, "
                f"{len(chaos.running())} of {len(chaos.names)} running, leader "
                f"{leader or 'none'}; {_progress(watches)}")
            next_say = now + PROGRESS_EVERY_S
        time.sleep(0.5)
    return time.monotonic() - begin


def _wait_for_jobs(swarms: tuple[Field, ...], watches: dict[str, JobWatch], timeout_s: float,
                   say: Say) -> float:
    """Until both jobs ended (or ``timeout_s``), fellows that exit brought back; the
    seconds it took."""
    begin = time.monotonic()
    next_say = begin + PROGRESS_EVERY_S
    while time.monotonic() < begin + timeout_s and not all(w.ended() for w in watches.values()):
        now = time.monotonic()
        for label, swarm in zip(("chaos", "calm"), swarms):
            swarm.upkeep(now)
            watches[label].poll(swarm)
        if now >= next_say:
            say(f"  {now - begin:.0f} s waiting: {_progress(watches)}")
            next_say = now + PROGRESS_EVERY_S
        time.sleep(1.0)
    return time.monotonic() - begin


def _progress(watches: dict[str, JobWatch]) -> str:
    return ", ".join(f"{label} job {w.last.get('state', 'unseen')} at step "
                     f"{w.last.get('step', 0)}" for label, w in watches.items())


def verdict(report: dict[str, Any]) -> list[str]:
    """Each target the run missed, in one line (empty: every target met)."""
    misses = []
    if report.get("failed"):
        misses.append(f"run ended early: {report['failed']}")
    if report["terms_with_two_leaders"]:
        misses.append(f"terms with two leaders: {report['terms_with_two_leaders']}")
    if report["leader_within_s"]["p99"] > 10.0:
        misses.append(f"leader within p99 {report['leader_within_s']['p99']} s > 10 s")
    job = report["job"]["chaos"]
    if job["state"] != "finished":
        misses.append(f"chaos job {job['state']}: {job['reason']}")
    if report["job"]["calm"]["state"] != "finished":
        misses.append(f"calm job {report['job']['calm']['state']}")
    if job["restarts"]:
        misses.append(f"chaos job restarted {job['restarts']} times")
    if report["loss_gap"] is None or report["loss_gap"] > LOSS_TOLERANCE:
        misses.append(f"final loss {job['final_loss']} vs calm "
                      f"{report['job']['calm']['final_loss']}: gap {report['loss_gap']}")
    if report["checkpoints_lost"]:
        misses.append(f"checkpoints lost: {report['checkpoints_lost']}")
    if report["agents_crashed"]:
        misses.append(f"agents crashed: {report['agents_crashed']}")
    reference = report["idle_gossip_reference_b_s"]
    for label, rate in report["idle_gossip_b_s"].items():
        if abs(rate - reference) > GOSSIP_TOLERANCE * reference:
            misses.append(f"idle gossip ({label}) {rate} B/s per fellow, not within 10 % "
                          f"of {reference:g}")
    return misses


__all__ = ["IDLE_GOSSIP_B_S", "checkpoints_lost", "idle", "idle_gossip_reference", "idle_window",
           "job_config", "run", "verdict"]
