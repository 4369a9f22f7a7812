"""The roster: what this node holds of every fellow (memberlist's ``state.go`` node map).

One ``Entry`` per fellow this node knows, this node not included. Beside the entries the
roster keeps the views the other parts probe and gossip by:

- the ring: every known node id (this node's too), sorted; a probe goes to this node's
  first or second live successor on it;
- the live set (alive or suspect) as a list with positions, so that a random pick and a
  removal are both O(1);
- the round-robin order: the live set shuffled once per round, a newcomer slotted in at a
  random place in the rest of the round;
- the reaps: a heap of (when, node) for fellows dead or left, forgotten after
  ``dead_reap_after_s``; the recently dead (gossip sends them news now and then, as they
  may refute) and the lost (reaped dead, tried again by anti-entropy now and then);
- the versions: ``version`` bumps on every change a view would show, ``roster_version``
  when who is in, where, in what state changes (an election's feed), with the ids that
  changed since the last ``take_changes``; and the digest of the view, cached until the
  next change.

Randomness comes from the machine's injected generator, drawn in the same order as ever.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from bisect import bisect_left, bisect_right, insort
from typing import TYPE_CHECKING

from p2pswarm.membership.member import STATE_NAMES, Member
from p2pswarm.membership.states import DEAD, GONE, PRESENT
from p2pswarm.wire.gossip import Alive, MemberRecord

if TYPE_CHECKING:  # a type only: the driver hands in its generator, seeded or not
    from p2pswarm.randomness import Rng


class Entry:
    __slots__ = (
        "addr",
        "alive_epoch",
        "alive_meta_version",
        "alive_signature",
        "announced_meta",
        "certificate",
        "incarnation",
        "last_heard",
        "left_signature",
        "meta_signature",
        "meta_version",
        "metadata",
        "name",
        "node",
        "priority",
        "public_key",
        "state",
        "state_at",
    )

    def __init__(self, node: bytes, name: str, addr: str, public_key: bytes, priority: int,
                 incarnation: int, state: int, now: float) -> None:
        self.node = node
        self.name = name
        self.addr = addr
        self.public_key = public_key
        self.priority = priority
        self.incarnation = incarnation
        self.state = state
        self.state_at = now
        self.announced_meta = 0
        self.meta_version = 0
        self.metadata = b""
        self.meta_signature: bytes | None = None
        self.last_heard: float | None = None
        # the owner's signed Alive at ``incarnation`` (what records and relays carry)
        self.alive_meta_version = 0
        self.alive_epoch = 0
        self.alive_signature: bytes | None = None
        self.certificate = b""  # its admission, as its Alive carried it
        self.left_signature: bytes | None = None  # its own goodbye, once it left

    def signed(self, msg: Alive) -> None:
        self.alive_meta_version = msg.meta_version
        self.alive_epoch = msg.epoch
        self.alive_signature = msg.signature
        if msg.certificate:  # relays leave it out; the one admitted with stays
            self.certificate = msg.certificate

    def alive(self, metadata: tuple[bytes, bytes | None] = (b"", None)) -> Alive:
        """The owner's Alive as it signed it, with ``metadata`` riding along."""
        return Alive(self.node, self.incarnation, self.name, self.addr, self.public_key,
                     self.alive_meta_version, self.priority, *metadata, self.alive_epoch,
                     self.alive_signature, self.certificate)

    def view(self) -> Member:
        return Member(self.node, self.name, self.addr, STATE_NAMES[self.state],
                      self.incarnation, self.metadata, self.meta_version, self.announced_meta,
                      self.last_heard, self.state_at, self.priority, self.public_key)

    def record(self) -> MemberRecord:
        return MemberRecord(self.node, self.incarnation, self.state, self.name, self.addr,
                            self.public_key, self.priority, self.meta_version, self.metadata,
                            self.meta_signature, self.alive_meta_version, self.alive_epoch,
                            self.alive_signature, self.certificate, self.left_signature)


