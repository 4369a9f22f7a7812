"""What serving's rooms see of the agent and of its leadership: small Protocols.

Each room names the few things it uses (who this fellow is, a spawner, its streams, its
counters, the membership view it reads, the planner's view, where its compute runs) and
is handed an object that has them. ``Agent`` and ``Leadership`` satisfy these
structurally; nothing in ``agent/serving`` imports ``Agent``, so serving does not tie
back into it, and a test may hand a room a small fake instead of a swarm.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from p2pswarm.agent.ports import (
    Answers,
    Computes,
    Configured,
    ControlHandler,
    Counted,
    HoldersPort,
    Named,
    Publishes,
    ServesControl,
    Spawns,
    StreamHandler,
)

if TYPE_CHECKING:
    from p2pswarm.agent.fellow_meta import FellowSays
    from p2pswarm.agent.plan_query import PlanQuery
    from p2pswarm.cards import Inventory
    from p2pswarm.inventory import CardSource
    from p2pswarm.membership.machine import Membership
    from p2pswarm.membership.member import Member
    from p2pswarm.planner import ClusterView, FleetPlan, Plan
    from p2pswarm.transport.secure import SecureStream

M = TypeVar("M")
R = TypeVar("R")

DatagramHandler = Callable[[Any, bytes, str], None]  # message, sender id, sender addr


# --- capabilities (the common ones are the agent's: ``p2pswarm.agent.ports``) ------------


class Random(Protocol):
    """The agent's one seeded random generator (bring-up names, session ids)."""

    @property
    def rng(self) -> random.Random: ...


class Fellows(Protocol):
    """The membership view a room reads: fellows, and what each says about itself."""

    @property
    def membership(self) -> Membership | None: ...

    def fellow(self, fellow_id: str) -> Member | None: ...

    def fellow_says(self, member: Member) -> FellowSays: ...


class Streams(Protocol):
    """Sealed streams: answering those that fellows open, and opening one."""

    def on_stream(self, message_type: type, handler: StreamHandler) -> None: ...

    async def open_secure(self, addr: str, *, timeout_s: float | None = None
                          ) -> SecureStream: ...


class Datagrams(Protocol):
    """Sealed datagrams: sending, and answering a type of them."""

    def on_datagram(self, message_type: type, handler: DatagramHandler) -> None: ...

    async def send(self, addr: str, *messages: Any) -> None: ...


class ShownPins(Protocol):
    def check_pin(self, expected: str | None, plan: Plan | FleetPlan) -> None: ...


class PlanningView(Protocol):
    """The planner as this agent runs it: its view of the swarm, a pinned plan."""

    @property
    def shown(self) -> ShownPins: ...

    def view(self) -> ClusterView: ...

    def pinned(self, query: PlanQuery, expected: str | None) -> Plan | FleetPlan: ...

    async def pinned_off_loop(self, request: bytes,
                              expected: str | None) -> Plan | FleetPlan: ...


class Plans(Protocol):
    @property
    def planning(self) -> PlanningView: ...


class ServicesView(Protocol):
    @property
    def loads_dir(self) -> Path | None: ...


class WorldView(Protocol):
    @property
    def services(self) -> ServicesView: ...


class Cards(Protocol):
    """This fellow's cards, its state directory and its world's directories."""

    @property
    def home(self) -> Path | None: ...

    @property
    def card_source(self) -> CardSource | None: ...

    @property
    def inventory(self) -> Inventory | None: ...

    @property
    def world(self) -> WorldView: ...


class Leader(Protocol):
    """The leader's calls and orders (``p2pswarm.agent.leadership``): calls this agent
    serves when it leads, orders it obeys, and asking the leader or ordering a fellow."""

    def serve(self, call_type: type[M], handler: Callable[[M], Awaitable[Any]]) -> None: ...

    def obey(self, order_type: type[M], handler: Callable[[M], Awaitable[Any]]) -> None: ...

    def is_leader(self) -> bool: ...

    def term(self) -> int: ...

    async def ask(self, call: Any, reply_type: type[R]) -> R: ...

    async def ask_until(self, call: Any, reply_type: type[R], deadline: float,
                        leaderless_s: float | None = None) -> R: ...

    async def order(self, addr: str, order: Any, reply_type: type[R]) -> R: ...


# --- what each room is handed ------------------------------------------------------------


class ProgressPort(Named, Random, Datagrams, Protocol):
    """``progress``: load progress to the CLI that asked."""


class OffersPort(Computes, Configured, Answers, Cards, Protocol):
    """``offers``: the weights this fellow offers, and its cache."""


class LoadsPort(Fellows, Plans, Random, Spawns, Configured, Protocol):
    """``loads``: the leader's bring-up and unload."""


class AskerPort(Named, Computes, Protocol):
    """``asking``: the fellow where ``load`` runs."""


class StageHostPort(HoldersPort, Computes, Fellows, Publishes, Spawns, Cards, Streams,
                    Protocol):
    """``stage_host``: a fellow's side of a load (and the weights it gathers)."""


class SessionsPort(Named, Computes, Configured, Streams, Spawns, Protocol):
    """``stage_session``: a hosted stage serving sessions."""


class GenerationPort(HoldersPort, Computes, Fellows, Random, Streams, Protocol):
    """``generation``: the driver (and the weights it gathers)."""


class KeepersPort(Fellows, Spawns, Plans, Configured, Protocol):
    """``keepers``: the fellows that keep a load's orders."""


class UnloadsPort(Named, Counted, Fellows, Configured, Protocol):
    """``unload_memory``: unloads remembered across leaders."""


class AdoptionPort(Named, Counted, Fellows, Spawns, Protocol):
    """``adoption``: a new leader takes over its predecessors' loads."""


class RecutPort(Spawns, Protocol):
    """``recut``: a live move to another cut."""


class FailoverPort(Named, Counted, Fellows, Spawns, Plans, ServesControl, Configured,
                   Protocol):
    """``failover`` and the rooms it builds (adoption, keepers, recut, unload memory)."""


class CopiesPort(Fellows, Plans, Spawns, Protocol):
    """``copies``: the leader has stages copied ahead."""


class CopyHostPort(HoldersPort, Computes, Fellows, Publishes, Spawns, Streams, Protocol):
    """``copy_host``: a fellow keeping a stage's copy (and the weights it gathers)."""


class InterruptedPort(Computes, Spawns, Protocol):
    """``interrupted``: a generation stopped midway."""


class ServingPort(HoldersPort, Computes, Random, Fellows, Publishes, Streams, Datagrams,
                  ServesControl, Plans, Cards, Spawns, Protocol):
    """Everything serving's rooms use, together: what ``Serving`` is handed."""


__all__ = [
    "AdoptionPort", "AskerPort", "Cards", "Computes", "Configured", "ControlHandler",
    "CopiesPort", "CopyHostPort", "Counted", "Datagrams", "FailoverPort", "Fellows",
    "GenerationPort", "InterruptedPort", "KeepersPort", "Leader", "LoadsPort", "Named",
    "OffersPort", "PlanningView", "Plans", "ProgressPort", "Publishes", "Random",
    "RecutPort", "ServesControl", "ServingPort", "SessionsPort", "Spawns", "StageHostPort",
    "StreamHandler", "Streams", "UnloadsPort",
]
