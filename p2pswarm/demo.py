"""`p2pswarm demo`: a real swarm of separate agent processes on loopback, then clean up."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from p2pswarm.control.client import request
from p2pswarm.errors import ControlError, SwarmError
from p2pswarm.home import Home
from p2pswarm.security import SwarmSecret

Say = Callable[[str], None]


@dataclass
class LocalSwarm:
    """Fellows as child processes, each with its own state directory under ``root``."""

    root: Path
    secret: SwarmSecret
    say: Say
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    homes: dict[str, Path] = field(default_factory=dict)

    def start(self, name: str, seeds: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> str:
        """Start a fellow and return its address once its agent answers."""
        home = self.root / name
        Home(home).join_swarm(self.secret)
        log = open(self.root / f"{name}.log", "wb")
        command = [sys.executable, "-m", "p2pswarm.cli", "join", *seeds, "--listen",
                   "127.0.0.1:0", "--name", name, "--preset", "local", "--home", str(home),
                   *extra]
        self.processes[name] = subprocess.Popen(command, stdout=log, stderr=log,
                                                stdin=subprocess.DEVNULL)
        self.homes[name] = home
        status = self.wait_for(name, lambda s: True, timeout_s=30, what="its agent to start")
        return str(status["self"]["addr"])

    def status(self, name: str) -> dict[str, Any]:
        return request(self.homes[name], {"op": "status"}, timeout_s=5)  # type: ignore[no-any-return]

    def wait_for(self, name: str, ready: Callable[[dict[str, Any]], bool], *, timeout_s: float,
                 what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            process = self.processes[name]
            if process.poll() is not None:
                log = (self.root / f"{name}.log").read_text(errors="replace")[-2000:]
                raise SwarmError(f"fellow {name} exited with {process.returncode}:\n{log}")
            try:
                status = self.status(name)
                if ready(status):
                    return status
            except ControlError:
                pass
            if time.monotonic() > deadline:
                raise SwarmError(f"fellow {name}: gave up waiting for {what} after {timeout_s:g} s")
            time.sleep(0.1)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for name, process in self.processes.items():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.say(f"fellow {name} did not leave within 10 s; killing it")
                process.kill()
                process.wait()


@contextmanager
def local_swarm(say: Say, keep: bool = False) -> Iterator[LocalSwarm]:
    root = Path(tempfile.mkdtemp(prefix="p2pswarm-demo-"))
    swarm = LocalSwarm(root=root, secret=SwarmSecret.generate(), say=say)
    try:
        yield swarm
    finally:
        swarm.stop()
        if keep:
            say(f"state and logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def run_demo(say: Say, render_status: Callable[[dict[str, Any]], None], *,
             fellows: int = 3, keep: bool = False) -> dict[str, Any]:
    """Form a swarm of ``fellows`` processes on loopback and show its status."""
    started = time.monotonic()
    names = [f"fellow-{i + 1}" for i in range(fellows)]
    with local_swarm(say, keep) as swarm:
        say(f"starting {fellows} fellows on loopback in {swarm.root}")
        seed = swarm.start(names[0])
        say(f"{names[0]} listening on {seed}")
        for name in names[1:]:
            addr = swarm.start(name, seeds=(seed,))
            say(f"{name} listening on {addr}, joining through {seed}")
        for name in names:
            swarm.wait_for(name, lambda s: s["leader"] is not None and sum(
                m["state"] == "alive" for m in s["members"]) == fellows, timeout_s=60,
                what="the swarm to form and elect a leader")
        status = swarm.status(names[0])
        say(f"swarm formed in {time.monotonic() - started:.1f} s")
        render_status(status)
        say("leaving")
    return status
