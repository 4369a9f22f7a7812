"""A rolling upgrade on real `p2pswarm join` processes: the previous release's fellows
replaced one at a time by this release's, as `docker service update` does, while a
client generates in a loop and a job trains.

The previous release is built from this repository's history (``PREVIOUS_RELEASE``,
``previous_release``): ``git archive`` of that commit into a folder of its own, whose
fellows run with the same interpreter and that folder first on their path (and as their
working directory, which ``python -m`` puts before everything).

The run (``run``):

1. the previous release's fellows start and elect a leader; this release's join them:
   the mixed swarm, which must have one leader;
2. a tiny model is loaded and a small DiLoCo job is submitted; a client generates in a
   loop (greedy, so every answer must carry the tokens of the first) and the job is
   watched until it has closed a few rounds;
3. each previous-release fellow in turn, as `docker service update` with
   ``order: stop-first``: SIGTERM (the fellow leaves), the process waited for, this
   release started on the same state directory and address, and waited for until it
   is a member again (``p2pswarm.health``: the health check of ``docker/stack.yml``)
   and the swarm has settled (every fellow names one leader, the load whole, the job
   running: what the update's ``delay`` leaves time for) before the next. The client
   is a load balancer's: it sends no new generation to the fellow about to stop, and
   that fellow stops once the generation it was answering has ended
   (``stop_grace_period``); generations through the other fellows, whose stages may be
   on the stopping one, go on;
4. the job is watched past a few more rounds, the client stops, every fellow must run
   this release and name one leader.

Counted: client errors (a generation that failed at the client, or answered other
tokens than the first), job restarts (a move that started it again from step 0, a step
that fell back to 0, the job gone or ended, ``JobWatch``) and, beside them, the steps a
takeover went back to its last round (not a restart: the rounds' state is kept).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import p2pswarm
from p2pswarm.control.client import stream
from p2pswarm.errors import SwarmError
from p2pswarm.health import is_member
from p2pswarm.sim.chaos import FELLOW_MEMORY, TERMINAL, JobWatch, job_config
from p2pswarm.sim.commands import ask_first, poll
from p2pswarm.sim.field import followed_per_term, free_address, one_leader, two_leaders
from p2pswarm.sim.processes import LocalSwarm, Say, local_swarm

# The previous release: the commit this branch started from, the last one shipped before
# the version skew work (a release and the one before it must form one swarm). Move it
# on when a release is cut.
PREVIOUS_RELEASE = "675ee12"
PROMPT = "The swarm of fellows"
MAX_TOKENS = 24
SETTLE_TIMEOUT_S = 180.0  # a member again, the load whole and the job running
ERROR_BACKOFF_S = 1.0  # a client that failed waits before it asks again, as clients do


@dataclass(frozen=True, slots=True)
class Release:
    """A release's package on disk: ``root`` holds the ``p2pswarm`` folder (``None``:
    the one this process runs, with the environment it runs in)."""

    label: str
    root: Path | None

    def env(self) -> dict[str, str]:
        return {} if self.root is None else {"PYTHONPATH": str(self.root)}

    def package(self) -> Path:
        """Where a fellow of this release imports ``p2pswarm`` from (asked of the
        interpreter the fellows run, with their path and working directory)."""
        found = subprocess.run(
            [sys.executable, "-c", "import p2pswarm; print(p2pswarm.__file__)"],
            capture_output=True, text=True, timeout=60, cwd=self.root,
            env={**os.environ, **self.env()})
        if found.returncode != 0:
            raise SwarmError(f"the {self.label} release does not import: "
                             f"{found.stderr.strip()[-500:]}")
        return Path(found.stdout.strip()).parent


CURRENT = Release("current", None)


def repository_root(start: Path | None = None) -> Path | None:
    """The git checkout this package lives in, or None (an installed package, an sdist)."""
    here = start or Path(p2pswarm.__file__).resolve().parent.parent
    if shutil.which("git") is None or not (here / ".git").exists():
        return None
    found = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel"],
                           capture_output=True, text=True, timeout=30)
    return Path(found.stdout.strip()) if found.returncode == 0 else None


def has_commit(repo: Path, commit: str = PREVIOUS_RELEASE) -> bool:
    """Whether ``repo``'s history holds ``commit`` (a shallow clone may not)."""
    found = subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"],
                           capture_output=True, timeout=30)
    return found.returncode == 0


