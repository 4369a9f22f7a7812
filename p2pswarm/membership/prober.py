"""The prober: the failure detector's datagrams.

The detector (``detector``) decides whom to probe and what an ended probe says; the prober
sends what it plans: the ping with the news the target should hear about itself (the
buddy rule: a suspect learns it is suspected, and refutes), the helpers' ``PingReq`` and
the stream ping when the direct ping goes unanswered, and, as a helper, the relayed ping
with the ack or nack it owes the asker. What a probe ends in comes back to the machine as
the detector's ``Verdict``.
"""

from __future__ import annotations

from typing import Any

from p2pswarm.effects import Effect, SendDatagram, StreamRequest
from p2pswarm.membership.broadcasts import item_bytes
from p2pswarm.membership.detector import DIRECT, INDIRECT, FailureDetector, Probe, Verdict
from p2pswarm.membership.dissemination import Dissemination
from p2pswarm.membership.metadata import inline
from p2pswarm.membership.requests import StreamRequests
from p2pswarm.membership.roster import Roster
from p2pswarm.membership.round_trips import ProbeRoundTrips
from p2pswarm.membership.states import DEAD, GONE, SEQ_MOD, SUSPECT
from p2pswarm.wire.gossip import Ack, Dead, Left, Nack, Ping, PingReq, Suspect

PING_ITEM = item_bytes(Ping(SEQ_MOD - 1, b"\0" * 16, b"\0" * 16))
ACK_ITEM = item_bytes(Ack(SEQ_MOD - 1))
NACK_ITEM = item_bytes(Nack(SEQ_MOD - 1))


class Prober:
    __slots__ = ("_detector", "_dissemination", "_inline_bytes", "_node_id", "_requests",
                 "_roster", "round_trips")

    def __init__(self, node_id: bytes, detector: FailureDetector, roster: Roster,
                 dissemination: Dissemination, requests: StreamRequests,
                 inline_bytes: int) -> None:
        self._node_id = node_id
        self._detector = detector
        self._roster = roster
        self._dissemination = dissemination
        self._requests = requests
        self._inline_bytes = inline_bytes
        self.round_trips = ProbeRoundTrips()  # direct acks' round trips, for /metrics

    def heard(self, node: bytes, now: float) -> None:
        """``node`` spoke to us first hand: it is not failing now."""
        e = self._roster.get(node)
        if e is not None:
            e.last_heard = now
            self._detector.streak.pop(node, None)

    def news_about(self, node: bytes) -> Any | None:
        """What a ping to ``node`` should tell it about itself (the buddy rule)."""
        e = self._roster.get(node)
        if e is None:
            return None
        if e.state == SUSPECT:
            s = self._detector.suspicions.get(node)
            source = s.first_source if s is not None else self._node_id
            return Suspect(node, e.incarnation, source)
        if e.state == DEAD:
            return Dead(node, e.incarnation, self._node_id)
        return None

    def _ping(self, seq: int, target: bytes, addr: str, out: list[Effect]) -> None:
        """Our ping ``seq`` to ``target`` at ``addr``, with its news about itself."""
        msgs: list[Any] = [Ping(seq, target, self._node_id)]
        size = PING_ITEM
        news = self.news_about(target)
        if news is not None:
            msgs.append(news)
            size += item_bytes(news)
        self._dissemination.send(out, addr, msgs, size)

    def start(self, now: float, out: list[Effect]) -> None:
        """Start the next probe, if the detector finds a target."""
        p = self._detector.start_probe(now)
        if p is None:
            return
        self._ping(p.seq, p.target, p.addr, out)
        if p.watch:  # a suspect: ask the helpers at once
            self.go_indirect(p, now, out, stream=False)

    def go_indirect(self, p: Probe, now: float, out: list[Effect], *,
                    stream: bool = True) -> None:
        helpers = self._detector.go_indirect(p)
        e = self._roster.get(p.target)
        incarnation = e.incarnation if e is not None else 0
        for helper in helpers:
            req = PingReq(p.seq, p.target, p.addr, self._node_id, incarnation)
            self._dissemination.send(out, self._roster.members[helper].addr, [req],
                                     item_bytes(req))
        if stream:
            rid = self._requests.new("ping", p.addr, p.seq, now)
            out.append(StreamRequest(p.addr, Ping(p.seq, p.target, self._node_id), rid))

    def timeouts(self, now: float, out: list[Effect]) -> Verdict | None:
        """The probe in flight past a deadline: ask the helpers, or end it as failed."""
        p = self._detector.probe
        if p is None:
            return None
        if p.phase == DIRECT and now >= p.direct_deadline:
            self.go_indirect(p, now, out)
        if p.phase == INDIRECT and now >= p.final_deadline:
            return self._detector.finish_probe(False, now)
        return None

    def on_ack(self, msg: Ack, now: float, out: list[Effect]) -> Verdict | None:
        """An ack: of our probe (its verdict), or of a ping we relayed (passed on)."""
        p = self._detector.probe
        if p is not None and msg.seq == p.seq:
            if p.phase == DIRECT:
                p.direct_ok = True
                self.round_trips.note(now - p.started)
            return self._detector.finish_probe(True, now)
        r = self._detector.relays.pop(msg.seq, None)
        if r is not None:
            self.heard(r.target, now)
            self._dissemination.send(out, r.requester_addr, [Ack(r.req_seq)], ACK_ITEM)
        return None

    def on_nack(self, msg: Nack, now: float) -> Verdict | None:
        """A helper's nack: once every helper failed too, there is no need to wait."""
        p = self._detector.probe
        if p is not None and msg.seq == p.seq:
            p.nacks += 1
            if p.nacks >= p.expected_nacks:
                return self._detector.finish_probe(False, now)
        return None

    def relay(self, msg: PingReq, addr: str, now: float, out: list[Effect]) -> None:
        """A fellow at ``addr`` asks us to ping its target."""
        self.heard(msg.source, now)
        e = self._roster.get(msg.target)
        if e is not None and e.state in GONE:
            news = Dead(e.node, e.incarnation, self._node_id) if e.state == DEAD \
                else Left(e.node, e.incarnation, e.left_signature)
            self._dissemination.send(out, addr, [Nack(msg.seq), news],
                                     NACK_ITEM + item_bytes(news))
            return
        if e is not None and e.incarnation > msg.incarnation:
            # the asker missed a refutation (or a rejoin): tell it, it may be all it needs
            held = e.meta_signature if e.meta_version == e.alive_meta_version else None
            alive = e.alive(inline(e.metadata, held, self._inline_bytes))
            out.append(SendDatagram(addr, (alive,)))
        if e is None or e.addr != msg.target_addr:
            # only to a member, at its own address: a relay is no way to make us ping
            # anyone a fellow names
            self._detector.stats["ping_reqs_refused"] += 1
            return
        seq = self._detector.relay(addr, msg.seq, msg.target, now)
        self._ping(seq, msg.target, msg.target_addr, out)

    def expire_relays(self, now: float, out: list[Effect]) -> None:
        """Relayed pings that went unanswered: each owes its asker a nack."""
        detector = self._detector
        for r in detector.due_relays(now):
            self._dissemination.send(out, r.requester_addr, [Nack(r.req_seq)], NACK_ITEM)
            detector.relay_failed(r.target, now)


__all__ = ["ACK_ITEM", "NACK_ITEM", "PING_ITEM", "Prober"]
