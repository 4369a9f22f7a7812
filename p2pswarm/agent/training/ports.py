"""What training's parts use of the agent and of each other, as small protocols.

No part of ``agent.training`` takes the whole ``Agent``: each takes the protocol below
that names what it uses (the agent satisfies them all structurally, as it satisfies
``TrainingAgent``, their union). Parts that work for one another take the protocol of
the other's side they call, not the whole ``Training`` (``TrainingPort``, ``DriverPort``).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio

if TYPE_CHECKING:
    from p2pswarm.agent.counters import Counters
    from p2pswarm.agent.pins import ShownPlans
    from p2pswarm.agent.training.job_plan import JobPlan
    from p2pswarm.agent.training.job_record import Job, Running
    from p2pswarm.agent.training.job_state import Handed
    from p2pswarm.agent.training.kept_store import JobCopy
    from p2pswarm.agent.training.placed import Placement, ReplicaPlacement
    from p2pswarm.agent.training.replica import Replica
    from p2pswarm.agent.training.runtime import TrainRuntime
    from p2pswarm.config import SwarmConfig, TrainingConfig
    from p2pswarm.control.requests import Handler
    from p2pswarm.election import ElectionStatus
    from p2pswarm.errors import ReplicaLost
    from p2pswarm.membership.member import Member
    from p2pswarm.planner import ClusterView
    from p2pswarm.training.checkpoint import CheckpointStore
    from p2pswarm.training.job import JobConfig
    from p2pswarm.transport.secure import SecureStream
    from p2pswarm.wire.versions import Release

T = TypeVar("T")
M = TypeVar("M")
R = TypeVar("R")

StreamHandler = Callable[[Any, "SecureStream"], Awaitable[Any]]


# --- the agent's side ---------------------------------------------------------------------


class Compute(Protocol):
    """Where torch work runs: worker threads, or inline."""

    async def run(self, fn: Callable[[], T],
                  limiter: trio.CapacityLimiter | None = None) -> T: ...


class MemberList(Protocol):
    def members(self) -> tuple[Member, ...]: ...


class ElectionView(Protocol):
    @property
    def term(self) -> int: ...

    def status(self) -> ElectionStatus: ...


class Leadership(Protocol):
    """The calls to and from the leader that training makes and answers."""

    def serve(self, call_type: type[M], handler: Callable[[M], Awaitable[Any]]) -> None: ...

    def serve_from(self, call_type: type[M],
                   handler: Callable[[M, bytes | None], Awaitable[Any]]) -> None: ...

    def obey(self, order_type: type[M], handler: Callable[[M], Awaitable[Any]]) -> None: ...

    def is_leader(self) -> bool: ...

    def term(self) -> int: ...

    async def ask(self, call: Any, reply_type: type[R]) -> R: ...

    async def order(self, addr: str, order: Any, reply_type: type[R]) -> R: ...

    def from_leader(self, sender: bytes | None, what: str) -> None: ...


class Planning(Protocol):
    """The leader's planner on its view."""

    def view(self) -> ClusterView: ...

    async def plan(self, message: dict[str, Any]) -> dict[str, Any]: ...


class OfferedModel(Protocol):
    @property
    def path(self) -> str: ...


class OfferServer(Protocol):
    @property
    def offers(self) -> Mapping[str, OfferedModel]: ...


class Offers(Protocol):
    @property
    def server(self) -> OfferServer: ...


class ServingView(Protocol):
    """What a fellow hosting a training stage asks of its serving side: the cards its
    live serving stages hold, whether it serves, and the model files it offers."""

    @property
    def hosted(self) -> Any: ...

    @property
    def offers(self) -> Offers: ...

    def _live_cards(self) -> tuple[Any, ...]: ...


class Node(Protocol):
    """One fellow as every part of training uses it: who it is, its config, its
    counters, its compute, its streams, its state directory, its nursery."""

    @property
    def name(self) -> str: ...

    @property
    def node_id(self) -> bytes: ...

    @property
    def config(self) -> SwarmConfig: ...

    @property
    def home(self) -> Path | None: ...

    @property
    def compute(self) -> Compute: ...

    @property
    def counters(self) -> Counters: ...

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...

    async def open_secure(self, addr: str, *,
                          timeout_s: float | None = None) -> SecureStream: ...

    def on_stream(self, message_type: type, handler: StreamHandler) -> None: ...

    def state_dir(self, name: str) -> Path: ...


