"""Dissemination: what this node tells the swarm, and when.

Theory of operation. Updates (``Alive``, ``Suspect``, ``Dead``, ``Left``) wait in a queue
(``broadcasts``), one per fellow, and ride on every datagram this node sends, least-sent
first, as many as fit the datagram budget (``send``); a gossip round every gossip interval
sends them to a few random fellows (twice as many when news is unsent; now and then a
recently dead one, which may refute). Each is sent ``retransmit_mult * ceil(log10(N + 1))``
times, then lingers a few seconds more where a probe or an ack has room, for whoever
missed the wave.

Quiet (``quiet``, while an already converged swarm is built in a simulation): news is
neither queued nor reported as events.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from p2pswarm.config import GossipConfig
from p2pswarm.effects import Effect, Event, EventKind, SendDatagram
from p2pswarm.membership.broadcasts import ENVELOPE_BYTES, BroadcastQueue
from p2pswarm.membership.clock import Clock
from p2pswarm.membership.roster import Entry, Roster
from p2pswarm.membership.timing import retransmit_limit
from p2pswarm.wire.gossip import Alive

if TYPE_CHECKING:  # a type only: the driver hands in its generator, seeded or not
    from p2pswarm.randomness import Rng


class Dissemination:
    __slots__ = ("_budget", "_clock", "_config", "_rng", "_roster", "next_gossip_at", "queue",
                 "quiet")

    def __init__(self, config: GossipConfig, rng: Rng, roster: Roster, clock: Clock,
                 budget_bytes: int) -> None:
        self._config = config
        self._clock = clock
        self._rng = rng
        self._roster = roster
        self._budget = budget_bytes
        self.queue = BroadcastQueue(config.tuning.linger_s)
        self.next_gossip_at = clock.now
        self.quiet = False

    def limit(self) -> int:
        """How many times each update is sent, for the swarm as large as we know it."""
        return retransmit_limit(self._config.retransmit_mult, len(self._roster) + 1)

    def broadcast(self, node: bytes, msg: Any) -> None:
        """Relay news about a fellow. A relayed Alive leaves the certificate out: it
        travels once per fellow (membership.certificates), not in every copy."""
        if not self.quiet:
            if type(msg) is Alive and msg.certificate:
                msg = dataclasses.replace(msg, certificate=b"")
            self.queue.add(node, msg)

    def event(self, out: list[Effect], kind: EventKind, e: Entry, detail: str,
              by: bytes) -> None:
        if not self.quiet:
            out.append(Event(kind, e.node, e.name, detail, e.incarnation, by))

    def send(self, out: list[Effect], addr: str, msgs: list[Any], size: int) -> None:
        """``msgs`` (``size`` item bytes) to ``addr``, with what updates fit beside them."""
        extra = self.queue.take(self._budget - ENVELOPE_BYTES - size, self.limit(),
                                self._clock.now, to=addr)
        if extra:
            msgs.extend(extra)
        out.append(SendDatagram(addr, tuple(msgs)))

    def deadline(self, t: float) -> float:
        if len(self.queue) and self._roster.live:
            return min(t, self.next_gossip_at)
        return t

    def due(self, now: float) -> bool:
        return bool(len(self.queue)) and now >= self.next_gossip_at

    def gossip(self, now: float, out: list[Effect]) -> None:
        """One gossip round."""
        config, t = self._config, self._config.tuning
        self.next_gossip_at = now + config.gossip_interval_s
        k = config.gossip_nodes
        if self.queue.has_fresh():  # news: spend its first sends wide (same total sends)
            k *= t.fresh_fanout_mult
        roster = self._roster
        targets = roster.sample_live(k)
        if roster.recent_dead:
            horizon = now - t.gossip_to_dead_s
            for node in [n for n, at in roster.recent_dead.items() if at < horizon]:
                del roster.recent_dead[node]
            dead = [n for n in roster.recent_dead if n in roster.members]
            if dead and self._rng.random() < len(dead) / (len(dead) + len(roster.live) + 1.0):
                targets = targets[:-1] + [self._rng.choice(dead)] if targets else [
                    self._rng.choice(dead)]
        limit = self.limit()
        budget = self._budget - ENVELOPE_BYTES
        for node in targets:
            msgs = self.queue.take(budget, limit, now, lingering=False)
            if not msgs:
                break
            out.append(SendDatagram(roster.members[node].addr, tuple(msgs)))


__all__ = ["Dissemination"]
