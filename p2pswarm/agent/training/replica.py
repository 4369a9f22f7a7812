"""The driver's view of one replica of a job: its links, its data, its place in the job
and in the rounds. The driver, its rounds and its checkpoints share these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from p2pswarm.agent.training.links import Link
from p2pswarm.agent.training.placed import BatchShape

if TYPE_CHECKING:
    from p2pswarm.agent.training.runtime import ReplicaData


@dataclass
class Replica:
    """The driver's view of one replica: its links, data, place in the job and rounds."""

    index: int
    links: list[Link]
    batch: BatchShape  # resolved when it was placed (``placed``)
    data: ReplicaData | None = None
    steps: int = 0  # optimizer steps taken (the learning-rate schedule's position)
    samples_unsent: int = 0
    steps_unsent: int = 0
    # its data position when its last delta left (or it last took the global state):
    # the samples past it are in no delta yet, and are trained again if its local steps
    # are thrown away (``GlobalState.forget_local_steps``)
    kept_position: int = 0
    paused: str = ""
    generation: int = 0  # its placement's (``Job.next_generation``)
    joining: bool = False  # placed again, links open: joins at the next round boundary
    placing: bool = False
    # asynchronous rounds (several replicas)
    version: int = 0  # the global version its stages are anchored on
    in_round: int = 0  # local steps taken of this round's budget
    rounds_done: int = 0  # budgets sent, or rounds caught up to (its place in the job)
    sent_version: int = -1  # the version its last fresh delta was anchored on
    budget: int = 0  # local steps this round (by measured speed)
    step_s: float = 0.0  # measured seconds per step (moving average); 0: not yet measured
    running: bool = False  # its training task is alive
    finished: bool = False  # trained to the job's end and sent everything
    lock: trio.Lock = field(default_factory=trio.Lock)  # one command sequence at a time

    @property
    def name(self) -> str:
        return f"replica-{self.index}"

    @property
    def stream(self) -> ReplicaData:
        assert self.data is not None
        return self.data


__all__ = ["Replica"]