def previous_release(repo: Path, into: Path, commit: str = PREVIOUS_RELEASE) -> Release:
    """``commit``'s tree extracted from ``repo``'s history into ``into`` (kept: a second
    call with the same folder reuses it)."""
    if not (into / "p2pswarm" / "__init__.py").is_file():
        into.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(repo), "archive", commit],
                                 capture_output=True, timeout=120)
        if archive.returncode != 0:
            raise SwarmError(f"cannot build release {commit} from {repo}: "
                             f"{archive.stderr.decode(errors='replace').strip()}")
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True,
                       timeout=120)
    return Release(f"previous ({commit})", into)


@dataclass
class Client:
    """Greedy generations in a loop, each through a fellow not about to stop."""

    swarm: LocalSwarm
    entries: list[str]
    max_tokens: int = MAX_TOKENS
    want: list[int] | None = None
    served: int = 0
    resumes: int = 0
    errors: list[str] = field(default_factory=list)
    draining: set[str] = field(default_factory=set)
    in_flight: str | None = None
    lock: threading.Condition = field(default_factory=threading.Condition)
    stopping: threading.Event = field(default_factory=threading.Event)
    turn: int = 0

    def once(self) -> None:
        with self.lock:
            usable = [n for n in self.entries if n not in self.draining]
            if not usable:
                self.lock.wait(0.2)
                return
            entry = usable[self.turn % len(usable)]
            self.turn += 1
            self.in_flight = entry
        try:
            got = stream(self.swarm.homes[entry], {"op": "generate", "prompt": PROMPT,
                                                   "max_tokens": self.max_tokens},
                         lambda event: None, timeout_s=120)
            tokens = list(got["token_ids"])
            if self.want is None:
                self.want = tokens
            if tokens != self.want:
                self.errors.append(f"through {entry}: other tokens {tokens} than {self.want}")
            self.served += 1
            self.resumes += int(got.get("resumes") or 0)
        except (SwarmError, KeyError, TypeError) as exc:
            said = str(exc).splitlines()[0] if str(exc) else repr(exc)
            self.errors.append(f"through {entry}: {said}")
            self.stopping.wait(ERROR_BACKOFF_S)
        finally:
            with self.lock:
                self.in_flight = None
                self.lock.notify_all()

    def loop(self) -> None:
        while not self.stopping.is_set():
            self.once()

    def drain(self, name: str, timeout_s: float = 180.0) -> None:
        """No new generation through ``name``; back once the one it answers has ended."""
        with self.lock:
            self.draining.add(name)
            if not self.lock.wait_for(lambda: self.in_flight != name, timeout=timeout_s):
                raise SwarmError(f"the generation through {name} did not end in {timeout_s:g} s")

    def undrain(self, name: str) -> None:
        with self.lock:
            self.draining.discard(name)


@dataclass
class Upgrade:
    """The swarm of the run: each fellow's address and the release it runs now."""

    swarm: LocalSwarm
    names: list[str]
    addresses: dict[str, str]
    extra: tuple[str, ...]
    runs: dict[str, Release] = field(default_factory=dict)

    def start(self, name: str, release: Release) -> None:
        seeds = tuple(self.addresses[n] for n in self.names if n != name)
        # the fellow imports its release: its folder first on the path and as the working
        # directory (``python -m`` looks there before the path)
        self.swarm.env = release.env()
        self.swarm.cwd = release.root
        self.swarm.launch(name, seeds=seeds, listen=self.addresses[name], extra=self.extra)
        self.runs[name] = release

    def running(self) -> list[str]:
        return [n for n in self.names if n in self.swarm.processes
                and self.swarm.processes[n].poll() is None]

    def ask(self, message: dict[str, Any], *, avoid: Collection[str] = (),
            timeout_s: float = 30, streamed: bool = False) -> Any:
        return ask_first((self.swarm.homes[n] for n in self.running() if n not in avoid),
                         message, timeout_s=timeout_s, streamed=streamed)

    def stop(self, name: str, timeout_s: float = 30.0) -> bool:
        """SIGTERM, as `docker stop` sends: the fellow leaves. False when it had to be
        killed after ``timeout_s`` (Docker's ``stop_grace_period`` running out)."""
        process = self.swarm.processes[name]
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return False


def wait_until(what: str, ready: Callable[[], Any], timeout_s: float,
               watch: Callable[[], None] | None = None) -> Any:
    """``ready()``'s first true value (errors count as not yet), ``watch`` called between
    tries."""
    return poll(what, ready, timeout_s, tolerate=(SwarmError,), interval_s=0.2, watch=watch)


