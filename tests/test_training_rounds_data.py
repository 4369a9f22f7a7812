"""A replica's data position through its rounds: the samples of local steps thrown away
(its stages put back on the global state after a lost fellow, or too far behind to catch
up) are trained again, never skipped. Driven with stand-ins for the links and keepers:
no torch, no network."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from p2pswarm.agent.training.driver import Link, Replica
from p2pswarm.agent.training.global_state import GlobalState
from p2pswarm.agent.training.placed import BatchShape
from p2pswarm.agent.training.rounds import RoundsKeeper
from p2pswarm.training.sync import Verdict
from p2pswarm.wire.training import Ack, Delta


class Stream:
    """A replica's data: each step takes ``batch`` samples."""

    def __init__(self) -> None:
        self.position = 0

    def next_step(self, micro_batches: int, micro_batch: int) -> tuple[list[bytes], list[bytes]]:
        self.position += micro_batches * micro_batch
        return [b""] * micro_batches, [b""] * micro_batches


class Keeper:
    version = 3
    history_kept = True

    def join_state(self, replica: str) -> tuple[int, bytes, int]:
        return self.version, b"params", 6

    def updates_since(self, version: int) -> list[bytes] | None:
        return [b"u"] * (self.version - version) if self.history_kept else None

    def contribute(self, replica: str, version: int, blob: bytes, samples: int,
                   now: float) -> Verdict:
        return Verdict(True, 0)


class StageLink(Link):
    async def ask(self, message: Any, reply: type) -> Any:  # type: ignore[override]
        return Delta(Keeper.version, b"delta") if reply is Delta else Ack()


class Rounds:
    """A driver as its rounds keeper sees it (``ports.DriverPort``), and the keeper."""

    def __init__(self) -> None:
        self.training = SimpleNamespace(timings=SimpleNamespace(step_timeout_s=5.0))
        self.job = SimpleNamespace(bytes_sent=0, job_id="j", rounds=[], samples=0)
        self.cfg = SimpleNamespace(sync=SimpleNamespace(staleness_decay=0.5,
                                                        staleness_bound=2))
        self.keepers = [Keeper()]
        self.replicas = [Replica(0, [StageLink(0, "a", "127.0.0.1:1")], BatchShape(2, 1),
                                 data=Stream())]
        global_state = GlobalState(self)  # type: ignore[arg-type]
        keeper = RoundsKeeper(self, global_state, None)  # type: ignore[arg-type]
        self._contribute = keeper._contribute
        self._catch_up = keeper._catch_up
        self.to_global_state = global_state.put


def local_steps(rounds: Rounds, r: Replica, n: int, batch: int = 2) -> None:
    """``n`` steps as ``Driver.step`` takes them: the data moves, the samples wait (and
    count in the job's samples, as ``RoundsKeeper._count`` counts them)."""
    for _ in range(n):
        r.stream.next_step(1, batch)
        r.samples_unsent += batch
        r.steps_unsent += 1
        rounds.job.samples += batch


async def test_a_replica_put_back_on_the_global_state_trains_its_lost_samples_again() -> None:
    rounds = Rounds()
    r = rounds.replicas[0]
    local_steps(rounds, r, 4)
    await rounds._contribute(r)  # these 8 samples left in a delta: they stay trained
    assert r.kept_position == 8 and r.samples_unsent == 0
    local_steps(rounds, r, 3)
    r.stream.next_step(1, 2)  # a step cut short when a fellow was lost
    assert r.stream.position == 16
    assert await rounds.to_global_state(r)  # placed again: the keepers' parameters
    assert r.stream.position == 8 and r.samples_unsent == 0 and r.version == 3
    assert rounds.job.samples == 8  # the thrown-away steps no longer count in its length
    local_steps(rounds, r, 2)
    await rounds._contribute(r)
    assert r.kept_position == 12  # the samples after 8 were trained once, not skipped


async def test_a_replica_too_far_behind_to_catch_up_trains_its_unsent_samples_again() -> None:
    rounds = Rounds()
    r = rounds.replicas[0]
    r.version = 1
    local_steps(rounds, r, 2)
    await rounds._catch_up(r)  # two updates behind, both still held: its steps count
    assert r.stream.position == 4 and r.version == 3
    r.version, Keeper.history_kept = 0, False
    try:
        await rounds._catch_up(r)  # the updates are gone: it starts over from the global
    finally:
        Keeper.history_kept = True
    assert r.stream.position == 0 and r.samples_unsent == 0 and r.version == 3
    assert rounds.job.samples == 0


async def test_a_delta_dropped_as_too_stale_does_not_count_in_the_jobs_length() -> None:
    rounds = Rounds()
    r = rounds.replicas[0]
    local_steps(rounds, r, 2)
    await rounds._contribute(r)
    assert rounds.job.samples == 4
    local_steps(rounds, r, 3)
    rounds.keepers[0].contribute = lambda *args: Verdict(False, 3)  # type: ignore[method-assign]
    await rounds._contribute(r)  # dropped: the model never learns from these 6 samples
    assert rounds.job.samples == 4 and r.samples_unsent == 0
