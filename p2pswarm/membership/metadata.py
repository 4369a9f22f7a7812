"""Metadata: what a fellow says of itself, as opaque, versioned bytes signed by its owner.

Theory of operation. Gossip announces the version (in ``Alive``), with the signed bytes
riding along when they are small (``GossipTuning.meta_inline_bytes``, ``inline``) and news
to the fellow passing them on, so a mere refutation stays small (``without_meta``);
whoever still holds an older one pulls the bytes from the owner over a stream
(``MetaPulls``), and anti-entropy carries them too. A newer version always wins; an older
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

from p2pswarm.membership.roster import Entry, Roster
from p2pswarm.membership.states import INF, PRESENT
from p2pswarm.wire.gossip import Alive


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


def take(e: Entry, version: int, metadata: bytes, signature: bytes) -> None:
    """``e``'s owner signed ``metadata`` at ``version``, newer than what we held."""
    e.meta_version = version
    e.metadata = metadata
    e.meta_signature = signature
    e.announced_meta = max(e.announced_meta, version)


def forget_old_life(e: Entry) -> bool:
    """``e`` restarted (its signed epoch grew): what we hold of its metadata is from its
    last life, whose versions say nothing against those of this one (they start again
    at 1). Drop it, so the fresh version, however low, is taken (inline or pulled). False
    if there was nothing to drop."""
    if e.meta_version == 0:
        return False
    e.meta_version = e.announced_meta = 0
    e.metadata = b""
    e.meta_signature = None
    return True


class MetaPulls:
    """Pulls of fellows' metadata: when each may be asked (again)."""

    __slots__ = ("_retry_s", "_wait")

    def __init__(self, retry_s: float) -> None:
        self._retry_s = retry_s
        self._wait: dict[bytes, float] = {}

    def ask(self, e: Entry, now: float) -> bool:
        """Whether to pull ``e``'s metadata now (a newer version was announced and no
        pull is under way); if so, the pull is noted."""
        if e.announced_meta <= e.meta_version:
            return False
        if self._wait.get(e.node, -INF) > now:
            return False
        self._wait[e.node] = now + self._retry_s
        return True

    def failed(self, node: bytes, now: float) -> None:
        self._wait[node] = now + self._retry_s

    def forget(self, node: bytes) -> None:
        self._wait.pop(node, None)

    def due(self, now: float, roster: Roster) -> list[Entry]:
        """Fellows whose pull failed or went unanswered and may be asked again."""
        if not self._wait:
            return []
        due: list[Entry] = []
        for node, at in list(self._wait.items()):
            e = roster.get(node)
            if e is None or e.announced_meta <= e.meta_version:
                del self._wait[node]
            elif at <= now and e.state in PRESENT:
                due.append(e)
        return due


__all__ = [
    "MetaPulls",
    "forget_old_life",
    "inline",
    "outdone",
    "take",
    "without_meta",
]
