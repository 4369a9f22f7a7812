"""gossip_lab: many membership + election machines on a simulated network, fast.

Theory of operation. No trio, no sockets, no clock: one heap of timed events and a
virtual ``now``. Each node is a ``Membership`` and an ``Election`` machine; after every
call the lab executes the effects they return and schedules the node's next wake-up at
the earlier of the two ``next_deadline()``s. Datagrams carry the message objects
themselves (no encoding, unless byte counting is on), so a simulated hour of 50 fellows
takes seconds.

The network. The models are MemoryNetwork's, from ``p2pswarm.transport.netmodel``; the
lab only keeps their state. Each datagram's fate is decided when it is sent: per-link
``Bernoulli`` loss; each node's radio, a Gilbert-Elliott chain in TIME
(``GilbertElliott``: fraction of time bad, mean fade length in seconds, exponential or
heavy-tailed), which loses what its node sends while bad and what arrives while bad;
partitions; downed (crashed) nodes; a ``UniformDelay``. The radio's fades are drawn ahead
as switch times (``Radio``, netmodel's ``FadeTimeline``), so the lab can ask "was it bad
then, and for how long?" when it judges a verdict (``longest_outage_s``).

Streams (anti-entropy, joins, stream pings, metadata pulls, pushed refutations) are
reliable but not free: a request/reply is six one-way legs (TCP connect, secure
handshake, request, reply), each sent again on netmodel's ``Retransmission`` timer while
a leg is lost (the same link and radio models decide), and given up after
``stream_timeout_s``, when the requester gets ``stream_failed``. The timers are TCP's
(``RTO_SYN_S`` for the connect legs, doubling, capped at ``RTO_MAX_S``) except one: the
lab's legs after the connect start at ``stream_rto_s`` = 0.25 s (``LAB_STREAM_RTO_S``),
not TCP's 0.2 s, because the lab's figures were measured with it; it is a parameter.
(The lab once capped the timer at 3 s: with ``stream_timeout_s`` up to 6.75 s, the
default 5 s included, no leg lives long enough for a cap under 4 s to act, so TCP's 60 s
cap gives the same runs.)

Determinism. One seed derives every generator (one per node, one for the network, one
per radio); the heap key is (time, sequence number), and nothing iterates a set, so the
same seed gives the same run. Every ``Event`` effect (membership and election) is folded
into a SHA-256 (``trace_hash``) as it happens.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from p2pswarm.config import ElectionConfig, SwarmConfig, lan, preset, replace
from p2pswarm.election import Election
from p2pswarm.membership import (
    Event,
    LocalNode,
    Membership,
    SendDatagram,
    StreamRequest,
    node_id_of,
)
from p2pswarm.membership.gate import AdmissionGate
from p2pswarm.security.admission import AdminKey, Certificate
from p2pswarm.transport.netmodel import (
    RTO_MAX_S,
    RTO_SYN_S,
    Bernoulli,
    FadeTimeline,
    GilbertElliott,
    LossState,
    Retransmission,
    UniformDelay,
    is_lost,
)
from p2pswarm.wire.codec import encode
from p2pswarm.wire.gossip import Alive, is_election

_WAKE, _DGRAM, _STREAM_AT_SERVER, _STREAM_REPLY, _STREAM_FAILED, _ACTION = range(6)
_INF = float("inf")
SEAL_OVERHEAD_BYTES = 60  # AEAD tag, nonce, sender id and epoch around every datagram
FRAME_OVERHEAD_BYTES = 40  # per stream frame (length, AEAD tag)
HANDSHAKE_BYTES = 400  # both directions of a stream's secure handshake
SPIN_LIMIT = 1000  # ticks of one node at one instant before the lab calls it a livelock
LAB_STREAM_RTO_S = 0.25  # the first retransmission timer of a leg after the TCP connect

Radio = FadeTimeline  # a node's radio: its Gilbert-Elliott fades, drawn ahead


class RandomDraws(random.Random):
    """A ``random.Random`` with the models' draws, each from the standard library's own
    (``expovariate``, ``gauss``): a seeded lab's generator, same stream as before."""

    def chance(self, probability: float) -> bool:
        # No draw for 0 and 1, as with SplitMixRng.
        if probability <= 0.0:
            return False
        return probability >= 1.0 or self.random() < probability

    def exponential(self, mean: float) -> float:
        return self.expovariate(1.0 / mean)

    def normal(self) -> float:
        return self.gauss(0.0, 1.0)

    def pareto(self, alpha: float) -> float:
        """Pareto with minimum 1 and tail index ``alpha``."""
        return math.pow(1.0 - self.random(), -1.0 / alpha)


