"""Running one real agent: state directory, sockets, signals. What `p2pswarm join` starts."""

from __future__ import annotations

import logging
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from p2pswarm.agent.address import advertised
from p2pswarm.agent.admission import AdmissionSetup
from p2pswarm.agent.agent import Agent
from p2pswarm.agent.card_news import cached_benchmarks
from p2pswarm.agent.heap import give_back_free_heap, tune_allocator
from p2pswarm.agent.world import AgentWorld, Compute
from p2pswarm.cards import benchmarks_to_dict
from p2pswarm.config import SwarmConfig
from p2pswarm.home import Home
from p2pswarm.inventory import CardSource, read_inventory
from p2pswarm.transport.udp_tcp import open_udp_tcp_transport

log = logging.getLogger("p2pswarm.agent")

# What runs beside the agent while the node lives, started as ``nursery.start(service,
# agent)`` once the agent runs: the HTTP API, which the CLI hands in (http sits above the
# agent in the layers, so the agent never imports it).
NodeService = Callable[..., Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class NodeSettings:
    home: Path
    listen: str  # host:port to bind, port 0 for any
    seeds: tuple[str, ...]
    name: str
    config: SwarmConfig
    advertise: str | None = None  # host:port fellows should use, when listen is 0.0.0.0
    leader_priority: int = 0  # higher: preferred as leader (a wired, always-on machine)
    card_source: CardSource | None = None  # the cards this fellow offers
    services: tuple[NodeService, ...] = ()  # e.g. the HTTP API and pages


async def run_node(settings: NodeSettings, *,
                   task_status: trio.TaskStatus[Agent] = trio.TASK_STATUS_IGNORED) -> None:
    """Run an agent until SIGINT/SIGTERM, then leave cleanly."""
    tune_allocator()
    home = Home(settings.home)
    keyring = home.load_keyring()
    identity = home.load_identity()
    async with open_udp_tcp_transport(settings.listen, settings.config.transport) as transport:
        # what it measured of its cards, gossiped from the start
        benchmarks = {} if settings.card_source is None else {"benchmarks": benchmarks_to_dict(
            cached_benchmarks(settings.home, read_inventory(settings.card_source)))}
        agent = Agent(AgentWorld(
            name=settings.name, transport=transport, keyring=keyring, identity=identity,
            config=settings.config,
            epoch=time.time_ns() // 1000,  # grows across restarts: old packets stay stale
            rng=random.Random(), seeds=settings.seeds, home=settings.home,
            advertise=advertised(transport.local_addr, settings.advertise, settings.seeds),
            leader_priority=settings.leader_priority, card_source=settings.card_source,
            metadata=benchmarks, compute=Compute(nice=settings.config.compute.nice),
            admission=AdmissionSetup.of_home(settings.home), ask_seeds_about_admission=True,
        ))
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(agent.run)
                nursery.start_soon(give_back_free_heap)
                for service in settings.services:
                    await nursery.start(service, agent)
                task_status.started(agent)

                async def stop_on_signal() -> None:
                    """The first signal leaves (within ``gossip.leave_timeout_s``); a
                    second one stops at once."""
                    signalled = False
                    async for signum in signals:
                        if signalled:
                            log.info("%s: stopping now (signal %s)", settings.name,
                                     signal.Signals(signum).name)
                            agent.stop()
                            return
                        log.info("%s: %s received", settings.name,
                                 signal.Signals(signum).name)
                        signalled = True
                        nursery.start_soon(agent.leave)

                nursery.start_soon(stop_on_signal)
                await agent.stopped.wait()
                nursery.cancel_scope.cancel()
    if agent.failure is not None:  # the agent stopped itself: `join` says why and fails
        raise agent.failure