class SwarmNode(Node, Protocol):
    """A fellow and the swarm as it sees it: its members and its election."""

    @property
    def membership(self) -> MemberList | None: ...

    @property
    def election(self) -> ElectionView | None: ...

    def fellow(self, fellow_id: str) -> Member | None: ...

    def release_of(self, node_id: bytes) -> Release: ...


class StageNode(SwarmNode, Protocol):
    """A fellow hosting training stages: it says so in its metadata, next to its
    serving side's cards."""

    @property
    def serving(self) -> ServingView: ...

    @property
    def extra_metadata(self) -> dict[str, Any]: ...

    def publish_metadata(self) -> None: ...


class TrainingAgent(StageNode, Protocol):
    """Everything training uses of its agent: the union of the above, with the
    leader's planner, its random generator and the control ops it adds."""

    @property
    def planning(self) -> Planning: ...

    @property
    def rng(self) -> random.Random: ...

    @property
    def control_ops(self) -> dict[str, Handler]: ...


# --- training's own parts -------------------------------------------------------------------


class HasTimings(Protocol):
    @property
    def timings(self) -> TrainingConfig: ...


class Leads(Protocol):
    def leads(self, term: int) -> bool: ...


class Shown(Protocol):
    @property
    def shown(self) -> ShownPlans: ...


class DataFiles(Protocol):
    """The files a job trains on, where this leader keeps them."""

    async def local(self, job: JobConfig) -> JobConfig: ...


class CheckpointCopies(Protocol):
    """Checkpoint shards copied to fellows, and fetched back."""

    @property
    def incoming(self) -> Path: ...

    async def spread(self, job_id: str, step: int, directory: Path,
                     copies: int) -> dict[str, list[str]]: ...

    async def restore(self, job_id: str, store: CheckpointStore) -> int | None: ...



# --- the driver's side, as its rounds and checkpoints use it ---------------------------------


class Placing(Protocol):
    """The placer, as a driver uses it."""

    async def place(self, job: Job, cut: list[int] | None = None) -> Placement: ...

    async def wait_to_resume(self, job: Job, lost: ReplicaLost) -> Placement: ...

    async def replacement(self, job: Job, replica: int) -> ReplicaPlacement: ...

    async def prepare(self, job: Job, replicas: Mapping[int, ReplicaPlacement],
                      generation: int = 0) -> list[str]: ...

    async def release(self, job: Job, replica: int | None = None,
                      addrs: list[str] | None = None,
                      generation: int | None = None) -> None: ...


class Copying(Protocol):
    """The job copies a leader hands on (``handover``)."""

    async def keep(self, job: Job, driver: Running | None = None) -> None: ...


class DriverTraining(HasTimings, Protocol):
    """What a driver's rounds and checkpoints use of training."""

    @property
    def agent(self) -> Node: ...

    @property
    def handover(self) -> Copying: ...

    @property
    def copies(self) -> CheckpointCopies: ...


class DriverPort(Running, Protocol):
    """What the driver's rounds keeper and checkpoint keeper use of the driver: the job,
    its replicas and keepers, one replica's step and its pause."""

    @property
    def training(self) -> DriverTraining: ...

    @property
    def runtime(self) -> TrainRuntime: ...

    @property
    def job(self) -> Job: ...

    @property
    def cfg(self) -> JobConfig: ...

    @property
    def active(self) -> list[Replica]: ...

    tokens: int  # tokens trained since it started (its throughput)
    started_s: float

    def batch_of(self, r: Replica) -> int: ...

    async def step(self, r: Replica, position: int | None = None) -> float: ...

    async def pause(self, r: Replica, exc: BaseException) -> None: ...


# --- training, as each of its parts uses it -------------------------------------------------


class JobsNode(Node, Protocol):
    """The leader's fellow as its job calls use it: its planner, the model files its
    serving side offers, its random generator (job ids)."""

    @property
    def planning(self) -> Planning: ...

    @property
    def serving(self) -> ServingView: ...

    @property
    def rng(self) -> random.Random: ...