PROPOSED_ELECTION = {
    # Deputies notice a silent leader after election_timeout_min_s (3 missed beats on
    # WiFi); keeping it short is what makes failover fast, and safe because voters
    # check the leader themselves before they grant.
    "lan": ElectionConfig(election_timeout_min_s=1.5, election_timeout_max_s=3.0,
                          heartbeat_interval_s=0.5, leader_lease_s=4.0),
    "wifi": ElectionConfig(election_timeout_min_s=1.5, election_timeout_max_s=3.0,
                           heartbeat_interval_s=0.5, leader_lease_s=6.0),
    "local": ElectionConfig(election_timeout_min_s=0.6, election_timeout_max_s=1.2,
                            heartbeat_interval_s=0.2, leader_lease_s=2.0),
}


LAB_EXPIRY_S = 10**9  # certificates in the lab hold for its whole (virtual) time


def proposed(name: str) -> SwarmConfig:
    """A preset with the election timings this simulation was tuned with (the gossip
    timings are the presets' own)."""
    return replace(preset(name), election=PROPOSED_ELECTION[name])


def fake_keys(seed: int, index: int) -> tuple[bytes, bytes]:
    """A deterministic stand-in identity: (public_key, node_id)."""
    public_key = hashlib.sha256(f"lab-{seed}-{index}".encode()).digest()
    return public_key, node_id_of(public_key)


def fake_sign_for(public_key: bytes) -> Callable[[bytes], bytes]:
    """A structural stand-in for Ed25519 (not secure): 64 bytes bound to key and data."""
    def sign(data: bytes) -> bytes:
        return hashlib.sha512(public_key + data).digest()
    return sign


def fake_verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    return hashlib.sha512(public_key + data).digest() == signature


@dataclass
class LabNode:
    index: int
    name: str
    addr: str
    public_key: bytes
    node_id: bytes
    priority: int
    rng: random.Random
    membership: Membership
    election: Election | None
    radio: Radio | None = None
    up: bool = True
    proc: int = 0  # bumps on restart: replies to the old process are dropped
    group: int | None = None
    wake_at: float = _INF
    wake_gen: int = 0
    seen_version: int = -1
    left: bool = False
    crashed_at: float | None = None
    last_tick_at: float = -1.0
    ticks_at_once: int = 0  # ticks in a row at the same instant (a machine that spins)
    sent_datagrams: int = 0
    sent_bytes: int = 0
    stream_bytes: int = 0


@dataclass
class Oracle:
    """What the lab saw: verdicts judged against the truth."""

    merge_gap_s: float = 0.0
    false_dead: list[tuple[float, int, int, float]] = field(default_factory=list)
    false_suspect_first_hand: int = 0  # a node's own probe made it suspect a live fellow
    suspect_events: int = 0
    # (subject, when it crashed, observer) -> seconds from the crash to the observer's verdict
    dead_learned: dict[tuple[int, float, int], float] = field(default_factory=dict)
    elected: dict[int, list[int]] = field(default_factory=dict)  # term -> winners
    leader_changes: int = 0


