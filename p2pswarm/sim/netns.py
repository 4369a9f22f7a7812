"""Real-network mode: the scenario run by real agent processes in network namespaces.

Theory of operation. Each fellow is a ``p2pswarm join`` process in its own network
namespace, with one veth pair whose other end sits on a bridge in the root namespace
(no address on the bridge: the fellows talk only among themselves). Loss is an nftables
table inside each namespace: ``numgen random mod 100 < P`` drops on input and output
(a radio's loss applies to what the fellow sends and what it hears; a link loss only on
input, so each packet meets it once). WiFi bursts are not reproduced: a Gilbert-Elliott
radio becomes independent loss at its mean rate (its delay, too, is the host's). Link
outages are ``ip link set eth0 down`` in the namespace; a partition adds a drop rule per
address of the other side; a crash is SIGKILL; a restart is the same home (same
identity) started again.

The scenario's timeline is performed by the same ``Director`` as a virtual run
(``p2pswarm.sim.director``), on a ``NetnsWorld``: one trio program in real time, where
the director's actions and a watcher task take turns. Card changes are not modelled
here (noted and skipped); a formed start becomes joins through fellow 0.

The watcher polls every fellow's control API (``status``) a few times a second and turns
changes of what each believes into the same events the virtual oracle judges, so both
worlds give the same figures. A change is dated by how long the fellow says the member
has been in its state (``in_state_s``), not by when the poll saw it: a round of polls
takes a good part of a second, which would otherwise add to every detection time.

Tear-down: every namespace, veth, bridge and nftables table this module makes carries
the run's tag; ``Netns.close`` kills the processes it started and removes all of them.
It runs on exit from the ``with`` block, on Ctrl-C, on SIGTERM and on a failure.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

from p2pswarm.config import DEFAULT_PORT
from p2pswarm.control.client import request as control_request
from p2pswarm.errors import ConfigError, ControlError, SwarmError
from p2pswarm.sim.actions import build_timeline
from p2pswarm.sim.director import Director
from p2pswarm.sim.metrics import summary
from p2pswarm.sim.oracle import Oracle
from p2pswarm.sim.profiles import Profile, profile
from p2pswarm.sim.scenario import Scenario

MAX_FELLOWS = 20
PORT = DEFAULT_PORT
POLL_S = 0.2
AGENT_CMD = [sys.executable, "-c", "from p2pswarm.cli import main; main()"]
ProgressFn = Callable[[float, float], None]


def missing_requirements() -> str | None:
    """Why real mode cannot run here, or None if it can."""
    if sys.platform != "linux":
        return "real mode needs Linux network namespaces"
    if os.geteuid() != 0:
        return "real mode needs root (network namespaces, nftables)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"real mode needs `{tool}` (apt-get install iproute2 nftables)"
    return None


def _run(*args: str, check: bool = True, input_text: str | None = None) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, input=input_text, timeout=30,
                          check=False)
    if check and proc.returncode != 0:
        raise SwarmError(f"{' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


@dataclass
class RealFellow:
    index: int
    name: str
    ns: str
    veth: str
    ip: str
    home: Path
    profile: Profile
    priority: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Any = None
    node_id: str = ""
    blocked: list[str] = field(default_factory=list)

    @property
    def addr(self) -> str:
        return f"{self.ip}:{PORT}"


class Netns:
    """The namespaces, links and rules of one real run. Use as a context manager."""

    def __init__(self, n: int, profiles: list[Profile], priorities: list[int],
                 work: Path, tag: str | None = None) -> None:
        if not 2 <= n <= MAX_FELLOWS:
            raise ConfigError(f"real mode runs 2 to {MAX_FELLOWS} fellows, not {n}")
        self.tag = tag or f"{os.getpid() % 100000:05d}"
        self.bridge = f"p2sb{self.tag}"
        subnet = 10 + int(self.tag) % 240
        self.work = work
        self.fellows = [
            RealFellow(i, f"f{i:03d}", f"p2s-{self.tag}-{i}", f"p2s{self.tag}v{i}",
                       f"10.213.{subnet}.{i + 1}", work / f"f{i:03d}", profiles[i],
                       priorities[i])
            for i in range(n)]
        self._made_ns: list[str] = []
        self._made_bridge = False
        self._closed = False

    # --- building and tearing down --------------------------------------------------

    def __enter__(self) -> Netns:
        self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        signal.signal(signal.SIGTERM, self._old_term)

    def _on_term(self, signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds through __exit__, which tears down

    def _build(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _run("ip", "link", "set", self.bridge, "up")
        for f in self.fellows:
            _run("ip", "netns", "add", f.ns)
            self._made_ns.append(f.ns)
            _run("ip", "link", "add", f.veth, "type", "veth", "peer", "name", "eth0",
                 "netns", f.ns)
            _run("ip", "link", "set", f.veth, "master", self.bridge)
            _run("ip", "link", "set", f.veth, "up")
            _run("ip", "-n", f.ns, "addr", "add", f"{f.ip}/24", "dev", "eth0")
            _run("ip", "-n", f.ns, "link", "set", "eth0", "up")
            _run("ip", "-n", f.ns, "link", "set", "lo", "up")
            self._set_rules(f)

    def _set_rules(self, f: RealFellow) -> None:
        radio = round(100 * f.profile.mean_loss)
        link = round(100 * f.profile.link_loss)
        lines = ["table inet p2pswarm_sim {",
                 "  chain input { type filter hook input priority 0; policy accept;"]
        for addr in f.blocked:
            lines.append(f"    iifname \"eth0\" ip saddr {addr} drop")
        if radio + link:
            lines.append(f"    iifname \"eth0\" numgen random mod 100 < {min(100, radio + link)} drop")
        lines.append("  }")
        lines.append("  chain output { type filter hook output priority 0; policy accept;")
        if radio:
            lines.append(f"    oifname \"eth0\" numgen random mod 100 < {radio} drop")
        lines.append("  }")
        lines.append("}")
        _run("ip", "netns", "exec", f.ns, "nft", "delete", "table", "inet", "p2pswarm_sim",
             check=False)
        _run("ip", "netns", "exec", f.ns, "nft", "-f", "-", input_text="\n".join(lines) + "\n")

    def close(self) -> None:
        """Kill what this run started and remove every namespace, link and rule it made."""
        if self._closed:
            return
        self._closed = True
        for f in self.fellows:
            self.kill(f.index)
        for f in self.fellows:
            if f.ns in self._made_ns:
                _run("ip", "netns", "exec", f.ns, "nft", "delete", "table", "inet",
                     "p2pswarm_sim", check=False)
                # the host end first: a namespace outlives its deletion while sockets in
                # TIME_WAIT hold it, and its veth pair with it
                _run("ip", "link", "del", f.veth, check=False)
                _run("ip", "netns", "del", f.ns, check=False)
        if self._made_bridge:
            _run("ip", "link", "del", self.bridge, check=False)
        self._made_ns.clear()
        self._made_bridge = False

    def leftovers(self) -> list[str]:
        """Namespaces or links of this run still present (empty after ``close``)."""
        out = []
        names = _run("ip", "netns", "list", check=False)
        out += [line.split()[0] for line in names.splitlines()
                if line.startswith(f"p2s-{self.tag}-")]
        links = _run("ip", "-o", "link", "show", check=False)
        out += [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()
                if f"p2s{self.tag}v" in line or self.bridge in line]
        return out

    # --- processes ------------------------------------------------------------------

    def init_swarm(self) -> str:
        out = _run(*AGENT_CMD, "init", "--home", str(self.fellows[0].home), "--json")
        return str(json.loads(out)["token"])

    def start(self, i: int, token: str, seeds: list[str], preset_name: str) -> None:
        f = self.fellows[i]
        f.home.mkdir(parents=True, exist_ok=True)
        if f.log is None:
            f.log = open(self.work / f"{f.name}.log", "ab")
        args = ["ip", "netns", "exec", f.ns, *AGENT_CMD, "join", *seeds,
                "--listen", f.addr, "--name", f.name, "--preset", preset_name,
                "--home", str(f.home), "--leader-priority", str(f.priority),
                "--cpu-memory", "4GB", "--log-level", "info"]
        env = {**os.environ, "P2PSWARM_TOKEN": token}  # never on a command line
        f.proc = subprocess.Popen(args, stdout=f.log, stderr=f.log, stdin=subprocess.DEVNULL,
                                  start_new_session=True, env=env)

    def kill(self, i: int) -> None:
        f = self.fellows[i]
        if f.proc is not None and f.proc.poll() is None:
            try:
                os.killpg(f.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            f.proc.wait(timeout=10)
        f.proc = None

    def leave(self, i: int) -> None:
        f = self.fellows[i]
        if f.proc is not None and f.proc.poll() is None:
            f.proc.send_signal(signal.SIGINT)  # the agent leaves gracefully
            try:
                f.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill(i)
        f.proc = None

    def link(self, i: int, up: bool) -> None:
        _run("ip", "-n", self.fellows[i].ns, "link", "set", "eth0", "up" if up else "down")

    def partition(self, groups: list[list[int]]) -> None:
        side = {i: g for g, members in enumerate(groups) for i in members}
        for f in self.fellows:
            f.blocked = [o.ip for o in self.fellows
                         if f.index in side and o.index in side
                         and side[o.index] != side[f.index]]
            self._set_rules(f)

    def heal(self) -> None:
        for f in self.fellows:
            if f.blocked:
                f.blocked = []
                self._set_rules(f)

    def status(self, i: int) -> dict[str, Any] | None:
        f = self.fellows[i]
        if f.proc is None or f.proc.poll() is not None:
            return None
        try:
            result = control_request(f.home, {"op": "status"}, timeout_s=2.0)
        except (ControlError, SwarmError, OSError):
            return None
        return result if isinstance(result, dict) else None


class NetnsWorld:
    """The director's ``World`` in namespaces: real processes, real time (seconds since
    the run began). It tells the oracle what it does, and a watcher task polls every
    fellow's status into the oracle's events (``_poll``)."""

    def __init__(self, netns: Netns, scenario: Scenario, oracle: Oracle, token: str,
                 notes: list[str]) -> None:
        self.netns = netns
        self.scenario = scenario
        self.oracle = oracle
        self.token = token
        self.notes = notes
        n = len(netns.fellows)
        self.n = n
        self.rng = random.Random(f"director:{scenario.seed}")
        self.started = [False] * n
        self.cut = [False] * n
        self.traffic = [[0.0, 0.0, 0.0, 0.0] for _ in range(n)]
        self.last_counters: dict[int, list[float]] = {}
        self.polled_at: dict[int, float] = {}  # when each fellow last answered a poll
        self.belief: dict[tuple[int, int], str] = {}
        self.leader_seen: dict[int, tuple[str, int] | None] = {}
        self.index_of: dict[str, int] = {}
        self.failovers: list[tuple[float, int, str]] = []
        self.t0 = 0.0
        self.end_s = 0.0

    async def main(self, progress: ProgressFn | None) -> None:
        """Run the scenario's timeline, watching every fellow, until its end."""
        s = self.scenario
        actions = build_timeline(replace(s, formed=False, stagger_s=max(s.stagger_s, 0.2)),
                                 [f.profile for f in self.netns.fellows], s.start or self.n)
        self.t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.watch, progress)
            director = Director(self, s, self.n, s.start or self.n, self.rng)
            await director.run(actions, nursery)
            self.end_s = self.now()
            nursery.cancel_scope.cancel()

    async def watch(self, progress: ProgressFn | None) -> None:
        """Poll every fellow a few times a second; judge failovers; report progress."""
        while True:
            t = self.now()
            _poll(self.netns, self.oracle, self.now, self.belief, self.leader_seen,
                  self.index_of, self.last_counters, self.polled_at)
            for f_at, old, old_id in list(self.failovers):
                agreed: set[str | None] = {
                    _leader_id(self.leader_seen.get(i)) for i in range(self.n)
                    if self.running(i) and not self.cut[i]}
                if len(agreed) == 1 and None not in agreed and old_id not in agreed:
                    self.oracle.failover(f_at, self.now(), old,
                                         self.index_of.get(str(next(iter(agreed)))))
                    self.failovers.remove((f_at, old, old_id))
                elif self.now() - f_at > 120:
                    self.oracle.failover(f_at, None, old, None)
                    self.failovers.remove((f_at, old, old_id))
            if progress is not None:
                progress(self.now(), self.scenario.duration_s)
            await trio.sleep(max(0.0, POLL_S - (self.now() - t)))

    def account(self, i: int) -> None:
        c = self.last_counters.pop(i, None)
        if c is not None:
            for k in range(4):
                self.traffic[i][k] += c[k]

    # the World -------------------------------------------------------------------------

    def now(self) -> float:
        return trio.current_time() - self.t0

    async def sleep_until(self, t: float) -> None:
        await trio.sleep_until(self.t0 + t)

    def running(self, i: int) -> bool:
        return self.netns.fellows[i].proc is not None

    def has_started(self, i: int) -> bool:
        return self.started[i]

    def is_cut(self, i: int) -> bool:
        return self.cut[i]

    async def start(self, i: int) -> None:
        fellows = self.netns.fellows
        first = not self.started[i]
        live = [f.addr for f in fellows if f.proc is not None and f.index != i]
        seeds = live[:3] if live else ([] if i == 0 else [fellows[0].addr])
        self.netns.start(i, self.token, seeds, self.scenario.preset)
        self.started[i] = True
        self.cut[i] = False
        self.oracle.started(i, self.now())
        for key in [k for k in self.belief if k[0] == i]:
            del self.belief[key]
        if first and i == 0:  # the others join through it: wait until it listens
            _wait_socket(self.netns, 0)

    async def form(self) -> None:
        self.note("a formed start is virtual only: here fellows join through fellow 0")

    def crash(self, i: int) -> None:
        self.account(i)
        self.netns.kill(i)
        self.oracle.crashed(i, self.now())

    async def leave(self, i: int) -> None:
        self.account(i)
        self.oracle.left_swarm(i, self.now())
        self.netns.leave(i)

    def link_down(self, i: int) -> None:
        self.netns.link(i, False)
        self.cut[i] = True
        self.oracle.cut(i, self.now())

    def link_up(self, i: int) -> None:
        self.netns.link(i, True)
        self.cut[i] = False
        self.oracle.uncut(i, self.now())

    def partition(self, groups: list[list[int]]) -> None:
        self.netns.partition(groups)
        self.oracle.partitioned(groups, self.now())

    def heal(self) -> None:
        self.netns.heal()
        self.oracle.healed(self.now())

    def leader(self) -> int | None:
        best: tuple[int, int] | None = None
        for i in range(self.n):
            seen = self.leader_seen.get(i)
            if seen and self.index_of.get(seen[0]) == i and (best is None or seen[1] > best[0]):
                best = (seen[1], i)
        return None if best is None else best[1]

    def kill_leader(self, i: int, nursery: trio.Nursery) -> None:
        self.failovers.append((self.now(), i, self.netns.fellows[i].node_id))
        self.crash(i)

    def card_is_free(self, i: int) -> bool:
        return True

    def set_card(self, i: int, free_gb: float | None) -> None:
        self.note(f"{self.now():.1f} s: card changes are not modelled in real mode; skipped")

    def note(self, text: str) -> None:
        self.notes.append(text)


