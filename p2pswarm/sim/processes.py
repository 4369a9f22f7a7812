"""Fellows as child processes: real `p2pswarm join` agents on this machine, each with its
own state directory, started, stopped, killed and restarted as a user would. The demo
runs on it, and so do the field scenarios (``p2pswarm.sim.field``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pswarm.control.client import request
from p2pswarm.disk_budget import tree_bytes
from p2pswarm.errors import ControlError, SwarmError
from p2pswarm.home import Home
from p2pswarm.security import SwarmSecret
from p2pswarm.sim import commands
from p2pswarm.sim.commands import hears_ctrl_c, poll, start

Say = Callable[[str], None]


@dataclass
class LocalSwarm:
    """Fellows as child processes, each with its own state directory under ``root``."""

    root: Path
    secret: SwarmSecret
    say: Say
    start_timeout_s: float = 30.0  # a busy machine starts many fellows slowly
    threads: int | None = 1  # torch threads per fellow; None: the fellow's own choice
    env: dict[str, str] = field(default_factory=dict)  # more environment for the fellows
    cwd: Path | None = None  # where they run (`python -m` imports the package from there)
    processes: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    homes: dict[str, Path] = field(default_factory=dict)

    def start(self, name: str, seeds: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> str:
        """Start a fellow and return its address once its agent answers."""
        self.launch(name, seeds, extra)
        return self.address(name)

    def address(self, name: str) -> str:
        """A launched fellow's address, once its agent answers."""
        status = self.wait_for(name, lambda s: True, timeout_s=self.start_timeout_s,
                               what="its agent to start")
        return str(status["self"]["addr"])

    def launch(self, name: str, seeds: tuple[str, ...] = (), extra: tuple[str, ...] = (),
               listen: str = "127.0.0.1:0") -> None:
        """Start a fellow's process (see ``address`` to wait for it); again after it
        stopped: the same fellow, from its own state directory."""
        home = self.root / name
        if not home.exists():
            Home(home).join_swarm(self.secret)
        log = open(self.root / f"{name}.log", "ab")
        command = ["join", *seeds, "--listen", listen, "--name", name, "--preset", "local",
                   "--home", str(home), *extra]
        # several fellows share this machine's cores: one torch thread each, or their
        # threads spend the time waiting for each other
        env = dict(os.environ)
        if self.threads is not None:
            env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        env.update(self.env)
        self.processes[name] = start(*command, stdout=log, stderr=log, env=env, cwd=self.cwd)
        self.homes[name] = home

    def status(self, name: str) -> dict[str, Any]:
        return request(self.homes[name], {"op": "status"}, timeout_s=5)  # type: ignore[no-any-return]

    def wait_for(self, name: str, ready: Callable[[dict[str, Any]], bool], *, timeout_s: float,
                 what: str) -> dict[str, Any]:
        def answered() -> dict[str, Any] | None:
            process = self.processes[name]
            if process.poll() is not None:
                log = (self.root / f"{name}.log").read_text(errors="replace")[-2000:]
                raise SwarmError(f"fellow {name} exited with {process.returncode}:\n{log}")
            status = self.status(name)
            return status if ready(status) else None

        return poll(f"{what} at fellow {name}", answered, timeout_s,  # type: ignore[no-any-return]
                    tolerate=(ControlError,))

    def wait_formed(self, names: list[str], timeout_s: float = 90.0) -> str:
        """Until each of ``names`` sees all of them alive and a leader; the leader's name."""
        for name in names:
            self.wait_for(name, lambda s: s["leader"] is not None and sum(
                m["state"] == "alive" for m in s["members"]) == len(names),
                timeout_s=timeout_s, what="the swarm")
        return str(self.status(names[0])["leader"]["name"])

    def stop(self) -> None:
        names = {process.pid: name for name, process in self.processes.items()}
        commands.stop(*self.processes.values(), timeout_s=10, killing=lambda process: self.say(
            f"fellow {names[process.pid]} did not leave within 10 s; killing it"))


@contextmanager
def local_swarm(say: Say, keep: bool = False, *, start_timeout_s: float = 30.0,
                threads: int | None = 1) -> Iterator[LocalSwarm]:
    root = Path(tempfile.mkdtemp(prefix="p2pswarm-demo-"))
    swarm = LocalSwarm(root=root, secret=SwarmSecret.generate(), say=say,
                       start_timeout_s=start_timeout_s, threads=threads)
    # SIGTERM (`timeout`, `kill`) would end this process without stopping the fellows,
    # leaving them running with no parent: make it unwind through `finally` instead
    earlier = _exit_on_sigterm()
    try:
        yield swarm
    finally:
        swarm.stop()
        if earlier is not None:
            signal.signal(signal.SIGTERM, earlier)
        if keep:
            for line in kept_lines(root):
                say(line)
        else:
            shutil.rmtree(root, ignore_errors=True)


def kept_lines(root: Path) -> list[str]:
    """What a kept run leaves under ``root``: its size, then each directory's (a fellow's
    home: its stores, the biggest first) and the logs together."""
    dirs = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    logs = sum(p.stat().st_size for p in root.glob("*.log"))
    total = tree_bytes(root)
    lines = [f"state and logs kept in {root}: {_mb(total)} in all"]
    for d in dirs:
        stores = sorted(((tree_bytes(s), s.name) for s in d.iterdir() if s.is_dir()),
                        reverse=True)
        inner = ", ".join(f"{name} {_mb(size)}" for size, name in stores if size)
        lines.append(f"  {d.name}: {_mb(tree_bytes(d))}" + (f" ({inner})" if inner else ""))
    lines.append(f"  logs (*.log): {_mb(logs)}")
    return lines


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def _exit_on_sigterm() -> Any:
    """Turn SIGTERM into SystemExit; the handler it replaced, or None off the main thread
    (where signal handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, leave)


__all__ = ["LocalSwarm", "Say", "hears_ctrl_c", "kept_lines", "local_swarm"]
