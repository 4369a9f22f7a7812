"""Anti-entropy: the periodic push-pull exchange of whole views over a stream.

Theory of operation. Every push-pull interval (longer past 32 fellows) this node sends one
random fellow the hash of its view over a stream; the same hash ends it. Otherwise the
fellow answers with one summary line per member, and this node sends the records the
other side lacks and asks for those it lacks (``compare``). Now and then the same goes to
a fellow held dead (or reaped), so both sides of a healed partition find each other
again. A join is the same exchange with a seed, asking for everything.

This keeps the exchange's schedule and compares summaries; the machine merges the records.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from p2pswarm.config import GossipConfig
from p2pswarm.membership.roster import Entry, Roster
from p2pswarm.membership.states import DEAD, PRESENT
from p2pswarm.membership.timing import push_pull_interval_s
from p2pswarm.wire.gossip import MemberSummary

if TYPE_CHECKING:  # a type only: the driver hands in its generator, seeded or not
    from random import Random


class AntiEntropy:
    __slots__ = ("_config", "_rng", "next_reconnect_at", "next_sync_at")

    def __init__(self, config: GossipConfig, rng: Random, now: float) -> None:
        self._config = config
        self._rng = rng
        self.next_sync_at = now + config.push_pull_interval_s * (0.5 + rng.random())
        self.next_reconnect_at = now + config.tuning.reconnect_interval_s * (
            0.5 + rng.random())

    def sync_target(self, now: float, roster: Roster) -> str | None:
        """Time for an exchange: the address of a random live fellow (None: none)."""
        interval = push_pull_interval_s(self._config.push_pull_interval_s, len(roster) + 1)
        self.next_sync_at = now + interval * (0.75 + 0.5 * self._rng.random())
        if not roster.live:
            return None
        node = self._rng.choice(roster.live)
        return roster.members[node].addr

    def reconnect_target(self, now: float, roster: Roster) -> str | None:
        """Time to try a fellow we hold dead (or reaped): if it is alive after all (a
        partition healed), the exchange tells each side about the other, and both
        converge. Its address, or None if there is nobody to try."""
        t = self._config.tuning
        self.next_reconnect_at = now + t.reconnect_interval_s * (0.75 + 0.5 * self._rng.random())
        horizon = now - t.reconnect_for_s
        lost = roster.lost
        for node in [n for n, (_, at) in lost.items() if at < horizon or n in roster.members]:
            del lost[node]
        addrs = [e.addr for e in roster.members.values() if e.state == DEAD]
        addrs += [addr for addr, _ in lost.values()]
        if not addrs:
            return None
        return addrs[self._rng.randrange(len(addrs))]


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


__all__ = ["AntiEntropy", "compare", "summaries"]
