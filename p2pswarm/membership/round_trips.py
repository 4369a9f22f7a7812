"""How long direct probes took to be acknowledged: a histogram for ``/metrics``.

Only a direct ack is timed (ping sent, ack back from the target itself); an ack relayed
by helpers measures the helpers' paths too, and a failed probe has no round trip. Plain
counts, never read by the machine: timing probes changes no decision.
"""

from __future__ import annotations

from bisect import bisect_left

# upper bounds of the buckets, in seconds (loopback to a slow WiFi link)
RTT_BOUNDS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                   1.0, 2.5)


class ProbeRoundTrips:
    """Direct probe round trips: a count per bucket (the last: above every bound), their
    number and their sum."""

    __slots__ = ("buckets", "count", "sum_s")

    def __init__(self) -> None:
        self.buckets = [0] * (len(RTT_BOUNDS_S) + 1)
        self.count = 0
        self.sum_s = 0.0

    def note(self, rtt_s: float) -> None:
        rtt_s = max(0.0, rtt_s)
        self.buckets[bisect_left(RTT_BOUNDS_S, rtt_s)] += 1
        self.count += 1
        self.sum_s += rtt_s

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, probes at or under it) per bucket, the last bound infinite."""
        out, total = [], 0
        for bound, n in zip((*RTT_BOUNDS_S, float("inf")), self.buckets):
            total += n
            out.append((bound, total))
        return out


__all__ = ["RTT_BOUNDS_S", "ProbeRoundTrips"]
