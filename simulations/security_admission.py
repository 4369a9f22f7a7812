"""Admission figures with real `p2pswarm join` processes (a section of bench_security.py).

An admin home makes an invitation of N uses; N + 2 fellows try to join with it, each
through the admin's fellow; the figure is how many the swarm admits. Then one admitted
fellow is revoked, and the figure is the time until it is out of every other fellow's
view.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from p2pswarm.errors import SwarmError
from p2pswarm.sim.commands import cli, join, present, status_of, stop, took_s
from p2pswarm.sim.field import free_port

Row = tuple[str, str, str, bool]


def _join(home: Path, port: int, *args: str) -> subprocess.Popen[str]:
    return join(home, *args, listen=f"127.0.0.1:{port}", output=subprocess.DEVNULL)


def _alive(home: Path) -> set[str]:
    return present(status_of(home))


def _took_s(ready: Callable[[], bool], timeout_s: float) -> float | None:
    """The seconds until ``ready()`` held; None if not within ``timeout_s``."""
    try:
        return took_s("a figure's condition", ready, timeout_s)
    except SwarmError:
        return None


def admission(uses: int = 3, extra: int = 2) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="p2pswarm-admission-") as tmp:
        root = Path(tmp)
        admin_home = root / "admin"
        cli("init", "--home", str(admin_home), "--json", check=True)
        token = json.loads(cli("invite", "--home", str(admin_home), "--uses", str(uses),
                               "--json", check=True).stdout)["token"]
        port = free_port()
        seed = f"127.0.0.1:{port}"
        procs = {"admin": _join(admin_home, port, "--name", "admin")}
        try:
            _took_s(lambda: "admin" in _alive(admin_home), 60)
            names = [f"f{i}" for i in range(uses + extra)]
            for name in names:
                procs[name] = _join(root / name, free_port(), seed, "--name", name,
                                    "--token", token)
            # settled: every joiner admitted or gone (a refused joiner exits)
            _took_s(lambda: all(procs[n].poll() is not None or n in _alive(admin_home)
                              for n in names), 120)
            admitted = sorted(_alive(admin_home) - {"admin"})
            rows: list[Row] = [(
                f"identities admitted with one invitation of {uses} uses ({uses + extra} "
                "tried)", str(len(admitted)), str(uses), len(admitted) == uses)]
            if not admitted:
                return rows
            victim = admitted[0]
            watchers = [admin_home] + [root / n for n in admitted[1:]]
            cli("revoke", victim, "--home", str(admin_home), check=True)
            took = _took_s(lambda: all(victim not in _alive(h) for h in watchers), 30)
            rows.append(("time until a revoked fellow is out of every view",
                         "not within 30 s" if took is None else f"{took:.1f} s", "<= 10 s",
                         took is not None and took <= 10.0))
            return rows
        finally:
            stop(*procs.values())


if __name__ == "__main__":
    for row in admission():
        print(" | ".join(str(x) for x in row))
