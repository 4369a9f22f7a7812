"""A swarm of fellows with one CPU card each, in virtual time, for the serving and training
tests: their torch work runs inline (it takes no virtual time)."""

from __future__ import annotations

from typing import Any

import trio

from p2pswarm.sim.virtual import VirtualSwarm, cpu_card, wait_until


async def start_cpu_swarm(nursery: trio.Nursery, n: int, seed: int, started: int | None = None,
                          **options: Any) -> VirtualSwarm:
    """``n`` fellows offering a 16 GB CPU card each (``options`` go to ``VirtualSwarm``),
    the first ``started`` of them (all by default) started and agreed on one leader."""
    swarm = VirtualSwarm(n, seed=seed, inline_compute=True, **options)
    for fellow in swarm.fellows:
        fellow.cards.cards = (cpu_card(16.0, name=f"{fellow.name} CPU"),)
    await nursery.start(swarm.run)
    for i in range(n if started is None else started):
        await swarm.start(i)
    await wait_until(lambda: swarm.converged() and len(swarm.leaders()) == 1
                     and None not in {lid for lid, _ in swarm.leaders()}, timeout_s=30)
    return swarm