@dataclass
class JobTrack:
    """The job's record as the run polls it, and how far a takeover ever set it back."""

    watch: JobWatch
    upgrade: Upgrade
    avoid: set[str] = field(default_factory=set)
    gone: int = 0  # polls that found no such job on an answering fellow
    steps_back: int = 0  # the most a takeover set the step back (to its last round)
    next_poll: float = 0.0

    def poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self.next_poll:
            return
        self.next_poll = now + 1.0
        try:
            jobs = self.upgrade.ask({"op": "jobs"}, avoid=self.avoid, timeout_s=10)
        except SwarmError:
            return
        record = next((j for j in jobs if j.get("job_id") == self.watch.job_id), None)
        if record is None:
            self.gone += 1
            return
        before = self.watch.last_step
        self._take(record)
        self.steps_back = max(self.steps_back, before - self.watch.last_step)

    def _take(self, record: dict[str, Any]) -> None:
        """What ``JobWatch.poll`` does with a record (it asks the swarm itself)."""
        step = int(record.get("step") or 0)
        if self.watch.last_step > 0 and step == 0 and record.get("state") not in TERMINAL:
            self.watch.fell_to_zero += 1
        self.watch.last_step = step
        self.watch.highest_step = max(self.watch.highest_step, step)
        self.watch.last = record

    def polled(self) -> dict[str, Any]:
        """The job's record, asked now."""
        self.poll(force=True)
        return self.watch.last

    def rounds(self) -> int:
        rounds = self.watch.last.get("rounds") or []
        return int(rounds[-1]["version"]) if rounds else 0

    def restarts(self) -> int:
        ended = self.watch.last.get("state") in ("failed", "cancelled")
        return self.watch.restarts() + int(ended) + int(self.gone > 2)


def job(*, seed: int, checkpoint_dir: Path | None) -> dict[str, Any]:
    """A DiLoCo job of two replicas of a small llama (the train demo's shape), far longer
    than the run (it is cancelled at the end), checkpointing every other round
    (``checkpoint_dir`` None: never; a takeover resumes from the rounds' copies all the
    same)."""
    from p2pswarm.planner import BUILTIN_MODELS

    model = {**BUILTIN_MODELS["tiny-llama"], "hidden_size": 128, "intermediate_size": 384,
             "num_hidden_layers": 6, "head_dim": 32, "max_position_embeddings": 512}
    config = job_config(model=model, steps=100_000, seed=seed, seq_len=32,
                        checkpoint_dir=checkpoint_dir or Path("."), inner_steps=4,
                        checkpoint_every=8)
    if checkpoint_dir is None:
        del config["checkpoint"]
    return config


def load_request(exclude: Collection[str] = ()) -> dict[str, Any]:
    """tiny-llama for serving, where the planner puts it, none of it on ``exclude``."""
    from p2pswarm.planner import BUILTIN_MODELS

    return {"model": {"name": "tiny-llama", "config": BUILTIN_MODELS["tiny-llama"]},
            "kind": "serve", "weights_dtype": "f32", "floors_bytes": {"cpu": "250MB"},
            "exclude": [f"{name}:cpu" for name in exclude]}


def protocols(swarm: LocalSwarm, observer: str) -> dict[str, Any]:
    """Each fellow's protocol as ``observer``'s status shows it (None where the status
    has no such column: a release before the version skew policy)."""
    return {str(m.get("name")): m.get("protocol") for m in swarm.status(observer)["members"]}


def stage_holders(upgrade: Upgrade) -> dict[str, str]:
    """Each stage's fellow and its state there, as the loads say: ``{"f1": "alive"}``."""
    loads = upgrade.ask({"op": "loads"}, timeout_s=10)["loads"]
    return {str(s.get("fellow")): str(s.get("state", "unknown"))
            for r in loads for s in r.get("stages", [])}


def load_whole(upgrade: Upgrade) -> bool:
    """The load is there, complete, and every stage's fellow alive."""
    loads = upgrade.ask({"op": "loads"}, timeout_s=10)["loads"]
    return bool(loads) and all(r.get("complete", True) and all(
        s.get("state") == "alive" for s in r.get("stages", [])) for r in loads)


def all_see_all(upgrade: Upgrade) -> bool:
    """Every fellow sees every fellow alive."""
    for name in upgrade.names:
        members = upgrade.swarm.status(name)["members"]
        if sum(m.get("state") == "alive" for m in members) != len(upgrade.names):
            return False
    return True


