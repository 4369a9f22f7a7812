"""Joining through seeds, retried with backoff.

Theory of operation. A join is an anti-entropy exchange with every seed at once, asking
for everything (``SyncRecords`` with ``want_all``); the first answer joins this node.
Attempts back off from ``join_retry_min_s``, doubling up to ``join_retry_max_s``; a new
attempt starts when every seed's request has failed, or a few seconds past the backoff if
none answered and none failed. No seeds: this node founds a new swarm.

This keeps the attempts' book; the machine builds and sends the requests.
"""

from __future__ import annotations

from p2pswarm.config import GossipConfig
from p2pswarm.membership.states import INF


class Join:
    __slots__ = ("_attempt", "_config", "_rids", "joined", "next_at", "seeds")

    def __init__(self, config: GossipConfig) -> None:
        self._config = config
        self.joined = False
        self.seeds: tuple[str, ...] = ()
        self._attempt = 0
        self.next_at = INF
        self._rids: dict[int, None] = {}

    def backoff_s(self) -> float:
        backoff: float = min(self._config.join_retry_max_s,
                             self._config.tuning.join_retry_min_s * 2 ** (self._attempt - 1))
        return backoff

    def start(self, seeds: tuple[str, ...]) -> None:
        self.seeds = seeds
        if seeds:
            self._attempt = 0

    def attempt(self, now: float) -> None:
        """One more attempt, now; the next one a backoff later (and a safety margin, in
        case no reply and no failure comes)."""
        self._attempt += 1
        self.next_at = now + self.backoff_s() + 5.0

    def track(self, rid: int) -> None:
        self._rids[rid] = None

    def forget(self, rid: int) -> None:
        self._rids.pop(rid, None)

    def failed(self, rid: int) -> bool:
        """The request ``rid`` failed; True if it was the last one of a join still not
        answered (time to schedule the next attempt)."""
        if rid not in self._rids:
            return False
        del self._rids[rid]
        return not self._rids and not self.joined

    def retry_later(self, now: float) -> float:
        """No seed answered: the backoff until the next attempt."""
        backoff = self.backoff_s()
        self.next_at = now + backoff
        return backoff

    def done(self) -> None:
        self.joined = True
        self._rids.clear()
        self.next_at = INF


__all__ = ["Join"]
