"""Anti-entropy: the periodic push-pull exchange of whole views over a stream.

Theory of operation. Every push-pull interval (longer past 32 fellows) this node sends one
random fellow the hash of its view over a stream; the same hash ends it. Otherwise the
fellow answers with one summary line per member, and this node sends the records the
other side lacks and asks for those it lacks (``compare``). Now and then the same goes to
a fellow held dead (or reaped), so both sides of a healed partition find each other
again. A join is the same exchange with a seed, asking for everything.

This keeps the exchange's schedule, answers it, and takes in fellows' records; records of
this node itself are the machine's to answer (it may refute, or publish its metadata
again above an old life's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from p2pswarm.config import GossipConfig
from p2pswarm.effects import Effect, StreamRequest
from p2pswarm.membership.leave import LeaveHandshake
from p2pswarm.membership.metadata import MetadataBook, inline
from p2pswarm.membership.own import OwnRecord
from p2pswarm.membership.requests import StreamRequests
from p2pswarm.membership.roster import Entry, Roster
from p2pswarm.membership.states import ALIVE, DEAD, LEFT, PRESENT, SUSPECT
from p2pswarm.membership.timing import push_pull_interval_s
from p2pswarm.membership.updates import Updates
from p2pswarm.wire.gossip import (
    Alive,
    Left,
    MemberRecord,
    MemberSummary,
    Suspect,
    SyncDigest,
    SyncRecords,
    SyncSame,
    SyncSummary,
)

if TYPE_CHECKING:  # a type only: the driver hands in its generator, seeded or not
    from p2pswarm.randomness import Rng


class AntiEntropy:
    __slots__ = ("_book", "_config", "_leave", "_own", "_requests", "_rng", "_roster",
                 "_updates", "next_reconnect_at", "next_sync_at")

    def __init__(self, config: GossipConfig, rng: Rng, own: OwnRecord, leave: LeaveHandshake,
                 roster: Roster, requests: StreamRequests, updates: Updates, book: MetadataBook,
                 *, next_sync_at: float, next_reconnect_at: float) -> None:
        self._config = config
        self._rng = rng
        self._own = own
        self._leave = leave
        self._roster = roster
        self._requests = requests
        self._updates = updates
        self._book = book
        self.next_sync_at = next_sync_at
        self.next_reconnect_at = next_reconnect_at

    # --- what we hold ------------------------------------------------------------------

    def digest(self) -> bytes:
        """SHA-256 over (id, incarnation, state, metadata version) of every member."""
        return self._roster.digest(self._own.row(self._leave.leaving))

    def summaries(self) -> tuple[MemberSummary, ...]:
        return summaries(self._own.summary(self._leave.leaving), self._roster.members.values())

    def record(self, node: bytes) -> MemberRecord | None:
        if node == self._own.local.node_id:
            return self._own.record(self._leave.leaving)
        e = self._roster.get(node)
        return None if e is None else e.record()

    def all_records(self) -> tuple[MemberRecord, ...]:
        out = [self._own.record(self._leave.leaving)]
        out.extend(r for r in (self.record(n) for n in self._roster.members) if r is not None)
        return tuple(out)

    def _request(self, addr: str, msg: Any, now: float, out: list[Effect]) -> None:
        rid = self._requests.new("sync", addr, None, now)
        out.append(StreamRequest(addr, msg, rid))

    def _digest_msg(self) -> SyncDigest:
        return SyncDigest(self._own.local.node_id, self.digest(), len(self._roster) + 1)

    # --- the exchange ------------------------------------------------------------------

    def start(self, now: float, out: list[Effect]) -> None:
        """Time for an exchange with a random live fellow."""
        roster = self._roster
        interval = push_pull_interval_s(self._config.push_pull_interval_s, len(roster) + 1)
        self.next_sync_at = now + interval * (0.75 + 0.5 * self._rng.random())
        self._requests.expire(now)
        if not roster.live:
            return
        node = self._rng.choice(roster.live)
        self._request(roster.members[node].addr, self._digest_msg(), now, out)

    def reconnect(self, now: float, out: list[Effect]) -> None:
        """Time to try a fellow we hold dead (or reaped): if it is alive after all (a
        partition healed), the exchange tells each side about the other, and both
        converge."""
        t = self._config.tuning
        roster = self._roster
        self.next_reconnect_at = now + t.reconnect_interval_s * (0.75 + 0.5 * self._rng.random())
        horizon = now - t.reconnect_for_s
        lost = roster.lost
        for node in [n for n, (_, at) in lost.items() if at < horizon or n in roster.members]:
            del lost[node]
        addrs = [e.addr for e in roster.members.values() if e.state == DEAD]
        addrs += [addr for addr, _ in lost.values()]
        if not addrs:
            return
        addr = addrs[self._rng.randrange(len(addrs))]
        self._request(addr, self._digest_msg(), now, out)

    def answer_digest(self, msg: SyncDigest) -> SyncSame | SyncSummary:
        """A fellow's digest: the same ends it; otherwise our summary lines."""
        if msg.digest == self.digest():
            return SyncSame()
        return SyncSummary(self.summaries())

    def answer_records(self, msg: SyncRecords) -> SyncRecords:
        """After taking in a fellow's records: everything if it asked for everything (a
        join), else what it asked for, and always our own (we may have just refuted)."""
        own = self._own.local.node_id
        if msg.want_all:
            records = self.all_records()
        else:
            wanted = [n for n in msg.want if n != own]
            records = (self._own.record(self._leave.leaving),) + tuple(
                r for r in (self.record(n) for n in wanted) if r)
        return SyncRecords(own, records)

    def on_summary(self, msg: SyncSummary, addr: str, now: float, out: list[Effect]) -> None:
        """The fellow's summary: send what it lacks, ask for what we lack."""
        send_nodes, want = compare(self.summaries(), msg.entries)
        send = [r for r in (self.record(n) for n in send_nodes) if r is not None]
        if send or want:
            self._request(addr, SyncRecords(self._own.local.node_id, tuple(send), tuple(want)),
                          now, out)

    def merge(self, r: MemberRecord, source: bytes, now: float, out: list[Effect]) -> None:
        """Take in a fellow's record (not this node's), as ``source`` holds it."""
        node = r.node
        updates = self._updates
        if r.state == ALIVE:  # small metadata inside: merged before a pull is asked
            carried = inline(r.metadata, r.meta_signature, self._config.tuning.meta_inline_bytes) \
                if r.meta_version == r.alive_meta_version else (b"", None)
            updates.alive(Alive(node, r.incarnation, r.name, r.addr, r.public_key,
                                r.alive_meta_version, r.priority, *carried, r.alive_epoch,
                                r.alive_signature, r.certificate), "", now, out)
        elif r.state == LEFT:
            updates.left(Left(node, r.incarnation, r.left_signature), now, out)
        else:  # a remote verdict of dead is only a suspicion here (as memberlist)
            if self._roster.get(node) is None and r.state == SUSPECT:
                updates.alive(record_alive(r), "", now, out)
            updates.suspect(Suspect(node, r.incarnation, source or node), now, out)
        self._book.merge(node, r.public_key, r.meta_version, r.metadata, r.meta_signature,
                         out, r.alive_epoch)


