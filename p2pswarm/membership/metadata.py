"""Metadata: what a fellow says of itself, as opaque, versioned bytes signed by its owner.

Theory of operation. Gossip announces the version (in ``Alive``), with the signed bytes
riding along when they are small (``GossipTuning.meta_inline_bytes``, ``inline``) and news
to the fellow passing them on, so a mere refutation stays small (``without_meta``);
whoever still holds an older one pulls the bytes from the owner over a stream
(``MetadataBook.want``), and anti-entropy carries them too. A newer version always wins; an older
one or a bad signature is ignored. A restarted owner starts again at version 1, so fellows
may hold its metadata from before at a version as high: once it sees such a record of
itself (its join's answer has one, and so does the record it asks of whoever names an
incarnation above its own), signed by it with a higher version, or the same version with
other bytes or a higher incarnation, it publishes its own again above that version
(``outdone``). And a fellow taking an Alive with a later epoch (signed; it grows across
restarts) than the one it held drops the metadata it held: the last life's versions say
nothing against the new one's.
"""

from __future__ import annotations

from p2pswarm.effects import METADATA, Effect, StreamRequest
from p2pswarm.membership.dissemination import Dissemination
from p2pswarm.membership.proofs import ProofCache, meta_signed_bytes
from p2pswarm.membership.requests import StreamRequests
from p2pswarm.membership.roster import Entry, Roster
from p2pswarm.membership.states import INF, PRESENT
from p2pswarm.wire.gossip import Alive, MetaPull, MetaPush


def inline(metadata: bytes, signature: bytes | None,
           limit_bytes: int) -> tuple[bytes, bytes | None]:
    """The (metadata, signature) an Alive carries: the signed bytes if small, or none."""
    if signature is None or not 0 < len(metadata) <= limit_bytes:
        return b"", None
    return metadata, signature


def without_meta(msg: Alive) -> Alive:
    return Alive(msg.node, msg.incarnation, msg.name, msg.addr, msg.public_key,
                 msg.meta_version, msg.priority, b"", None, msg.epoch, msg.signature)


def outdone(seen_version: int, seen_incarnation: int, seen_metadata: bytes | None,
            version: int, incarnation: int, metadata: bytes) -> bool:
    """Whether fellows hold metadata of ours from before a restart that outdoes ours (at
    ``version``, ``incarnation``, ``metadata``): a version above ours, ours with an
    incarnation above ours, or ours with other bytes than we signed in this life can only
    be that. ``seen_metadata``: the bytes seen, proven signed by us, or None."""
    return seen_version > version or (
        seen_version == version and (
            seen_incarnation > incarnation
            or (seen_metadata is not None and seen_metadata != metadata)))


class MetadataBook:
    """Fellows' metadata: taking newer signed versions in, pulling announced ones."""

    __slots__ = ("_dissemination", "_proofs", "_requests", "_retry_s", "_roster", "_stats",
                 "_wait")

    def __init__(self, roster: Roster, proofs: ProofCache, requests: StreamRequests,
                 dissemination: Dissemination, stats: dict[str, int], retry_s: float) -> None:
        self._roster = roster
        self._proofs = proofs
        self._requests = requests
        self._dissemination = dissemination
        self._stats = stats
        self._retry_s = retry_s  # how soon a failed pull is tried again
        self._wait: dict[bytes, float] = {}  # pulls under way: when to ask again

    def merge(self, node: bytes, public_key: bytes, version: int, metadata: bytes,
              signature: bytes | None, out: list[Effect], epoch: int) -> bool:
        """Take ``node``'s signed metadata if newer than ours; True if it was taken.
        ``epoch``: that of the Alive it came with; one older than the Alive we hold is
        from the owner's earlier life (its versions start again at 1 after a restart)."""
        e = self._roster.get(node)
        if e is None or version <= e.meta_version or signature is None \
                or epoch < e.alive_epoch:
            return False
        if not self._proofs.binding_ok(node, public_key) or public_key != e.public_key:
            return False
        if not self._proofs.signed_by(e.public_key, signature,
                                      meta_signed_bytes(node, version, metadata)):
            self._stats["bad_signatures"] += 1
            return False
        e.meta_version = version
        e.metadata = metadata
        e.meta_signature = signature
        e.announced_meta = max(e.announced_meta, version)
        self._wait.pop(node, None)
        self._roster.changed(node, roster=False)
        self._dissemination.event(out, METADATA, e, f"metadata version {version}", node)
        return True

    def merge_inline(self, msg: Alive, out: list[Effect]) -> bool:
        """Take the metadata riding in ``msg``, if any and newer."""
        return msg.meta_signature is not None and self.merge(
            msg.node, msg.public_key, msg.meta_version, msg.metadata, msg.meta_signature, out,
            msg.epoch)

    def forget_old_life(self, e: Entry) -> None:
        """``e`` restarted (its signed epoch grew): what we hold of its metadata is from its
        last life, whose versions say nothing against those of this one (they start again
        at 1). Drop it, so the fresh version, however low, is taken (inline or pulled)."""
        if e.meta_version == 0:
            return
        e.meta_version = e.announced_meta = 0
        e.metadata = b""
        e.meta_signature = None
        self._wait.pop(e.node, None)
        self._roster.changed(e.node, roster=False)

    def want(self, e: Entry, now: float, out: list[Effect]) -> None:
        """Pull ``e``'s metadata if a newer version was announced and no pull is under
        way."""
        if e.announced_meta <= e.meta_version or self._dissemination.quiet:
            return
        if self._wait.get(e.node, -INF) > now:
            return
        self._wait[e.node] = now + self._retry_s
        rid = self._requests.new("meta", e.addr, e.node, now)
        out.append(StreamRequest(e.addr, MetaPull((e.node,)), rid))

    def retry(self, now: float, out: list[Effect]) -> None:
        """Ask again for what a failed or unanswered pull did not bring."""
        if not self._wait:
            return
        for node, at in list(self._wait.items()):
            e = self._roster.get(node)
            if e is None or e.announced_meta <= e.meta_version:
                del self._wait[node]
            elif at <= now and e.state in PRESENT:
                self.want(e, now, out)

    def on_push(self, msg: MetaPush, addr: str, now: float, out: list[Effect]) -> None:
        """The answer to our pull: the records asked for."""
        for r in msg.records:
            self.merge(r.node, r.public_key, r.meta_version, r.metadata, r.meta_signature, out,
                       r.alive_epoch)

    def failed(self, node: bytes, now: float) -> None:
        """A pull of ``node``'s metadata failed: ask again a while later."""
        self._wait[node] = now + self._retry_s

    def forget(self, node: bytes) -> None:
        self._wait.pop(node, None)


__all__ = ["MetadataBook", "inline", "outdone", "without_meta"]
