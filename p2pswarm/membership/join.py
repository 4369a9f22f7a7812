"""Joining through seeds, retried with backoff.

Theory of operation. A join is an anti-entropy exchange with every seed at once, asking
for everything (``SyncRecords`` with ``want_all``); the first answer joins this node.
Attempts back off from ``join_retry_min_s``, doubling up to ``join_retry_max_s``; a new
attempt starts when every seed's request has failed, or a few seconds past the backoff if
none answered and none failed. No seeds: this node founds a new swarm.

This keeps the attempts' book and sends the requests; the machine takes in the answer.
"""

from __future__ import annotations

from p2pswarm.config import GossipConfig
from p2pswarm.effects import JOIN_RETRY, Effect, Event, StreamRequest
from p2pswarm.membership.leave import LeaveHandshake
from p2pswarm.membership.own import OwnRecord
from p2pswarm.membership.requests import StreamRequests
from p2pswarm.membership.states import INF
from p2pswarm.wire.gossip import SyncRecords


class Join:
    __slots__ = ("_attempt", "_config", "_leave", "_own", "_requests", "_rids", "joined",
                 "next_at", "seeds")

    def __init__(self, config: GossipConfig, own: OwnRecord, leave: LeaveHandshake,
                 requests: StreamRequests) -> None:
        self._config = config
        self._own = own
        self._leave = leave
        self._requests = requests
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

    def attempt(self, now: float, out: list[Effect]) -> None:
        """One more attempt, now, asking every seed for everything; the next one a backoff
        later (and a safety margin, in case no reply and no failure comes)."""
        self._attempt += 1
        self.next_at = now + self.backoff_s() + 5.0
        own = self._own
        request = SyncRecords(own.local.node_id, (own.record(self._leave.leaving),), (), True)
        for seed in self.seeds:
            rid = self._requests.new("join", seed, None, now)
            self._rids[rid] = None
            out.append(StreamRequest(seed, request, rid))

    def forget(self, rid: int) -> None:
        self._rids.pop(rid, None)

    def failed(self, rid: int, now: float, out: list[Effect]) -> None:
        """The request ``rid`` failed; if it was the last one of a join still not answered,
        the next attempt comes a backoff later."""
        if rid not in self._rids:
            return
        del self._rids[rid]
        if self._rids or self.joined:
            return
        backoff = self.backoff_s()
        self.next_at = now + backoff
        local = self._own.local
        out.append(Event(JOIN_RETRY, local.node_id, local.name,
                         f"no seed answered; trying again in {backoff:.0f} s"))

    def done(self) -> None:
        self.joined = True
        self._rids.clear()
        self.next_at = INF


__all__ = ["Join"]
