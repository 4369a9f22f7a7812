"""Membership: SWIM with the Lifeguard refinements, as a sans-I/O state machine.

Theory of operation.

Failure detection. Once per probe interval this node pings one fellow. Two probes in
three go to its first and second successors on a ring ordered by node id, so every
fellow is checked at a steady pace by two fellows that know it well; the third walks a
shuffled round-robin, so every fellow is also checked by everyone now and then. No ack
within the probe timeout: k helpers ping it too (``PingReq``) and a stream ping is tried
in parallel. A helper that gets no answer sends a ``Nack``, which proves that OUR link
works; a probe that heard neither an ack nor a single nack says nothing about the target
(our own radio is out), raises nothing, and is repeated. A helper that failed to reach
the target probes it itself now and then, so a failing fellow soon has several probers;
a helper that knows the target under a newer incarnation (it refuted) says so at once.

Doubt before suspicion. This node keeps an estimate of how many direct pings miss their
ack. On a clean network one failed probe makes the target a suspect. On a lossy one the
target is looked at again at once, and only failures spanning a second (when lossy;
less as the loss is less) raise suspicion: a fellow whose radio dropped out for under a
second is in doubt, not suspected. The span also grows to cover the silences this node
has seen fellows come back from (their 90th percentile, up to 2 s): where fades are
heavy-tailed (bad WiFi) it waits them out; short bursts give it less to grow on, so
crashes are still found fast there. The dead verdict counts from the first failure, or from
one second before the suspicion if the span was longer, so the fellow keeps its time to
refute.

Watching. While a fellow is in doubt or suspected, this node probes it every half
interval, asking ping and helpers at the same time (a short probe), with the suspicion
attached to the ping (the buddy rule: the suspect learns it is suspected and refutes).

Suspicion and the dead verdict. A suspect's timeout starts long and shrinks (Lifeguard,
as memberlist) with each confirmation, down to a floor; confirmations count only if they
are further apart than a radio fade (on a lossy network), and a failed probe of our own,
with nacks from freshly picked helpers, confirms too. On WiFi the loss sits on the
suspect's own radio, so everybody fails at the same moment and a count of confirmations
says little; what matters is for how long. So the floor grows with the measured loss
(under a second when clean, 3 s when lossy) and a verdict needs more than the timer: this
node's own probes of the suspect must have failed, with nacks, without a success and
without looking away for long, over a run of at least the floor, the last one just now
(another watcher's run, reported in its ``Suspect``, extends ours if the two touch).
A live fellow is therefore declared dead only if it stayed unreachable through every
probe of a run longer than the floor: a single fade shorter than the floor cannot do it.
Others adopt a received ``Dead`` at once.

Nobody listens. The stream ping of a failed probe can come back refused (TCP reset: the
fellow's host is up and answered, but no process listens at its address). No radio fade
does that, so there is nothing to wait out: the fellow is suspected at once and its
suspicion runs for the clean network's floor, and the dead verdict still needs this
node's own probes to fail over that floor (``stream_failed(..., nobody_listens=True)``).
A process restarted at the same address answers those probes and refutes.

Refutation. A suspected fellow raises its incarnation and says ``Alive``: on the ack of
the very ping that told it, by gossip, straight back to whoever sent the news, and pushed
over a stream to its accuser. A fellow whose probes heard nothing for a while (its radio
was out) refutes unasked with the first datagram it hears again. Old news about itself
is answered with its current ``Alive`` rather than a new incarnation.

Local health (Lifeguard LHM). Two probes in a row that heard nothing at all, having
to refute a suspicion, and the node's own loop waking later than a probe timeout
(``note_lag``: a starved CPU) raise a score; successful probes lower it; probe interval
and timeout are multiplied by score + 1, and a node with a bad score passes no verdicts.

Dissemination. Updates (``Alive``, ``Suspect``, ``Dead``, ``Left``) wait in a queue, one
per fellow, and ride on every datagram this node sends, least-sent first, as many as fit
the datagram budget; a gossip round every gossip interval sends them to a few random
fellows (twice as many when news is unsent; now and then a recently dead one, which may
refute). Each is sent ``retransmit_mult * ceil(log10(N + 1))`` times, then lingers a few
seconds more where a probe or an ack has room, for whoever missed the wave.

Leaving. A goodbye is ``Left``, gossiped like any update and also sent straight to every
live fellow with a ``Ping`` in the same datagram: a fellow takes in the news before it
answers the ping, so its ``Ack`` proves it holds the leave. Fellows that have not
acknowledged are asked again every probe timeout, for ``leave_timeout_s`` at most. The
goodbye has spread (``leave_spread``) once every fellow asked has acknowledged (or is no
longer live), or once ``indirect_checks`` have and gossip has sent it its full count: those
fellows pass it on. A leaving node answers no pings (but the goodbye pings of other
leavers: a swarm shut down at once does not wait out the bound), refutes nothing and
publishes no new metadata: a new incarnation would undo its goodbye, and it would be
recorded dead.

Anti-entropy. Every push-pull interval (longer past 32 fellows) this node sends one random
fellow the hash of its view over a stream; the same hash ends it. Otherwise the fellow
answers with one summary line per member, and this node sends the records the other side
lacks and asks for those it lacks. Now and then the same goes to a fellow held dead (or
reaped), so both sides of a healed partition find each other again. A join is the same
exchange with a seed, asking for everything; seeds are retried with backoff.

Metadata. A fellow's metadata is opaque, versioned bytes signed by its owner. Gossip
announces the version (in ``Alive``), with the signed bytes riding along when they are small
(``GossipTuning.meta_inline_bytes``) and news to the fellow passing them on, so a mere
refutation stays small; whoever still holds an older one pulls the bytes from the owner over a
stream, and anti-entropy carries them too. A newer version always wins; an older one or
a bad signature is ignored. A restarted owner starts again at version 1, so fellows may
hold its metadata from before at a version as high: once it sees such a record of itself
(its join's answer has one, and so does the record it asks of whoever names an incarnation
above its own), signed by it with a higher version, or the same version with other bytes or
a higher incarnation, it publishes its own again above that version. And a fellow taking
an Alive with a later epoch (signed; it grows across restarts) than the one it held drops
the metadata it held: the last life's versions say nothing against the new one's.

Time comes in as ``now`` on every call; randomness from the injected ``random.Random``.

One coherent algorithm, so one file (as memberlist's ``state.go``): the parts above share
one view of the fellows and one clock, and each section below is one of them. The pieces
that stand alone already live beside it (``awareness``, ``broadcasts``, ``member``,
``timing``).
"""

from __future__ import annotations

import hashlib
import heapq
import struct as _struct
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from p2pswarm.config import GossipConfig
from p2pswarm.effects import (
    ALIVE,
    DEAD,
    JOIN_RETRY,
    JOINED,
    LEFT,
    MEMBER_JOINED,
    METADATA,
    REAPED,
    REFUTED,
    SUSPECT,
    UPDATED,
    Effect,
    Event,
    EventKind,
    SendDatagram,
    StreamRequest,
)
from p2pswarm.errors import AuthenticationError
from p2pswarm.membership.awareness import Awareness
from p2pswarm.membership.broadcasts import ENVELOPE_BYTES, BroadcastQueue, item_bytes
from p2pswarm.membership.member import (
    STATE_NAMES,
    LocalNode,
    Member,
    MemberState,
    node_id_of,
)
from p2pswarm.membership.proofs import U32_MAX, ProofCache, alive_signed_bytes
from p2pswarm.membership.timing import (
    lerp_by_loss,
    push_pull_interval_s,
    retransmit_limit,
    suspicion_max_s,
    suspicion_timeout_s,
)
from p2pswarm.wire.gossip import (  # importing it registers the messages with the codec
    STATE_ALIVE,
    STATE_DEAD,
    STATE_LEFT,
    STATE_SUSPECT,
    Ack,
    Alive,
    Dead,
    Left,
    MemberRecord,
    MemberSummary,
    MetaPull,
    MetaPush,
    Nack,
    Noted,
    Ping,
    PingReq,
    Suspect,
    SyncDigest,
    SyncRecords,
    SyncSame,
    SyncSummary,
)

if TYPE_CHECKING:  # a type only: the driver hands in its generator, seeded or not
    from p2pswarm.randomness import Rng as Random

Signer = Callable[[bytes], bytes]
Verifier = Callable[[bytes, bytes, bytes], object]  # (public_key, signature, data)

_SEQ_MOD = 2**32
_INF = float("inf")
_PING_ITEM = item_bytes(Ping(_SEQ_MOD - 1, b"\0" * 16, b"\0" * 16))
_ACK_ITEM = item_bytes(Ack(_SEQ_MOD - 1))
_NACK_ITEM = item_bytes(Nack(_SEQ_MOD - 1))
_DIRECT, _INDIRECT = 0, 1
_META_DOMAIN = b"p2pswarm-meta\x00"
_STREAM_PENDING_S = 60.0  # forget a stream request nobody answered after this long

_ALIVE, _SUSPECT, _DEAD, _LEFT = STATE_ALIVE, STATE_SUSPECT, STATE_DEAD, STATE_LEFT


def meta_signed_bytes(node_id: bytes, version: int, metadata: bytes) -> bytes:
    """What an owner signs for its metadata."""
    return _META_DOMAIN + node_id + _struct.pack(">Q", version) + metadata


