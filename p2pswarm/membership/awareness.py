"""Lifeguard local health awareness: a node that misses acks slows itself down.

The score counts recent evidence that this node itself is in trouble (probes that got
neither an ack nor the nacks its helpers owed, having to refute a suspicion of itself);
every successful probe lowers it. Probe interval and probe timeout are multiplied by
``score + 1``, so a node on a failing radio probes less often and waits longer before
blaming others, instead of spraying false suspicions.
"""

from __future__ import annotations


class Awareness:
    __slots__ = ("max_score", "score")

    def __init__(self, max_multiplier: int) -> None:
        self.max_score = max(0, max_multiplier - 1)
        self.score = 0

    def apply(self, delta: int) -> None:
        self.score = min(self.max_score, max(0, self.score + delta))

    def scale(self, duration_s: float) -> float:
        return duration_s * (self.score + 1)


__all__ = ["Awareness"]
