"""What the agent's services see of it: small Protocols, never the whole ``Agent``.

Each service names the few things it uses (who this fellow is, its sealed streams, its
counters, the membership view it reads, where its compute runs) and gets an object that
has them: ``Agent`` satisfies every port here structurally, and a test may hand a service
a fake of a dozen lines instead of a swarm. None of this imports ``Agent``, so the
services below it do not tie back into it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from p2pswarm.control.requests import Handler

if TYPE_CHECKING:
    from p2pswarm.agent.compute import Compute
    from p2pswarm.agent.counters import Counters
    from p2pswarm.agent.fellow_meta import FellowSays
    from p2pswarm.config import SwarmConfig
    from p2pswarm.election import ElectionStatus
    from p2pswarm.membership.member import Member
    from p2pswarm.transport.secure import SecureStream

# Returns the reply message, or None to end the stream. A handler may instead keep the
# stream for itself (raw frames, e.g. tensors) and return None when it is done with it.
StreamHandler = Callable[[Any, "SecureStream"], Awaitable[Any]]
ControlHandler = Handler  # a control op: the request map in, the answer out (control's own)


class Named(Protocol):
    """Who this fellow is."""

    @property
    def name(self) -> str: ...

    @property
    def node_id(self) -> bytes: ...

    @property
    def addr(self) -> str: ...


class Spawns(Protocol):
    """Runs a service's timer or reporter alongside the agent, ending with it."""

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...


class Configured(Protocol):
    @property
    def config(self) -> SwarmConfig: ...


class Counted(Protocol):
    """The traffic counters drops and refusals are counted in."""

    @property
    def counters(self) -> Counters: ...


class Computes(Protocol):
    """Where blocking work (torch, disk, hashing) runs."""

    @property
    def compute(self) -> Compute: ...


class Dials(Protocol):
    """Sealed streams to fellows, outgoing."""

    async def call(self, addr: str, request: Any, *, timeout_s: float | None = None) -> Any: ...

    async def open_secure(self, addr: str, *, timeout_s: float | None = None
                          ) -> SecureStream: ...


class Answers(Protocol):
    """Sealed streams from fellows: who answers which first message."""

    def on_stream(self, message_type: type, handler: StreamHandler) -> None: ...


class FindsFellow(Protocol):
    def fellow(self, fellow_id: str) -> Member | None:
        """The fellow plans and records name by ``fellow_id`` (its node id in hex)."""


class Fellows(FindsFellow, Protocol):
    """The membership view a service reads: fellows, and what each says about itself."""

    def members(self) -> list[Member]:
        """Every fellow known, this one included."""

    def fellows(self) -> list[Member]:
        """Every fellow known, this one excluded, by name."""

    def fellow_says(self, member: Member) -> FellowSays:
        """What ``member`` says about itself, checked once at the edge (``fellow_meta``)."""


class Elected(Protocol):
    """What a service reads of the election: its term and who leads."""

    @property
    def term(self) -> int: ...

    def status(self) -> ElectionStatus: ...


class FollowsLeader(Protocol):
    @property
    def election(self) -> Elected | None: ...


class Publishes(Protocol):
    """What this fellow says about itself, and gossiping a new version of it."""

    @property
    def extra_metadata(self) -> dict[str, Any]: ...

    def publish_metadata(self) -> None: ...


class ServesControl(Protocol):
    """The local control API's operations, by name."""

    @property
    def control_ops(self) -> dict[str, ControlHandler]: ...


class LeadershipPort(Named, Dials, Answers, Counted, FindsFellow, FollowsLeader, Protocol):
    """What ``Leadership`` asks the leader and takes orders with."""


class PlanningPort(Named, Fellows, ServesControl, Computes, Counted, Configured, Protocol):
    """What ``Planning`` builds the swarm's view from, and where it plans for fellows."""


class WeightsPort(Dials, Configured, Protocol):
    """What fetching weights from one fellow uses."""


class HoldersPort(Named, Dials, Configured, Counted, Fellows, Protocol):
    """What gathering weights from whichever fellows hold them uses."""


__all__ = [
    "Answers", "Computes", "Configured", "ControlHandler", "Counted", "Dials", "Elected",
    "Fellows", "FindsFellow", "FollowsLeader", "HoldersPort", "LeadershipPort", "Named",
    "PlanningPort", "Publishes", "ServesControl", "Spawns", "StreamHandler", "WeightsPort",
]