class GossipLab:
    """N fellows on a simulated network. See the module docstring."""

    def __init__(
        self,
        n: int,
        *,
        seed: int = 0,
        config: SwarmConfig | None = None,
        link_loss: float = 0.0,
        radio: GilbertElliott | None = None,
        delay_s: tuple[float, float] = (0.001, 0.004),
        election: bool = True,
        priorities: dict[int, int] | None = None,
        measure_bytes: bool = False,
        stream_timeout_s: float = 5.0,
        keep_trace: bool = False,
        merge_gap_s: float = 0.0,
        handshake_rto_s: float = RTO_SYN_S,
        stream_rto_s: float = LAB_STREAM_RTO_S,
        max_rto_s: float = RTO_MAX_S,
        admission: bool = False,
    ) -> None:
        self.seed = seed
        # admission: an admin key (deterministic from the seed) certifies every node under
        # one invitation of n uses; each membership checks certificates (``gate``)
        self.admin: AdminKey | None = None
        if admission:
            self.admin = AdminKey.from_private_bytes(
                hashlib.sha256(f"lab-admin-{seed}".encode()).digest())
            self.invitation = self.admin.invite(hashlib.sha256(
                f"lab-invitation-{seed}".encode()).digest()[:16], max(1, n), LAB_EXPIRY_S,
                max_priority=max((priorities or {}).values(), default=0))
        self.certificates: dict[int, bytes] = {}
        self.config = config or lan()
        self.link = Bernoulli(link_loss)
        self._link_state = LossState()
        self.radio_model = radio
        self.delay_s = delay_s
        self.delay = UniformDelay(*delay_s)
        self.handshake_timer = Retransmission(handshake_rto_s, max_rto_s)
        self.stream_timer = Retransmission(stream_rto_s, max_rto_s)
        self.use_election = election
        self.measure_bytes = measure_bytes
        self.stream_timeout_s = stream_timeout_s
        self.keep_trace = keep_trace
        self.now = 0.0
        self._master = random.Random(seed)
        self._net = RandomDraws(self._master.getrandbits(64))
        self._heap: list[tuple[float, int, int, Any, Any, Any]] = []
        self._seq = 0
        self._hash = hashlib.sha256()
        self.trace: list[str] = []
        self.listeners: list[Callable[[float, LabNode, Event], None]] = []
        self.oracle = Oracle(merge_gap_s=merge_gap_s)
        self.nodes: list[LabNode] = []
        self._by_addr: dict[str, LabNode] = {}
        self._by_id: dict[bytes, LabNode] = {}
        self.events_processed = 0
        priorities = priorities or {}
        for i in range(n):
            self._add_node(i, priorities.get(i, 0))

    # --- building ----------------------------------------------------------------------

    def _add_node(self, i: int, priority: int) -> LabNode:
        public_key, node_id = fake_keys(self.seed, i)
        addr = f"10.{i // 250}.{i % 250}.1:7946"
        rng = random.Random(self._master.getrandbits(64))
        node = LabNode(i, f"n{i:03d}", addr, public_key, node_id, priority, rng,
                       self._new_membership(i, addr, public_key, node_id, priority, rng), None)
        node.election = self._new_election(node)
        if self.radio_model is not None:
            node.radio = Radio(self.radio_model, RandomDraws(self._master.getrandbits(64)))
        self.nodes.append(node)
        self._by_addr[addr] = node
        self._by_id[node_id] = node
        return node

    def _new_membership(self, i: int, addr: str, public_key: bytes, node_id: bytes,
                        priority: int, rng: random.Random) -> Membership:
        gate = None
        certificate = b""
        if self.admin is not None:
            if i not in self.certificates:
                self.certificates[i] = Certificate.issue(
                    self.admin.identity, self.invitation, public_key, f"n{i:03d}",
                    i % self.invitation.uses, 0, LAB_EXPIRY_S, max_priority=priority).encode()
            certificate = self.certificates[i]
            gate = AdmissionGate(self.admin.public_key)
        local = LocalNode(node_id, f"n{i:03d}", addr, public_key, priority, certificate)
        return Membership(local, self.config.gossip, rng, sign=fake_sign_for(public_key),
                          verify=fake_verify, now=self.now,
                          datagram_budget_bytes=self.config.transport.max_datagram_bytes
                          - SEAL_OVERHEAD_BYTES, admission=gate)

    def _new_election(self, node: LabNode, term: int = 0, voted_for: bytes | None = None,
                      electorate: tuple[bytes, ...] = ()) -> Election | None:
        if not self.use_election:
            return None
        return Election(node.node_id, node.name, self.config.election, node.rng,
                        leader_priority=node.priority, now=self.now, term=term,
                        voted_for=voted_for, voters=electorate)

    def start(self, *, converged: bool = False, seed_index: int = 0,
              stagger_s: float = 0.0) -> None:
        """Start every node. ``converged``: everyone already knows everyone (quietly, no
        gossip), as after a long calm; otherwise node ``seed_index`` founds the swarm and
        the others join through it, ``stagger_s`` apart."""
        if converged:
            records = [n.membership.self_record() for n in self.nodes]
            for node in self.nodes:
                self._call(node, node.membership.join((), self.now))
                node.membership.merge_records(
                    [r for r in records if r.node != node.node_id], self.now, quiet=True)
                self._call(node, [])
            return
        seed_addr = self.nodes[seed_index].addr
        for node in self.nodes:
            seeds = () if node.index == seed_index else (seed_addr,)
            at = self.now + (0.0 if node.index == seed_index else stagger_s * node.index)
            self.at(at, functools.partial(self._join, node, seeds))

    def _join(self, node: LabNode, seeds: tuple[str, ...]) -> None:
        self._call(node, node.membership.join(seeds, self.now))

    # --- scenario actions --------------------------------------------------------------

    def at(self, t: float, action: Callable[[], None]) -> None:
        self._push(t, _ACTION, action, None, None)

    def crash(self, i: int) -> None:
        node = self.nodes[i]
        node.up = False
        node.crashed_at = self.now
        node.wake_gen += 1
        node.wake_at = _INF

    def restart(self, i: int, seeds: Iterable[str] | None = None) -> None:
        """Bring a crashed node back as a fresh process with the same identity."""
        node = self.nodes[i]
        term, voted, electorate = (node.election.persistent_state() if node.election
                                   else (0, None, ()))
        node.proc += 1
        node.up = True
        node.left = False
        node.crashed_at = None
        node.membership = self._new_membership(i, node.addr, node.public_key, node.node_id,
                                               node.priority, node.rng)
        node.election = self._new_election(node, term, voted, electorate)
        node.seen_version = -1
        if seeds is None:
            seeds = [n.addr for n in self.nodes if n.up and not n.left and n is not node][:1]
        self._call(node, node.membership.join(tuple(seeds), self.now))

    def leave(self, i: int, linger_s: float = 2.0) -> None:
        node = self.nodes[i]
        effects = node.membership.leave(self.now)
        if node.election is not None:
            effects += node.election.leave(self.now)
        node.left = True
        self._call(node, effects)
        self.at(self.now + linger_s, lambda: self._stop(node))

    def _stop(self, node: LabNode) -> None:
        node.up = False
        node.wake_gen += 1
        node.wake_at = _INF

    def set_metadata(self, i: int, data: bytes) -> None:
        node = self.nodes[i]
        self._call(node, node.membership.set_metadata(data, self.now))

    def partition(self, *groups: Iterable[int]) -> None:
        for g, members in enumerate(groups):
            for i in members:
                self.nodes[i].group = g

    def heal(self) -> None:
        for node in self.nodes:
            node.group = None

    def set_radio(self, i: int, model: GilbertElliott | None) -> None:
        node = self.nodes[i]
        node.radio = None if model is None else Radio(model, RandomDraws(
            self._master.getrandbits(64)))

    # --- running -----------------------------------------------------------------------

    def run_until(self, t_end: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= t_end:
            t, _, kind, a, b, c = heapq.heappop(heap)
            self.now = t
            self.events_processed += 1
            if kind == _WAKE:
                node = a
                if b != node.wake_gen or not node.up:
                    continue
                node.wake_at = _INF
                self._tick(node)
            elif kind == _DGRAM:
                node = a
                if node.up:
                    self._deliver(node, b, c)
            elif kind == _STREAM_AT_SERVER:
                self._serve_stream(a, b, c)
            elif kind == _STREAM_REPLY:
                node, proc, rid = a
                if node.up and node.proc == proc:
                    self._call(node, node.membership.handle_reply(rid, b, self.now))
            elif kind == _STREAM_FAILED:
                node, proc, rid = a
                if node.up and node.proc == proc:
                    self._call(node, node.membership.stream_failed(rid, self.now))
            else:
                a()
        self.now = max(self.now, t_end)
        if self.radio_model is not None and int(t_end) % 60 == 0:
            for node in self.nodes:
                if node.radio is not None:
                    node.radio.prune(t_end - 120.0)

    def run_for(self, dt: float) -> None:
        self.run_until(self.now + dt)

    def _push(self, t: float, kind: int, a: Any, b: Any, c: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b, c))

    def _tick(self, node: LabNode) -> None:
        now = self.now
        if now == node.last_tick_at:
            node.ticks_at_once += 1
            if node.ticks_at_once > SPIN_LIMIT:
                raise RuntimeError(
                    f"{node.name} asks to be woken at {now:.6f} s again and again: membership "
                    f"deadline {node.membership.next_deadline()}, election deadline "
                    f"{node.election.next_deadline() if node.election else None}")
        else:
            node.last_tick_at, node.ticks_at_once = now, 0
        effects = node.membership.tick(now)
        if node.election is not None:
            effects += node.election.tick(now)
        self._call(node, effects)

    def _deliver(self, node: LabNode, msgs: tuple[Any, ...], src_addr: str) -> None:
        now = self.now
        election_msgs = [m for m in msgs if is_election(m)]
        if election_msgs:
            member_msgs = [m for m in msgs if not is_election(m)]
            effects = node.membership.handle_datagram(member_msgs, src_addr, now) \
                if member_msgs else []
            if node.election is not None:
                for m in election_msgs:
                    effects += node.election.handle(m, src_addr, now)
        else:
            effects = node.membership.handle_datagram(msgs, src_addr, now)
        self._call(node, effects)

    def _call(self, node: LabNode, effects: list[Any]) -> None:
        """Execute effects, keep the election fed, reschedule the node's wake-up."""
        while True:
            for effect in effects:
                t = type(effect)
                if t is SendDatagram:
                    self._send(node, effect.addr, effect.messages)
                elif t is StreamRequest:
                    self._request(node, effect)
                elif t is Event:
                    self._record(node, effect)
            effects = self._after(node)
            if not effects:
                break
        self._reschedule(node)

    def _after(self, node: LabNode) -> list[Any]:
        m = node.membership
        if node.election is None or m.roster_version == node.seen_version:
            return []
        node.seen_version = m.roster_version
        changed, gone = m.roster_changes()
        return node.election.update_changed(changed, gone, self.now, joined=m.joined)

    def _reschedule(self, node: LabNode) -> None:
        if not node.up:
            return
        d = node.membership.next_deadline()
        if node.election is not None:
            e = node.election.next_deadline()
            if e is not None and (d is None or e < d):
                d = e
        if d is None:
            return
        d = max(d, self.now)
        if d != node.wake_at:
            node.wake_at = d
            node.wake_gen += 1
            self._push(d, _WAKE, node, node.wake_gen, None)

    # --- the network -------------------------------------------------------------------

    def reachable(self, a: LabNode, b: LabNode) -> bool:
        return a.group == b.group

    def _datagram_lost(self, src: LabNode, dst: LabNode, t_send: float, t_arrive: float) -> bool:
        if not dst.up or src.group != dst.group:
            return True
        if is_lost(self._link_state, self.link, self._net, t_send):
            return True
        if src.radio is not None and src.radio.lost_at(t_send):
            return True
        return dst.radio is not None and dst.radio.lost_at(t_arrive)

    def _delay(self) -> float:
        return self.delay.sample_s(self._net)

    def _send(self, src: LabNode, addr: str, msgs: tuple[Any, ...]) -> None:
        dst = self._by_addr.get(addr)
        src.sent_datagrams += 1
        if self.measure_bytes:
            src.sent_bytes += len(encode(*msgs)) + SEAL_OVERHEAD_BYTES
        if dst is None or dst is src:
            return
        arrive = self.now + self._delay()
        if self._datagram_lost(src, dst, self.now, arrive):
            return
        self._push(arrive, _DGRAM, dst, msgs, src.addr)

    def _leg(self, a: LabNode, b: LabNode, t: float, timer: Retransmission,
             give_up: float) -> float | None:
        """When a one-way stream packet sent at ``t`` gets through (retransmitted)."""
        def attempt(at: float) -> float | None:
            arrive = at + self._delay()
            return None if self._datagram_lost(a, b, at, arrive) or not a.up else arrive
        return timer.first_arrival(t, give_up, attempt)

    def _request(self, src: LabNode, req: StreamRequest) -> None:
        dst = self._by_addr.get(req.addr)
        give_up = self.now + self.stream_timeout_s
        token = (src, src.proc, req.request_id)
        t: float | None = None
        if dst is not None and dst is not src:
            t = self.now
            # SYN, SYN-ACK, the secure handshake both ways, the request
            syn, data = self.handshake_timer, self.stream_timer
            for a, b, timer in ((src, dst, syn), (dst, src, syn), (src, dst, data),
                                (dst, src, data), (src, dst, data)):
                t = self._leg(a, b, t, timer, give_up)
                if t is None:
                    break
        if t is None or dst is None:
            self._push(give_up, _STREAM_FAILED, token, None, None)
            return
        if self.measure_bytes:
            src.stream_bytes += len(encode(req.message)) + FRAME_OVERHEAD_BYTES + HANDSHAKE_BYTES
        self._push(t, _STREAM_AT_SERVER, token, dst, (req.message, give_up))

    def _serve_stream(self, token: tuple[LabNode, int, int], dst: LabNode,
                      payload: tuple[Any, float]) -> None:
        src = token[0]
        message, give_up = payload
        if not dst.up:
            self._push(give_up, _STREAM_FAILED, token, None, None)
            return
        reply, effects = dst.membership.handle_stream(message, src.addr, self.now)
        self._call(dst, effects)
        if reply is None:
            self._push(self.now + self._delay(), _STREAM_FAILED, token, None, None)
            return
        if self.measure_bytes:
            dst.stream_bytes += len(encode(reply)) + FRAME_OVERHEAD_BYTES
        t = self._leg(dst, src, self.now, self.stream_timer, give_up)
        if t is None:
            self._push(give_up, _STREAM_FAILED, token, None, None)
        else:
            self._push(t, _STREAM_REPLY, token, reply, None)

    # --- watching ----------------------------------------------------------------------

    def _record(self, node: LabNode, event: Event) -> None:
        line = (f"{self.now:.6f}|{node.index}|{event.kind}|{event.node_id.hex()}|"
                f"{event.incarnation}|{event.term}")
        self._hash.update(line.encode())
        if self.keep_trace:
            self.trace.append(f"{line}|{event.detail}")
        self._judge(node, event)
        for listener in self.listeners:
            listener(self.now, node, event)

    def _judge(self, observer: LabNode, event: Event) -> None:
        o = self.oracle
        subject = self._by_id.get(event.node_id)
        kind = event.kind
        if kind == "elected":
            o.elected.setdefault(event.term, [])
            if observer.index not in o.elected[event.term]:
                o.elected[event.term].append(observer.index)
            o.leader_changes += 1
            return
        if subject is None or subject is observer:
            return
        truly_gone = not subject.up or subject.left
        if kind == "suspect":
            o.suspect_events += 1
            if event.by == observer.node_id and not truly_gone:
                o.false_suspect_first_hand += 1
        elif kind == "dead":
            if subject.crashed_at is not None:
                key = (subject.index, subject.crashed_at, observer.index)
                if key not in o.dead_learned:
                    o.dead_learned[key] = self.now - subject.crashed_at
            if not truly_gone and subject.group == observer.group:
                outage = 0.0
                if subject.radio is not None:
                    outage = subject.radio.longest_outage_s(self.now - 30.0, self.now,
                                                            o.merge_gap_s)
                o.false_dead.append((self.now, observer.index, subject.index, outage))

    @property
    def trace_hash(self) -> str:
        return self._hash.hexdigest()

    # --- views -------------------------------------------------------------------------

    def live(self) -> list[LabNode]:
        return [n for n in self.nodes if n.up and not n.left]

    def state_seen(self, observer: int, subject: int) -> str | None:
        m = self.nodes[observer].membership.member(self.nodes[subject].node_id)
        return None if m is None else m.state

    def all_see_all(self, nodes: Iterable[LabNode] | None = None) -> bool:
        """Every given live node sees every other given node alive."""
        group = list(nodes) if nodes is not None else self.live()
        for a in group:
            for b in group:
                if a is not b:
                    m = a.membership.member(b.node_id)
                    if m is None or m.state != "alive":
                        return False
        return True

    def leader_seen(self, i: int) -> bytes | None:
        e = self.nodes[i].election
        return None if e is None else e.status().leader_id

    def leaders_per_term(self) -> dict[int, list[int]]:
        return {t: list(w) for t, w in self.oracle.elected.items()}

    def node_by_id(self, node_id: bytes) -> LabNode | None:
        return self._by_id.get(node_id)


class HopLab(GossipLab):
    """A lab that follows one update (``watch``: origin id and incarnation): for each
    fellow, the forwarding generation at which it got it (``hops``) and when
    (``reached_at``). Set both maps and ``watch`` before the update is made."""

    watch: tuple[bytes, int] | None = None
    hops: dict[int, int]
    reached_at: dict[int, float]

    def _deliver(self, node: LabNode, msgs: tuple[Any, ...], src_addr: str) -> None:
        if self.watch is not None and node.index not in self.hops:
            origin, inc = self.watch
            for m in msgs:
                if type(m) is Alive and m.node == origin and m.incarnation >= inc:
                    src = self._by_addr[src_addr]
                    if src.index in self.hops:
                        self.hops[node.index] = self.hops[src.index] + 1
                        self.reached_at[node.index] = self.now
                    break
        super()._deliver(node, msgs, src_addr)


__all__ = [
    "LAB_STREAM_RTO_S",
    "PROPOSED_ELECTION",
    "SEAL_OVERHEAD_BYTES",
    "GossipLab",
    "HopLab",
    "LabNode",
    "Oracle",
    "Radio",
    "RandomDraws",
    "fake_keys",
    "fake_sign_for",
    "fake_verify",
    "proposed",
]