class _Entry:
    __slots__ = (
        "addr",
        "alive_epoch",
        "alive_meta_version",
        "alive_signature",
        "announced_meta",
        "incarnation",
        "last_heard",
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

    def signed(self, msg: Alive) -> None:
        self.alive_meta_version = msg.meta_version
        self.alive_epoch = msg.epoch
        self.alive_signature = msg.signature

    def alive(self, metadata: tuple[bytes, bytes | None] = (b"", None)) -> Alive:
        """The owner's Alive as it signed it, with ``metadata`` riding along."""
        return Alive(self.node, self.incarnation, self.name, self.addr, self.public_key,
                     self.alive_meta_version, self.priority, *metadata, self.alive_epoch,
                     self.alive_signature)


class _Suspicion:
    __slots__ = (
        "counted",
        "deadline",
        "expected",
        "expired",
        "first_source",
        "heard_back",
        "incarnation",
        "last_count_at",
        "max_s",
        "min_s",
        "reported_at",
        "reported_since",
        "silent_since",
        "sources",
        "start",
    )

    def __init__(self, incarnation: int, start: float, source: bytes, min_s: float,
                 max_s: float, expected: int) -> None:
        self.incarnation = incarnation
        self.start = start
        self.sources: dict[bytes, None] = {source: None}
        self.first_source = source
        self.heard_back = False  # a probe of ours reached it again (its fade ended)
        self.silent_since = start  # our first failed probe of it, if we raised it
        self.counted = 0
        self.last_count_at = start
        self.min_s = min_s
        self.max_s = max_s
        self.expected = expected
        self.deadline = start + suspicion_timeout_s(0, expected, min_s, max_s)
        self.expired = False
        # the earliest time since which some fellow reported failing to reach it, and when
        # that report came: other watchers' runs of failures extend ours if they touch
        self.reported_since = _INF
        self.reported_at = _INF

    def report(self, silent_ms: int, now: float) -> None:
        since = now - silent_ms / 1000.0
        if silent_ms > 0 and since < self.reported_since:
            self.reported_since, self.reported_at = since, now


class _Probe:
    __slots__ = (
        "addr",
        "direct_deadline",
        "direct_ok",
        "expected_nacks",
        "final_deadline",
        "gone",
        "nacks",
        "phase",
        "seq",
        "started",
        "target",
        "watch",
    )

    def __init__(self, target: bytes, addr: str, seq: int, started: float,
                 direct_deadline: float, final_deadline: float) -> None:
        self.target = target
        self.addr = addr
        self.seq = seq
        self.started = started
        self.direct_deadline = direct_deadline
        self.final_deadline = final_deadline
        self.phase = _DIRECT
        self.direct_ok = False
        self.gone = False  # its host refused our stream ping: nothing listens there
        self.expected_nacks = 0
        self.nacks = 0
        self.watch = False


class _Relay:
    __slots__ = ("nack_at", "req_seq", "requester_addr", "target")

    def __init__(self, requester_addr: str, req_seq: int, nack_at: float, target: bytes) -> None:
        self.requester_addr = requester_addr
        self.req_seq = req_seq
        self.nack_at = nack_at
        self.target = target


class Membership:
    """One node's view of the swarm; drive it with handle/tick/next_deadline."""

    def __init__(
        self,
        local: LocalNode,
        config: GossipConfig,
        rng: Random,
        *,
        sign: Signer,
        verify: Verifier,
        now: float = 0.0,
        incarnation: int = 0,
        metadata: bytes = b"",
        datagram_budget_bytes: int = 1340,
        epoch: int = 0,
    ) -> None:
        self.local = local
        self.config = config
        self.tuning = config.tuning
        self.rng = rng
        self._sign = sign
        self._verify = verify
        self._budget = datagram_budget_bytes
        self.epoch = epoch  # our datagram epoch, signed into our Alive
        self._proofs = ProofCache(verify)
        self._alive_signed: tuple[tuple[Any, ...], bytes] | None = None  # fields, signature
        self.incarnation = incarnation
        self.meta_version = 1 if metadata else 0
        self.metadata = metadata
        self.meta_signature = self._sign_meta() if metadata else None
        self._meta_news_until = -_INF  # our Alives carry our metadata until then
        self._members: dict[bytes, _Entry] = {}
        self._roster_dirty: set[bytes] = {local.node_id}  # for roster_changes()
        self._live: list[bytes] = []
        self._live_pos: dict[bytes, int] = {}
        self._ring: list[bytes] = [local.node_id]
        self._order: list[bytes] = []
        self._order_i = 0
        self._probe: _Probe | None = None
        self._probe_count = 0
        self._ring_turn = 0
        self._next_probe_at = now + rng.random() * config.probe_interval_s
        self._recheck: bytes | None = None
        self._inconclusive: bytes | None = None  # the last target a probe said nothing of
        self._doubt: dict[bytes, tuple[float, int]] = {}
        self._fades: deque[float] = deque(maxlen=self.tuning.fade_samples)  # silences
        # of fellows that came back, first failed probe to the probe that reached them
        self._watch: dict[bytes, float] = {}
        self._confirm: list[bytes] = []
        self._own_fail: dict[bytes, float] = {}  # our latest failed probe of a fellow
        # our unbroken run of failed probes of a fellow: (first start, latest start)
        self._streak: dict[bytes, tuple[float, float]] = {}
        self._last_rx = now
        self._deaf = False
        self._clock = now  # the latest `now` we were given
        self._suspicions: dict[bytes, _Suspicion] = {}
        self._relays: dict[int, _Relay] = {}
        self._queue = BroadcastQueue(self.tuning.linger_s)
        self._next_gossip_at = now
        self._next_sync_at = now + config.push_pull_interval_s * (0.5 + rng.random())
        self._next_reconnect_at = now + self.tuning.reconnect_interval_s * (0.5 + rng.random())
        self._streams: dict[int, tuple[str, str, Any, float]] = {}  # kind, addr, extra, at
        self._next_rid = 0
        self._seq = rng.randrange(_SEQ_MOD)
        self._reaps: list[tuple[float, bytes]] = []
        self._recent_dead: dict[bytes, float] = {}
        self._lost: dict[bytes, tuple[str, float]] = {}  # reaped dead: (addr, when), to retry
        self._awareness = Awareness(config.awareness_max_multiplier)
        self._silent_probes = 0
        self._loss = self.tuning.loss_prior
        self._joined = False
        self._seeds: tuple[str, ...] = ()
        self._join_attempt = 0
        self._next_join_at = _INF
        self._join_rids: dict[int, None] = {}
        self._leaving = False
        self._leave_waiting: dict[bytes, int] = {}  # fellows yet to acknowledge our leave
        self._leave_seqs: dict[int, bytes] = {}  # the pings that rode with it -> fellow
        self._leave_asked = 0
        self._leave_acked = 0
        self._leave_retry_at = _INF
        self._leave_until = _INF  # no more asking after this
        self._digest: bytes | None = None
        self._meta_wait: dict[bytes, float] = {}
        self._refute_streamed: dict[bytes, float] = {}
        self._proof_asked: dict[str, float] = {}  # addr -> when we last asked it (below)
        self._replying_to: str | None = None
        self._reply_extra: list[Any] = []
        self._quiet = False
        self._bindings: dict[bytes, bytes] = {}
        self.version = 0  # bumps on every change a view would show
        self.roster_version = 0  # bumps when who is in, where, in what state changes
        self.stats: dict[str, int] = {
            "probes": 0, "probes_failed": 0, "probes_inconclusive": 0, "suspicions_raised": 0,
            "confirmations_sent": 0, "dead_declared": 0, "refutations": 0, "syncs": 0,
            "bad_signatures": 0, "bad_bindings": 0, "unsigned_alives": 0,
            "claims_clamped": 0, "incarnation_exhausted": 0, "probes_refused": 0,
            "refutations_unasked": 0, "late_wakes": 0,
        }
        self._dispatch: dict[type, Callable[[Any, str, float, list[Effect]], None]] = {
            Ping: self._on_ping, Ack: self._on_ack, Nack: self._on_nack,
            PingReq: self._on_ping_req, Alive: self._on_alive, Suspect: self._on_suspect,
            Dead: self._on_dead, Left: self._on_left, SyncSame: self._on_nothing,
            SyncSummary: self._on_sync_summary, SyncRecords: self._on_sync_records,
            MetaPush: self._on_meta_push, Noted: self._on_nothing,
        }

    # --- views -------------------------------------------------------------------------

    @property
    def node_id(self) -> bytes:
        return self.local.node_id

    @property
    def joined(self) -> bool:
        return self._joined

    @property
    def health_score(self) -> int:
        """Lifeguard local health: 0 is healthy; probes slow down by score + 1."""
        return self._awareness.score

    @property
    def loss_estimate(self) -> float:
        """Fraction of recent direct pings that missed their ack."""
        return self._loss

    def members(self) -> tuple[Member, ...]:
        """Every fellow this node knows (this node included, ``is_self``), by node id."""
        out = [self._self_view()]
        out.extend(self._view(e) for e in self._members.values())
        out.sort(key=lambda m: m.node_id)
        return tuple(out)

    def roster_changes(self) -> tuple[tuple[Member, ...], tuple[bytes, ...]]:
        """What changed in the roster since the last call (an election's feed, which then
        costs what changed, not the size of the swarm): the views of fellows whose
        presence, state, name, address or priority changed, this node included, and the ids
        of those no longer known. The first call gives everyone."""
        dirty, self._roster_dirty = self._roster_dirty, set()
        changed: list[Member] = []
        gone: list[bytes] = []
        for node in sorted(dirty):
            e = self._members.get(node)
            if node == self.node_id:
                changed.append(self._self_view())
            elif e is None:
                gone.append(node)
            else:
                changed.append(self._view(e))
        return tuple(changed), tuple(gone)

    def member(self, node_id: bytes) -> Member | None:
        if node_id == self.node_id:
            return self._self_view()
        e = self._members.get(node_id)
        return None if e is None else self._view(e)

    def _view(self, e: _Entry) -> Member:
        return Member(e.node, e.name, e.addr, STATE_NAMES[e.state], e.incarnation, e.metadata,
                      e.meta_version, e.announced_meta, e.last_heard, e.state_at, e.priority,
                      e.public_key)

    def _self_view(self) -> Member:
        loc = self.local
        state: MemberState = "left" if self._leaving else "alive"
        return Member(loc.node_id, loc.name, loc.addr, state, self.incarnation, self.metadata,
                      self.meta_version, self.meta_version, None, 0.0, loc.priority,
                      loc.public_key, is_self=True)

    def self_record(self) -> MemberRecord:
        loc = self.local
        return MemberRecord(loc.node_id, self.incarnation, _LEFT if self._leaving else _ALIVE,
                            loc.name, loc.addr, loc.public_key, loc.priority, self.meta_version,
                            self.metadata, self.meta_signature, self.meta_version, self.epoch,
                            self._sign_alive())

    def counters(self) -> dict[str, int]:
        return dict(self.stats)

    # --- driving -----------------------------------------------------------------------

    def join(self, seed_addrs: Iterable[str], now: float) -> list[Effect]:
        """Join through these seeds (retried with backoff); none: found a new swarm."""
        self._clock = max(self._clock, now)
        seeds = tuple(a for a in seed_addrs if a != self.local.addr)
        out: list[Effect] = []
        self._seeds = seeds
        if not seeds:
            self._joined = True
            self._changed()  # the election waits for this
            out.append(Event(JOINED, self.node_id, self.local.name, "founded a new swarm"))
            return out
        self._join_attempt = 0
        self._send_join(now, out)
        return out

    def leave(self, now: float) -> list[Effect]:
        """Say goodbye: fellows mark this node ``left``, not dead. Keep ticking (and
        handing in datagrams) until ``leave_spread``, or ``leave_timeout_s`` at most."""
        self._clock = max(self._clock, now)
        out: list[Effect] = []
        if self._leaving:
            return out
        self._leaving = True
        self._queue.add(self.node_id, Left(self.node_id, self.incarnation))
        self._leave_asked = len(self._live)
        for node in sorted(self._live):
            self._ask_to_note_leave(node, out)
        self._leave_retry_at = now + self.config.probe_timeout_s
        self._leave_until = now + self.config.leave_timeout_s
        self._probe = None
        self._changed()
        out.append(Event(LEFT, self.node_id, self.local.name, "this node left the swarm",
                         self.incarnation, self.node_id))
        return out

    @property
    def leave_spread(self) -> bool:
        """Whether our goodbye has got around (see Leaving, above); False before ``leave``."""
        if not self._leaving:
            return False
        if not self._leave_waiting:
            return True
        enough = min(self.config.indirect_checks, self._leave_asked)
        return self._leave_acked >= enough and self._queue.retired(self.node_id)

    def leave_acknowledgements(self) -> tuple[int, int]:
        """(fellows that acknowledged our leave, fellows asked to)."""
        return self._leave_acked, self._leave_asked

    def _ask_to_note_leave(self, node: bytes, out: list[Effect]) -> None:
        """Our ``Left`` to ``node`` with a ping behind it: its ack proves it took the news."""
        seq = self._next_seq()
        self._leave_waiting[node] = seq
        self._leave_seqs[seq] = node
        out.append(SendDatagram(self._members[node].addr, (
            Left(self.node_id, self.incarnation), Ping(seq, node, self.node_id))))

    def _ask_again_to_note_leave(self, now: float, out: list[Effect]) -> None:
        self._leave_retry_at = now + self.config.probe_timeout_s
        for node in sorted(self._leave_waiting):
            if node in self._live_pos:
                self._ask_to_note_leave(node, out)
            else:  # found dead or gone meanwhile: it will not answer
                del self._leave_waiting[node]

    def set_metadata(self, metadata: bytes, now: float) -> list[Effect]:
        """Publish new metadata: a new version, announced by gossip, pulled by fellows.
        Nothing while leaving: its new incarnation would take the goodbye back."""
        if self._leaving:
            return []
        if self.incarnation >= U32_MAX or self.meta_version >= U32_MAX:
            self.stats["incarnation_exhausted"] += 1  # saturated: keep what fellows hold
            return []
        self._clock = max(self._clock, now)
        self.metadata = metadata
        self.meta_version += 1
        self.meta_signature = self._sign_meta()
        self.incarnation += 1
        self._news_of_metadata(now)
        self._queue.add(self.node_id, self._alive_msg())
        self._changed(roster=False)
        return [Event(METADATA, self.node_id, self.local.name,
                      f"published metadata version {self.meta_version}", self.incarnation,
                      self.node_id)]

    def _outdo_old_metadata(self, seen_version: int, seen_incarnation: int,
                            seen_metadata: bytes | None, now: float, out: list[Effect]) -> None:
        """Fellows still hold metadata of ours from before a restart, at a version as high
        as our fresh one: publish ours again above it, or theirs would keep winning. (A
        version above ours, ours with an incarnation above ours, or ours with other bytes
        than we signed in this life can only be that.) ``seen_metadata``: the bytes seen,
        proven signed by us, or None if none came with it."""
        stale = seen_version > self.meta_version or (
            seen_version == self.meta_version and (
                seen_incarnation > self.incarnation
                or (seen_metadata is not None and seen_metadata != self.metadata)))
        if stale and self.metadata and not self._leaving:
            if seen_version >= U32_MAX or self.incarnation >= U32_MAX:
                self.stats["incarnation_exhausted"] += 1
                return
            self.meta_version = seen_version
            out.extend(self.set_metadata(self.metadata, now))

    def piggyback(self, budget_bytes: int, now: float | None = None) -> list[Any]:
        """Queued updates fitting in ``budget_bytes`` (item bytes, envelope not included),
        to ride on a datagram the driver sends anyway."""
        if now is not None:
            self._clock = max(self._clock, now)
        return self._queue.take(budget_bytes, self._limit(), self._clock)

    def handle(self, message: Any, sender_addr: str, now: float) -> list[Effect]:
        """One message from a datagram, or the reply to one of our stream requests."""
        self._clock = max(self._clock, now)
        out: list[Effect] = []
        self._received(sender_addr, now, out)
        handler = self._dispatch.get(type(message))
        if handler is not None:
            handler(message, sender_addr, now, out)
        return out

    def handle_datagram(self, messages: Sequence[Any], sender_addr: str,
                        now: float) -> list[Effect]:
        """All membership messages of one datagram: news first, then pings, so that the
        ack of a ping carries the refutation of a suspicion that came with it."""
        out: list[Effect] = []
        self._clock = max(self._clock, now)
        pings = [m for m in messages if type(m) is Ping]
        self._replying_to = sender_addr if pings else None
        self._received(sender_addr, now, out)
        for msg in messages:
            if type(msg) is not Ping:
                handler = self._dispatch.get(type(msg))
                if handler is not None:
                    handler(msg, sender_addr, now, out)
        for msg in pings:
            self._on_ping(msg, sender_addr, now, out)
        self._replying_to = None
        self._reply_extra = []
        return out

    def _received(self, sender_addr: str, now: float, out: list[Effect]) -> None:
        """A datagram got through to us. After a long deafness (a probe of ours heard
        nothing at all, and nothing else came for a while: our own radio was out),
        fellows may be suspecting us: refute before they even tell us."""
        deaf_s = now - self._last_rx
        self._last_rx = now
        if self._deaf and deaf_s >= self.tuning.deaf_refute_s and self._joined \
                and not self._leaving:
            self.stats["refutations_unasked"] += 1
            self._refute(self.incarnation, None, sender_addr, now, out)
        self._deaf = False

    def handle_reply(self, request_id: int, reply: Any, now: float) -> list[Effect]:
        """The reply to ``StreamRequest`` ``request_id``."""
        pending = self._streams.pop(request_id, None)
        self._join_rids.pop(request_id, None)
        addr = pending[1] if pending is not None else ""
        return self.handle(reply, addr, now)

    def handle_stream(self, message: Any, sender_addr: str,
                      now: float) -> tuple[Any | None, list[Effect]]:
        """Answer a stream request from a fellow: (reply or None to close, effects)."""
        self._clock = max(self._clock, now)
        out: list[Effect] = []
        t = type(message)
        if t is Ping:
            if message.target != self.node_id:
                return None, out
            self._heard(message.source, now)
            return Ack(message.seq), out
        if t is SyncDigest:
            self._heard(message.source, now)
            self.stats["syncs"] += 1
            if message.digest == self.digest():
                return SyncSame(), out
            return SyncSummary(self._summaries()), out
        if t is SyncRecords:
            self._heard(message.source, now)
            self._merge_records(message.records, message.source, now, out)
            if message.want_all:
                records = self._all_records()
            else:  # what was asked for, and always our own (we may have just refuted)
                wanted = [n for n in message.want if n != self.node_id]
                records = (self.self_record(),) + tuple(
                    r for r in (self._record(n) for n in wanted) if r)
            return SyncRecords(self.node_id, records), out
        if t is MetaPull:
            records = tuple(r for r in (self._record(n) for n in message.nodes)
                            if r is not None and r.meta_version > 0)
            return MetaPush(records), out
        if t is Alive:
            self._on_alive(message, sender_addr, now, out)
            return Noted(), out
        return None, out

    def stream_failed(self, request_id: int, now: float, *,
                      nobody_listens: bool = False) -> list[Effect]:
        """Stream request ``request_id`` failed; ``nobody_listens``: the peer's host
        refused the connection (its process is gone, not behind a fade)."""
        self._clock = max(self._clock, now)
        out: list[Effect] = []
        pending = self._streams.pop(request_id, None)
        p = self._probe
        if nobody_listens and pending is not None and pending[0] == "ping":
            if p is not None and (p.addr, p.seq) == (pending[1], pending[2]):
                p.gone = True  # judged when the probe ends
            else:
                self._refused_late(pending[1], now, out)
        if request_id in self._join_rids:
            del self._join_rids[request_id]
            if not self._join_rids and not self._joined:
                self._schedule_join_retry(now, out)
        if pending is not None and pending[0] == "meta":
            self._meta_wait[pending[2]] = now + self.tuning.meta_pull_retry_s
        return out

    def next_deadline(self) -> float | None:
        t = _INF if self._joined or self._leaving else self._next_join_at
        if self._leave_waiting and self._leave_retry_at < self._leave_until:
            t = min(t, self._leave_retry_at)
        if not self._leaving:
            p = self._probe
            if p is None:
                if self._live:
                    t = min(t, self._next_probe_at)
            else:
                t = min(t, p.direct_deadline if p.phase == _DIRECT else p.final_deadline)
            if self._joined and self._live:
                t = min(t, self._next_sync_at)
            if self._joined and (len(self._members) > len(self._live) or self._lost):
                t = min(t, self._next_reconnect_at)
        for r in self._relays.values():
            t = min(t, r.nack_at)
        for s in self._suspicions.values():
            if not s.expired and s.deadline < t:
                t = s.deadline
        if len(self._queue) and self._live:
            t = min(t, self._next_gossip_at)
        if self._reaps and self._reaps[0][0] < t:
            t = self._reaps[0][0]
        return None if t == _INF else t

    def note_lag(self, lag_s: float, now: float) -> None:
        """This node's own loop woke ``lag_s`` late at ``now`` (its CPU busy with other
        work). Past a probe timeout that is trouble of its own, as Lifeguard counts it: the
        score rises (probes slow down, and a bad score passes no dead verdicts), and a
        probe in flight waits its timeout again from now, so that acks and nacks already
        waiting in the socket are read before the probe is judged failed."""
        if not self.config.probe_timeout_s < lag_s < _INF:
            return
        self._awareness.apply(1)
        self.stats["late_wakes"] += 1
        p = self._probe
        if p is not None:
            wait = self.config.probe_timeout_s * self._scale()
            if p.phase == _DIRECT:
                p.direct_deadline = max(p.direct_deadline, now + wait)
            p.final_deadline = max(p.final_deadline, now + wait)

    def tick(self, now: float) -> list[Effect]:
        self._clock = max(self._clock, now)
        out: list[Effect] = []
        if not self._joined and not self._leaving and now >= self._next_join_at:
            self._send_join(now, out)
        if self._leave_waiting and self._leave_retry_at <= now < self._leave_until:
            self._ask_again_to_note_leave(now, out)
        if self._relays:
            for seq in [s for s, r in self._relays.items() if r.nack_at <= now]:
                r = self._relays.pop(seq)
                self._send(out, r.requester_addr, [Nack(r.req_seq)], _NACK_ITEM)
                self._relay_failed(r.target, now)
        if not self._leaving:
            p = self._probe
            if p is not None:
                if p.phase == _DIRECT and now >= p.direct_deadline:
                    self._go_indirect(p, now, out)
                if p.phase == _INDIRECT and now >= p.final_deadline:
                    self._finish_probe(False, now, out)
            if self._suspicions:
                self._check_suspicions(now, out)
            if self._probe is None and now >= self._next_probe_at:
                self._start_probe(now, out)
            if self._joined and now >= self._next_sync_at:
                self._start_sync(now, out)
            if self._joined and now >= self._next_reconnect_at:
                self._reconnect(now, out)
        if len(self._queue) and now >= self._next_gossip_at:
            self._gossip(now, out)
        while self._reaps and self._reaps[0][0] <= now:
            _, node = heapq.heappop(self._reaps)
            self._reap(node, now, out)
        return out

    def merge_records(self, records: Iterable[MemberRecord], now: float, *,
                      quiet: bool = False) -> list[Effect]:
        """Take in full records (as from anti-entropy). ``quiet``: no gossip, no events;
        for building an already converged swarm in simulations."""
        out: list[Effect] = []
        self._quiet = quiet
        try:
            self._merge_records(tuple(records), b"", now, out)
        finally:
            self._quiet = False
        if quiet:
            out = [e for e in out if not isinstance(e, Event)]
        return out

    # --- probing -----------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) % _SEQ_MOD
        return self._seq

    def _scale(self) -> int:
        return self._awareness.score + 1

    def _start_probe(self, now: float, out: list[Effect]) -> None:
        interval = self.config.probe_interval_s * self._scale()
        self._next_probe_at = now + (interval * self.tuning.watch_fraction if self._watch
                                     else interval)
        self._retry_meta(now, out)
        target = self._pick_target(now)
        if target is None:
            return
        e = self._members[target]
        seq = self._next_seq()
        scale = self._scale()
        timeout = self.config.probe_timeout_s * scale
        watching = target in self._watch
        if watching:  # a suspect: ask the helpers at once, and expect an answer soon
            self._watch[target] = now
            self._probe = _Probe(target, e.addr, seq, now, now, now + timeout * 1.2)
            self._probe.watch = True
        else:
            final = max(interval, timeout + self.config.probe_timeout_s * 1.2)
            self._probe = _Probe(target, e.addr, seq, now, now + timeout, now + final)
        self.stats["probes"] += 1
        msgs: list[Any] = [Ping(seq, target, self.node_id)]
        size = _PING_ITEM
        news = self._news_about(target)
        if news is not None:
            msgs.append(news)
            size += item_bytes(news)
        self._send(out, e.addr, msgs, size)
        if watching:
            self._go_indirect(self._probe, now, out, stream=False)

    def _pick_target(self, now: float) -> bytes | None:
        live = self._live_pos
        if self._recheck is not None:
            target, self._recheck = self._recheck, None
            if target in live:
                return target
        if self._watch:
            interval = self.config.probe_interval_s * self._scale() * self.tuning.watch_fraction
            best, best_at = None, _INF
            for node, last in list(self._watch.items()):
                e = self._members.get(node)
                if e is None or not (e.state == _SUSPECT or
                                     e.state == _ALIVE and node in self._doubt):
                    del self._watch[node]
                    continue
                if now - last >= interval and last < best_at:
                    best, best_at = node, last
            if best is not None:
                return best
        while self._confirm:
            node = self._confirm.pop(0)
            if node in live:
                return node
        if not self._live:
            return None
        self._probe_count += 1
        every = self.tuning.random_probe_every
        if every > 1 and self._probe_count % every != 0:
            self._ring_turn += 1
            successor = self._successor(1 + self._ring_turn % self.tuning.ring_depth)
            if successor is not None:
                return successor
        return self._round_robin()

    def _successor(self, nth: int = 1) -> bytes | None:
        """The ``nth`` live fellow after this node on the ring of node ids."""
        ring = self._ring
        n = len(ring)
        i = bisect_right(ring, self.node_id)
        found = None
        for k in range(n - 1):
            node = ring[(i + k) % n]
            if node in self._live_pos:
                found = node
                nth -= 1
                if nth == 0:
                    break
        return found

    def _round_robin(self) -> bytes | None:
        for _ in range(2):
            while self._order_i < len(self._order):
                node = self._order[self._order_i]
                self._order_i += 1
                if node in self._live_pos:
                    return node
            self._order = list(self._live)
            self.rng.shuffle(self._order)
            self._order_i = 0
        return None

    def _news_about(self, node: bytes) -> Any | None:
        """What a ping to ``node`` should tell it about itself (the buddy rule)."""
        e = self._members.get(node)
        if e is None:
            return None
        if e.state == _SUSPECT:
            s = self._suspicions.get(node)
            source = s.first_source if s is not None else self.node_id
            return Suspect(node, e.incarnation, source)
        if e.state == _DEAD:
            return Dead(node, e.incarnation, self.node_id)
        return None

    def _go_indirect(self, p: _Probe, now: float, out: list[Effect], *,
                     stream: bool = True) -> None:
        p.phase = _INDIRECT
        k = self.config.indirect_checks
        helpers = [n for n in self._sample_live(k + 1) if n != p.target][:k]
        e = self._members.get(p.target)
        incarnation = e.incarnation if e is not None else 0
        for helper in helpers:
            req = PingReq(p.seq, p.target, p.addr, self.node_id, incarnation)
            self._send(out, self._members[helper].addr, [req], item_bytes(req))
        p.expected_nacks = len(helpers)
        if stream:
            rid = self._new_rid("ping", p.addr, p.seq, now)
            out.append(StreamRequest(p.addr, Ping(p.seq, p.target, self.node_id), rid))

    def _finish_probe(self, ok: bool, now: float, out: list[Effect]) -> None:
        p = self._probe
        assert p is not None
        self._probe = None
        t = self.tuning
        loss_before = self._loss  # judge this probe by the link as it was before it
        if not p.watch:
            self._loss += t.loss_alpha * ((0.0 if p.direct_ok else 1.0) - self._loss)
        target = p.target
        e = self._members.get(target)
        if ok:
            self._awareness.apply(-1)
            self._silent_probes = 0
            doubt = self._doubt.pop(target, None)
            if doubt is not None:
                self._watch.pop(target, None)
                self._fades.append(p.started - doubt[0])
            elif e is not None and e.state == _SUSPECT:
                s = self._suspicions.get(target)
                if s is not None and s.first_source == self.node_id and not s.heard_back:
                    s.heard_back = True
                    self._fades.append(p.started - s.silent_since)
            self._own_fail.pop(target, None)
            self._streak.pop(target, None)
            if e is not None:
                e.last_heard = now
            return
        self.stats["probes_failed"] += 1
        if p.gone:  # its host answered for it: our link works, and nothing listens there
            self._silent_probes = 0
            self.stats["probes_refused"] += 1
        elif p.expected_nacks == 0 or p.nacks == 0:
            # nobody answered us: our own link, most likely. Twice in a row: we are in
            # trouble, slow down (Lifeguard); once is a fade like any other.
            self._silent_probes += 1
            self._deaf = True
            if self._silent_probes >= 2:
                self._awareness.apply(1)
        else:
            self._silent_probes = 0
        if p.expected_nacks > 0 and p.nacks == 0 and not p.gone:
            self.stats["probes_inconclusive"] += 1
            if self._inconclusive != target:  # we learned nothing about it: ask once more
                self._inconclusive = target
                self._recheck = target
                self._next_probe_at = now
            else:
                self._inconclusive = None
            return
        self._inconclusive = None
        if e is None or e.state not in (_ALIVE, _SUSPECT):
            return
        self._own_fail[target] = now
        first, latest = self._streak.get(target, (p.started, p.started))
        if p.started - latest > t.streak_max_gap_s:  # we looked away too long: start over
            first = p.started
        self._streak[target] = (first, p.started)
        if e.state == _SUSPECT:
            s = self._suspicions.get(target)
            if s is None:
                return
            if p.gone:
                self._nobody_listens(s)
            self._watch[target] = p.started
            # our own failure, with nacks from helpers picked afresh, confirms too
            self._count_confirmation(s, now)
            if self.node_id not in s.sources:
                s.sources[self.node_id] = None
                msg = Suspect(target, e.incarnation, self.node_id,
                              self._silent_ms(target, now))
                self._queue.add(target, msg)
                self.stats["confirmations_sent"] += 1
                out.append(Event(SUSPECT, target, e.name, "confirmed by this node",
                                 e.incarnation, self.node_id))
            if s.expired and self._may_declare(target, s, now):
                self._declare_dead(target, now, out)
            return
        first, count = self._doubt.get(target, (p.started, 0))
        if now - first > 6 * self.config.probe_interval_s * self._scale():
            first, count = p.started, 0
        count += 1
        needed, base, span = 1, 0.0, 0.0
        if loss_before > t.recheck_above_loss:  # lossy: a second failure, across a fade
            needed = 2
            base = lerp_by_loss(0.0, t.doubt_span_lossy_s, loss_before, t.lossy_reference)
            span = max(base, self._fade_span())
        if p.gone:  # no fade to wait out: suspect it now, from the first failure
            self._doubt.pop(target, None)
            self._start_suspicion(target, e.incarnation, self.node_id, first, now, out,
                                  silent_since=first)
            self._nobody_listens(self._suspicions[target])
        elif count >= needed and p.started - first >= span:
            self._doubt.pop(target, None)
            # the suspicion counts from the first failure, but waiting out a longer fade
            # must not shorten the time it leaves the fellow to refute
            start = max(first, p.started - base)
            self._start_suspicion(target, e.incarnation, self.node_id, start, now, out,
                                  silent_since=first)
        else:  # look again soon, quickly, before telling anyone
            self._doubt[target] = (first, count)
            self._watch[target] = -_INF
            self._next_probe_at = now

    def _refused_late(self, addr: str, now: float, out: list[Effect]) -> None:
        """A refusal that came back after its probe ended (every helper's nack was in
        first): it still tells on the fellow at ``addr`` we doubt or suspect."""
        for node in (*self._doubt, *self._suspicions):
            e = self._members.get(node)
            if e is None or e.addr != addr:
                continue
            self.stats["probes_refused"] += 1
            if node in self._doubt and e.state == _ALIVE:
                first, _ = self._doubt.pop(node)
                self._start_suspicion(node, e.incarnation, self.node_id, first, now, out,
                                      silent_since=first)
            s = self._suspicions.get(node)
            if s is not None:
                self._nobody_listens(s)
            return

    def _nobody_listens(self, s: _Suspicion) -> None:
        """Nothing listens at a suspect's address (its host refused our stream): its
        process is gone, so no radio fade needs waiting out. Its suspicion runs for the
        clean network's floor; the dead verdict still needs our own probes to fail over
        that span, so a restarted process at the same address refutes in time."""
        floor = self.tuning.suspicion_floor_clean_s
        if s.min_s <= floor:
            return
        s.min_s = s.max_s = floor
        s.deadline = s.start + suspicion_timeout_s(s.counted, s.expected, s.min_s, s.max_s)

    def _fade_span(self) -> float:
        """How long the fades this node has seen fellows come back from last (a high
        quantile), capped; 0 until it has seen a few."""
        if len(self._fades) < 8:
            return 0.0
        ordered = sorted(self._fades)
        q = ordered[int(self.tuning.fade_quantile * (len(ordered) - 1))]
        return min(self.tuning.doubt_span_max_s, q)

    def _silent_ms(self, node: bytes, now: float) -> int:
        run = self._streak.get(node)
        return 0 if run is None else min(2**32 - 1, int((now - run[0]) * 1000))

    def _relay_failed(self, target: bytes, now: float) -> None:
        """We could not reach a fellow for someone else. One helper in k looks into it
        itself, so a failing fellow soon has several independent probers."""
        e = self._members.get(target)
        if e is None or e.state not in (_ALIVE, _SUSPECT) or target in self._confirm:
            return
        if self.rng.random() * max(1, self.config.indirect_checks) < 1.0:
            self._confirm.append(target)
            if self._probe is None:
                self._next_probe_at = min(self._next_probe_at, now)

    def _sample_live(self, k: int) -> list[bytes]:
        live = self._live
        if len(live) <= k:
            return list(live)
        return self.rng.sample(live, k)

    # --- suspicion ---------------------------------------------------------------------

    def _suspicion_bounds(self) -> tuple[float, float, int]:
        t = self.tuning
        n = len(self._members) + 1
        floor = lerp_by_loss(t.suspicion_floor_clean_s, t.suspicion_floor_lossy_s, self._loss,
                             t.lossy_reference)
        top = suspicion_max_s(self.config.suspicion_mult, n, self.config.probe_interval_s)
        top = min(top, floor * max(1.0, self.config.suspicion_max_timeout_mult))
        expected = t.confirmations_expected
        if n - 2 < expected:
            expected = 0
        return floor, max(floor, top), expected

    def _start_suspicion(self, node: bytes, incarnation: int, source: bytes, start: float,
                         now: float, out: list[Effect], msg: Suspect | None = None,
                         silent_since: float | None = None) -> None:
        e = self._members[node]
        first_hand = source == self.node_id
        e.state = _SUSPECT
        e.incarnation = incarnation
        e.state_at = now
        lo, hi, expected = self._suspicion_bounds()
        self._suspicions[node] = susp = _Suspicion(incarnation, start, source, lo, hi, expected)
        if silent_since is not None:
            susp.silent_since = silent_since
        if msg is None:
            msg = Suspect(node, incarnation, source, self._silent_ms(node, now))
        else:
            susp.report(msg.silent_ms, now)
        self._broadcast(node, msg)
        if first_hand:
            self.stats["suspicions_raised"] += 1
            self._watch[node] = -_INF  # keep watching it from now on
        elif self._live and self.rng.random() < self.tuning.confirm_fanout / len(self._live):
            self._confirm.append(node)
            if self._probe is None:
                self._next_probe_at = min(self._next_probe_at, now)
        self._changed(node=node)
        self._event(out, SUSPECT, e, "suspected by this node" if first_hand
                    else f"suspected by {self._name_of(source)}", source)

    def _confirm_suspicion(self, node: bytes, source: bytes, now: float, msg: Suspect) -> None:
        s = self._suspicions.get(node)
        if s is None or source in s.sources:
            return
        s.sources[source] = None
        s.report(msg.silent_ms, now)
        if self._count_confirmation(s, now) and not self._quiet:
            self._queue.add(node, msg)

    def _count_confirmation(self, s: _Suspicion, now: float) -> bool:
        """Count one confirmation if it is independent of the last one counted: further
        apart in time than a radio fade (on a lossy network)."""
        gap = lerp_by_loss(self.tuning.independence_gap_clean_s,
                           self.tuning.independence_gap_lossy_s, self._loss,
                           self.tuning.lossy_reference)
        if s.counted and now - s.last_count_at < gap:
            return False
        s.counted += 1
        s.last_count_at = now
        s.deadline = s.start + suspicion_timeout_s(s.counted, s.expected, s.min_s, s.max_s)
        return True

    def _check_suspicions(self, now: float, out: list[Effect]) -> None:
        for node, s in list(self._suspicions.items()):
            if s.expired or now < s.deadline:
                continue
            s.expired = True
            if self._may_declare(node, s, now):
                self._declare_dead(node, now, out)
            else:
                self._watch[node] = -_INF  # check it ourselves first
                if self._probe is None:
                    self._next_probe_at = min(self._next_probe_at, now)

    def _may_declare(self, node: bytes, s: _Suspicion, now: float) -> bool:
        """A dead verdict needs: our own probes of it have failed (with nacks) without a
        break for at least the suspicion floor, the last one just now, and our own
        health is good."""
        if self._own_fail.get(node, -_INF) < now - self.tuning.evidence_fresh_s:
            return False
        first, latest = self._streak.get(node, (now, now))
        if s.reported_since < first <= s.reported_at + self.tuning.streak_max_gap_s:
            first = s.reported_since  # another watcher's run of failures joins ours
        if latest - first < s.min_s:  # unreachable at probes at least the floor apart
            return False
        return self._awareness.score <= self.tuning.declare_max_score

    def _declare_dead(self, node: bytes, now: float, out: list[Effect]) -> None:
        e = self._members[node]
        self.stats["dead_declared"] += 1
        self._set_dead(e, e.incarnation, self.node_id, now, out)

    # --- refutation --------------------------------------------------------------------

    def _alive_msg(self) -> Alive:
        loc = self.local
        meta = self._inline_meta(self.metadata, self.meta_signature) \
            if self._clock < self._meta_news_until else (b"", None)
        return Alive(loc.node_id, self.incarnation, loc.name, loc.addr, loc.public_key,
                     self.meta_version, loc.priority, *meta, self.epoch, self._sign_alive())

    def _sign_alive(self) -> bytes:
        """Our signature over our Alive as it stands: signed once per incarnation."""
        loc = self.local
        fields = (loc.node_id, self.incarnation, loc.name, loc.addr, loc.public_key,
                  self.meta_version, loc.priority, self.epoch)
        if self._alive_signed is None or self._alive_signed[0] != fields:
            self._alive_signed = (fields, self._sign(alive_signed_bytes(*fields)))
        return self._alive_signed[1]

    def alive_proven(self, msg: Alive) -> bool:
        """Whether ``msg`` carries its owner's valid signature (cached)."""
        return self._proofs.check(msg.node, msg.public_key, msg.signature, alive_signed_bytes(
            msg.node, msg.incarnation, msg.name, msg.addr, msg.public_key, msg.meta_version,
            msg.priority, msg.epoch))

    def _proven(self, msg: Alive) -> bool:
        """``alive_proven``, counting what fails: an Alive counts only if its owner signed
        it."""
        if node_id_of(msg.public_key) != msg.node:
            self.stats["bad_bindings"] += 1
            return False
        if msg.signature is None:
            self.stats["unsigned_alives"] += 1
            return False
        if not self.alive_proven(msg):
            self.stats["bad_signatures"] += 1
            return False
        return True

    def _about_us(self, incarnation: int, addr: str, now: float, out: list[Effect]) -> int:
        """A verdict about us above our incarnation: honest fellows only know numbers we
        signed, so after a restart the sender holds our signed record from before. Ask
        it for that record (its answer, proven, lets us refute above it) and meanwhile
        count the claim at our own incarnation."""
        if incarnation > self.incarnation and addr and not self._leaving:
            if now - self._proof_asked.get(addr, -_INF) >= self.config.probe_interval_s:
                self._proof_asked[addr] = now
                if len(self._proof_asked) > 256:
                    del self._proof_asked[next(iter(self._proof_asked))]
                rid = self._new_rid("sync", addr, None, now)
                out.append(StreamRequest(addr, SyncRecords(
                    self.node_id, (self.self_record(),), (self.node_id,)), rid))
        return self._claimed(incarnation, self.incarnation)

    def _claimed(self, incarnation: int, known: int) -> int:
        """A third party's claim about a fellow counts at most at the incarnation the
        fellow itself signed (as far as we know): nobody can push it further."""
        if incarnation > known:
            self.stats["claims_clamped"] += 1
            return known
        return incarnation

    def _news_of_metadata(self, now: float) -> None:
        """Our Alives carry our metadata while gossip spreads its news (a join or a new
        version): a refutation then does not take it out of the queue. Later Alives only
        announce the version, so refutations stay small."""
        self._meta_news_until = now + self._limit() * self.config.gossip_interval_s

    def _inline_meta(self, metadata: bytes, signature: bytes | None
                     ) -> tuple[bytes, bytes | None]:
        """The (metadata, signature) an Alive carries: the signed bytes if small, or none."""
        if signature is None or not 0 < len(metadata) <= self.tuning.meta_inline_bytes:
            return b"", None
        return metadata, signature

    def _refute(self, seen_incarnation: int, accuser: bytes | None, sender_addr: str,
                now: float, out: list[Effect]) -> None:
        if self._leaving:
            return
        if seen_incarnation < self.incarnation:
            # old news: the sender missed our refutation; tell it again, first hand
            if sender_addr:
                self._answer_with_alive(sender_addr, out)
            return
        if seen_incarnation >= U32_MAX:  # cannot be outdone: saturate, never overflow
            self.stats["incarnation_exhausted"] += 1
            return
        self.incarnation = seen_incarnation + 1
        self._awareness.apply(1)
        self.stats["refutations"] += 1
        alive = self._alive_msg()
        self._queue.add(self.node_id, alive)
        self._changed(roster=False)
        out.append(Event(REFUTED, self.node_id, self.local.name,
                         f"refuted a suspicion by {self._name_of(accuser)}"
                         if accuser else "refuted", self.incarnation, accuser or b""))
        if sender_addr:
            self._answer_with_alive(sender_addr, out)
        if accuser is not None and accuser != self.node_id and self.tuning.refute_by_stream:
            acc = self._members.get(accuser)
            if acc is not None and acc.state in (_ALIVE, _SUSPECT):
                last = self._refute_streamed.get(accuser, -_INF)
                if now - last >= self.config.probe_interval_s:
                    self._refute_streamed[accuser] = now
                    rid = self._new_rid("refute", acc.addr, None, now)
                    out.append(StreamRequest(acc.addr, alive, rid))

    def _answer_with_alive(self, addr: str, out: list[Effect]) -> None:
        """Send our current ``Alive`` to ``addr``: on the ack we are about to send if the
        news came with a ping, else in a datagram of its own."""
        alive = self._alive_msg()
        if addr == self._replying_to:
            if alive not in self._reply_extra:
                self._reply_extra.append(alive)
        else:
            out.append(SendDatagram(addr, (alive,)))

    # --- incoming ----------------------------------------------------------------------

    def _on_nothing(self, msg: Any, addr: str, now: float, out: list[Effect]) -> None:
        return

    def _on_ping(self, msg: Ping, addr: str, now: float, out: list[Effect]) -> None:
        if msg.target != self.node_id:
            return
        if self._leaving:  # answer only the goodbye of another leaver (fellows leaving
            e = self._members.get(msg.source)  # together each wait for the others' acks)
            if e is None or e.state != _LEFT:
                return
        self._heard(msg.source, now)
        msgs: list[Any] = [Ack(msg.seq)]
        size = _ACK_ITEM
        if self._reply_extra and addr == self._replying_to:
            msgs.extend(self._reply_extra)
            size += sum(item_bytes(m) for m in self._reply_extra)
            self._reply_extra = []
        news = self._news_about(msg.source)  # tell a suspect who pings us, too
        if news is not None:
            msgs.append(news)
            size += item_bytes(news)
        self._send(out, addr, msgs, size)

    def _on_ack(self, msg: Ack, addr: str, now: float, out: list[Effect]) -> None:
        if self._leaving and msg.seq in self._leave_seqs:
            node = self._leave_seqs.pop(msg.seq)
            if self._leave_waiting.pop(node, None) is not None:
                self._leave_acked += 1
            return
        p = self._probe
        if p is not None and msg.seq == p.seq:
            if p.phase == _DIRECT:
                p.direct_ok = True
            self._finish_probe(True, now, out)
            return
        r = self._relays.pop(msg.seq, None)
        if r is not None:
            self._heard(r.target, now)
            self._send(out, r.requester_addr, [Ack(r.req_seq)], _ACK_ITEM)

    def _on_nack(self, msg: Nack, addr: str, now: float, out: list[Effect]) -> None:
        p = self._probe
        if p is not None and msg.seq == p.seq:
            p.nacks += 1
            if p.nacks >= p.expected_nacks:  # every helper failed too: no need to wait
                self._finish_probe(False, now, out)

    def _on_ping_req(self, msg: PingReq, addr: str, now: float, out: list[Effect]) -> None:
        if self._leaving:
            return
        self._heard(msg.source, now)
        e = self._members.get(msg.target)
        if e is not None and e.state in (_DEAD, _LEFT):
            news = Dead(e.node, e.incarnation, self.node_id) if e.state == _DEAD \
                else Left(e.node, e.incarnation)
            self._send(out, addr, [Nack(msg.seq), news], _NACK_ITEM + item_bytes(news))
            return
        if e is not None and e.incarnation > msg.incarnation:
            # the asker missed a refutation (or a rejoin): tell it, it may be all it needs
            held = e.meta_signature if e.meta_version == e.alive_meta_version else None
            alive = e.alive(self._inline_meta(e.metadata, held))
            out.append(SendDatagram(addr, (alive,)))
        seq = self._next_seq()
        nack_at = now + self.config.probe_timeout_s * self.tuning.nack_after_fraction
        self._relays[seq] = _Relay(addr, msg.seq, nack_at, msg.target)
        msgs: list[Any] = [Ping(seq, msg.target, self.node_id)]
        size = _PING_ITEM
        about = self._news_about(msg.target)
        if about is not None:
            msgs.append(about)
            size += item_bytes(about)
        self._send(out, msg.target_addr, msgs, size)

    def _on_alive(self, msg: Alive, addr: str, now: float, out: list[Effect]) -> None:
        node = msg.node
        e = self._members.get(node)
        # Only what changes something needs its owner's signature: an older or the same
        # incarnation changes nothing but metadata, which carries a signature of its own.
        if (e is None or msg.incarnation > e.incarnation) and not self._proven(msg):
            if e is not None:
                self._merge_inline_meta(msg, out)
            return
        if node == self.node_id:
            seen = msg.metadata if msg.meta_signature is not None and self._our_meta_proven(
                msg.meta_version, msg.metadata, msg.meta_signature) else None
            self._outdo_old_metadata(msg.meta_version, msg.incarnation, seen, now, out)
            if msg.incarnation > self.incarnation or (
                    msg.incarnation == self.incarnation
                    and (msg.addr != self.local.addr or msg.public_key != self.local.public_key)):
                self._refute(msg.incarnation, None, "", now, out)
            return
        if e is None:
            if not self._binding_ok(node, msg.public_key):
                return
            e = _Entry(node, msg.name, msg.addr, msg.public_key, msg.priority, msg.incarnation,
                       _ALIVE, now)
            e.signed(msg)
            e.announced_meta = msg.meta_version
            self._add_entry(e)
            if addr == msg.addr:
                e.last_heard = now
            self._broadcast(node, msg)
            self._changed(node=node)
            self._event(out, MEMBER_JOINED, e, f"joined at {msg.addr}", node)
            self._merge_inline_meta(msg, out)
            self._want_meta(e, now, out)
            return
        if msg.incarnation > e.incarnation and msg.epoch > e.alive_epoch \
                and msg.public_key == e.public_key:
            self._forget_old_life_metadata(e)
        meta_news = self._merge_inline_meta(msg, out)
        if msg.incarnation <= e.incarnation:
            return
        if msg.public_key != e.public_key and not self._binding_ok(node, msg.public_key):
            return
        old = e.state
        changed = (msg.name, msg.addr, msg.priority) != (e.name, e.addr, e.priority)
        e.incarnation = msg.incarnation
        e.name, e.addr, e.public_key, e.priority = msg.name, msg.addr, msg.public_key, msg.priority
        e.signed(msg)
        e.announced_meta = max(e.announced_meta, msg.meta_version)
        if addr == msg.addr:
            e.last_heard = now
        if old != _ALIVE:
            e.state = _ALIVE
            e.state_at = now
            if old in (_DEAD, _LEFT):
                self._live_add(node)
                self._recent_dead.pop(node, None)
        # news it signed since: whatever failed probes we were still doubting it on are
        # older than that proof of life, and must not carry over to its new incarnation
        self._clear_suspicion(node)
        # relay the bytes only while they are news: a refutation learnt with bytes we
        # already hold (from a sync record, say) must not crowd the gossip it rides in
        self._broadcast(node, msg if meta_news or msg.meta_signature is None
                        else _without_meta(msg))
        self._changed(roster=changed or old != _ALIVE, node=node)
        if old != _ALIVE:
            self._event(out, ALIVE, e, f"alive again (incarnation {msg.incarnation})"
                        if old == _SUSPECT else f"back after {STATE_NAMES[old]}", node)
        elif changed:
            self._event(out, UPDATED, e, f"now {msg.name} at {msg.addr}", node)
        self._want_meta(e, now, out)

    def _on_suspect(self, msg: Suspect, addr: str, now: float, out: list[Effect]) -> None:
        node = msg.node
        if node == self.node_id:
            self._refute(self._about_us(msg.incarnation, addr, now, out), msg.source, addr,
                         now, out)
            return
        e = self._members.get(node)
        if e is None or msg.incarnation < e.incarnation or e.state in (_DEAD, _LEFT):
            return
        if msg.incarnation > e.incarnation:
            msg = Suspect(node, self._claimed(msg.incarnation, e.incarnation), msg.source,
                          msg.silent_ms)
        if e.state == _SUSPECT and msg.incarnation == e.incarnation:
            self._confirm_suspicion(node, msg.source, now, msg)
            return
        self._doubt.pop(node, None)
        self._start_suspicion(node, msg.incarnation, msg.source, now, now, out, msg)

    def _on_dead(self, msg: Dead, addr: str, now: float, out: list[Effect]) -> None:
        node = msg.node
        if node == self.node_id:
            self._refute(self._about_us(msg.incarnation, addr, now, out), msg.source, addr,
                         now, out)
            return
        e = self._members.get(node)
        if e is None or msg.incarnation < e.incarnation:
            return
        if msg.incarnation > e.incarnation:
            msg = Dead(node, self._claimed(msg.incarnation, e.incarnation), msg.source)
        if e.state in (_DEAD, _LEFT):
            if e.state == _DEAD and msg.incarnation > e.incarnation:
                e.incarnation = msg.incarnation
            return
        self._set_dead(e, msg.incarnation, msg.source, now, out, msg)

    def _on_left(self, msg: Left, addr: str, now: float, out: list[Effect]) -> None:
        node = msg.node
        if node == self.node_id:
            self._refute(self._about_us(msg.incarnation, addr, now, out), None, addr, now, out)
            return
        e = self._members.get(node)
        if e is None or msg.incarnation < e.incarnation or e.state == _LEFT:
            return
        if msg.incarnation > e.incarnation:
            msg = Left(node, self._claimed(msg.incarnation, e.incarnation))
        was_live = e.state in (_ALIVE, _SUSPECT)
        e.incarnation = msg.incarnation
        e.state = _LEFT
        e.state_at = now
        if was_live:
            self._live_remove(node)
        self._clear_suspicion(node)
        self._recent_dead.pop(node, None)
        self._broadcast(node, msg)
        heapq.heappush(self._reaps, (now + self.config.dead_reap_after_s, node))
        self._changed(node=node)
        self._event(out, LEFT, e, "left the swarm", node)

    # --- state changes -----------------------------------------------------------------

    def _set_dead(self, e: _Entry, incarnation: int, source: bytes, now: float,
                  out: list[Effect], msg: Dead | None = None) -> None:
        node = e.node
        was_live = e.state in (_ALIVE, _SUSPECT)
        e.incarnation = incarnation
        e.state = _DEAD
        e.state_at = now
        if was_live:
            self._live_remove(node)
        self._clear_suspicion(node)
        self._recent_dead[node] = now
        self._broadcast(node, msg if msg is not None else Dead(node, incarnation, source))
        heapq.heappush(self._reaps, (now + self.config.dead_reap_after_s, node))
        self._changed(node=node)
        self._event(out, DEAD, e, "declared dead by this node" if source == self.node_id
                    else f"declared dead by {self._name_of(source)}", source)

    def _clear_suspicion(self, node: bytes) -> None:
        self._suspicions.pop(node, None)
        self._watch.pop(node, None)
        self._doubt.pop(node, None)
        self._own_fail.pop(node, None)
        self._streak.pop(node, None)

    def _reap(self, node: bytes, now: float, out: list[Effect]) -> None:
        e = self._members.get(node)
        if e is None or e.state not in (_DEAD, _LEFT):
            return
        if now < e.state_at + self.config.dead_reap_after_s:
            return
        del self._members[node]
        if e.state == _DEAD:  # a dead fellow may be alive behind a partition: keep trying
            self._lost[node] = (e.addr, now)
            while len(self._lost) > self.tuning.reconnect_max_lost:
                del self._lost[next(iter(self._lost))]
        i = bisect_left(self._ring, node)
        if i < len(self._ring) and self._ring[i] == node:
            del self._ring[i]
        self._recent_dead.pop(node, None)
        self._meta_wait.pop(node, None)
        self._changed(node=node)
        self._event(out, REAPED, e, f"forgotten after {STATE_NAMES[e.state]}", node)

    def _add_entry(self, e: _Entry) -> None:
        self._members[e.node] = e
        insort(self._ring, e.node)
        if e.state in (_ALIVE, _SUSPECT):
            self._live_add(e.node)
            # a newcomer gets a random place in the rest of this round
            lo = self._order_i
            self._order.insert(self.rng.randint(lo, len(self._order)), e.node)

    def _live_add(self, node: bytes) -> None:
        if node not in self._live_pos:
            self._live_pos[node] = len(self._live)
            self._live.append(node)

    def _live_remove(self, node: bytes) -> None:
        i = self._live_pos.pop(node, None)
        if i is None:
            return
        last = self._live.pop()
        if last != node:
            self._live[i] = last
            self._live_pos[last] = i

    def _changed(self, roster: bool = True, node: bytes | None = None) -> None:
        """Something a view shows changed; ``roster``: ``node``'s (default: this node's)
        presence, state, name, address or priority (what an election reads), not just
        metadata or incarnation."""
        self._digest = None
        self.version += 1
        if roster:
            self.roster_version += 1
            self._roster_dirty.add(self.node_id if node is None else node)

    def _broadcast(self, node: bytes, msg: Any) -> None:
        if not self._quiet:
            self._queue.add(node, msg)

    def _event(self, out: list[Effect], kind: EventKind, e: _Entry, detail: str, by: bytes) -> None:
        if not self._quiet:
            out.append(Event(kind, e.node, e.name, detail, e.incarnation, by))

    def _heard(self, node: bytes, now: float) -> None:
        e = self._members.get(node)
        if e is not None:
            e.last_heard = now
            self._streak.pop(node, None)

    def _name_of(self, node: bytes | None) -> str:
        if node is None:
            return "?"
        if node == self.node_id:
            return self.local.name
        e = self._members.get(node)
        return e.name if e is not None else node.hex()[:8]

    def _binding_ok(self, node: bytes, public_key: bytes) -> bool:
        if self._bindings.get(node) == public_key:
            return True
        if node_id_of(public_key) != node:
            self.stats["bad_bindings"] += 1
            return False
        self._bindings[node] = public_key
        return True

    # --- sending -----------------------------------------------------------------------

    def _limit(self) -> int:
        return retransmit_limit(self.config.retransmit_mult, len(self._members) + 1)

    def _send(self, out: list[Effect], addr: str, msgs: list[Any], size: int) -> None:
        extra = self._queue.take(self._budget - ENVELOPE_BYTES - size, self._limit(),
                                 self._clock, to=addr)
        if extra:
            msgs.extend(extra)
        out.append(SendDatagram(addr, tuple(msgs)))

    def _gossip(self, now: float, out: list[Effect]) -> None:
        self._next_gossip_at = now + self.config.gossip_interval_s
        k = self.config.gossip_nodes
        if self._queue.has_fresh():  # news: spend its first sends wide (same total sends)
            k *= self.tuning.fresh_fanout_mult
        targets = self._sample_live(k)
        if self._recent_dead:
            horizon = now - self.tuning.gossip_to_dead_s
            for node in [n for n, t in self._recent_dead.items() if t < horizon]:
                del self._recent_dead[node]
            dead = [n for n in self._recent_dead if n in self._members]
            if dead and self.rng.random() < len(dead) / (len(dead) + len(self._live) + 1.0):
                targets = targets[:-1] + [self.rng.choice(dead)] if targets else [
                    self.rng.choice(dead)]
        limit = self._limit()
        budget = self._budget - ENVELOPE_BYTES
        for node in targets:
            msgs = self._queue.take(budget, limit, now, lingering=False)
            if not msgs:
                break
            out.append(SendDatagram(self._members[node].addr, tuple(msgs)))

    def _new_rid(self, kind: str, addr: str, extra: Any, now: float) -> int:
        self._next_rid += 1
        self._streams[self._next_rid] = (kind, addr, extra, now)
        if len(self._streams) > 256:
            for rid in list(self._streams)[:128]:
                del self._streams[rid]
        return self._next_rid

    # --- joining -----------------------------------------------------------------------

    def _send_join(self, now: float, out: list[Effect]) -> None:
        self._join_attempt += 1
        backoff = min(self.config.join_retry_max_s,
                      self.tuning.join_retry_min_s * 2 ** (self._join_attempt - 1))
        self._next_join_at = now + backoff + 5.0  # a safety net if no reply and no failure
        request = SyncRecords(self.node_id, (self.self_record(),), (), True)
        for seed in self._seeds:
            rid = self._new_rid("join", seed, None, now)
            self._join_rids[rid] = None
            out.append(StreamRequest(seed, request, rid))

    def _schedule_join_retry(self, now: float, out: list[Effect]) -> None:
        backoff = min(self.config.join_retry_max_s,
                      self.tuning.join_retry_min_s * 2 ** (self._join_attempt - 1))
        self._next_join_at = now + backoff
        out.append(Event(JOIN_RETRY, self.node_id, self.local.name,
                         f"no seed answered; trying again in {backoff:.0f} s"))

    # --- anti-entropy ------------------------------------------------------------------

    def digest(self) -> bytes:
        """SHA-256 over (id, incarnation, state, metadata version) of every member."""
        if self._digest is None:
            h = hashlib.sha256()
            rows = [(self.node_id, self.incarnation, _LEFT if self._leaving else _ALIVE,
                     self.meta_version)]
            rows.extend((e.node, e.incarnation, e.state, e.meta_version)
                        for e in self._members.values())
            rows.sort()
            for node, inc, state, meta in rows:
                h.update(node)
                h.update(_struct.pack(">IBI", inc, state, meta))
            self._digest = h.digest()
        return self._digest

    def _summaries(self) -> tuple[MemberSummary, ...]:
        rows = [MemberSummary(self.node_id, self.incarnation,
                              _LEFT if self._leaving else _ALIVE, self.meta_version)]
        rows.extend(MemberSummary(e.node, e.incarnation, e.state, e.meta_version)
                    for e in self._members.values())
        return tuple(rows)

    def _record(self, node: bytes) -> MemberRecord | None:
        if node == self.node_id:
            return self.self_record()
        e = self._members.get(node)
        if e is None:
            return None
        return MemberRecord(e.node, e.incarnation, e.state, e.name, e.addr, e.public_key,
                            e.priority, e.meta_version, e.metadata, e.meta_signature,
                            e.alive_meta_version, e.alive_epoch, e.alive_signature)

    def _all_records(self) -> tuple[MemberRecord, ...]:
        out = [self.self_record()]
        out.extend(r for r in (self._record(n) for n in self._members) if r is not None)
        return tuple(out)

    def _start_sync(self, now: float, out: list[Effect]) -> None:
        n = len(self._members) + 1
        interval = push_pull_interval_s(self.config.push_pull_interval_s, n)
        self._next_sync_at = now + interval * (0.75 + 0.5 * self.rng.random())
        stale = now - _STREAM_PENDING_S
        for rid in [r for r, v in self._streams.items() if v[3] < stale]:
            del self._streams[rid]
        if not self._live:
            return
        node = self.rng.choice(self._live)
        addr = self._members[node].addr
        rid = self._new_rid("sync", addr, None, now)
        out.append(StreamRequest(addr, SyncDigest(self.node_id, self.digest(),
                                                  len(self._members) + 1), rid))

    def _reconnect(self, now: float, out: list[Effect]) -> None:
        """Anti-entropy with a fellow we hold dead: if it is alive after all (a partition
        healed), the exchange tells each side about the other, and both converge."""
        self._next_reconnect_at = now + self.tuning.reconnect_interval_s * (
            0.75 + 0.5 * self.rng.random())
        horizon = now - self.tuning.reconnect_for_s
        for node in [n for n, (_, at) in self._lost.items()
                     if at < horizon or n in self._members]:
            del self._lost[node]
        addrs = [e.addr for e in self._members.values() if e.state == _DEAD]
        addrs += [addr for addr, _ in self._lost.values()]
        if not addrs:
            return
        addr = addrs[self.rng.randrange(len(addrs))]
        rid = self._new_rid("sync", addr, None, now)
        out.append(StreamRequest(addr, SyncDigest(self.node_id, self.digest(),
                                                  len(self._members) + 1), rid))

    def _on_sync_summary(self, msg: SyncSummary, addr: str, now: float,
                         out: list[Effect]) -> None:
        theirs = {s.node: s for s in msg.entries}
        send: list[MemberRecord] = []
        want: list[bytes] = []
        mine = self._summaries()
        for s in mine:
            t = theirs.pop(s.node, None)
            if t is None:
                if s.state in (_ALIVE, _SUSPECT):
                    record = self._record(s.node)
                    if record is not None:
                        send.append(record)
                continue
            if (s.incarnation, s.state) > (t.incarnation, t.state) or \
                    s.meta_version > t.meta_version:
                record = self._record(s.node)
                if record is not None:
                    send.append(record)
            if (t.incarnation, t.state) > (s.incarnation, s.state) or \
                    t.meta_version > s.meta_version:
                want.append(s.node)
        for node, t in theirs.items():
            if t.state in (_ALIVE, _SUSPECT):
                want.append(node)
        if send or want:
            rid = self._new_rid("sync", addr, None, now)
            out.append(StreamRequest(addr, SyncRecords(self.node_id, tuple(send), tuple(want)),
                                     rid))

    def _on_sync_records(self, msg: SyncRecords, addr: str, now: float,
                         out: list[Effect]) -> None:
        self._heard(msg.source, now)
        self._merge_records(msg.records, msg.source, now, out)
        if not self._joined:
            self._joined = True
            self._changed()  # the election waits for this, even if no record was new
            self._join_rids.clear()
            self._next_join_at = _INF
            self._news_of_metadata(now)
            self._queue.add(self.node_id, self._alive_msg())
            out.append(Event(JOINED, self.node_id, self.local.name,
                             f"joined through {addr}; {len(self._live) + 1} fellows alive"))

    def _merge_records(self, records: Sequence[MemberRecord], source: bytes, now: float,
                       out: list[Effect]) -> None:
        for r in records:
            node = r.node
            alive = Alive(node, r.incarnation, r.name, r.addr, r.public_key,
                          r.alive_meta_version, r.priority, b"", None, r.alive_epoch,
                          r.alive_signature)
            if node == self.node_id:
                if not self._proven(alive):  # only what we signed ourselves counts
                    continue
                if self._our_meta_proven(r.meta_version, r.metadata, r.meta_signature):
                    self._outdo_old_metadata(r.meta_version, r.incarnation, r.metadata, now,
                                             out)
                if r.incarnation >= self.incarnation and (
                        r.state != _ALIVE or r.incarnation > self.incarnation
                        or r.addr != self.local.addr):
                    self._refute(r.incarnation, None, "", now, out)
                continue
            if r.state == _ALIVE:  # small metadata inside: merged before a pull is asked
                inline = self._inline_meta(r.metadata, r.meta_signature) \
                    if r.meta_version == r.alive_meta_version else (b"", None)
                self._on_alive(Alive(node, r.incarnation, r.name, r.addr, r.public_key,
                                     r.alive_meta_version, r.priority, *inline,
                                     r.alive_epoch, r.alive_signature),
                               "", now, out)
            elif r.state == _LEFT:
                self._on_left(Left(node, r.incarnation), "", now, out)
            else:  # a remote verdict of dead is only a suspicion here (as memberlist)
                e = self._members.get(node)
                if e is None and r.state == _SUSPECT:
                    self._on_alive(alive, "", now, out)
                self._on_suspect(Suspect(node, r.incarnation, source or node), "", now, out)
            self._merge_meta(node, r.public_key, r.meta_version, r.metadata, r.meta_signature,
                             out, r.alive_epoch)

    # --- metadata ----------------------------------------------------------------------

    def _sign_meta(self) -> bytes:
        return self._sign(meta_signed_bytes(self.node_id, self.meta_version, self.metadata))

    def _merge_meta(self, node: bytes, public_key: bytes, version: int, metadata: bytes,
                    signature: bytes | None, out: list[Effect], epoch: int) -> bool:
        """Take ``node``'s signed metadata if newer than ours; True if it was taken.
        ``epoch``: that of the Alive it came with; one older than the Alive we hold is
        from the owner's earlier life (its versions start again at 1 after a restart)."""
        e = self._members.get(node)
        if e is None or version <= e.meta_version or signature is None \
                or epoch < e.alive_epoch:
            return False
        if not self._binding_ok(node, public_key) or public_key != e.public_key:
            return False
        data = meta_signed_bytes(node, version, metadata)
        try:
            ok = self._verify(e.public_key, signature, data)
        except AuthenticationError:
            ok = False
        if ok is False:
            self.stats["bad_signatures"] += 1
            return False
        e.meta_version = version
        e.metadata = metadata
        e.meta_signature = signature
        e.announced_meta = max(e.announced_meta, version)
        self._meta_wait.pop(node, None)
        self._changed(roster=False)
        self._event(out, METADATA, e, f"metadata version {version}", node)
        return True

    def _forget_old_life_metadata(self, e: _Entry) -> None:
        """``e`` restarted (its signed epoch grew): what we hold of its metadata is from its
        last life, whose versions say nothing against those of this one (they start again
        at 1). Drop it, so the fresh version, however low, is taken (inline or pulled)."""
        if e.meta_version == 0:
            return
        e.meta_version = e.announced_meta = 0
        e.metadata = b""
        e.meta_signature = None
        self._meta_wait.pop(e.node, None)
        self._changed(roster=False)

    def _our_meta_proven(self, version: int, metadata: bytes, signature: bytes | None) -> bool:
        """Whether this is metadata we signed (in this life or an earlier one: a version we
        may have to outdo)."""
        if signature is None or version == 0:
            return False
        if version == self.meta_version and metadata == self.metadata:
            return True  # what we publish now (signatures are deterministic): no check
        try:
            ok = self._verify(self.local.public_key, signature,
                              meta_signed_bytes(self.node_id, version, metadata))
        except AuthenticationError:
            return False
        return ok is not False

    def _merge_inline_meta(self, msg: Alive, out: list[Effect]) -> bool:
        return msg.meta_signature is not None and self._merge_meta(
            msg.node, msg.public_key, msg.meta_version, msg.metadata, msg.meta_signature, out,
            msg.epoch)

    def _want_meta(self, e: _Entry, now: float, out: list[Effect]) -> None:
        if e.announced_meta <= e.meta_version or self._quiet:
            return
        if self._meta_wait.get(e.node, -_INF) > now:
            return
        self._meta_wait[e.node] = now + self.tuning.meta_pull_retry_s
        rid = self._new_rid("meta", e.addr, e.node, now)
        out.append(StreamRequest(e.addr, MetaPull((e.node,)), rid))

    def _retry_meta(self, now: float, out: list[Effect]) -> None:
        if not self._meta_wait:
            return
        for node, at in list(self._meta_wait.items()):
            e = self._members.get(node)
            if e is None or e.announced_meta <= e.meta_version:
                del self._meta_wait[node]
            elif at <= now and e.state in (_ALIVE, _SUSPECT):
                self._want_meta(e, now, out)

    def _on_meta_push(self, msg: MetaPush, addr: str, now: float, out: list[Effect]) -> None:
        for r in msg.records:
            self._merge_meta(r.node, r.public_key, r.meta_version, r.metadata,
                             r.meta_signature, out, r.alive_epoch)


def _without_meta(msg: Alive) -> Alive:
    return Alive(msg.node, msg.incarnation, msg.name, msg.addr, msg.public_key,
                 msg.meta_version, msg.priority, b"", None, msg.epoch, msg.signature)


__all__ = ["Membership", "Signer", "Verifier", "meta_signed_bytes"]
