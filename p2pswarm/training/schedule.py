"""Pipeline schedules: the order in which one stage runs its micro-batches' passes.

A schedule is a list of ops per stage, ``Op("F", m)`` (forward of micro-batch m) or
``Op("B", m)`` (its backward), and nothing else: a stage runs its list in order, each
op waiting for its input (activations from the stage before, or gradients from the
stage after). The same lists drive the in-process ``LocalTrainPipeline`` and, over
streams, the fellows of a placed pipeline.

- GPipe (Huang et al. 2019): every forward, then every backward. Simple; keeps all
  micro-batches' activations alive at once.
- 1F1B (PipeDream-Flush, Narayanan et al. 2019): stage s runs ``n_stages - s - 1``
  warm-up forwards, then alternates one forward and one backward, then drains the
  backwards. Same bubble as GPipe, but at most ``n_stages - s`` micro-batches' activations
  alive on stage s.

Both run each stage's backwards in micro-batch order, so gradients accumulate in the
same order whatever the schedule: the result is the same to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pswarm.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True, slots=True)
class Op:
    kind: str  # "F" | "B"
    micro: int


def gpipe(stage: int, n_stages: int, n_micro: int) -> list[Op]:
    _check(stage, n_stages, n_micro)
    return [Op("F", m) for m in range(n_micro)] + [Op("B", m) for m in range(n_micro)]


def one_f_one_b(stage: int, n_stages: int, n_micro: int) -> list[Op]:
    _check(stage, n_stages, n_micro)
    warmup = min(n_stages - stage - 1, n_micro)
    ops = [Op("F", m) for m in range(warmup)]
    for m in range(warmup, n_micro):
        ops += [Op("F", m), Op("B", m - warmup)]
    ops += [Op("B", m) for m in range(n_micro - warmup, n_micro)]
    return ops


def stage_ops(schedule: str, stage: int, n_stages: int, n_micro: int) -> list[Op]:
    if schedule == "gpipe":
        return gpipe(stage, n_stages, n_micro)
    if schedule == "1f1b":
        return one_f_one_b(stage, n_stages, n_micro)
    raise ConfigError(f"schedule {schedule!r} must be one of {', '.join(SCHEDULES)}")


def peak_live_micro_batches(ops: list[Op]) -> int:
    """The most micro-batches whose activations a stage holds at once under ``ops``."""
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == "F" else -1
        peak = max(peak, live)
    return peak


def _check(stage: int, n_stages: int, n_micro: int) -> None:
    if n_stages < 1 or n_micro < 1 or not 0 <= stage < n_stages:
        raise ConfigError(f"no schedule for stage {stage} of {n_stages} with {n_micro} "
                          "micro-batches")
