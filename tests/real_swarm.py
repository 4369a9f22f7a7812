"""Helpers of the tests that run real `join` processes: waiting for something with a
deadline, looked at often (``p2pswarm.sim.commands.poll`` is the rest's), and what a
fellow's status says of its stages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from p2pswarm.sim import commands
from p2pswarm.sim.processes import LocalSwarm


def poll(what: str, ready: Callable[[], Any], timeout_s: float = 60.0, *,
         tolerate: tuple[type[BaseException], ...] = ()) -> Any:
    """``commands.poll`` every 50 ms: these tests time sessions and generations."""
    return commands.poll(what, ready, timeout_s, tolerate=tolerate, interval_s=0.05)


def stage_sessions(swarm: LocalSwarm, name: str) -> int:
    """Sessions open at the stages fellow ``name`` holds (0 when it does not answer: a
    frozen or killed fellow)."""
    try:
        held = swarm.status(name)["stages_held"]
    except Exception:
        return 0
    return sum(int(h.get("sessions", 0)) for h in held)

