"""The formulas: retransmit limit, suspicion timeout, anti-entropy interval.

The machine's knobs live in the config (``GossipConfig.tuning``, a
``p2pswarm.config.GossipTuning``).

``suspicion_timeout_s`` is Lifeguard's (as in memberlist): it starts at ``max_s`` and
shrinks towards ``min_s`` logarithmically with the number of independent confirmations,
reaching ``min_s`` at ``expected`` confirmations. What differs here is what ``min_s`` is
and what counts as independent (see ``p2pswarm.membership.suspicion`` and
``p2pswarm.membership.detector``).
"""

from __future__ import annotations

import math


def retransmit_limit(mult: int, n_members: int) -> int:
    """How many times each update is piggybacked: mult * ceil(log10(N + 1))."""
    return mult * max(1, math.ceil(math.log10(n_members + 1)))


def suspicion_max_s(mult: float, n_members: int, probe_interval_s: float) -> float:
    """The timeout of a suspicion nobody confirms (memberlist's suspicion timeout)."""
    return mult * max(1.0, math.log10(max(n_members, 10))) * probe_interval_s


def suspicion_timeout_s(confirmations: int, expected: int, min_s: float, max_s: float) -> float:
    if expected < 1 or max_s <= min_s:
        return min_s
    frac = math.log(confirmations + 1.0) / math.log(expected + 1.0)
    return max(min_s, max_s - frac * (max_s - min_s))


def push_pull_interval_s(interval_s: float, n_members: int) -> float:
    """Anti-entropy slows down past 32 fellows, like memberlist's pushPullScale."""
    if n_members <= 32:
        return interval_s
    return interval_s * (math.ceil(math.log2(n_members) - math.log2(32)) + 1)


def lerp_by_loss(clean: float, lossy: float, loss: float, reference: float) -> float:
    w = min(1.0, max(0.0, loss / reference)) if reference > 0 else 1.0
    return clean + (lossy - clean) * w


__all__ = [
    "lerp_by_loss",
    "push_pull_interval_s",
    "retransmit_limit",
    "suspicion_max_s",
    "suspicion_timeout_s",
]
