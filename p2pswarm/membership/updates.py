"""What news about a fellow does to this node's view of it (memberlist's ``aliveNode``,
``suspectNode`` and ``deadNode``).

Theory of operation. News names a fellow and an incarnation. Older news than the
incarnation held changes nothing; newer news wins, and at the same incarnation ``Suspect``
beats ``Alive`` and ``Dead``/``Left`` beat both. Only what changes something needs its
owner's signature: an ``Alive`` at a new incarnation counts only if the fellow signed it,
so a third party can neither move a fellow, rename it, nor invent one; its claims of
suspicion or death count at most at the incarnation the fellow itself signed
(``claimed``). A ``Suspect`` of a fellow already suspected at that incarnation is a
confirmation (``suspicion``); a fellow held dead that signs a newer ``Alive`` is back. A
remote verdict of dead taken from a record is only a suspicion here (as memberlist); a
``Dead`` datagram is adopted at once. Dead and left fellows are reaped after
``dead_reap_after_s``.

News about this node itself is the machine's to answer (it refutes); this handles the
fellows', and hands what it changes to gossip and to the election's feed.
"""

from __future__ import annotations

import dataclasses

from p2pswarm import effects as fx
from p2pswarm.config import GossipConfig
from p2pswarm.effects import Effect
from p2pswarm.membership.broadcasts import item_bytes
from p2pswarm.membership.certificates import PendingCertificates
from p2pswarm.membership.detector import FailureDetector
from p2pswarm.membership.dissemination import Dissemination
from p2pswarm.membership.gate import AdmissionGate
from p2pswarm.membership.member import STATE_NAMES
from p2pswarm.membership.metadata import MetadataBook, without_meta
from p2pswarm.membership.proofs import ProofCache, left_signed_bytes
from p2pswarm.membership.roster import Entry, Roster
from p2pswarm.membership.states import ALIVE, DEAD, GONE, LEFT, PRESENT, SUSPECT
from p2pswarm.wire.gossip import Alive, Dead, Left, Revoked, Suspect

TELL_REVOKED_EVERY_S = 5.0  # a revoked fellow that still speaks is told, this often at most