def run(*, previous: Release, fellows: int, new_at_start: int = 1, say: Say,
        rounds_before: int = 2, rounds_after: int = 2, keep: bool = False,
        current: Release = CURRENT, seed: int = 0, checkpoints: bool = True,
        serve_on_new: bool = False) -> dict[str, Any]:
    """The rolling upgrade (see the module); its figures. ``new_at_start`` of the
    ``fellows`` run this release from the start, the others the previous one;
    ``checkpoints``: the job writes checkpoints (two copies on other fellows) too;
    ``serve_on_new``: the load's stages only on the fellows of this release from the
    start, which are not stopped (generations still enter through every fellow, the
    previous release's included); without it, a stage whose fellow leaves is moved by
    the leader while the generations through it wait, see ``docs/operations.md``)."""
    if not 0 < new_at_start < fellows:
        raise SwarmError("new_at_start must leave at least one fellow of each release")
    names = [f"f{i}" for i in range(fellows)]
    olds, news = names[:fellows - new_at_start], names[fellows - new_at_start:]
    began = time.monotonic()
    report: dict[str, Any] = {"fellows": fellows, "previous": previous.label,
                              "old_fellows": olds, "new_fellows": news,
                              "serve_on_new": serve_on_new}
    packages = {"previous": str(previous.package()), "current": str(current.package())}
    if packages["previous"] == packages["current"]:
        raise SwarmError(f"both releases import p2pswarm from {packages['current']}")
    report["packages"] = packages

    def took() -> float:
        return round(time.monotonic() - began, 1)

    with local_swarm(say, keep=keep, start_timeout_s=180) as swarm:
        upgrade = Upgrade(swarm, names, {n: free_address() for n in names},
                          ("--cpu-memory", FELLOW_MEMORY, "--log-level", "info"))
        client = Client(swarm, list(names))
        thread = threading.Thread(target=client.loop, daemon=True)
        track: JobTrack | None = None
        try:
            for name in olds:
                upgrade.start(name, previous)
            wait_until("the previous release's fellows to elect a leader",
                       lambda: one_leader(swarm, olds), SETTLE_TIMEOUT_S)
            for name in news:
                upgrade.start(name, current)
            mixed = wait_until("the mixed swarm to form with one leader",
                               lambda: all(is_member(swarm.status(n)) for n in names)
                               and one_leader(swarm, names), SETTLE_TIMEOUT_S)
            report["mixed_protocols"] = protocols(swarm, news[0])
            report["mixed_leader"] = {"name": mixed[0], "term": mixed[1],
                                      "release": upgrade.runs[mixed[0]].label}
            report["formed_s"] = took()
            say(f"mixed swarm of {len(olds)} previous and {len(news)} current fellows "
                f"formed, leader {mixed[0]} ({report['formed_s']} s); protocols as "
                f"{news[0]} sees them: {report['mixed_protocols']}")
            wait_until("the load", lambda: upgrade.ask(
                {"op": "load", "request": load_request(olds if serve_on_new else ())},
                timeout_s=120, streamed=True),
                SETTLE_TIMEOUT_S)
            stores = swarm.root / "checkpoints" if checkpoints else None
            submitted = upgrade.ask({"op": "job_submit", "config": job(
                seed=seed, checkpoint_dir=stores)}, timeout_s=120)
            track = JobTrack(JobWatch(str(submitted["job_id"])), upgrade)
            client.once()  # the reference answer, before anything moves
            if client.errors:
                raise SwarmError(f"the mixed swarm did not serve: {client.errors[0]}")
            thread.start()
            wait_until(f"the job to close round {rounds_before}", lambda: (
                track.polled() and track.rounds() >= rounds_before),
                SETTLE_TIMEOUT_S)
            report["mixed_served"] = client.served
            report["mixed_round"] = track.rounds()
            say(f"mixed swarm serves ({client.served} generations) and trains (round "
                f"{track.rounds()}, step {track.watch.last_step}) ({took()} s)")
            steps: list[dict[str, Any]] = []
            upgrade_began = time.monotonic()
            for name in olds:
                steps.append(replace(upgrade, client, track, name, current, say))
            report["upgrade_s"] = round(time.monotonic() - upgrade_began, 1)
            report["replaced"] = steps
            at = track.rounds()
            wait_until(f"the job to close {rounds_after} more rounds", lambda: (
                track.polled() and track.rounds() >= at + rounds_after),
                SETTLE_TIMEOUT_S)
            client.stopping.set()
            thread.join(timeout=180)
            final = wait_until("one leader for all at the end",
                               lambda: one_leader(swarm, names), SETTLE_TIMEOUT_S)
            report["final_leader"] = {"name": final[0], "term": final[1]}
            report["all_current"] = all(upgrade.runs[n] == current for n in names)
            upgrade.ask({"op": "job_cancel", "job_id": track.watch.job_id}, timeout_s=60)
            report["failed"] = ""
        except SwarmError as exc:
            report["failed"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            say(f"run ended early ({took()} s): {report['failed']}")
        finally:
            client.stopping.set()
            if thread.is_alive():
                thread.join(timeout=180)
        terms = followed_per_term(swarm)
    report.update({
        "run_s": took(),
        "generations": client.served, "client_errors": len(client.errors),
        "client_error_lines": client.errors[:10], "resumes": client.resumes,
        "terms_with_two_leaders": two_leaders(terms),
    })
    if track is not None:
        last = track.watch.last
        report["job"] = {"job_id": track.watch.job_id, "restarts": track.restarts(),
                         "state": last.get("state"), "step": last.get("step"),
                         "round": track.rounds(), "steps_back": track.steps_back,
                         "moves": last.get("moves", [])}
    return report


def replace(upgrade: Upgrade, client: Client, track: JobTrack, name: str,
            release: Release, say: Say) -> dict[str, Any]:
    """One task of `docker service update` (stop-first): ``name`` drained, stopped,
    started on ``release`` from its state directory and address, and waited for until
    it is a member again and the swarm has settled."""
    swarm = upgrade.swarm
    began = time.monotonic()
    was_leader = (one_leader(swarm, upgrade.running()) or ("", 0))[0] == name
    try:
        held = stage_holders(upgrade).get(name)
    except SwarmError:
        held = None
    replicas = sorted({str(s.get("fellow")) for replica in
                       (track.watch.last.get("stages") or []) if isinstance(replica, list)
                       for s in replica if isinstance(s, dict)})
    errors_before = len(client.errors)
    track.avoid = {name}
    client.drain(name)
    left = upgrade.stop(name)
    stopped = time.monotonic()
    upgrade.start(name, release)
    wait_until(f"{name} to be a member again", lambda: is_member(swarm.status(name)),
               SETTLE_TIMEOUT_S, track.poll)
    member = time.monotonic()
    track.avoid = set()
    client.undrain(name)
    wait_until("the swarm to settle (all see all alive, one leader, the load whole with "
               "every stage's fellow alive, the job running)",
               lambda: all_see_all(upgrade) and one_leader(swarm, upgrade.names)
               and load_whole(upgrade) and track.polled().get("state") == "running",
               SETTLE_TIMEOUT_S, track.poll)
    step = {"fellow": name, "was_leader": was_leader, "held_stage": held is not None,
            "replica_fellows": replicas, "left_cleanly": left,
            "error_count": len(client.errors) - errors_before,
            "errors": client.errors[errors_before:][:5],
            "stop_s": round(stopped - began, 1), "member_again_s": round(member - stopped, 1),
            "settled_s": round(time.monotonic() - member, 1),
            "errors_so_far": len(client.errors), "job_step": track.watch.last_step}
    say(f"  {name}{' (leader)' if was_leader else ''} replaced: a member again "
        f"{step['member_again_s']} s after its stop, settled {step['settled_s']} s later; "
        f"{client.served} generations, {len(client.errors)} errors; job at step "
        f"{track.watch.last_step}")
    return step


def verdict(report: dict[str, Any]) -> list[str]:
    """Each target the run missed, one line each (empty: all met)."""
    misses = []
    if report.get("failed"):
        misses.append(f"run ended early: {report['failed']}")
    if report.get("client_errors"):
        misses.append(f"{report['client_errors']} client errors: "
                      f"{report['client_error_lines'][:3]}")
    job_seen = report.get("job") or {}
    if job_seen.get("restarts", 1):
        misses.append(f"job restarts: {job_seen.get('restarts')} ({job_seen.get('moves')})")
    if report.get("terms_with_two_leaders"):
        misses.append(f"terms with two leaders: {report['terms_with_two_leaders']}")
    if not report.get("all_current"):
        misses.append("not every fellow runs the current release at the end")
    return misses


__all__ = ["CURRENT", "PREVIOUS_RELEASE", "Release", "has_commit", "previous_release",
           "repository_root", "run", "verdict"]
