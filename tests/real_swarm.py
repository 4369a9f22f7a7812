"""Helpers of the tests that run real `join` processes: what a fellow's status says of its
stages; waiting with a deadline (``poll``) and the rest live in ``p2pswarm.sim.commands``."""

from __future__ import annotations

from p2pswarm.sim.commands import poll
from p2pswarm.sim.processes import LocalSwarm


def stage_sessions(swarm: LocalSwarm, name: str) -> int:
    """Sessions open at the stages fellow ``name`` holds (0 when it does not answer: a
    frozen or killed fellow)."""
    try:
        held = swarm.status(name)["stages_held"]
    except Exception:
        return 0
    return sum(int(h.get("sessions", 0)) for h in held)


__all__ = ["poll", "stage_sessions"]
