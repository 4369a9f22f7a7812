"""The rule by which sync rounds close and replicas budget, wait and weigh their deltas.

Written once, used by the agent's driver (``agent.training.rounds``) and by the
virtual-time ``training.virtual.VirtualSwarm``, so the simulation measures the rule the
swarm runs:

- a round closes when every member has sent a fresh delta, or at its deadline with
  whatever arrived (``round_closes``; with nothing arrived the deadline moves on);
- a late delta weighs ``samples * decay**staleness``, or is dropped beyond the staleness
  bound (``delta_weight``);
- each replica's step budget goes by measured speed: the fastest takes ``inner_steps``, a
  slower one what it manages in the same time, and replicas within ``SAME_SPEED`` of the
  fastest count as as fast, so jitter never halves a budget (``round_budgets``);
- a replica whose delta was fresh waits for its round to close while every replica yet to
  send should send within about ``WAIT_STEPS`` of its steps (``worth_waiting``); otherwise
  it trains on and applies the update when it comes.

Pure: no torch, no clock; time comes in as ``now``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from p2pswarm.errors import ConfigError

SAME_SPEED = 0.9  # replicas measured within this fraction of the fastest get its budget
WAIT_STEPS = 1.5  # a replica waits for its round while the rest should send within this


class Keeper(Protocol):
    """What the rule reads of a stage's keeper (``training.sync.OuterSync``)."""

    def ready(self, now: float) -> bool: ...

    def next_deadline(self) -> float: ...


def round_closes(keeper: Keeper, now: float) -> bool:
    """Whether the keeper's round closes at ``now``: every member sent, or the deadline
    has come (with nothing arrived, closing only moves the deadline on)."""
    return keeper.ready(now) or now >= keeper.next_deadline()


def delta_weight(samples: int, staleness: int, decay: float, bound: int) -> float:
    """What a delta ``staleness`` versions old counts for; 0.0 beyond the bound."""
    if staleness > bound:
        return 0.0
    return samples * decay ** staleness


def step_budgets(speeds: Mapping[str, float], inner_steps: int) -> dict[str, int]:
    """Local steps per round by measured speed (steps/s): the fastest replica takes
    ``inner_steps``, the others what they manage in the same time (at least one)."""
    if not speeds:
        return {}
    fastest = max(speeds.values())
    if fastest <= 0:
        raise ConfigError("replica speeds must be positive")
    return {r: max(1, int(inner_steps * s / fastest + 1e-9)) for r, s in speeds.items()}


def round_budgets(speeds: Mapping[str, float], inner_steps: int,
                  speed_aware: bool = True) -> dict[str, int]:
    """Each replica's budget this round (``speeds`` in steps/s, measured ones only):
    ``step_budgets`` with replicas within ``SAME_SPEED`` of the fastest as fast as it."""
    if not speed_aware or not speeds:
        return dict.fromkeys(speeds, inner_steps)
    fastest = max(speeds.values())
    even = {n: fastest if v >= SAME_SPEED * fastest else v for n, v in speeds.items()}
    return step_budgets(even, inner_steps)


def worth_waiting(own_step_s: float, unsent: Iterable[tuple[int, float]]) -> bool:
    """Whether a replica taking ``own_step_s`` per step should wait for its round, given
    each replica yet to send as (steps left of its budget, its seconds per step; 0: not
    measured yet): yes while every one of them should send within about ``WAIT_STEPS``
    of its steps (or is not measured), so equally fast replicas train as one process."""
    for steps_left, step_s in unsent:
        if step_s <= 0 or own_step_s <= 0:
            return True
        if max(0, steps_left) * step_s > WAIT_STEPS * own_step_s:
            return False
    return True


__all__ = ["SAME_SPEED", "WAIT_STEPS", "delta_weight", "round_budgets", "round_closes",
           "step_budgets", "worth_waiting"]
