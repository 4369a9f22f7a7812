"""What an agent is made of: one frozen value, handed to ``Agent`` whole.

The agent takes nothing from module globals. Who it is (name, keys, identity), where it
runs (transport, state directory, the address it advertises), how it is tuned (the
config, the machines' tunings among it), where its randomness and cards come from, who
hears of its events, which machines it runs and how its compute runs: all of it arrives
here. ``p2pswarm join`` builds a world of sockets and real cards (``agent.node``); the
simulation and the tests build worlds of ``MemoryNetwork`` transports and fake cards,
and a simulation variant (the memberlist baseline, a planted bug) is just another world.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pswarm.agent.admission import AdmissionSetup
from p2pswarm.agent.compute import Compute
from p2pswarm.agent.serving.runtime import StageRuntime
from p2pswarm.agent.votes import VoteRecord
from p2pswarm.config import SwarmConfig
from p2pswarm.effects import Event
from p2pswarm.election import Election
from p2pswarm.inventory import CardSource
from p2pswarm.membership.machine import Membership
from p2pswarm.security import Identity, Keyring
from p2pswarm.transport.base import Transport

EventSink = Callable[[Event], None]  # hears every membership and election event noted
MembershipFactory = Callable[..., Membership]  # called as Membership(...) is
ElectionFactory = Callable[..., Election]  # called as Election(...) is


@dataclass(frozen=True, slots=True)
class Services:
    """What serving and training are given beyond the config. The defaults are the real
    world's: the services' own timeouts, weights cached under the state directory, stages
    built by torch. A simulation may make each hosted training step take some virtual
    time (its compute runs inline and takes none) and wait less for it, or hand serving
    a runtime that builds no tensors (a test of placement, not of compute)."""

    training_step_s: float = 0.0  # virtual seconds each hosted training step takes
    training_step_timeout_s: float | None = None  # the driver's wait for a step; None: default
    training_retry_s: float | None = None  # a pending job retries this often; None: default
    weights_dir: Path | None = None  # weights cache; None: <home>/weights, else a temp dir
    stage_runtime: StageRuntime | None = None  # builds and runs stages; None: torch's
    loads_dir: Path | None = None  # kept stage orders; None: <home>/loads, else memory only


@dataclass(frozen=True, slots=True)
class AgentWorld:
    """Everything an ``Agent`` is built from (see the module docstring)."""

    name: str  # this fellow's name, as others see it
    transport: Transport  # datagrams and streams (optional capabilities: transport.base)
    keyring: Keyring  # the swarm keys
    identity: Identity  # this fellow's Ed25519 identity
    config: SwarmConfig  # timings and tunings of every part, the machines' included
    epoch: int  # grows across restarts, so packets from an earlier life stay stale
    rng: random.Random  # every random choice the agent and its machines make
    seeds: tuple[str, ...] = ()  # addresses to join through
    home: Path | None = None  # state directory (votes, control socket); None: none
    advertise: str | None = None  # the address fellows reach us at, if not the bound one
    leader_priority: int = 0  # higher: preferred as leader
    card_source: CardSource | None = None  # the cards this fellow offers; None: none
    votes: VoteRecord | None = None  # term and vote; None: <home>/votes, or in memory
    metadata: Mapping[str, Any] = field(default_factory=dict)  # published from the start
    on_event: EventSink | None = None  # also told each event the agent notes
    membership: MembershipFactory = Membership  # builds the membership machine
    election: ElectionFactory = Election  # builds the election machine
    compute: Compute = field(default_factory=Compute)  # torch on worker threads, or inline
    services: Services = field(default_factory=Services)
    admission: AdmissionSetup | None = None  # certificates asked and checked; None: off
    # without admission: ask the seeds whether their swarm admits by invitation (then stop,
    # saying so) rather than run unseen; `p2pswarm join` does, simulations need not
    ask_seeds_about_admission: bool = False


__all__ = [
    "AgentWorld", "Compute", "ElectionFactory", "EventSink", "MembershipFactory", "Services",
]