def run_real(scenario: Scenario, progress: ProgressFn | None = None,
             keep_dir: Path | None = None) -> dict[str, Any]:
    """Run ``scenario`` with real processes in namespaces; return a result like the
    virtual harness's (each change dated by the fellow's own ``in_state_s``)."""
    why = missing_requirements()
    if why is not None:
        raise ConfigError(why)
    n = scenario.nodes
    layout = scenario.profiles()
    profiles = [profile(p) for p, _, _ in layout]
    work = Path(tempfile.mkdtemp(prefix="p2pswarm-real-")) if keep_dir is None else keep_dir
    oracle = Oracle(n, scenario.checks, measure_from_s=scenario.warmup_s,
                    plan_grace_s=scenario.plan.grace_s)
    notes: list[str] = []
    if scenario.formed:
        notes.append("a formed start is virtual only: here fellows join through fellow 0")
    wall0 = time.monotonic()
    try:
        with Netns(n, profiles, [p for _, p, _ in layout], work) as netns:
            world = NetnsWorld(netns, scenario, oracle, netns.init_swarm(), notes)
            trio.run(world.main, progress)
            end_s = world.end_s
            for i in range(n):
                world.account(i)
            traffic = world.traffic
        leftovers = netns.leftovers()
    finally:
        if keep_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    judged = oracle.finish(end_s)
    rates = []
    for i in range(n):
        if oracle.run_seconds[i] > 0:
            rates.append(traffic[i][1] / oracle.run_seconds[i])
    return {
        "scenario": scenario.to_dict(), "variant": "real", "preset": scenario.preset,
        "seed": scenario.seed, "nodes": n, "duration_s": scenario.duration_s,
        "warmup_s": scenario.warmup_s,
        **judged,
        "trace_hash": "-",
        "traffic": {"bytes_out_per_fellow_s": summary(rates, 2),
                    "datagrams_out_per_fellow_s": summary(
                        [traffic[i][0] / oracle.run_seconds[i] for i in range(n)
                         if oracle.run_seconds[i] > 0], 2),
                    "_bytes_out_per_fellow_s": [round(v, 2) for v in rates]},
        "views": oracle.view_samples, "notes": notes + [
            f"changes seen by polling every {POLL_S:g} s, dated by each fellow's in_state_s; "
            "bursts are independent loss at the profile's mean"],
        "leftovers": leftovers, "wall_s": round(time.monotonic() - wall0, 2),
    }


