"""The leave handshake: saying goodbye so that fellows record ``left``, not dead.

Theory of operation. A goodbye is ``Left``, gossiped like any update and also sent straight
to every live fellow with a ``Ping`` in the same datagram: a fellow takes in the news
before it answers the ping, so its ``Ack`` proves it holds the leave. Fellows that have not
acknowledged are asked again every probe timeout, for ``leave_timeout_s`` at most. The
goodbye has spread (``spread``) once every fellow asked has acknowledged (or is no longer
live), or once ``indirect_checks`` have and gossip has sent it its full count: those
fellows pass it on. A leaving node answers no pings (but the goodbye pings of other
leavers: a swarm shut down at once does not wait out the bound), refutes nothing and
publishes no new metadata: a new incarnation would undo its goodbye, and it would be
recorded dead.

This keeps the handshake's book (who was asked under which ping, who acknowledged, when to
ask again) and sends its datagrams; the machine gossips the goodbye.
"""

from __future__ import annotations

from collections.abc import Callable

from p2pswarm.config import GossipConfig
from p2pswarm.effects import Effect, SendDatagram
from p2pswarm.membership.roster import Roster
from p2pswarm.membership.states import INF
from p2pswarm.wire.gossip import Left, Ping


class LeaveHandshake:
    __slots__ = ("_config", "_next_seq", "_retry_at", "_roster", "_seqs", "_until", "_waiting",
                 "acked", "asked", "leaving")

    def __init__(self, config: GossipConfig, roster: Roster, next_seq: Callable[[], int]) -> None:
        self._config = config
        self._roster = roster
        self._next_seq = next_seq  # the probes' sequence: an ack names the ping it answers
        self.leaving = False
        self._waiting: dict[bytes, int] = {}  # fellows yet to acknowledge our leave
        self._seqs: dict[int, bytes] = {}  # the pings that rode with it -> fellow
        self.asked = 0
        self.acked = 0
        self._retry_at = INF
        self._until = INF  # no more asking after this

    def begin(self, goodbye: Left, now: float, out: list[Effect]) -> None:
        """Start leaving: ``goodbye`` straight to every live fellow, a ping behind it."""
        self.leaving = True
        live = self._roster.live
        self.asked = len(live)
        for node in sorted(live):
            self._ask(node, goodbye, out)
        self._retry_at = now + self._config.probe_timeout_s
        self._until = now + self._config.leave_timeout_s

    def _ask(self, node: bytes, goodbye: Left, out: list[Effect]) -> None:
        """Our goodbye to ``node`` with a ping behind it: its ack proves it took the news."""
        seq = self._next_seq()
        self._waiting[node] = seq
        self._seqs[seq] = node
        out.append(SendDatagram(self._roster.members[node].addr, (
            goodbye, Ping(seq, node, goodbye.node))))

    def due(self, now: float) -> bool:
        return bool(self._waiting) and self._retry_at <= now < self._until

    def deadline(self) -> float:
        return self._retry_at if self._waiting and self._retry_at < self._until else INF

    def ask_again(self, goodbye: Left, now: float, out: list[Effect]) -> None:
        """Time to ask again the fellows still waited for."""
        self._retry_at = now + self._config.probe_timeout_s
        for node in sorted(self._waiting):
            if node in self._roster.live_pos:
                self._ask(node, goodbye, out)
            else:  # found dead or gone meanwhile: it will not answer
                del self._waiting[node]

    def acknowledged(self, seq: int) -> bool:
        """An ack for ``seq``; True if it answers a goodbye ping (and is taken here)."""
        if not self.leaving or seq not in self._seqs:
            return False
        node = self._seqs.pop(seq)
        if self._waiting.pop(node, None) is not None:
            self.acked += 1
        return True

    def spread(self, enough: int, gossip_done: bool) -> bool:
        """Whether the goodbye has got around: everyone asked acknowledged, or ``enough``
        of them did and gossip has sent it its full count (``gossip_done``)."""
        if not self.leaving:
            return False
        if not self._waiting:
            return True
        return self.acked >= min(enough, self.asked) and gossip_done


__all__ = ["LeaveHandshake"]
