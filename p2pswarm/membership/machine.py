"""Membership: SWIM with the Lifeguard refinements, as a sans-I/O state machine.

Theory of operation.

The machine takes in messages, replies and ticks, and gives back effects (datagrams,
stream requests, events). It routes each message to the part it concerns, applies what
the parts decide, and answers news about this node itself (it refutes, or publishes its
metadata again above an old life's). Each part lives in a module of its own, with its
own theory of operation, as memberlist splits its ``state.go``, ``suspicion.go``,
``awareness.go`` and ``queue.go``; the leaves first:

- ``states``: the states and constants the parts share (so none imports the machine);
  ``clock``: the latest ``now``; ``requests``: the stream requests in flight;
- ``roster``: the fellows (one ``Entry`` each), the probe ring, the live set, the reaps
  and the versions a view is read by;
- ``suspicion``: one suspicion's bounds, timer and confirmations; ``awareness``:
  Lifeguard's local health score;
- ``detector``: probing, doubt, watching, suspicions and the dead verdict; a probe that
  ends gives a ``Verdict`` (healthy, doubt, suspect, confirm, declare, ...) that the
  machine applies; ``prober``: the datagrams the detector plans, and relayed pings;
- ``broadcasts``: the queue of updates; ``dissemination``: piggybacking and gossip rounds;
- ``updates``: what news about a fellow does to the view of it (alive, suspect, dead,
  left, reaped); ``gate``: admission by certificate; ``certificates``: relayed Alives
  waiting for their fellow's certificate (relays leave it out; the receiver asks);
  ``credentials``: revocations and certificates exchanged between fellows;
- ``own``: this node's own record and signed ``Alive``; ``refutation``: its answer to
  news about itself; ``proofs``: what fellows sign, checked;
- ``metadata``, ``leave``, ``join``, ``sync`` (anti-entropy): each its book and exchange.

Time comes in as ``now`` on every call: an entry point (``_entry``) moves the clock
forward once, before anything else. Randomness comes from the injected ``random.Random``,
drawn in one fixed order (the constructor's draws included), so a seeded run replays
exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

from p2pswarm import effects as fx
from p2pswarm.config import GossipConfig, GossipTuning
from p2pswarm.effects import Effect, Event
from p2pswarm.membership import metadata as meta
from p2pswarm.membership.broadcasts import item_bytes
from p2pswarm.membership.clock import Clock
from p2pswarm.membership.credentials import CredentialExchange
from p2pswarm.membership.detector import FailureDetector, Verdict
from p2pswarm.membership.dissemination import Dissemination
from p2pswarm.membership.gate import AdmissionGate
from p2pswarm.membership.join import Join
from p2pswarm.membership.leave import LeaveHandshake
from p2pswarm.membership.member import LocalNode, Member
from p2pswarm.membership.own import OwnRecord
from p2pswarm.membership.prober import ACK_ITEM, Prober
from p2pswarm.membership.proofs import (
    U32_MAX,
    ProofCache,
    Signer,
    Verifier,
    left_signed_bytes,
    meta_signed_bytes,
)
from p2pswarm.membership.refutation import Refuter
from p2pswarm.membership.requests import StreamRequests
from p2pswarm.membership.roster import Roster
from p2pswarm.membership.round_trips import ProbeRoundTrips
from p2pswarm.membership.states import ALIVE, COUNTERS, INF, LEFT, SEQ_MOD
from p2pswarm.membership.sync import AntiEntropy, record_alive
from p2pswarm.membership.updates import Updates
from p2pswarm.wire.gossip import (  # importing it registers the messages with the codec
    Ack,
    Alive,
    CertificateAsk,
    Certificates,
    Dead,
    Left,
    MemberRecord,
    MetaPull,
    MetaPush,
    Nack,
    Noted,
    Ping,
    PingReq,
    Revoked,
    Suspect,
    SyncDigest,
    SyncRecords,
    SyncSame,
    SyncSummary,
)

if TYPE_CHECKING:  # a type only: the driver hands in its generator, seeded or not
    from p2pswarm.randomness import Rng


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _entry(method: Callable[Concatenate[Membership, _P], _R]
           ) -> Callable[Concatenate[Membership, _P], _R]:
    """An entry point: the ``now`` it is given (its last positional argument, or named)
    moves the machine's clock forward before anything else."""

    def entry(self: Membership, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self._clock.advance(cast(float, kwargs["now"] if "now" in kwargs else args[-1]))
        return method(self, *args, **kwargs)

    functools.update_wrapper(entry, method)
    return entry


class Membership:
    """One node's view of the swarm; drive it with handle/tick/next_deadline."""

    def __init__(
        self,
        local: LocalNode,
        config: GossipConfig,
        rng: Rng,
        *,
        sign: Signer,
        verify: Verifier,
        now: float = 0.0,
        incarnation: int = 0,
        metadata: bytes = b"",
        datagram_budget_bytes: int = 1340,
        epoch: int = 0,
        admission: AdmissionGate | None = None,
    ) -> None:
        self._clock = Clock(now)  # the latest `now` we were given
        self._own = OwnRecord(local, sign, self._clock, config.tuning.meta_inline_bytes,
                              incarnation=incarnation, metadata=metadata, epoch=epoch)
        self.config = config
        self.rng = rng
        self.stats: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._proofs = ProofCache(verify, self.stats)
        self._roster = Roster(local.node_id, rng)
        # the draws in this order: first probe, first sync, first reconnect, probe seq
        next_probe_at = now + rng.random() * config.probe_interval_s
        next_sync_at = now + config.push_pull_interval_s * (0.5 + rng.random())
        next_reconnect_at = now + config.tuning.reconnect_interval_s * (0.5 + rng.random())
        self._detector = FailureDetector(local.node_id, config, rng, self._roster, self.stats,
                                         next_probe_at=next_probe_at,
                                         seq=rng.randrange(SEQ_MOD), now=now)
        self._gossip = Dissemination(config, rng, self._roster, self._clock,
                                     datagram_budget_bytes)
        self._requests = StreamRequests()
        self._book = meta.MetadataBook(self._roster, self._proofs, self._requests, self._gossip,
                                       self.stats, config.tuning.meta_pull_retry_s)
        self._updates = Updates(local.node_id, local.name, config, self._roster, self._detector,
                                self._gossip, self._book, self._proofs, self.stats)
        # where the swarm has an admin key: only certified fellows are members
        self.admission = admission
        self._updates.gate = admission
        if admission is not None:
            admission.stats = self.stats
        self._sign = sign
        self._prober = Prober(local.node_id, self._detector, self._roster, self._gossip,
                              self._requests, config.tuning.meta_inline_bytes)
        self._leave = LeaveHandshake(config, self._roster, self._detector.next_seq)
        self._sync = AntiEntropy(config, rng, self._own, self._leave, self._roster,
                                 self._requests, self._updates, self._book,
                                 next_sync_at=next_sync_at, next_reconnect_at=next_reconnect_at)
        self._join = Join(config, self._own, self._leave, self._requests)
        self._refuter = Refuter(config, self._own, self._leave, self._detector.awareness,
                                self._roster, self._gossip, self._requests, self._updates,
                                self.stats)
        self._credentials = credentials = CredentialExchange(
            admission, self._own, self._roster, self._gossip, self._updates, self.stats,
            datagram_budget_bytes)
        self._dispatch: dict[type, Callable[[Any, str, float, list[Effect]], None]] = {
            Ping: self._on_ping, Ack: self._on_ack, Nack: self._on_nack,
            PingReq: self._on_ping_req, Alive: self._on_alive, Suspect: self._on_suspect,
            Dead: self._on_dead, Left: self._on_left, SyncSame: self._on_nothing,
            SyncSummary: self._sync.on_summary, SyncRecords: self._on_sync_records,
            MetaPush: self._book.on_push, Noted: self._on_nothing,
            Revoked: credentials.on_revoked, CertificateAsk: credentials.on_certificate_ask,
            Certificates: credentials.on_certificates,
        }

    # --- views -------------------------------------------------------------------------

    @property
    def node_id(self) -> bytes:
        return self.local.node_id

    @property
    def local(self) -> LocalNode:
        return self._own.local

    @property
    def epoch(self) -> int:
        """Our datagram epoch, signed into our Alive."""
        return self._own.epoch

    @property
    def incarnation(self) -> int:
        return self._own.incarnation

    @incarnation.setter
    def incarnation(self, incarnation: int) -> None:
        self._own.incarnation = incarnation

    @property
    def metadata(self) -> bytes:
        return self._own.metadata

    @property
    def meta_version(self) -> int:
        return self._own.meta_version

    @meta_version.setter
    def meta_version(self, version: int) -> None:
        self._own.meta_version = version

    @property
    def meta_signature(self) -> bytes | None:
        return self._own.meta_signature

    @meta_signature.setter
    def meta_signature(self, signature: bytes | None) -> None:
        self._own.meta_signature = signature

    @property
    def tuning(self) -> GossipTuning:
        return self.config.tuning

    @property
    def joined(self) -> bool:
        return self._join.joined

    @property
    def version(self) -> int:
        """Bumps on every change a view would show."""
        return self._roster.version

    @property
    def roster_version(self) -> int:
        """Bumps when who is in, where, in what state changes."""
        return self._roster.roster_version

    @property
    def health_score(self) -> int:
        """Lifeguard local health: 0 is healthy; probes slow down by score + 1."""
        return self._detector.awareness.score

    @property
    def loss_estimate(self) -> float:
        """Fraction of recent direct pings that missed their ack."""
        return self._detector.loss

    def members(self) -> tuple[Member, ...]:
        """Every fellow this node knows (this node included, ``is_self``), by node id."""
        out = [self._self_view()]
        out.extend(e.view() for e in self._roster.members.values())
        out.sort(key=lambda m: m.node_id)
        return tuple(out)

    def roster_changes(self) -> tuple[tuple[Member, ...], tuple[bytes, ...]]:
        """What changed in the roster since the last call (an election's feed, which then
        costs what changed, not the size of the swarm): the views of fellows whose
        presence, state, name, address or priority changed, this node included, and the ids
        of those no longer known. The first call gives everyone."""
        changed: list[Member] = []
        gone: list[bytes] = []
        for node in self._roster.take_changes():
            e = self._roster.get(node)
            if node == self.node_id:
                changed.append(self._self_view())
            elif e is None:
                gone.append(node)
            else:
                changed.append(e.view())
        return tuple(changed), tuple(gone)

    def member(self, node_id: bytes) -> Member | None:
        if node_id == self.node_id:
            return self._self_view()
        e = self._roster.get(node_id)
        return None if e is None else e.view()

    def _self_view(self) -> Member:
        return self._own.view(self._leave.leaving)

    def self_record(self) -> MemberRecord:
        return self._own.record(self._leave.leaving)

    def counters(self) -> dict[str, int]:
        return dict(self.stats)

    @property
    def probe_round_trips(self) -> ProbeRoundTrips:
        """Direct probes' round trips so far (read by ``/metrics``)."""
        return self._prober.round_trips

    def digest(self) -> bytes:
        """SHA-256 over (id, incarnation, state, metadata version) of every member."""
        return self._sync.digest()

    # --- driving -----------------------------------------------------------------------

    @_entry
    def join(self, seed_addrs: Iterable[str], now: float) -> list[Effect]:
        """Join through these seeds (retried with backoff); none: found a new swarm."""
        seeds = tuple(a for a in seed_addrs if a != self.local.addr)
        out: list[Effect] = []
        self._join.start(seeds)
        if not seeds:
            self._join.joined = True
            self._changed()  # the election waits for this
            out.append(Event(fx.JOINED, self.node_id, self.local.name, "founded a new swarm"))
            return out
        self._join.attempt(now, out)
        return out

    @_entry
    def leave(self, now: float) -> list[Effect]:
        """Say goodbye: fellows mark this node ``left``, not dead. Keep ticking (and
        handing in datagrams) until ``leave_spread``, or ``leave_timeout_s`` at most."""
        out: list[Effect] = []
        if self._leave.leaving:
            return out
        goodbye = self._goodbye()
        self._leave.begin(goodbye, now, out)
        self._gossip.queue.add(self.node_id, goodbye)
        self._detector.probe = None
        self._changed()
        out.append(Event(fx.LEFT, self.node_id, self.local.name, "this node left the swarm",
                         self.incarnation, self.node_id))
        return out

    @property
    def leave_spread(self) -> bool:
        """Whether our goodbye has got around (see ``leave``); False before ``leave``."""
        return self._leave.spread(self.config.indirect_checks,
                                  self._gossip.queue.retired(self.node_id))

    def leave_acknowledgements(self) -> tuple[int, int]:
        """(fellows that acknowledged our leave, fellows asked to)."""
        return self._leave.acked, self._leave.asked

    def set_metadata(self, metadata: bytes, now: float) -> list[Effect]:
        """Publish new metadata: a new version, announced by gossip, pulled by fellows.
        Nothing while leaving: its new incarnation would take the goodbye back."""
        if self._leave.leaving:
            return []
        if self._own.exhausted():
            self.stats["incarnation_exhausted"] += 1  # saturated: keep what fellows hold
            return []
        return self._publish_metadata(metadata, now)

    @_entry
    def _publish_metadata(self, metadata: bytes, now: float) -> list[Effect]:
        self._own.publish(metadata)
        self._news_of_metadata(now)
        self._gossip.queue.add(self.node_id, self._alive_msg())
        self._changed(roster=False)
        return [Event(fx.METADATA, self.node_id, self.local.name,
                      f"published metadata version {self.meta_version}", self.incarnation,
                      self.node_id)]

    def _outdo_old_metadata(self, seen_version: int, seen_incarnation: int,
                            seen_metadata: bytes | None, now: float, out: list[Effect]) -> None:
        """Fellows still hold metadata of ours from before a restart, at a version as high
        as our fresh one: publish ours again above it, or theirs would keep winning."""
        stale = meta.outdone(seen_version, seen_incarnation, seen_metadata,
                             self.meta_version, self.incarnation, self.metadata)
        if stale and self.metadata and not self._leave.leaving:
            if seen_version >= U32_MAX or self.incarnation >= U32_MAX:
                self.stats["incarnation_exhausted"] += 1
                return
            self._own.meta_version = seen_version
            out.extend(self.set_metadata(self.metadata, now))

    def piggyback(self, budget_bytes: int, now: float | None = None) -> list[Any]:
        """Queued updates fitting in ``budget_bytes`` (item bytes, envelope not included),
        to ride on a datagram the driver sends anyway."""
        if now is not None:  # an entry point whose time is optional
            self._clock.advance(now)
        return self._gossip.queue.take(budget_bytes, self._gossip.limit(), self._clock.now)

    @_entry
    def handle(self, message: Any, sender_addr: str, now: float) -> list[Effect]:
        """One message from a datagram, or the reply to one of our stream requests."""
        out: list[Effect] = []
        self._received(sender_addr, now, out)
        handler = self._dispatch.get(type(message))
        if handler is not None:
            handler(message, sender_addr, now, out)
        self._credentials.ask_certificates(out)
        return out

    @_entry
    def handle_datagram(self, messages: Sequence[Any], sender_addr: str,
                        now: float) -> list[Effect]:
        """All membership messages of one datagram: news first, then pings, so that the
        ack of a ping carries the refutation of a suspicion that came with it."""
        out: list[Effect] = []
        pings = [m for m in messages if type(m) is Ping]
        self._refuter.replying_to = sender_addr if pings else None
        self._received(sender_addr, now, out)
        for msg in messages:
            if type(msg) is not Ping:
                handler = self._dispatch.get(type(msg))
                if handler is not None:
                    handler(msg, sender_addr, now, out)
        for msg in pings:
            self._on_ping(msg, sender_addr, now, out)
        self._refuter.replied()
        self._credentials.ask_certificates(out)
        return out

    def _received(self, sender_addr: str, now: float, out: list[Effect]) -> None:
        """A datagram got through to us. After a long deafness (a probe of ours heard
        nothing at all, and nothing else came for a while: our own radio was out),
        fellows may be suspecting us: refute before they even tell us."""
        if self._detector.heard_datagram(now) and self._join.joined \
                and not self._leave.leaving:
            self.stats["refutations_unasked"] += 1
            self._refute(self.incarnation, None, sender_addr, now, out)

    def handle_reply(self, request_id: int, reply: Any, now: float) -> list[Effect]:
        """The reply to ``StreamRequest`` ``request_id``."""
        pending = self._requests.pop(request_id)
        self._join.forget(request_id)
        addr = pending.addr if pending is not None else ""
        return self.handle(reply, addr, now)

    @_entry
    def handle_stream(self, message: Any, sender_addr: str,
                      now: float) -> tuple[Any | None, list[Effect]]:
        """Answer a stream request from a fellow: (reply or None to close, effects)."""
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
            return self._sync.answer_digest(message), out
        if t is SyncRecords:
            self._heard(message.source, now)
            self._merge_records(message.records, message.source, now, out, sender_addr)
            return self._sync.answer_records(message), out
        if t is MetaPull:
            records = tuple(r for r in (self._sync.record(n) for n in message.nodes)
                            if r is not None and r.meta_version > 0)
            return MetaPush(records), out
        if t is Alive:
            self._on_alive(message, sender_addr, now, out)
            return Noted(), out
        return None, out

    @_entry
    def stream_failed(self, request_id: int, now: float, *,
                      nobody_listens: bool = False) -> list[Effect]:
        """Stream request ``request_id`` failed; ``nobody_listens``: the peer's host
        refused the connection (its process is gone, not behind a fade)."""
        out: list[Effect] = []
        pending = self._requests.pop(request_id)
        p = self._detector.probe
        if nobody_listens and pending is not None and pending.kind == "ping":
            if p is not None and (p.addr, p.seq) == (pending.addr, pending.extra):
                p.gone = True  # judged when the probe ends
            else:
                verdict = self._detector.refused_late(pending.addr)
                if verdict is not None:
                    self._apply(verdict, now, out)
        self._join.failed(request_id, now, out)
        if pending is not None and pending.kind == "meta":
            self._book.failed(pending.extra, now)
        return out

    def next_deadline(self) -> float | None:
        leaving = self._leave.leaving
        t = INF if self._join.joined or leaving else self._join.next_at
        t = min(t, self._leave.deadline())
        t = self._detector.deadline(t, probing=not leaving)
        if not leaving and self._join.joined:
            roster = self._roster
            if roster.live:
                t = min(t, self._sync.next_sync_at)
            if len(roster.members) > len(roster.live) or roster.lost:
                t = min(t, self._sync.next_reconnect_at)
        t = self._gossip.deadline(t)
        reap_at = self._roster.next_reap_at()
        if reap_at is not None and reap_at < t:
            t = reap_at
        return None if t == INF else t

    def note_lag(self, lag_s: float, now: float) -> None:
        """This node's own loop woke ``lag_s`` late at ``now`` (its CPU busy with other
        work). Past a probe timeout that is trouble of its own, as Lifeguard counts it: the
        score rises (probes slow down, and a bad score passes no dead verdicts), and a
        probe in flight waits its timeout again from now, so that acks and nacks already
        waiting in the socket are read before the probe is judged failed."""
        if not self.config.probe_timeout_s < lag_s < INF:
            return
        self._detector.note_lag(now)

    @_entry
    def tick(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        leaving = self._leave.leaving
        detector = self._detector
        if not self._join.joined and not leaving and now >= self._join.next_at:
            self._join.attempt(now, out)
        if self._leave.due(now):
            self._leave.ask_again(self._goodbye(), now, out)
        self._prober.expire_relays(now, out)
        if not leaving:
            verdict = self._prober.timeouts(now, out)
            if verdict is not None:
                self._apply(verdict, now, out)
            if detector.suspicions:
                for node in detector.expire(now):
                    self._updates.declare_dead(node, now, out)
            if detector.probe is None and now >= detector.next_probe_at:
                self._start_probe(now, out)
            if self._join.joined and now >= self._sync.next_sync_at:
                self._sync.start(now, out)
            if self._join.joined and now >= self._sync.next_reconnect_at:
                self._sync.reconnect(now, out)
        if self._gossip.due(now):
            self._gossip.gossip(now, out)
        for node in self._roster.due_reaps(now):
            self._updates.reap(node, now, out)
        return out

    def merge_records(self, records: Iterable[MemberRecord], now: float, *,
                      quiet: bool = False) -> list[Effect]:
        """Take in full records (as from anti-entropy). ``quiet``: no gossip, no events;
        for building an already converged swarm in simulations."""
        out: list[Effect] = []
        self._gossip.quiet = quiet
        try:
            self._merge_records(tuple(records), b"", now, out)
        finally:
            self._gossip.quiet = False
        if quiet:
            out = [e for e in out if not isinstance(e, Event)]
        return out

    # --- probing -----------------------------------------------------------------------

    def _start_probe(self, now: float, out: list[Effect]) -> None:
        self._book.retry(now, out)
        self._prober.start(now, out)

    def _apply(self, verdict: Verdict, now: float, out: list[Effect]) -> None:
        """Do what the failure detector's verdict on a fellow says."""
        target, kind = verdict.target, verdict.kind
        e = self._roster.get(target)
        if e is None and kind != "healthy":
            return  # expelled (revoked) while the probe was out
        if kind == "healthy":
            if e is not None:
                e.last_heard = now
        elif kind == "suspect":
            assert e is not None
            self._updates.start_suspicion(target, e.incarnation, self.node_id, verdict.start_s,
                                          now, out, silent_since=verdict.silent_since_s)
            if verdict.nobody_listens:
                self._detector.nobody_listens(target)
        elif kind in ("confirm", "declare"):
            assert e is not None
            if verdict.news is not None:
                self._gossip.queue.add(target, verdict.news)
                out.append(Event(fx.SUSPECT, target, e.name, "confirmed by this node",
                                 e.incarnation, self.node_id))
            if kind == "declare":
                self._updates.declare_dead(target, now, out)

    # --- this node --------------------------------------------------------------------

    def _refute(self, seen_incarnation: int, accuser: bytes | None, sender_addr: str,
                now: float, out: list[Effect]) -> None:
        """Every refutation goes through here (see ``refutation``): the simulation harness
        plants a fellow that never refutes by overriding it."""
        self._refuter.refute(seen_incarnation, accuser, sender_addr, now, out)

    def _goodbye(self) -> Left:
        """Our ``Left``, signed: nobody else can make us left."""
        return Left(self.node_id, self.incarnation,
                    self._sign(left_signed_bytes(self.node_id, self.incarnation)))

    def _alive_msg(self) -> Alive:
        return self._own.alive()

    def alive_proven(self, msg: Alive) -> bool:
        """Whether ``msg`` carries its owner's valid signature (cached)."""
        return self._proofs.alive(msg)

    def _news_of_metadata(self, now: float) -> None:
        """Our Alives carry our metadata while gossip spreads its news (a join or a new
        version): a refutation then does not take it out of the queue. Later Alives only
        announce the version, so refutations stay small."""
        self._own.meta_news_until = now + self._gossip.limit() * self.config.gossip_interval_s

    # --- incoming ----------------------------------------------------------------------

    def _on_nothing(self, msg: Any, addr: str, now: float, out: list[Effect]) -> None:
        return

    def _on_ping(self, msg: Ping, addr: str, now: float, out: list[Effect]) -> None:
        if msg.target != self.node_id:
            return
        if self._leave.leaving:  # answer only the goodbye of another leaver (fellows
            e = self._roster.get(msg.source)  # leaving together each wait for the others')
            if e is None or e.state != LEFT:
                return
        self._prober.heard(msg.source, now)
        msgs: list[Any] = [Ack(msg.seq)]
        size = ACK_ITEM
        riders = self._refuter.riders(addr)  # our refutation, if the ping told us news
        if riders:
            msgs.extend(riders)
            size += sum(item_bytes(m) for m in riders)
        news = self._prober.news_about(msg.source)  # tell a suspect who pings us, too
        if news is not None:
            msgs.append(news)
            size += item_bytes(news)
        self._gossip.send(out, addr, msgs, size)

    def _on_ack(self, msg: Ack, addr: str, now: float, out: list[Effect]) -> None:
        if self._leave.acknowledged(msg.seq):
            return
        verdict = self._prober.on_ack(msg, now, out)
        if verdict is not None:
            self._apply(verdict, now, out)

    def _on_nack(self, msg: Nack, addr: str, now: float, out: list[Effect]) -> None:
        verdict = self._prober.on_nack(msg, now)
        if verdict is not None:
            self._apply(verdict, now, out)

    def _on_ping_req(self, msg: PingReq, addr: str, now: float, out: list[Effect]) -> None:
        if not self._leave.leaving:
            self._prober.relay(msg, addr, now, out)

    def _on_alive(self, msg: Alive, addr: str, now: float, out: list[Effect]) -> None:
        if msg.node != self.node_id:
            self._updates.alive(msg, addr, now, out)
            return
        if not self._proofs.proven(msg):
            return
        seen = msg.metadata if msg.meta_signature is not None and self._our_meta_proven(
            msg.meta_version, msg.metadata, msg.meta_signature) else None
        self._outdo_old_metadata(msg.meta_version, msg.incarnation, seen, now, out)
        if msg.incarnation > self.incarnation or (
                msg.incarnation == self.incarnation
                and (msg.addr != self.local.addr or msg.public_key != self.local.public_key)):
            self._refute(msg.incarnation, None, "", now, out)

    def _on_suspect(self, msg: Suspect, addr: str, now: float, out: list[Effect]) -> None:
        if msg.node == self.node_id:
            self._refute(self._refuter.about_us(msg.incarnation, addr, now, out), msg.source,
                         addr, now, out)
        else:
            self._updates.suspect(msg, now, out)

    def _on_dead(self, msg: Dead, addr: str, now: float, out: list[Effect]) -> None:
        if msg.node == self.node_id:
            self._refute(self._refuter.about_us(msg.incarnation, addr, now, out), msg.source,
                         addr, now, out)
        else:
            self._updates.dead(msg, now, out)

    def _on_left(self, msg: Left, addr: str, now: float, out: list[Effect]) -> None:
        if msg.node == self.node_id:
            self._refute(self._refuter.about_us(msg.incarnation, addr, now, out), None, addr,
                         now, out)
        else:
            self._updates.left(msg, now, out)

    @_entry
    def revoke(self, data: bytes, now: float) -> list[Effect]:
        """Take in an admin-signed revocation (from the CLI, a home, or a fellow): the
        fellows it names are out of the view at once, and it is gossiped on."""
        out: list[Effect] = []
        self._credentials.on_revoked(Revoked(data), "", now, out)
        return out

    def revocations(self) -> tuple[bytes, ...]:
        """Every revocation taken in (to keep across restarts)."""
        gate = self.admission
        return () if gate is None else tuple(r.encode() for r in gate.revocations())

    # --- state changes -----------------------------------------------------------------

    def _changed(self, roster: bool = True) -> None:
        """Something a view of this node shows changed; ``roster``: its presence, state,
        name, address or priority (what an election reads), not just metadata or
        incarnation."""
        self._roster.changed(self.node_id, roster)

    def _heard(self, node: bytes, now: float) -> None:
        self._prober.heard(node, now)

    # --- anti-entropy ------------------------------------------------------------------

    def _on_sync_records(self, msg: SyncRecords, addr: str, now: float,
                         out: list[Effect]) -> None:
        self._heard(msg.source, now)
        self._merge_records(msg.records, msg.source, now, out, addr)
        if not self._join.joined:
            self._join.done()
            self._changed()  # the election waits for this, even if no record was new
            self._news_of_metadata(now)
            self._gossip.queue.add(self.node_id, self._alive_msg())
            out.append(Event(fx.JOINED, self.node_id, self.local.name,
                             f"joined through {addr}; {len(self._roster.live) + 1} fellows "
                             "alive"))

    def _merge_records(self, records: Sequence[MemberRecord], source: bytes, now: float,
                       out: list[Effect], sender_addr: str = "") -> None:
        gate = self.admission
        if gate is None:
            self._merge_each(records, now, out, source)
            return
        # many records in one message: a cap on the signature checks it may cost, paid
        # from its sender's budget
        gate.begin_message()
        self._updates.sender = sender_addr or source.hex()  # its address: not its word
        try:
            self._merge_each(records, now, out, source)
        finally:
            gate.end_message()
            self._updates.sender = ""

    def _merge_each(self, records: Sequence[MemberRecord], now: float, out: list[Effect],
                    source: bytes) -> None:
        for r in records:
            if r.node != self.node_id:
                self._sync.merge(r, source, now, out)
                continue
            if not self._proofs.proven(record_alive(r)):  # only what we signed counts
                continue
            if self._our_meta_proven(r.meta_version, r.metadata, r.meta_signature):
                self._outdo_old_metadata(r.meta_version, r.incarnation, r.metadata, now, out)
            if r.incarnation >= self.incarnation and (
                    r.state != ALIVE or r.incarnation > self.incarnation
                    or r.addr != self.local.addr):
                self._refute(r.incarnation, None, "", now, out)

    # --- metadata ----------------------------------------------------------------------

    def _sign_meta(self) -> bytes:
        return self._own.sign_meta()

    def _our_meta_proven(self, version: int, metadata: bytes, signature: bytes | None) -> bool:
        return self._own.meta_proven(self._proofs, version, metadata, signature)


__all__ = ["Membership", "Signer", "Verifier", "meta_signed_bytes"]
