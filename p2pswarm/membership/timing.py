"""The formulas: retransmit limit, suspicion timeout, anti-entropy interval, and the
extra tunables that ``GossipConfig`` does not (yet) carry.

``suspicion_timeout_s`` is Lifeguard's (as in memberlist): it starts at ``max_s`` and
shrinks towards ``min_s`` logarithmically with the number of independent confirmations,
reaching ``min_s`` at ``expected`` confirmations. What differs here is what ``min_s`` is
and what counts as independent (see ``p2pswarm.membership.machine``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tuning:
    """Tunables beyond ``GossipConfig``; the defaults are the measured ones."""

    # Probing
    random_probe_every: int = 3  # every n-th probe walks the shuffled round-robin; the
    ring_depth: int = 2  # others go to this node's ring successors, first, second, ... in turn
    nack_after_fraction: float = 0.8  # a helper sends its nack after this much of a timeout
    # Link-quality estimate (fraction of direct pings that missed their ack)
    loss_prior: float = 0.15  # where the estimate starts: cautious until measured
    loss_alpha: float = 1.0 / 16.0  # EWMA weight of one probe
    lossy_reference: float = 0.2  # at this estimate the "lossy" settings apply in full
    recheck_above_loss: float = 0.05  # above it, a failed probe is repeated before suspecting
    doubt_span_lossy_s: float = 1.0  # ... and on a lossy network, failed probes spanning
    # this long (less as the loss is less) raise suspicion: a shorter radio fade is doubt.
    fade_quantile: float = 0.9  # the span also covers this share of the silences this
    fade_samples: int = 64  # node last saw fellows come back from (once it has seen 8),
    doubt_span_max_s: float = 2.0  # up to this: heavy-tailed fades wait longer, short
    # bursts (where crashes must be found fast) give it less to grow on.
    # Suspicion
    suspicion_floor_clean_s: float = 0.8  # shortest suspicion on a clean network
    suspicion_floor_lossy_s: float = 3.0  # ... on a lossy, bursty one (spans radio fades)
    confirmations_expected: int = 2  # confirmations that bring the timeout to its floor
    independence_gap_clean_s: float = 0.0  # confirmations closer than this count once
    independence_gap_lossy_s: float = 0.4
    confirm_fanout: int = 4  # fellows expected to probe a suspect at once to confirm it
    evidence_fresh_s: float = 1.5  # a dead verdict needs a failed probe of our own this new
    streak_max_gap_s: float = 1.9  # failed probes further apart do not make one run
    watch_fraction: float = 0.5  # a watched suspect is probed every this much of an interval
    deaf_refute_s: float = 1.0  # heard nothing this long: refute any suspicion unasked
    declare_max_score: int = 2  # no dead verdicts from a node whose own health is worse
    # Dissemination and anti-entropy
    linger_s: float = 4.0  # sent-out updates still ride where a datagram has room
    fresh_fanout_mult: int = 2  # a gossip round carrying unsent news goes to this many x
    gossip_to_dead_s: float = 30.0  # keep gossiping to a dead fellow this long (it may refute)
    reconnect_interval_s: float = 10.0  # try anti-entropy with a dead fellow this often
    reconnect_for_s: float = 24 * 3600.0  # ... even after its tombstone is reaped, this long
    reconnect_max_lost: int = 256  # reaped fellows remembered for that
    refute_by_stream: bool = True  # push a refutation to its accuser over a stream too
    meta_pull_retry_s: float = 5.0  # how soon a failed metadata pull is tried again
    meta_inline_bytes: int = 512  # metadata up to this size rides in its Alive (memberlist's
    # limit): gossip spreads it where a pull over a lossy link waits out TCP's timers
    join_retry_min_s: float = 1.0  # first backoff between join attempts


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
    "Tuning",
    "lerp_by_loss",
    "push_pull_interval_s",
    "retransmit_limit",
    "suspicion_max_s",
    "suspicion_timeout_s",
]
