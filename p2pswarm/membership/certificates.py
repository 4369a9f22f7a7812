"""Relayed ``Alive``s waiting for their fellow's admission certificate.

Theory of operation. A certificate is about 200 bytes, more than the rest of an ``Alive``;
carried in every relayed copy it halves what a datagram holds and slows a join wave
several times over. So a certificate travels once per fellow: in the fellow's own
``Alive``s, in push-pull records, and in the answer to a ``CertificateAsk``; relays leave
it out (``Dissemination.broadcast``). A receiver whose gate already holds the fellow's
certificate (by its key) puts it back and admits as before; one that does not keeps the
``Alive`` here and asks whoever sent it, which admitted the fellow and so holds it. When
the certificate comes, the ``Alive`` goes through the gate again: no record without a
valid certificate becomes a member, and every fresh check is paid from the sender's
budget as before.

The table is small (``MAX_PENDING`` fellows, the oldest dropped first), each entry expires
after ``PENDING_S`` (a later relay or push-pull brings the fellow again), and the same
fellow is asked for at most every ``ASK_EVERY_S``; all of it is counted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from p2pswarm.wire.gossip import Alive

MAX_PENDING = 256
PENDING_S = 5.0
ASK_EVERY_S = 0.5


@dataclass(frozen=True, slots=True)
class PendingAlive:
    msg: Alive
    addr: str  # who relayed it (asked for the certificate)
    until: float  # dropped after this
    asked_at: float


class PendingCertificates:
    __slots__ = ("_pending", "_stats")

    def __init__(self, stats: dict[str, int]) -> None:
        self._stats = stats
        self._pending: OrderedDict[bytes, PendingAlive] = OrderedDict()  # node -> its wait

    def __len__(self) -> int:
        return len(self._pending)

    def _count(self, counter: str) -> None:
        self._stats[counter] = self._stats.get(counter, 0) + 1

    def hold(self, msg: Alive, addr: str, now: float) -> bool:
        """Keep ``msg`` (heard from ``addr``) until its certificate comes; whether to ask
        ``addr`` for it now."""
        self.expire(now)
        node = msg.node
        old = self._pending.pop(node, None)
        if old is not None and old.msg.incarnation > msg.incarnation:
            msg = old.msg  # the newer news waits; an older relay only renews the wait
        if old is None:
            self._count("certificate_waits")
            if len(self._pending) >= MAX_PENDING:
                self._pending.popitem(last=False)
                self._count("certificate_waits_dropped")
        ask = old is None or now - old.asked_at >= ASK_EVERY_S
        asked_at = now if ask else old.asked_at if old is not None else now
        self._pending[node] = PendingAlive(msg, addr, now + PENDING_S, asked_at)
        return ask

    def take(self, node: bytes, now: float) -> PendingAlive | None:
        """The ``Alive`` waiting for ``node``'s certificate, if any (out of the table)."""
        self.expire(now)
        return self._pending.pop(node, None)

    def expire(self, now: float) -> None:
        pending = self._pending
        while pending:
            node, p = next(iter(pending.items()))
            if p.until > now:
                return
            del pending[node]
            self._count("certificate_waits_expired")


__all__ = ["ASK_EVERY_S", "MAX_PENDING", "PENDING_S", "PendingAlive", "PendingCertificates"]
