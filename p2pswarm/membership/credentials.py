"""What fellows exchange about admission: revocations gossiped, certificates asked for
and answered.

Theory of operation. Where the swarm has an admin key (``gate``), three messages carry
admission between fellows, apart from the news of who is alive: a ``Revoked`` takes the
fellows it names out of the view at once and is gossiped on; a ``CertificateAsk`` asks a
fellow for the certificates of relayed ``Alive``s we hold waiting (``certificates``), paid
from the asker's budget; the ``Certificates`` it answers with put those ``Alive``s through
the gate again. Without a gate all three are ignored. The machine routes these messages
here, and sends the asks gathered while it handled a datagram.
"""

from __future__ import annotations

import dataclasses

from p2pswarm import effects as fx
from p2pswarm.effects import Effect, Event, SendDatagram
from p2pswarm.membership.dissemination import Dissemination
from p2pswarm.membership.gate import AdmissionGate
from p2pswarm.membership.own import OwnRecord
from p2pswarm.membership.roster import Roster
from p2pswarm.membership.states import LEFT
from p2pswarm.membership.updates import Updates
from p2pswarm.wire.gossip import (
    MAX_CERTIFICATES_PER_MESSAGE,
    CertificateAsk,
    CertificateOf,
    Certificates,
    Revoked,
)


class CredentialExchange:
    __slots__ = ("_datagram_budget", "_gate", "_gossip", "_own", "_roster", "_stats",
                 "_updates")

    def __init__(self, gate: AdmissionGate | None, own: OwnRecord, roster: Roster,
                 gossip: Dissemination, updates: Updates, stats: dict[str, int],
                 datagram_budget_bytes: int) -> None:
        self._gate = gate
        self._own = own
        self._roster = roster
        self._gossip = gossip
        self._updates = updates
        self._stats = stats
        self._datagram_budget = datagram_budget_bytes

    def on_revoked(self, msg: Revoked, addr: str, now: float, out: list[Effect]) -> None:
        gate = self._gate
        if gate is None:
            return
        rev = gate.revoke(msg.revocation)
        if rev is None:
            return
        self._gossip.queue.add(b"revoked:" + rev.signature[:16], msg)
        for e in list(self._roster.members.values()):
            if rev.covers(e.node, e.name):
                self._updates.expel(e.node, "revoked by the admin key", now, out)
        local = self._own.local
        if rev.covers(local.node_id, local.name):
            out.append(Event(fx.REAPED, local.node_id, local.name,
                             "this node was revoked by the admin key", self._own.incarnation,
                             local.node_id))

    def ask_certificates(self, out: list[Effect]) -> None:
        """Ask each sender of relayed Alives we could not admit yet for the certificates
        (a few per datagram)."""
        asks = self._updates.asks
        if not asks:
            return
        by_addr: dict[str, list[bytes]] = {}
        for addr, node in asks:
            by_addr.setdefault(addr, []).append(node)
        asks.clear()
        for addr, nodes in by_addr.items():
            for i in range(0, len(nodes), MAX_CERTIFICATES_PER_MESSAGE):
                ask = CertificateAsk(tuple(nodes[i:i + MAX_CERTIFICATES_PER_MESSAGE]))
                self._stats["certificate_asks_sent"] += 1
                out.append(SendDatagram(addr, (ask,)))

    def on_certificate_ask(self, msg: CertificateAsk, addr: str, now: float,
                           out: list[Effect]) -> None:
        gate = self._gate
        if gate is None:
            return
        if not gate.budget.take(addr, now):  # an answer costs bytes: the asker's budget
            self._stats["certificate_asks_refused"] += 1
            return
        local = self._own.local
        found: list[CertificateOf] = []
        for node in msg.nodes:
            if node == local.node_id:
                data = local.certificate
            else:
                e = self._roster.get(node)
                data = e.certificate if e is not None and e.state != LEFT else b""
            if data and not any(c.node == node for c in found):
                found.append(CertificateOf(node, data))
        # one datagram each when large (a certificate with a delegation), else together
        batch: list[CertificateOf] = []
        size = 0
        for c in found:
            n = len(c.certificate) + len(c.node) + 8
            if batch and size + n > self._datagram_budget // 2:
                out.append(SendDatagram(addr, (Certificates(tuple(batch)),)))
                batch, size = [], 0
            batch.append(c)
            size += n
        if batch:
            out.append(SendDatagram(addr, (Certificates(tuple(batch)),)))

    def on_certificates(self, msg: Certificates, addr: str, now: float,
                        out: list[Effect]) -> None:
        if self._gate is None:
            return
        for c in msg.certificates:
            waiting = self._updates.waiting.take(c.node, now)
            if waiting is None:
                self._stats["certificates_unasked"] += 1
                continue
            self._updates.alive(dataclasses.replace(waiting.msg, certificate=c.certificate),
                                waiting.addr, now, out)