class Roster:
    """The fellows this node knows, with the ring, live set, order, reaps and versions."""

    __slots__ = (
        "_digest",
        "_dirty",
        "_order",
        "_order_i",
        "_reaps",
        "_ring",
        "live",
        "live_pos",
        "lost",
        "members",
        "node_id",
        "recent_dead",
        "rng",
        "roster_version",
        "version",
    )

    def __init__(self, node_id: bytes, rng: Rng) -> None:
        self.node_id = node_id
        self.rng = rng
        self.members: dict[bytes, Entry] = {}
        self.live: list[bytes] = []
        self.live_pos: dict[bytes, int] = {}
        self._ring: list[bytes] = [node_id]
        self._order: list[bytes] = []
        self._order_i = 0
        self._reaps: list[tuple[float, bytes]] = []
        self.recent_dead: dict[bytes, float] = {}
        self.lost: dict[bytes, tuple[str, float]] = {}  # reaped dead: (addr, when), to retry
        self._dirty: set[bytes] = {node_id}  # for take_changes()
        self._digest: bytes | None = None
        self.version = 0  # bumps on every change a view would show
        self.roster_version = 0  # bumps when who is in, where, in what state changes

    def get(self, node: bytes) -> Entry | None:
        return self.members.get(node)

    def __len__(self) -> int:
        """Fellows known, this node not counted."""
        return len(self.members)

    # --- who is in -----------------------------------------------------------------------

    def add(self, e: Entry) -> None:
        self.members[e.node] = e
        insort(self._ring, e.node)
        if e.state in PRESENT:
            self.live_add(e.node)
            # a newcomer gets a random place in the rest of this round
            lo = self._order_i
            self._order.insert(self.rng.randint(lo, len(self._order)), e.node)

    def live_add(self, node: bytes) -> None:
        if node not in self.live_pos:
            self.live_pos[node] = len(self.live)
            self.live.append(node)

    def live_remove(self, node: bytes) -> None:
        i = self.live_pos.pop(node, None)
        if i is None:
            return
        last = self.live.pop()
        if last != node:
            self.live[i] = last
            self.live_pos[last] = i

    # --- reaping -------------------------------------------------------------------------

    def schedule_reap(self, at: float, node: bytes) -> None:
        heapq.heappush(self._reaps, (at, node))

    def next_reap_at(self) -> float | None:
        return self._reaps[0][0] if self._reaps else None

    def due_reaps(self, now: float) -> list[bytes]:
        """The nodes whose reap time has come, taken off the heap in order."""
        due: list[bytes] = []
        while self._reaps and self._reaps[0][0] <= now:
            due.append(heapq.heappop(self._reaps)[1])
        return due

    def reap(self, node: bytes, now: float, after_s: float, max_lost: int) -> Entry | None:
        """Forget ``node`` if it has been dead or left for ``after_s``; its entry if so. A
        dead fellow may be alive behind a partition: it is kept among the lost (at most
        ``max_lost``), to be tried again."""
        e = self.members.get(node)
        if e is None or e.state not in GONE:
            return None
        if now < e.state_at + after_s:
            return None
        del self.members[node]
        if e.state == DEAD:
            self.lost[node] = (e.addr, now)
            while len(self.lost) > max_lost:
                del self.lost[next(iter(self.lost))]
        i = bisect_left(self._ring, node)
        if i < len(self._ring) and self._ring[i] == node:
            del self._ring[i]
        self.recent_dead.pop(node, None)
        return e

    def remove(self, node: bytes) -> Entry | None:
        """Forget ``node`` now, whatever its state (revoked: not kept among the lost)."""
        e = self.members.pop(node, None)
        if e is None:
            return None
        self.live_remove(node)
        i = bisect_left(self._ring, node)
        if i < len(self._ring) and self._ring[i] == node:
            del self._ring[i]
        self.recent_dead.pop(node, None)
        self.lost.pop(node, None)
        return e

    # --- picking -------------------------------------------------------------------------

    def successor(self, nth: int = 1) -> bytes | None:
        """The ``nth`` live fellow after this node on the ring of node ids."""
        ring = self._ring
        n = len(ring)
        i = bisect_right(ring, self.node_id)
        found = None
        for k in range(n - 1):
            node = ring[(i + k) % n]
            if node in self.live_pos:
                found = node
                nth -= 1
                if nth == 0:
                    break
        return found

    def round_robin(self) -> bytes | None:
        for _ in range(2):
            while self._order_i < len(self._order):
                node = self._order[self._order_i]
                self._order_i += 1
                if node in self.live_pos:
                    return node
            self._order = list(self.live)
            self.rng.shuffle(self._order)
            self._order_i = 0
        return None

    def sample_live(self, k: int) -> list[bytes]:
        live = self.live
        if len(live) <= k:
            return list(live)
        return self.rng.sample(live, k)

    # --- versions ------------------------------------------------------------------------

    def changed(self, node: bytes, roster: bool = True) -> None:
        """Something a view shows changed; ``roster``: ``node``'s presence, state, name,
        address or priority (what an election reads), not just metadata or incarnation."""
        self._digest = None
        self.version += 1
        if roster:
            self.roster_version += 1
            self._dirty.add(node)

    def take_changes(self) -> list[bytes]:
        """The ids whose roster view changed since the last call, sorted."""
        dirty, self._dirty = self._dirty, set()
        return sorted(dirty)

    def digest(self, own: tuple[bytes, int, int, int]) -> bytes:
        """SHA-256 over (id, incarnation, state, metadata version) of every member, this
        node's ``own`` row included; cached until the next change."""
        if self._digest is None:
            h = hashlib.sha256()
            rows = [own]
            rows.extend((e.node, e.incarnation, e.state, e.meta_version)
                        for e in self.members.values())
            rows.sort()
            for node, inc, state, meta in rows:
                h.update(node)
                h.update(struct.pack(">IBI", inc, state, meta))
            self._digest = h.digest()
        return self._digest


__all__ = ["Entry", "Roster"]
