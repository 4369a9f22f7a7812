"""Admission figures with real `p2pswarm join` processes (a section of bench_security.py).

An admin home makes an invitation of N uses; N + 2 fellows try to join with it, each
through the admin's fellow; the figure is how many the swarm admits. Then one admitted
fellow is revoked, and the figure is the time until it is out of every other fellow's
view.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2pswarm.control import client as control_client
from p2pswarm.errors import SwarmError
from p2pswarm.sim.field import free_port

Row = tuple[str, str, str, bool]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2pswarm.cli", *args], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL, check=True)


def _join(home: Path, port: int, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "p2pswarm.cli", "join", "--home", str(home), "--preset",
         "local", "--no-cpu", "--http", "off", "--listen", f"127.0.0.1:{port}", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
        stdin=subprocess.DEVNULL)


def _alive(home: Path) -> set[str]:
    try:
        data: dict[str, Any] = control_client.request(home, {"op": "status"}, timeout_s=10)
    except SwarmError:
        return set()
    return {m["name"] for m in data["members"] if m["state"] in ("alive", "suspect")}


def _wait(ready: Callable[[], bool], timeout_s: float) -> float | None:
    began = time.monotonic()
    while not ready():
        if time.monotonic() - began > timeout_s:
            return None
        time.sleep(0.1)
    return time.monotonic() - began


def admission(uses: int = 3, extra: int = 2) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="p2pswarm-admission-") as tmp:
        root = Path(tmp)
        admin_home = root / "admin"
        _cli("init", "--home", str(admin_home), "--json")
        token = json.loads(_cli("invite", "--home", str(admin_home), "--uses", str(uses),
                                "--json").stdout)["token"]
        port = free_port()
        seed = f"127.0.0.1:{port}"
        procs = {"admin": _join(admin_home, port, "--name", "admin")}
        try:
            _wait(lambda: "admin" in _alive(admin_home), 60)
            names = [f"f{i}" for i in range(uses + extra)]
            for name in names:
                procs[name] = _join(root / name, free_port(), seed, "--name", name,
                                    "--token", token)
            # settled: every joiner admitted or gone (a refused joiner exits)
            _wait(lambda: all(procs[n].poll() is not None or n in _alive(admin_home)
                              for n in names), 120)
            admitted = sorted(_alive(admin_home) - {"admin"})
            rows: list[Row] = [(
                f"identities admitted with one invitation of {uses} uses ({uses + extra} "
                "tried)", str(len(admitted)), str(uses), len(admitted) == uses)]
            if not admitted:
                return rows
            victim = admitted[0]
            watchers = [admin_home] + [root / n for n in admitted[1:]]
            _cli("revoke", victim, "--home", str(admin_home))
            took = _wait(lambda: all(victim not in _alive(h) for h in watchers), 30)
            rows.append(("time until a revoked fellow is out of every view",
                         "not within 30 s" if took is None else f"{took:.1f} s", "<= 10 s",
                         took is not None and took <= 10.0))
            return rows
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            for p in procs.values():
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


if __name__ == "__main__":
    for row in admission():
        print(" | ".join(str(x) for x in row))