def record_alive(r: MemberRecord) -> Alive:
    """The owner's signed Alive a record carries (no metadata inline)."""
    return Alive(r.node, r.incarnation, r.name, r.addr, r.public_key, r.alive_meta_version,
                 r.priority, b"", None, r.alive_epoch, r.alive_signature, r.certificate)


def summaries(own: MemberSummary, entries: Iterable[Entry]) -> tuple[MemberSummary, ...]:
    """One summary line per member, this node's ``own`` first."""
    rows = [own]
    rows.extend(MemberSummary(e.node, e.incarnation, e.state, e.meta_version)
                for e in entries)
    return tuple(rows)


def compare(mine: Sequence[MemberSummary],
            theirs: Sequence[MemberSummary]) -> tuple[list[bytes], list[bytes]]:
    """(the nodes whose records to send, the nodes whose records to ask for): what the
    other side lacks or holds older, and what it holds newer or we lack."""
    by_node = {s.node: s for s in theirs}
    send: list[bytes] = []
    want: list[bytes] = []
    for s in mine:
        t = by_node.pop(s.node, None)
        if t is None:
            if s.state in PRESENT:
                send.append(s.node)
            continue
        if (s.incarnation, s.state) > (t.incarnation, t.state) or \
                s.meta_version > t.meta_version:
            send.append(s.node)
        if (t.incarnation, t.state) > (s.incarnation, s.state) or \
                t.meta_version > s.meta_version:
            want.append(s.node)
    for node, t in by_node.items():
        if t.state in PRESENT:
            want.append(node)
    return send, want


__all__ = ["AntiEntropy", "compare", "record_alive", "summaries"]
