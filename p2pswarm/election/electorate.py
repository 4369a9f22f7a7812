"""The electorate: the fellows a majority is counted against, and the membership view it
is kept from.

Each fellow keeps the set of fellows it has seen present (alive or suspect), itself
included, with when it last saw each. A fellow that leaves gracefully leaves the set at
once; a dead (or reaped) one stays for ``electorate_dead_after_s`` after it was last
seen, then leaves it too, and comes back only by being seen present. A restored entry
counts as seen at the restart."""

from __future__ import annotations

from collections.abc import Iterable

from p2pswarm.config import ElectionConfig
from p2pswarm.election.constants import INF, MAX_VOTERS, PRESENT
from p2pswarm.membership.member import Member


class Electorate:
    """One fellow's view of its fellows (``members``) and of who votes (``voters``:
    fellow -> when last seen present; restored ones: when restored)."""

    def __init__(self, node_id: bytes, config: ElectionConfig, now: float,
                 voters: Iterable[bytes]) -> None:
        self.node_id = node_id
        self.config = config
        self.members: dict[bytes, Member] = {}
        self.voters: dict[bytes, float] = {node_id: now}
        for v in voters:
            if len(self.voters) >= MAX_VOTERS:
                break
            self.voters[bytes(v)] = now
        self._kept: tuple[bytes, ...] | None = None  # kept()'s cache
        self._expired: dict[bytes, None] = {}  # dropped for being dead too long
        self._expiry_at: float | None = None  # next_expiry's cache
        self.arrived: list[Member] = []  # fellows that became present since the last feed

    # --- feeding the membership view -----------------------------------------------------

    def feed(self, members: Iterable[Member], now: float) -> None:
        """The whole membership view (this node included)."""
        new = {m.node_id: m for m in members}
        for m in new.values():
            self._note(self.members.get(m.node_id), m, now)
        for node in self.members.keys() - new.keys():
            self._note(self.members[node], None, now)
        self.members = new

    def feed_changes(self, changed: Iterable[Member], gone: Iterable[bytes],
                     now: float) -> None:
        """Only what changed since the last feed: new views, and ids no longer known."""
        members = self.members
        added = False
        for m in changed:
            old = members.get(m.node_id)
            added = added or old is None
            self._note(old, m, now)
            members[m.node_id] = m
        for node in gone:
            self._note(members.pop(node, None), None, now)
        if added:  # kept in node-id order, as a full view is
            self.members = dict(sorted(members.items()))

    def _note(self, old: Member | None, new: Member | None, now: float) -> None:
        """Every fellow known and not left is in the electorate; a fellow that is not
        present keeps the time it was last seen (or first heard of, dead), and one
        dropped for being dead too long comes back only by being seen present."""
        self._expiry_at = None
        if new is not None and new.state in PRESENT:
            self._expired.pop(new.node_id, None)
            self._add_voter(new.node_id, now)
            if (old is None or old.state not in PRESENT) and new.node_id != self.node_id:
                self.arrived.append(new)
        elif new is not None and new.state == "left" and new.node_id != self.node_id:
            if self.voters.pop(new.node_id, None) is not None:
                self._kept = None
        elif old is not None and old.state in PRESENT and old.node_id in self.voters:
            self.voters[old.node_id] = now  # dead or forgotten from now on
        elif new is not None and new.node_id not in self._expired:
            self._add_voter(new.node_id, now, refresh=False)  # heard of, dead

    def _add_voter(self, node: bytes, now: float, *, refresh: bool = True) -> None:
        if node in self.voters:
            if refresh:
                self.voters[node] = now
        elif len(self.voters) < MAX_VOTERS:
            self.voters[node] = now
            self._kept = None

    def expire(self, now: float) -> None:
        """Drop the fellows dead for longer than the bound from the electorate."""
        after = self.config.electorate_dead_after_s
        # (seen + after, as next_expiry sums it: now - after may round the other way,
        # and the alarm would ring again and again at the same instant)
        stale = [node for node, seen in self.voters.items() if seen + after <= now
                 and node != self.node_id and not self.is_present(node)]
        self._expiry_at = None
        for node in stale:
            del self.voters[node]
            self._expired[node] = None
        while len(self._expired) > MAX_VOTERS:
            del self._expired[next(iter(self._expired))]
        if stale:
            self._kept = None

    def next_expiry(self) -> float:
        """When the next absent fellow leaves the electorate (kept until the view moves:
        this is asked after every datagram)."""
        if self._expiry_at is None:
            after = self.config.electorate_dead_after_s
            self._expiry_at = min((seen + after for node, seen in self.voters.items()
                                   if node != self.node_id and not self.is_present(node)),
                                  default=INF)
        return self._expiry_at

    # --- views ---------------------------------------------------------------------------

    def kept(self) -> tuple[bytes, ...]:
        """The voters, sorted: what is kept across restarts."""
        if self._kept is None:
            self._kept = tuple(sorted(self.voters))
        return self._kept

    def size(self) -> int:
        """The denominator of a majority."""
        return len(self.voters)

    def present(self) -> int:
        """Fellows present (alive or suspect), this node included."""
        return sum(1 for m in self.members.values() if m.state in PRESENT)

    def is_present(self, node: bytes) -> bool:
        m = self.members.get(node)
        return m is not None and m.state in PRESENT

    def others(self) -> list[Member]:
        """The present fellows but this one."""
        return [m for m in self.members.values()
                if m.state in PRESENT and m.node_id != self.node_id]

    def name(self, node: bytes) -> str:
        m = self.members.get(node)
        return m.name if m is not None else node.hex()[:8]

    # --- the order of succession ---------------------------------------------------------

    def succession_rank(self, leader: bytes | None) -> int:
        """This node's place in the order of succession after ``leader``."""
        order = sorted((m for m in self.members.values()
                        if m.state in PRESENT and m.node_id != leader),
                       key=lambda m: (-m.priority, m.node_id))
        for i, m in enumerate(order):
            if m.node_id == self.node_id:
                return i
        return len(order)

    def succession_key(self, node: bytes, own_priority: int) -> tuple[int, bytes]:
        if node == self.node_id:
            return (-own_priority, node)
        m = self.members.get(node)
        return (-(m.priority if m is not None else 0), node)

    def deputies(self, count: int) -> list[Member]:
        """The first ``count`` alive fellows in the order of succession."""
        order = sorted((m for m in self.members.values()
                        if m.state == "alive" and m.node_id != self.node_id),
                       key=lambda m: (-m.priority, m.node_id))
        return order[:count]


__all__ = ["Electorate"]
