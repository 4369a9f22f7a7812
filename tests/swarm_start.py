"""Starting a virtual swarm as most tests do: its network run in the test's nursery,
every fellow started, and a wait until they have formed."""

from __future__ import annotations

from collections.abc import Callable

import trio

from p2pswarm.sim.virtual import VirtualSwarm, wait_until


async def formed(nursery: trio.Nursery, swarm: VirtualSwarm, *, timeout_s: float,
                 until: Callable[[], bool] | None = None) -> float:
    """Runs ``swarm``'s network in ``nursery``, starts every fellow and waits until they
    have converged (or until ``until``): the virtual seconds that took."""
    await nursery.start(swarm.run)
    await swarm.start_all()
    return await wait_until(until or swarm.converged, timeout_s=timeout_s)
