"""This node's own record: who it is, its incarnation, its metadata, its signed ``Alive``.

Theory of operation. The owner is the only one who can speak for itself: its ``Alive``
and its metadata carry its signatures (``proofs``), and a new incarnation is how it
outdoes any news about it (a refutation) or announces new metadata. Our Alives carry our
metadata while gossip spreads the news of it (``meta_news_until``: a join, or a new
version), so a refutation meanwhile does not take the bytes out of the queue; later ones
only announce the version, so refutations stay small.
"""

from __future__ import annotations

from p2pswarm.membership.clock import Clock
from p2pswarm.membership.member import LocalNode, Member, MemberState
from p2pswarm.membership.metadata import inline
from p2pswarm.membership.proofs import (
    U32_MAX,
    OwnSignatures,
    ProofCache,
    Signer,
    meta_signed_bytes,
)
from p2pswarm.membership.states import ALIVE, INF, LEFT
from p2pswarm.wire.gossip import Alive, MemberRecord, MemberSummary


class OwnRecord:
    __slots__ = ("_clock", "_inline_bytes", "_signatures", "epoch", "incarnation", "local",
                 "meta_news_until", "meta_signature", "meta_version", "metadata")

    def __init__(self, local: LocalNode, sign: Signer, clock: Clock, inline_bytes: int, *,
                 incarnation: int, metadata: bytes, epoch: int) -> None:
        self.local = local
        self._clock = clock
        self._inline_bytes = inline_bytes  # metadata up to this size rides in our Alive
        self._signatures = OwnSignatures(sign)
        self.epoch = epoch  # our datagram epoch, signed into our Alive
        self.incarnation = incarnation
        self.meta_version = 1 if metadata else 0
        self.metadata = metadata
        self.meta_signature = self.sign_meta() if metadata else None
        self.meta_news_until = -INF  # our Alives carry our metadata until then

    def sign_meta(self) -> bytes:
        return self._signatures.meta(self.local.node_id, self.meta_version, self.metadata)

    def sign_alive(self) -> bytes:
        """Our signature over our Alive as it stands: signed once per incarnation."""
        loc = self.local
        return self._signatures.alive((loc.node_id, self.incarnation, loc.name, loc.addr,
                                       loc.public_key, self.meta_version, loc.priority,
                                       self.epoch))

    def alive(self) -> Alive:
        """Our Alive as it stands, with our metadata inline while it is news."""
        loc = self.local
        metadata = inline(self.metadata, self.meta_signature, self._inline_bytes) \
            if self._clock.now < self.meta_news_until else (b"", None)
        return Alive(loc.node_id, self.incarnation, loc.name, loc.addr, loc.public_key,
                     self.meta_version, loc.priority, *metadata, self.epoch, self.sign_alive(),
                     loc.certificate)

    @staticmethod
    def state(left: bool) -> int:
        return LEFT if left else ALIVE

    def record(self, left: bool) -> MemberRecord:
        loc = self.local
        return MemberRecord(loc.node_id, self.incarnation, self.state(left),
                            loc.name, loc.addr, loc.public_key, loc.priority, self.meta_version,
                            self.metadata, self.meta_signature, self.meta_version, self.epoch,
                            self.sign_alive(), loc.certificate)

    def view(self, left: bool) -> Member:
        loc = self.local
        state: MemberState = "left" if left else "alive"
        return Member(loc.node_id, loc.name, loc.addr, state, self.incarnation, self.metadata,
                      self.meta_version, self.meta_version, None, 0.0, loc.priority,
                      loc.public_key, is_self=True)

    def summary(self, left: bool) -> MemberSummary:
        return MemberSummary(self.local.node_id, self.incarnation, self.state(left),
                             self.meta_version)

    def row(self, left: bool) -> tuple[bytes, int, int, int]:
        """Our line in the digest of the view."""
        return self.local.node_id, self.incarnation, self.state(left), self.meta_version

    def exhausted(self) -> bool:
        """Whether incarnation or metadata version cannot grow any more."""
        return self.incarnation >= U32_MAX or self.meta_version >= U32_MAX

    def publish(self, metadata: bytes) -> None:
        """New metadata: a new version, signed, under a new incarnation."""
        self.metadata = metadata
        self.meta_version += 1
        self.meta_signature = self.sign_meta()
        self.incarnation += 1

    def meta_proven(self, proofs: ProofCache, version: int, metadata: bytes,
                    signature: bytes | None) -> bool:
        """Whether this is metadata we signed (in this life or an earlier one: a version we
        may have to outdo)."""
        if signature is None or version == 0:
            return False
        if version == self.meta_version and metadata == self.metadata:
            return True  # what we publish now (signatures are deterministic): no check
        return proofs.signed_by(self.local.public_key, signature,
                                meta_signed_bytes(self.local.node_id, version, metadata))


__all__ = ["OwnRecord"]
