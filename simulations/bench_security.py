"""Security figures: what a stranger's connections cost a live agent, and what the
defences cost the honest path.

    python simulations/bench_security.py [--only SECTION,...] [--json] [--baseline FILE]

Sections (each a function in ``SECTIONS``; add yours there, it returns table rows):

- ``giant_frames``: 1,000 stranger connections, each announcing a 64 MiB frame and then
  holding the connection; the agent's RSS growth, and whether it keeps answering
  ``status`` and planning meanwhile.
- ``giant_frames_here``: the same against an agent in this process (its RSS is ours):
  runs on the code before the fix too, e.g. ``--connections 10`` there.
- ``flood``: a connection flood against an agent at its descriptor limit (started with a
  low ``RLIMIT_NOFILE``): exits, plans answered during the flood.
- ``throughput``: bench_wire's sealed-datagram and sealed-stream figures; with
  ``--baseline`` (``bench_wire.py --json`` run on the code before), the change in percent.
- ``wire``: a rogue holding the swarm key against a live agent in this process
  (simulations/security_wire_attacks.py): every wire message type at its schema's
  extremes, 16 MiB of ``0x90``, twelve 48 MiB frames held back a byte, every handshake
  slot held from 64 addresses; the victim's loop lag and memory growth, worst and named.
- ``insider``: a fellow holding the token sends ``--messages`` election messages, orders
  and shard pushes with hostile values to a virtual swarm (simulations/bench_insider.py):
  crashes, leader changes, files outside the state directories, and the cost of signed
  elections.
- ``peer_attacks``: a fellow's costly asks against real processes (a plan of 2^24 and
  2^31-1 layers, job data from a fellow not leading, a model directory linking to the
  fellow's identity): the victim's loop lag and memory growth, and the refusal
  (simulations/security_peer_attacks.py).

Agents run as real ``p2pswarm join`` processes on loopback; strangers connect from other
127.0.0.0/8 addresses (Linux routes them all to lo), so per-host caps see many hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from p2pswarm.control.client import request
from p2pswarm.errors import SwarmError
from p2pswarm.home import Home
from p2pswarm.planner import BUILTIN_MODELS
from p2pswarm.security import SwarmSecret
from p2pswarm.sim import commands
from p2pswarm.transport.udp_tcp import parse_addr

Row = tuple[str, str, str, bool]  # figure, value, target, met
MIB = 1024 * 1024


# --- agents as processes ----------------------------------------------------------------


@dataclass
class Fellow:
    name: str
    home: Path
    process: subprocess.Popen[bytes]
    addr: str = ""

    def status(self, timeout_s: float = 10.0) -> dict[str, Any]:
        return request(self.home, {"op": "status"}, timeout_s=timeout_s)  # type: ignore[no-any-return]

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def plan(self, timeout_s: float = 20.0) -> bool:
        body = {"model": {"name": "tiny-llama", "config": BUILTIN_MODELS["tiny-llama"]},
                "kind": "serve", "stages": 2, "weights_dtype": "f32", "kv_dtype": "f32",
                "context": 512, "sequences": 1, "exclude": [], "floors_bytes": {},
                "maximize": None}
        try:
            plan = request(self.home, {"op": "plan", "request": body}, timeout_s=timeout_s)
        except SwarmError:
            return False
        return isinstance(plan, dict) and len(str(plan.get("plan_id", ""))) == 16


@dataclass
class Swarm:
    root: Path
    secret: SwarmSecret = field(default_factory=SwarmSecret.generate)
    fellows: list[Fellow] = field(default_factory=list)

    def start(self, name: str, seeds: tuple[str, ...] = (), nofile: int | None = None) -> Fellow:
        home = self.root / name
        Home(home).join_swarm(self.secret)
        log = open(self.root / f"{name}.log", "ab")

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        command = [sys.executable, "-m", "p2pswarm.cli", "join", *seeds, "--listen",
                   "127.0.0.1:0", "--name", name, "--preset", "local", "--home", str(home)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        process = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                   env=env, preexec_fn=limit)
        fellow = Fellow(name, home, process)
        self.fellows.append(fellow)
        fellow.addr = str(wait_for(fellow, lambda s: True)["self"]["addr"])
        return fellow

    def stop(self) -> None:
        commands.stop(*(f.process for f in self.fellows), timeout_s=15)


def wait_for(fellow: Fellow, ready: Callable[[dict[str, Any]], bool],
             timeout_s: float = 60.0) -> dict[str, Any]:
    def answered() -> dict[str, Any] | None:
        if fellow.process.poll() is not None:
            raise SystemExit(f"{fellow.name} exited with {fellow.process.returncode}")
        status = fellow.status(timeout_s=5)
        return status if ready(status) else None

    ready_status: dict[str, Any] = commands.poll(f"{fellow.name} to be ready", answered,
                                                 timeout_s, tolerate=(SwarmError,))
    return ready_status


@contextmanager
def two_fellows(nofile: int | None = None) -> Iterator[tuple[Fellow, Fellow]]:
    """``a`` (the one attacked, its descriptors limited to ``nofile``) and ``b``, joined
    with a leader."""
    root = Path(tempfile.mkdtemp(prefix="p2pswarm-bench-security-"))
    swarm = Swarm(root)
    try:
        a = swarm.start("a", nofile=nofile)
        b = swarm.start("b", (a.addr,))
        wait_for(a, lambda s: len(s["members"]) == 2 and s["leader"] is not None)
        yield a, b
    finally:
        swarm.stop()


# --- the stranger -----------------------------------------------------------------------


def stranger_host(i: int) -> str:
    """Source addresses 127.0.1.1 ... 127.0.4.250: many hosts, as a botnet would be."""
    return f"127.0.{1 + i // 250}.{1 + i % 250}"


async def hold_connections(addr: str, count: int, announce: int | None,
                           while_held: Callable[[], Any]) -> tuple[int, Any]:
    """Open ``count`` connections (announcing a frame of ``announce`` bytes on each, with
    1 KiB of it), run ``while_held`` in a thread while they are all open, close them.
    Returns (connections made, what ``while_held`` returned)."""
    host, port = parse_addr(addr)
    socks: list[trio.socket.SocketType] = []
    header = b"" if announce is None else struct.pack("!I", announce) + bytes(1024)

    async def one(i: int) -> None:
        sock = trio.socket.socket()
        try:
            await sock.bind((stranger_host(i), 0))
            with trio.move_on_after(5):
                await sock.connect((host, port))
                if header:
                    await sock.send(header)
        except OSError:
            sock.close()
            return
        socks.append(sock)

    try:
        async with trio.open_nursery() as nursery:
            for i in range(count):
                nursery.start_soon(one, i)
                if i % 50 == 49:
                    await trio.sleep(0)
        result = await trio.to_thread.run_sync(while_held)
    finally:
        for sock in socks:
            sock.close()
    return len(socks), result


# --- sections ---------------------------------------------------------------------------


def giant_frames() -> list[Row]:
    with two_fellows() as (a, _):
        before = a.rss_bytes()
        peak = [before]

        def during() -> tuple[bool, bool]:
            time.sleep(1.0)  # let the agent read every header
            peak.append(a.rss_bytes())
            status_ok = a.status(timeout_s=10)["self"]["name"] == "a"
            planned = a.plan()
            peak.append(a.rss_bytes())
            return status_ok, planned

        made, (status_ok, planned) = trio.run(hold_connections, a.addr, 1000, 64 * MIB,
                                              during)
        growth = max(peak) - before
        status = a.status()
        alive = a.process.poll() is None
    drops = status["counters"]["drops"]
    refused = status.get("transport", {}).get("streams_refused_busy", 0)
    return [
        (f"stranger connections announcing 64 MiB ({made} made)",
         f"{drops.get('stream-handshake', 0)} cut off, {refused} refused at accept", "all", True),
        ("agent RSS growth, all of them held open", f"{growth / MIB:.1f} MiB", "<= 64 MiB",
         growth <= 64 * MIB),
        ("status and plan answered during the attack", f"{status_ok and planned}", "True",
         status_ok and planned and alive),
    ]


def giant_frames_here(count: int = 1000) -> list[Row]:
    """The same attack on an agent in this process (real sockets): its RSS is ours, so
    the run on the code before this fix can be measured too without it being killed
    (there 10 connections are enough to see it)."""
    import random

    from p2pswarm.agent import Agent
    from p2pswarm.agent.heap import tune_allocator
    from p2pswarm.agent.world import AgentWorld
    from p2pswarm.config import local
    from p2pswarm.security import Identity, Keyring
    from p2pswarm.transport.udp_tcp import open_udp_tcp_transport

    tune_allocator()

    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    async def attack() -> tuple[int, int, dict[str, int]]:
        async with open_udp_tcp_transport("127.0.0.1:0", local().transport) as t, \
                trio.open_nursery() as nursery:
            agent = Agent(AgentWorld(name="a", transport=t,
                                     keyring=Keyring([SwarmSecret.generate()]),
                                     identity=Identity.generate(), config=local(), epoch=1,
                                     rng=random.Random(1)))
            await nursery.start(agent.run)
            before = rss()
            made, _ = await hold_connections(t.local_addr, count, 64 * MIB,
                                             lambda: time.sleep(1.0))
            growth = rss() - before
            drops = dict(agent.counters.drops)
            nursery.cancel_scope.cancel()
        return made, growth, drops

    made, growth, drops = trio.run(attack)
    return [(f"the same, agent in this process ({made} connections)",
             f"{growth / MIB:.1f} MiB, {drops.get('stream-handshake', 0)} cut off", "<= 64 MiB",
             growth <= 64 * MIB)]


def flood() -> list[Row]:
    nofile = 128
    with two_fellows(nofile=nofile) as (a, b):
        def during() -> tuple[bool, bool]:
            time.sleep(1.0)
            return a.plan(timeout_s=30), b.plan(timeout_s=30)

        made, (planned_a, planned_b) = trio.run(hold_connections, a.addr, 2000, None, during)
        time.sleep(1.0)
        status = wait_for(a, lambda s: True)
        exits = sum(f.process.poll() is not None for f in (a, b))
    paused = status.get("transport", {}).get("accept_paused", 0)
    refused = status.get("transport", {}).get("streams_refused_busy", 0)
    return [
        (f"connection flood, agent at RLIMIT_NOFILE={nofile} ({made} connections)",
         f"{paused} accept pauses, {refused} refused at accept", "survives", exits == 0),
        ("agent exits", str(exits), "0", exits == 0),
        ("plans answered during the flood (attacked fellow, its peer)",
         f"{planned_a}, {planned_b}", "True, True", planned_a and planned_b),
    ]


def throughput(baseline: dict[str, Any] | None) -> list[Row]:
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_wire

    from p2pswarm.agent.heap import tune_allocator

    tune_allocator()  # as every agent does at start (and bench_wire.py)
    seal_us = bench_wire.seal_open_1kib()
    mbps = max(trio.run(bench_wire.stream_throughput, 1 << 20, 256 << 20) for _ in range(3))
    rows: list[Row] = []
    for figure, value, unit, lower_is_better in (
            ("seal + open of a 1 KiB datagram, with codec (median)", seal_us, "µs", True),
            ("sealed stream throughput, 1 MiB frames, loopback", mbps, "MB/s", False)):
        text, met = f"{value:.1f} {unit}", True
        if baseline is not None:
            before = next((float(r[1].split()[0]) for r in baseline["rows"] if r[0] == figure),
                          None)
            if before:
                change = (value - before) / before * 100
                worse = change if lower_is_better else -change
                text += f" (was {before:.1f}, {change:+.1f}%)"
                met = worse <= 10.0
        rows.append((figure, text, "within 10% of before", met))
    return rows


def peer_attacks() -> list[Row]:
    """A fellow's costly asks: huge plans, job data not from the leader, a model directory
    linking out (simulations/security_peer_attacks.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import security_peer_attacks

    return security_peer_attacks.peer_attacks()


def wire_attacks(quick: bool) -> list[Row]:
    """A rogue holding the swarm key against the wire and the transport
    (simulations/security_wire_attacks.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import security_wire_attacks

    return security_wire_attacks.rows(trio.run(security_wire_attacks.run_attacks, quick))


def admission() -> list[Row]:
    """Invitations and revocation with real fellows (simulations/security_admission.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import security_admission

    return security_admission.admission()


def insider(messages: int) -> list[Row]:
    """A fellow holding the token floods a virtual swarm (simulations/bench_insider.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_insider

    return bench_insider.table(bench_insider.measure(messages, 1, 3, bench_insider.N),
                               bench_insider.N)


SECTIONS: dict[str, Callable[[argparse.Namespace], list[Row]]] = {
    "giant_frames": lambda args: giant_frames(),
    "giant_frames_here": lambda args: giant_frames_here(args.connections),
    "flood": lambda args: flood(),
    "throughput": lambda args: throughput(
        json.loads(Path(args.baseline).read_text()) if args.baseline else None),
    "insider": lambda args: insider(args.messages),
    "peer_attacks": lambda args: peer_attacks(),
    "wire": lambda args: wire_attacks(args.quick_wire),
    "admission": lambda args: admission(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections of: {', '.join(SECTIONS)}")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--baseline", help="bench_wire.py --json output from before")
    parser.add_argument("--connections", type=int, default=1000,
                        help="stranger connections for giant_frames_here")
    parser.add_argument("--messages", type=int, default=100_000,
                        help="insider messages for the insider section")
    parser.add_argument("--quick-wire", action="store_true",
                        help="wire section: 256 KiB extremes, no 16 and 48 MiB frames")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the strangers need sockets
    rows: list[Row] = []
    for name in args.only.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"unknown section {name!r}; sections: {', '.join(SECTIONS)}")
        rows += SECTIONS[name](args)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"
    if args.json:
        print(json.dumps({"machine": machine, "rows": rows}, indent=2))
    else:
        print(f"machine: {machine}")
        width = max(len(r[0]) for r in rows)
        for figure, value, target, met in rows:
            print(f"{figure:<{width}}  {value:>44}  (target {target}){'' if met else '  MISSED'}")
    if not all(r[3] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
