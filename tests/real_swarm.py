"""Helpers of the tests that run real `join` processes: waiting for something with a
deadline (polled, never a fixed sleep), and what a fellow's status says of its stages."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from p2pswarm.sim.processes import LocalSwarm


def poll(what: str, ready: Callable[[], Any], timeout_s: float = 60.0, *,
         tolerate: tuple[type[BaseException], ...] = ()) -> Any:
    """``ready()``'s first true value within ``timeout_s``; an exception in ``tolerate``
    counts as not ready yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = ready()
        except tolerate:
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def stage_sessions(swarm: LocalSwarm, name: str) -> int:
    """Sessions open at the stages fellow ``name`` holds (0 when it does not answer: a
    frozen or killed fellow)."""
    try:
        held = swarm.status(name)["stages_held"]
    except Exception:
        return 0
    return sum(int(h.get("sessions", 0)) for h in held)