class Updates:
    __slots__ = ("_book", "_config", "_detector", "_dissemination", "_name", "_node_id",
                 "_proofs", "_roster", "_stats", "_told_revoked", "asks", "gate", "sender",
                 "waiting")

    def __init__(self, node_id: bytes, name: str, config: GossipConfig, roster: Roster,
                 detector: FailureDetector, dissemination: Dissemination, book: MetadataBook,
                 proofs: ProofCache, stats: dict[str, int]) -> None:
        self._node_id = node_id
        self._name = name
        self._config = config
        self._roster = roster
        self._detector = detector
        self._dissemination = dissemination
        self._book = book
        self._proofs = proofs
        self._stats = stats
        self.gate: AdmissionGate | None = None  # where admission is on (see ``gate``)
        self._told_revoked: dict[bytes, float] = {}  # revoked fellow -> when last told
        self.sender = ""  # who sent the records being merged (their budget pays)
        # relayed Alives whose certificate we lack, and whom to ask for which (the machine
        # sends the asks once the datagram in hand is handled)
        self.waiting = PendingCertificates(stats)
        self.asks: list[tuple[str, bytes]] = []

    # --- news --------------------------------------------------------------------------

    def alive(self, msg: Alive, addr: str, now: float, out: list[Effect]) -> None:
        """A fellow's ``Alive`` (not this node's), heard from ``addr`` ("": a record)."""
        node = msg.node
        e = self._roster.get(node)
        news = e is None or msg.incarnation > e.incarnation
        if news and self.gate is not None and not msg.certificate:
            # relays leave certificates out: put back the one we hold, or wait and ask
            known = self.gate.known(msg.public_key, msg.name, now)
            if not known and e is not None and e.public_key == msg.public_key \
                    and e.name == msg.name:
                known = e.certificate
            if not known:
                if addr and self.waiting.hold(msg, addr, now):
                    self.asks.append((addr, node))
                elif not addr:
                    self.gate.certificate(b"", msg.public_key, msg.name, now)  # counted
                return
            msg = dataclasses.replace(msg, certificate=known)
        if news and self.gate is not None:
            # admission first: a record without a certificate costs no signature check;
            # the fellow's own signature then costs the sender's budget too
            sender = addr or self.sender
            admitted, pushed_out = self.gate.admits(msg, now, sender)
            if not admitted:
                self._tell_revoked(msg, now, out)
                return
            if not self._proofs.known_alive(msg) and not self.gate.charge(sender, now):
                return
            if pushed_out is not None and pushed_out != node:
                self.expel(pushed_out, "pushed out of its invitation slot", now, out)
        # Only what changes something needs its owner's signature: an older or the same
        # incarnation changes nothing but metadata, which carries a signature of its own.
        if news and not self._proofs.proven(msg):
            if e is not None:
                self._book.merge_inline(msg, out)
            return
        gossip = self._dissemination
        if e is None:
            if not self._proofs.binding_ok(node, msg.public_key):
                return
            e = Entry(node, msg.name, msg.addr, msg.public_key, msg.priority, msg.incarnation,
                      ALIVE, now)
            e.signed(msg)
            e.announced_meta = msg.meta_version
            self._roster.add(e)
            if addr == msg.addr:
                e.last_heard = now
            gossip.broadcast(node, msg)
            self._roster.changed(node)
            gossip.event(out, fx.MEMBER_JOINED, e, f"joined at {msg.addr}", node)
            self._book.merge_inline(msg, out)
            self._book.want(e, now, out)
            return
        if msg.incarnation > e.incarnation and msg.epoch > e.alive_epoch \
                and msg.public_key == e.public_key:
            self._book.forget_old_life(e)
        meta_news = self._book.merge_inline(msg, out)
        if msg.incarnation <= e.incarnation:
            return
        if msg.public_key != e.public_key and not self._proofs.binding_ok(node, msg.public_key):
            return
        old = e.state
        changed = (msg.name, msg.addr, msg.priority) != (e.name, e.addr, e.priority)
        e.incarnation = msg.incarnation
        e.name, e.addr, e.public_key, e.priority = msg.name, msg.addr, msg.public_key, msg.priority
        e.signed(msg)
        e.announced_meta = max(e.announced_meta, msg.meta_version)
        if addr == msg.addr:
            e.last_heard = now
        if old != ALIVE:
            e.state = ALIVE
            e.state_at = now
            if old in GONE:
                self._roster.live_add(node)
                self._roster.recent_dead.pop(node, None)
        # news it signed since: whatever failed probes we were still doubting it on are
        # older than that proof of life, and must not carry over to its new incarnation
        self._detector.forget(node)
        # relay the bytes only while they are news: a refutation learnt with bytes we
        # already hold (from a sync record, say) must not crowd the gossip it rides in
        gossip.broadcast(node, msg if meta_news or msg.meta_signature is None
                         else without_meta(msg))
        self._roster.changed(node, roster=changed or old != ALIVE)
        if old != ALIVE:
            gossip.event(out, fx.ALIVE, e, f"alive again (incarnation {msg.incarnation})"
                         if old == SUSPECT else f"back after {STATE_NAMES[old]}", node)
        elif changed:
            gossip.event(out, fx.UPDATED, e, f"now {msg.name} at {msg.addr}", node)
        self._book.want(e, now, out)

    def suspect(self, msg: Suspect, now: float, out: list[Effect]) -> None:
        """A ``Suspect`` of a fellow (not this node)."""
        node = msg.node
        e = self._roster.get(node)
        if e is None or msg.incarnation < e.incarnation or e.state in GONE:
            return
        if msg.incarnation > e.incarnation:
            msg = Suspect(node, self.claimed(msg.incarnation, e.incarnation), msg.source,
                          msg.silent_ms)
        if e.state == SUSPECT and msg.incarnation == e.incarnation:
            if self._detector.confirm(node, msg.source, now, msg):
                self._dissemination.broadcast(node, msg)
            return
        self._detector.doubt.pop(node, None)
        self.start_suspicion(node, msg.incarnation, msg.source, now, now, out, msg)

    def dead(self, msg: Dead, now: float, out: list[Effect]) -> None:
        """A ``Dead`` of a fellow (not this node): adopted at once; where admission is on,
        a third party's word is only a suspicion, which expires unless refuted."""
        node = msg.node
        if self.gate is not None:
            self._stats["third_party_dead_as_suspicion"] += 1
            self.suspect(Suspect(node, msg.incarnation, msg.source), now, out)
            s = self._detector.suspicions.get(node)
            if s is not None:
                s.at_floor()
            return
        e = self._roster.get(node)
        if e is None or msg.incarnation < e.incarnation:
            return
        if msg.incarnation > e.incarnation:
            msg = Dead(node, self.claimed(msg.incarnation, e.incarnation), msg.source)
        if e.state in GONE:
            if e.state == DEAD and msg.incarnation > e.incarnation:
                e.incarnation = msg.incarnation
            return
        self._set_dead(e, msg.incarnation, msg.source, now, out, msg)

    def left(self, msg: Left, now: float, out: list[Effect]) -> None:
        """A fellow (not this node) said goodbye."""
        node = msg.node
        e = self._roster.get(node)
        if e is None or msg.incarnation < e.incarnation or e.state == LEFT:
            return
        if self.gate is not None:
            # only the fellow itself can say it left
            if msg.signature is None or not self._proofs.signed_by(
                    e.public_key, msg.signature, left_signed_bytes(node, msg.incarnation)):
                self._stats["unsigned_lefts"] += 1
                return
        elif msg.incarnation > e.incarnation:
            msg = Left(node, self.claimed(msg.incarnation, e.incarnation))
        e.left_signature = msg.signature
        was_live = e.state in PRESENT
        e.incarnation = msg.incarnation
        e.state = LEFT
        e.state_at = now
        if was_live:
            self._roster.live_remove(node)
        self._detector.forget(node)
        self._roster.recent_dead.pop(node, None)
        self._dissemination.broadcast(node, msg)
        self._roster.schedule_reap(now + self._config.dead_reap_after_s, node)
        self._roster.changed(node)
        self._dissemination.event(out, fx.LEFT, e, "left the swarm", node)

    def _tell_revoked(self, msg: Alive, now: float, out: list[Effect]) -> None:
        """A revoked fellow that still speaks (restarted with its certificate, say) is sent
        its revocation at its own signed address, so it stops instead of running unseen."""
        assert self.gate is not None
        rev = self.gate.revocation_of(msg.node, msg.name)
        if rev is None or now - self._told_revoked.get(msg.node, -1e18) < TELL_REVOKED_EVERY_S:
            return
        if len(self._told_revoked) > 1024:
            self._told_revoked.clear()
        self._told_revoked[msg.node] = now
        told = Revoked(rev.encode())
        self._dissemination.send(out, msg.addr, [told], item_bytes(told))

    def expel(self, node: bytes, why: str, now: float, out: list[Effect]) -> None:
        """Take ``node`` out of the view now (revoked, or its slot lost): no longer probed,
        counted or kept."""
        e = self._roster.remove(node)
        if e is None:
            return
        self._stats["revoked"] += 1
        self._detector.forget(node)
        self._detector.doubt.pop(node, None)
        self._book.forget(node)
        if self.gate is not None:
            self.gate.slots.release(node)
        self._roster.changed(node)
        self._dissemination.event(out, fx.REAPED, e, why, node)

    def claimed(self, incarnation: int, known: int) -> int:
        """A third party's claim about a fellow counts at most at the incarnation the
        fellow itself signed (as far as we know): nobody can push it further."""
        if incarnation > known:
            self._stats["claims_clamped"] += 1
            return known
        return incarnation

    # --- verdicts ----------------------------------------------------------------------

    def start_suspicion(self, node: bytes, incarnation: int, source: bytes, start: float,
                        now: float, out: list[Effect], msg: Suspect | None = None,
                        silent_since: float | None = None) -> None:
        e = self._roster.members[node]
        e.state = SUSPECT
        e.incarnation = incarnation
        e.state_at = now
        msg = self._detector.suspect(node, incarnation, source, start, now, msg, silent_since)
        self._dissemination.broadcast(node, msg)
        self._roster.changed(node)
        self._dissemination.event(out, fx.SUSPECT, e, "suspected by this node"
                                  if source == self._node_id
                                  else f"suspected by {self.name_of(source)}", source)

    def declare_dead(self, node: bytes, now: float, out: list[Effect]) -> None:
        e = self._roster.members[node]
        self._stats["dead_declared"] += 1
        self._set_dead(e, e.incarnation, self._node_id, now, out)

    def _set_dead(self, e: Entry, incarnation: int, source: bytes, now: float,
                  out: list[Effect], msg: Dead | None = None) -> None:
        node = e.node
        was_live = e.state in PRESENT
        e.incarnation = incarnation
        e.state = DEAD
        e.state_at = now
        if was_live:
            self._roster.live_remove(node)
        self._detector.forget(node)
        self._roster.recent_dead[node] = now
        self._dissemination.broadcast(node, msg if msg is not None
                                      else Dead(node, incarnation, source))
        self._roster.schedule_reap(now + self._config.dead_reap_after_s, node)
        self._roster.changed(node)
        self._dissemination.event(out, fx.DEAD, e, "declared dead by this node"
                                  if source == self._node_id
                                  else f"declared dead by {self.name_of(source)}", source)

    def reap(self, node: bytes, now: float, out: list[Effect]) -> None:
        e = self._roster.reap(node, now, self._config.dead_reap_after_s,
                              self._config.tuning.reconnect_max_lost)
        if e is None:
            return
        self._book.forget(node)
        self._roster.changed(node)
        self._dissemination.event(out, fx.REAPED, e, f"forgotten after {STATE_NAMES[e.state]}",
                                  node)

    def name_of(self, node: bytes | None) -> str:
        if node is None:
            return "?"
        if node == self._node_id:
            return self._name
        e = self._roster.get(node)
        return e.name if e is not None else node.hex()[:8]


__all__ = ["Updates"]