class PlacerNode(SwarmNode, Protocol):
    @property
    def planning(self) -> Planning: ...


class JobPlans(Protocol):
    """The leader's job plans, as the placer asks for them."""

    async def placing_plan(self, job: Job, cut: list[int] | None) -> JobPlan: ...


class KeptCopies(Protocol):
    """The job copies this fellow keeps (``handover``), as a new leader reads them."""

    @property
    def kept(self) -> dict[str, JobCopy]: ...

    def hold(self, copy: JobCopy, state: str) -> None: ...


class Resuming(Protocol):
    """A new leader's side (``takeover``), as a driver resumes from it."""

    async def place(self, job: Job, handed: Handed) -> Placement: ...

    def own_copy(self, job: Job) -> Handed | None: ...

    def from_checkpoint(self, job: Job) -> str: ...

    async def place_afresh(self, job: Job, handed: Handed, *, synced: bool,
                           moved: bool) -> Placement: ...


class Drives(Protocol):
    async def drive(self, job: Job, handed: Handed | None = None) -> None: ...


class CheckpointDirs(Protocol):
    def checkpoint_dir(self, job: Job) -> Path | None: ...


class JobsPort(Shown, Drives, CheckpointDirs, Protocol):
    """What the leader's job calls (``jobs.LeaderJobs``) use of training."""

    @property
    def agent(self) -> JobsNode: ...

    @property
    def leadership(self) -> Leadership: ...


class PlacerPort(HasTimings, Leads, CheckpointDirs, Protocol):
    """What the placer (``placement.Placer``) uses of training."""

    @property
    def agent(self) -> PlacerNode: ...

    @property
    def leadership(self) -> Leadership: ...

    @property
    def leader(self) -> JobPlans: ...

    @property
    def jobs(self) -> dict[str, Job]: ...

    @property
    def hosts(self) -> Mapping[tuple[str, int, int], object]: ...


class StageHostsPort(HasTimings, Protocol):
    """What a fellow hosting stages (``stage_host.StageHosts``) uses of training."""

    @property
    def agent(self) -> StageNode: ...

    @property
    def leadership(self) -> Leadership: ...

    @property
    def runtime(self) -> TrainRuntime: ...

    @property
    def copies(self) -> CheckpointCopies: ...


class HandoverPort(Leads, Protocol):
    """What the job copies (``handover.JobHandover``) use of training."""

    @property
    def agent(self) -> SwarmNode: ...

    @property
    def leadership(self) -> Leadership: ...

    @property
    def runtime(self) -> TrainRuntime: ...


class TakeoverPort(Drives, Protocol):
    """What a new leader's side (``takeover.Takeover``) uses of training."""

    @property
    def agent(self) -> SwarmNode: ...

    @property
    def leadership(self) -> Leadership: ...

    @property
    def placer(self) -> Placing: ...

    @property
    def handover(self) -> KeptCopies: ...

    @property
    def jobs(self) -> dict[str, Job]: ...


class DrivePort(DriverTraining, Leads, CheckpointDirs, Protocol):
    """What a job's drive (``driver.drive``, ``driver.Driver``) uses of training."""

    @property
    def agent(self) -> SwarmNode: ...  # the roster's releases decide how its replicas sync

    @property
    def runtime(self) -> TrainRuntime: ...

    @property
    def leadership(self) -> Leadership: ...

    @property
    def placer(self) -> Placing: ...

    @property
    def takeover(self) -> Resuming: ...

    @property
    def data(self) -> DataFiles: ...

    def hand_on(self, job: Job) -> None: ...


__all__ = ["CheckpointCopies", "CheckpointDirs", "Compute", "Copying", "DataFiles",
           "DrivePort", "DriverPort", "DriverTraining", "Drives", "ElectionView",
           "HandoverPort", "HasTimings", "JobPlans", "JobsNode", "JobsPort", "KeptCopies",
           "Leads", "Leadership", "MemberList", "Node", "OfferServer", "OfferedModel",
           "Offers", "PlacerNode", "PlacerPort", "Placing", "Planning", "Resuming",
           "ServingView", "Shown", "StageHostsPort", "StageNode", "StreamHandler",
           "SwarmNode", "TakeoverPort", "TrainingAgent"]