def _leader_id(seen: tuple[str, int] | None) -> str | None:
    return None if seen is None else seen[0]


def _wait_socket(world: Netns, i: int, timeout_s: float = 20.0) -> None:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if world.status(i) is not None:
            return
        time.sleep(0.1)
    raise SwarmError(f"fellow {i} did not start within {timeout_s:g} s "
                     f"(see {world.work / world.fellows[i].name}.log)")


_STATE_EVENT = {"suspect": "suspect", "dead": "dead", "left": "left", "alive": "alive"}


def _poll(world: Netns, oracle: Oracle, now: Callable[[], float],
          belief: dict[tuple[int, int], str], leader_seen: dict[int, Any],
          index_of: dict[str, int], last_counters: dict[int, list[float]],
          polled_at: dict[int, float]) -> None:
    """One round of status calls, turned into the oracle's events."""
    for f in world.fellows:
        asked = now()
        status = world.status(f.index)
        if status is None:
            continue
        t = (asked + now()) / 2.0  # when the fellow answered, give or take half the call
        since_last_poll = polled_at.get(f.index, 0.0)
        polled_at[f.index] = t
        f.node_id = status["self"]["id"]
        index_of[f.node_id] = f.index
        c = status.get("counters", {})
        last_counters[f.index] = [float(c.get("datagrams_out", 0)), float(c.get("bytes_out", 0)),
                                  float(c.get("datagrams_in", 0)), float(c.get("bytes_in", 0))]
        for m in status.get("members", []):
            if m.get("self"):
                continue
            s = index_of.get(m["id"])
            if s is None:
                s = next((g.index for g in world.fellows if g.name == m["name"]), -1)
                if s < 0:
                    continue
                index_of[m["id"]] = s
            key = (f.index, s)
            state = m["state"]
            before = belief.get(key)
            if before == state:
                continue
            belief[key] = state
            if before is None and state == "alive":
                continue
            kind = _STATE_EVENT.get(state)
            if kind is not None:
                changed_at = min(t, max(since_last_poll, t - float(m.get("in_state_s", 0.0))))
                oracle.event(changed_at, f.index, kind, s, int(m.get("incarnation", 0)), 0)
        leader = status.get("leader")
        seen = (leader["id"], int(leader["term"])) if leader else None
        if seen != leader_seen.get(f.index):
            leader_seen[f.index] = seen
            if seen is not None:
                who = index_of.get(seen[0], -1)
                oracle.event(t, f.index, "leader", who, 0, seen[1])
                if who == f.index:
                    oracle.event(t, f.index, "elected", who, 0, seen[1])


__all__ = ["MAX_FELLOWS", "Netns", "NetnsWorld", "missing_requirements", "run_real"]
