"""Refutation: how this node answers news that it is suspected, dead or gone.

Theory of operation. A suspected fellow raises its incarnation and says ``Alive``: on the
ack of the very ping that told it, by gossip, straight back to whoever sent the news, and
pushed over a stream to its accuser. A fellow whose probes heard nothing for a while (its
radio was out) refutes unasked with the first datagram it hears again. Old news about
itself is answered with its current ``Alive`` rather than a new incarnation. News about
it above its incarnation can only come from its last life (honest fellows only know
numbers it signed): it asks the sender for that signed record (``about_us``), which lets
it refute above it, and meanwhile counts the claim at its own incarnation. Refuting raises
its own health score (Lifeguard). A leaving node refutes nothing: a new incarnation would
take its goodbye back.
"""

from __future__ import annotations

from typing import Any

from p2pswarm.config import GossipConfig
from p2pswarm.effects import REFUTED, Effect, Event, SendDatagram, StreamRequest
from p2pswarm.membership.awareness import Awareness
from p2pswarm.membership.dissemination import Dissemination
from p2pswarm.membership.leave import LeaveHandshake
from p2pswarm.membership.own import OwnRecord
from p2pswarm.membership.proofs import U32_MAX
from p2pswarm.membership.requests import StreamRequests
from p2pswarm.membership.roster import Roster
from p2pswarm.membership.states import INF, PRESENT
from p2pswarm.membership.updates import Updates
from p2pswarm.wire.gossip import SyncRecords

_MAX_ASKED = 256  # addresses remembered for the rate limit of ``about_us``


class Refuter:
    __slots__ = ("_asked", "_awareness", "_config", "_dissemination", "_leave", "_own",
                 "_pushed", "_requests", "_riders", "_roster", "_stats", "_updates",
                 "replying_to")

    def __init__(self, config: GossipConfig, own: OwnRecord, leave: LeaveHandshake,
                 awareness: Awareness, roster: Roster, dissemination: Dissemination,
                 requests: StreamRequests, updates: Updates, stats: dict[str, int]) -> None:
        self._config = config
        self._own = own
        self._leave = leave
        self._awareness = awareness
        self._roster = roster
        self._dissemination = dissemination
        self._requests = requests
        self._updates = updates
        self._stats = stats
        self._pushed: dict[bytes, float] = {}  # accuser -> when we last pushed it our Alive
        self._asked: dict[str, float] = {}  # addr -> when we last asked it for our record
        # the datagram in hand carries a ping from this address: what to add to our ack
        self.replying_to: str | None = None
        self._riders: list[Any] = []

    def riders(self, addr: str) -> list[Any]:
        """What to add to our ack of a ping from ``addr`` (taken: once)."""
        if self._riders and addr == self.replying_to:
            riders, self._riders = self._riders, []
            return riders
        return []

    def replied(self) -> None:
        """The datagram in hand is done with."""
        self.replying_to = None
        self._riders = []

    def refute(self, seen_incarnation: int, accuser: bytes | None, sender_addr: str,
               now: float, out: list[Effect]) -> None:
        """News about us at ``seen_incarnation`` (from ``accuser``, if named, heard from
        ``sender_addr``, if any): outdo it."""
        own = self._own
        if self._leave.leaving:
            return
        if seen_incarnation < own.incarnation:
            # old news: the sender missed our refutation; tell it again, first hand
            if sender_addr:
                self._answer_with_alive(sender_addr, out)
            return
        if seen_incarnation >= U32_MAX:  # cannot be outdone: saturate, never overflow
            self._stats["incarnation_exhausted"] += 1
            return
        own.incarnation = seen_incarnation + 1
        self._awareness.apply(1)
        self._stats["refutations"] += 1
        alive = own.alive()
        node_id = own.local.node_id
        self._dissemination.queue.add(node_id, alive)
        self._roster.changed(node_id, roster=False)
        out.append(Event(REFUTED, node_id, own.local.name,
                         f"refuted a suspicion by {self._updates.name_of(accuser)}"
                         if accuser else "refuted", own.incarnation, accuser or b""))
        if sender_addr:
            self._answer_with_alive(sender_addr, out)
        if accuser is not None and accuser != node_id and self._config.tuning.refute_by_stream:
            acc = self._roster.get(accuser)
            if acc is not None and acc.state in PRESENT:
                last = self._pushed.get(accuser, -INF)
                if now - last >= self._config.probe_interval_s:
                    self._pushed[accuser] = now
                    rid = self._requests.new("refute", acc.addr, None, now)
                    out.append(StreamRequest(acc.addr, alive, rid))

    def _answer_with_alive(self, addr: str, out: list[Effect]) -> None:
        """Send our current ``Alive`` to ``addr``: on the ack we are about to send if the
        news came with a ping, else in a datagram of its own."""
        alive = self._own.alive()
        if addr == self.replying_to:
            if alive not in self._riders:
                self._riders.append(alive)
        else:
            out.append(SendDatagram(addr, (alive,)))

    def about_us(self, incarnation: int, addr: str, now: float, out: list[Effect]) -> int:
        """A verdict about us above our incarnation: honest fellows only know numbers we
        signed, so after a restart the sender holds our signed record from before. Ask
        it for that record (its answer, proven, lets us refute above it) and meanwhile
        count the claim at our own incarnation."""
        own = self._own
        if incarnation > own.incarnation and addr and not self._leave.leaving:
            if now - self._asked.get(addr, -INF) >= self._config.probe_interval_s:
                self._asked[addr] = now
                if len(self._asked) > _MAX_ASKED:
                    del self._asked[next(iter(self._asked))]
                rid = self._requests.new("sync", addr, None, now)
                node_id = own.local.node_id
                out.append(StreamRequest(addr, SyncRecords(
                    node_id, (own.record(self._leave.leaving),), (node_id,)), rid))
        return self._updates.claimed(incarnation, own.incarnation)


__all__ = ["Refuter"]
