"""Bursts of total loss drawn ahead, for the worlds that cannot draw them per packet.

Theory of operation. The virtual world decides each packet's fate with the radio's
Gilbert-Elliott chain as it crosses the radio (``p2pswarm.transport.netmodel``). The
network-namespace world cannot: the kernel drops packets, and all it can be told is a
rule. So the same chain is drawn ahead as a list of bursts, ``(begin, end)`` in seconds
since the run began, one schedule per fellow, and a driver turns each burst into a
"drop everything" rule for its length (``p2pswarm.sim.netns``); the loss between bursts
(``loss_in_good``) stays a ``numgen random`` rule. Same profile, same chain
(``FadeTimeline``, ``GilbertElliott.stay_s``), so the fraction of time in bursts and
their length distribution are the virtual world's.

A schedule is a function of the scenario's seed and the fellow's index, so a run can be
repeated. Only radios whose bursts are long enough for a rule to follow them are drawn
ahead (``replayable``): a W1 radio's 20 ms bursts would be as long as a rule change
takes on a busy host; those radios stay independent loss at their mean rate.
"""

from __future__ import annotations

from collections.abc import Sequence

from p2pswarm.sim.gossip_lab import RandomDraws
from p2pswarm.transport.netmodel import FadeTimeline, GilbertElliott, LossModel

MIN_REPLAYED_BURST_S = 0.1  # shorter mean bursts are left to per-packet loss


def replayable(radio: LossModel | None) -> bool:
    """Can a driver of drop rules reproduce this radio's bursts (total loss, long enough)?"""
    return (isinstance(radio, GilbertElliott) and radio.loss_in_bad >= 1.0
            and radio.bad_fraction > 0.0 and radio.mean_burst_s >= MIN_REPLAYED_BURST_S)


def burst_schedule(radio: GilbertElliott, seed: int, fellow: int, end_s: float
                   ) -> list[tuple[float, float]]:
    """The bursts of ``fellow``'s radio over [0, end_s): sorted, disjoint, clipped."""
    timeline = FadeTimeline(radio, RandomDraws(f"bursts:{seed}:{fellow}"))
    return [(a, b) for a, b in timeline.bad_runs(0.0, end_s) if b > a]


def time_in_bursts(spans: Sequence[tuple[float, float]], start_s: float, end_s: float
                   ) -> float:
    """The fraction of [start_s, end_s] that ``spans`` cover."""
    if not end_s > start_s:
        return 0.0
    covered = sum(max(0.0, min(b, end_s) - max(a, start_s)) for a, b in spans)
    return covered / (end_s - start_s)


__all__ = ["MIN_REPLAYED_BURST_S", "burst_schedule", "replayable", "time_in_bursts"]
