"""Real-network mode: the scenario run by real agent processes in network namespaces.

Theory of operation. Each fellow is a ``p2pswarm join`` process in its own network
namespace, with one veth pair whose other end sits on a bridge in the root namespace
(no address on the bridge: the fellows talk only among themselves). Loss is an nftables
table inside each namespace: ``numgen random mod 100 < P`` drops on input and output
(a radio's loss applies to what the fellow sends and what it hears; a link loss only on
input, so each packet meets it once). A radio's bursts of total loss are drawn ahead from
the profile's own chain (``p2pswarm.sim.bursts``, seeded by the scenario and the fellow)
and replayed by a driver thread: each burst puts the fellow's ``eth0`` in the set of a
second table (``p2pswarm_burst``: drop all in and out) for its length, through one
``nft -i`` process per namespace, so a switch is a line on a pipe, not a process start;
between bursts the random rule drops at the radio's ``loss_in_good``. Radios whose bursts
are too short to replay stay independent loss at their mean rate; delay is the host's.
Link outages are ``ip link set eth0 down`` in the namespace; a partition adds a drop rule per
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
import threading
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
from p2pswarm.sim.bursts import burst_schedule, replayable, time_in_bursts
from p2pswarm.sim.director import Director
from p2pswarm.sim.metrics import summary
from p2pswarm.sim.oracle import Oracle
from p2pswarm.sim.profiles import Profile, profile
from p2pswarm.sim.scenario import Scenario
from p2pswarm.transport.netmodel import GilbertElliott

MAX_FELLOWS = 20
PORT = DEFAULT_PORT
POLL_S = 0.2
LOAD_EVERY_S = 10.0  # a starved host delays acks: each result says how busy it was
# What each fellow counts that a run sums (since the warm-up): traffic, and its own
# membership machine's probes and verdicts (exact, where polling states can miss a
# suspicion refuted within a poll; a refutation is one false suspicion of that fellow).
COUNTERS = ("datagrams_out", "bytes_out", "datagrams_in", "bytes_in", "probes",
            "probes_failed", "probes_refused", "suspicions_raised", "refutations",
            "refutations_unasked", "dead_declared")
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
    bursts: list[tuple[float, float]] = field(default_factory=list)  # replayed, seconds

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
            if replayable(f.profile.radio):
                _run("ip", "netns", "exec", f.ns, "nft", "-f", "-", input_text=BURST_TABLE)

    def _set_rules(self, f: RealFellow) -> None:
        _run("ip", "netns", "exec", f.ns, "nft", "delete", "table", "inet", "p2pswarm_sim",
             check=False)
        _run("ip", "netns", "exec", f.ns, "nft", "-f", "-", input_text=ruleset(f))

    def close(self) -> None:
        """Kill what this run started and remove every namespace, link and rule it made."""
        if self._closed:
            return
        self._closed = True
        for f in self.fellows:
            self.kill(f.index)
        for f in self.fellows:
            if f.ns in self._made_ns:
                for table in ("p2pswarm_sim", "p2pswarm_burst"):
                    _run("ip", "netns", "exec", f.ns, "nft", "delete", "table", "inet",
                         table, check=False)
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


def ruleset(f: RealFellow) -> str:
    """The nftables table of fellow ``f``'s loss and blocked addresses (its bursts, if
    replayed, come on top from ``BURST_TABLE``)."""
    radio = round(100 * f.profile.mean_loss)
    if isinstance(f.profile.radio, GilbertElliott) and replayable(f.profile.radio):
        radio = round(100 * f.profile.radio.loss_in_good)  # the bursts come on top
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
    return "\n".join(lines) + "\n"


BURST_TABLE = """table inet p2pswarm_burst {
  set on { type ifname; }
  chain input { type filter hook input priority -10; policy accept; iifname @on drop; }
  chain output { type filter hook output priority -10; policy accept; oifname @on drop; }
}
"""


class BurstDriver:
    """Replays each fellow's bursts: a thread that walks every switch in time order and
    writes it to that namespace's ``nft -i``. The trio loop is busy with blocking status
    calls, so the switches keep their own clock (``time.monotonic``). It records how late
    each switch was applied, and the spans really applied."""

    def __init__(self, netns: Netns) -> None:
        self.netns = netns
        self._shells: dict[int, subprocess.Popen[str]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.late_s: list[float] = []
        self.applied: dict[int, list[tuple[float, float]]] = {}

    def start(self, t0_monotonic: float) -> None:
        switches: list[tuple[float, int, bool]] = []
        for f in self.netns.fellows:
            if not f.bursts:
                continue
            log = open(self.netns.work / f"{f.name}.nft.log", "ab")
            self._shells[f.index] = subprocess.Popen(
                ["ip", "netns", "exec", f.ns, "nft", "-i"], stdin=subprocess.PIPE,
                stdout=log, stderr=log, text=True, bufsize=1)
            log.close()
            for a, b in f.bursts:
                switches += [(a, f.index, True), (b, f.index, False)]
        switches.sort()
        self._thread = threading.Thread(target=self._run, args=(switches, t0_monotonic),
                                        name="bursts", daemon=True)
        self._thread.start()

    def _run(self, switches: list[tuple[float, int, bool]], t0: float) -> None:
        began: dict[int, float] = {}
        for at, i, on in switches:
            if self._stop.wait(max(0.0, t0 + at - time.monotonic())):
                break
            verb = "add" if on else "delete"
            shell = self._shells[i]
            try:
                assert shell.stdin is not None
                shell.stdin.write(f'{verb} element inet p2pswarm_burst on {{ "eth0" }}\n')
                shell.stdin.flush()
            except (BrokenPipeError, OSError):
                continue
            now = time.monotonic() - t0
            self.late_s.append(now - at)
            if on:
                began[i] = now
            elif i in began:
                self.applied.setdefault(i, []).append((began.pop(i), now))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for shell in self._shells.values():
            try:
                if shell.stdin is not None:
                    shell.stdin.close()
                shell.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                shell.kill()
        self._shells.clear()

    def report(self, start_s: float, end_s: float) -> dict[str, Any]:
        """What was replayed: the share of [start_s, end_s] each fellow spent in a burst
        (mean over fellows), how many bursts, their mean length, how late switches came."""
        spans = [s for i in sorted(self.applied) for s in self.applied[i]]
        shares = [time_in_bursts(self.applied.get(i, []), start_s, end_s)
                  for i in self._burst_fellows()]
        return {"fellows": len(shares), "bursts": len(spans),
                "time_in_bursts": round(sum(shares) / len(shares), 4) if shares else 0.0,
                "mean_burst_s": round(sum(b - a for a, b in spans) / len(spans), 4)
                if spans else None,
                "switch_late_ms": summary([1e3 * x for x in self.late_s], 2)}

    def _burst_fellows(self) -> list[int]:
        return [f.index for f in self.netns.fellows if f.bursts]


class NetnsWorld:
    """The director's ``World`` in namespaces: real processes, real time (seconds since
    the run began). It tells the oracle what it does, and a watcher task polls every
    fellow's status into the oracle's events (``_poll``)."""

    def __init__(self, netns: Netns, scenario: Scenario, oracle: Oracle, token: str,
                 notes: list[str], bursts: BurstDriver | None = None) -> None:
        self.netns = netns
        self.bursts = bursts
        self.scenario = scenario
        self.oracle = oracle
        self.token = token
        self.notes = notes
        n = len(netns.fellows)
        self.n = n
        self.rng = random.Random(f"director:{scenario.seed}")
        self.started = [False] * n
        self.cut = [False] * n
        self.traffic = [[0.0] * len(COUNTERS) for _ in range(n)]  # since the warm-up
        self.last_counters: dict[int, list[float]] = {}
        self.base_counters: dict[int, list[float]] = {}  # each process's at the warm-up
        self._based = False
        self.polled_at: dict[int, float] = {}  # when each fellow last answered a poll
        self.belief: dict[tuple[int, int], str] = {}
        self.leader_seen: dict[int, tuple[str, int] | None] = {}
        self.index_of: dict[str, int] = {}
        self.failovers: list[tuple[float, int, str]] = []
        self.t0 = 0.0
        self.end_s = 0.0
        self.loads: list[float] = []  # the host's 1-minute load average, every LOAD_EVERY_S

    async def main(self, progress: ProgressFn | None) -> None:
        """Run the scenario's timeline, watching every fellow, until its end."""
        s = self.scenario
        actions = build_timeline(replace(s, formed=False, stagger_s=max(s.stagger_s, 0.2)),
                                 [f.profile for f in self.netns.fellows], s.start or self.n)
        self.t0 = trio.current_time()
        if self.bursts is not None:
            self.bursts.start(time.monotonic())
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
            if not self._based and self.now() >= self.scenario.warmup_s:
                self._based = True  # count from here, as the oracle's node-hours do
                self.base_counters = {i: list(c) for i, c in self.last_counters.items()}
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
            if len(self.loads) <= self.now() / LOAD_EVERY_S:
                self.loads.append(round(os.getloadavg()[0], 2))
            await trio.sleep(max(0.0, POLL_S - (self.now() - t)))

    def account(self, i: int) -> None:
        c = self.last_counters.pop(i, None)
        base = self.base_counters.pop(i, None)
        if c is not None and self._based:
            for k in range(len(COUNTERS)):
                self.traffic[i][k] += c[k] - (base[k] if base is not None else 0.0)

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
    burst_figures: dict[str, Any] | None = None
    try:
        with Netns(n, profiles, [p for _, p, _ in layout], work) as netns:
            driver = _plan_bursts(netns, scenario, oracle)
            world = NetnsWorld(netns, scenario, oracle, netns.init_swarm(), notes, driver)
            try:
                trio.run(world.main, progress)
            finally:
                if driver is not None:
                    driver.close()
            end_s = world.end_s
            if driver is not None:
                burst_figures = driver.report(scenario.warmup_s, end_s)
            for i in range(n):
                world.account(i)
            traffic = world.traffic
            loads = world.loads
        leftovers = netns.leftovers()
    finally:
        if keep_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    judged = oracle.finish(end_s)
    # a false death only a cut or fade of 3 s or more excuses: the issue's "after outages
    # under 3 s" (bursts shorter than that are the radio's ordinary weather)
    judged["false_deaths_short_outages"] = oracle.false_deaths_judged(
        scenario.checks.excuse_window_s, max(3.0, scenario.checks.blackout_min_s))
    rates = []
    for i in range(n):
        if oracle.run_seconds[i] > 0:
            rates.append(traffic[i][1] / oracle.run_seconds[i])
    node_h = sum(oracle.run_seconds) / 3600.0
    own = {k: int(sum(t[j] for t in traffic)) for j, k in enumerate(COUNTERS) if j >= 4}
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
        "bursts": burst_figures,
        "load_average": loads,
        "counted_by_fellows": {**own, "refutations_per_node_hour": round(
            own["refutations"] / node_h, 2) if node_h else None},
        "views": oracle.view_samples, "notes": notes + [
            f"changes seen by polling every {POLL_S:g} s, dated by each fellow's in_state_s"
            + ("; bursts replayed by nft rules" if burst_figures else "")],
        "leftovers": leftovers, "wall_s": round(time.monotonic() - wall0, 2),
    }


def _plan_bursts(netns: Netns, scenario: Scenario, oracle: Oracle) -> BurstDriver | None:
    """Draw every replayable radio's bursts for the run; tell the oracle of those long
    enough to count as a blackout, as the virtual harness does. None: no bursts here."""
    any_bursts = False
    for f in netns.fellows:
        radio = f.profile.radio
        if isinstance(radio, GilbertElliott) and replayable(radio):
            f.bursts = burst_schedule(radio, scenario.seed, f.index, scenario.duration_s)
            any_bursts = any_bursts or bool(f.bursts)
            for a, b in f.bursts:
                if b - a >= scenario.checks.blackout_min_s:
                    oracle.blackout(f.index, a, b)
    return BurstDriver(netns) if any_bursts else None


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
        c = {**status.get("counters", {}), **status.get("membership", {})}
        last_counters[f.index] = [float(c.get(k, 0)) for k in COUNTERS]
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


__all__ = ["BURST_TABLE", "MAX_FELLOWS", "BurstDriver", "Netns", "NetnsWorld",
           "missing_requirements", "ruleset", "run_real"]
