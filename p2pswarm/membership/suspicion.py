"""One suspicion of one fellow: its bounds, its timer and its confirmations (memberlist's
``suspicion.go``).

A suspicion starts with a long timeout (``max_s``) that shrinks towards a floor
(``min_s``) as independent confirmations come in, reaching the floor at ``expected`` of
them (Lifeguard). A confirmation counts only if it is further from the last one counted
than a radio fade (``confirm``'s ``gap_s``): on WiFi everybody fails at the same moment,
and ten watchers failing together say no more than one. The floor itself grows with the
measured loss (``suspicion_bounds``). When the timer runs out the suspicion is
``expired``; whether that makes a dead verdict is the failure detector's call, on its own
probes of the suspect.

Other watchers tell how long they have failed to reach the suspect (``Suspect.silent_ms``):
the earliest such run (``reported_since``, heard at ``reported_at``) may extend this
node's own run of failures (``joined_run``).
"""

from __future__ import annotations

from p2pswarm.config import GossipConfig, GossipTuning
from p2pswarm.membership.states import INF
from p2pswarm.membership.timing import lerp_by_loss, suspicion_max_s, suspicion_timeout_s


def suspicion_bounds(config: GossipConfig, n_members: int,
                     loss: float) -> tuple[float, float, int]:
    """(floor, ceiling, confirmations expected) of a suspicion raised now, in a swarm of
    ``n_members`` (this node included) on a link that loses ``loss`` of its pings."""
    t = config.tuning
    floor = lerp_by_loss(t.suspicion_floor_clean_s, t.suspicion_floor_lossy_s, loss,
                         t.lossy_reference)
    top = suspicion_max_s(config.suspicion_mult, n_members, config.probe_interval_s)
    top = min(top, floor * max(1.0, config.suspicion_max_timeout_mult))
    expected = t.confirmations_expected
    if n_members - 2 < expected:
        expected = 0
    return floor, max(floor, top), expected


def independence_gap_s(tuning: GossipTuning, loss: float) -> float:
    """How far apart two confirmations must be to count as independent."""
    return lerp_by_loss(tuning.independence_gap_clean_s, tuning.independence_gap_lossy_s,
                        loss, tuning.lossy_reference)


class Suspicion:
    __slots__ = (
        "counted",
        "deadline",
        "expected",
        "expired",
        "first_source",
        "heard_back",
        "incarnation",
        "last_count_at",
        "max_s",
        "min_s",
        "reported_at",
        "reported_since",
        "silent_since",
        "sources",
        "start",
    )

    def __init__(self, incarnation: int, start: float, source: bytes, min_s: float,
                 max_s: float, expected: int) -> None:
        self.incarnation = incarnation
        self.start = start
        self.sources: dict[bytes, None] = {source: None}
        self.first_source = source
        self.heard_back = False  # a probe of ours reached it again (its fade ended)
        self.silent_since = start  # our first failed probe of it, if we raised it
        self.counted = 0
        self.last_count_at = start
        self.min_s = min_s
        self.max_s = max_s
        self.expected = expected
        self.deadline = start + suspicion_timeout_s(0, expected, min_s, max_s)
        self.expired = False
        # the earliest time since which some fellow reported failing to reach it, and when
        # that report came: other watchers' runs of failures extend ours if they touch
        self.reported_since = INF
        self.reported_at = INF

    def add_source(self, source: bytes) -> bool:
        """Note ``source`` as one more accuser; False if it already was one."""
        if source in self.sources:
            return False
        self.sources[source] = None
        return True

    def report(self, silent_ms: int, now: float) -> None:
        since = now - silent_ms / 1000.0
        if silent_ms > 0 and since < self.reported_since:
            self.reported_since, self.reported_at = since, now

    def confirm(self, now: float, gap_s: float) -> bool:
        """Count one confirmation if it is independent of the last one counted (further
        apart than ``gap_s``); the timer shrinks. False if it did not count."""
        if self.counted and now - self.last_count_at < gap_s:
            return False
        self.counted += 1
        self.last_count_at = now
        self._rearm()
        return True

    def at_floor(self) -> None:
        """Another watcher's dead verdict: its own suspicion ran out, so ours waits only the
        floor (the suspect still refutes, and our own probes still judge it)."""
        if self.counted < self.expected:
            self.counted = self.expected
            self._rearm()

    def nobody_listens(self, floor_s: float) -> None:
        """Nothing listens at the suspect's address: no fade to wait out, so the timer runs
        for the clean network's floor (``floor_s``) and no longer."""
        if self.min_s <= floor_s:
            return
        self.min_s = self.max_s = floor_s
        self._rearm()

    def due(self, now: float) -> bool:
        """Whether the timer ran out just now (it fires once)."""
        return not self.expired and now >= self.deadline

    def joined_run(self, first: float, max_gap_s: float) -> float:
        """The start of our run of failures begun at ``first``, extended by another
        watcher's reported run if the two touch."""
        if self.reported_since < first <= self.reported_at + max_gap_s:
            return self.reported_since
        return first

    def _rearm(self) -> None:
        self.deadline = self.start + suspicion_timeout_s(self.counted, self.expected,
                                                         self.min_s, self.max_s)


__all__ = ["Suspicion", "independence_gap_s", "suspicion_bounds"]
