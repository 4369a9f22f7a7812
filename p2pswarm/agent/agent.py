"""The agent: one trio nursery that drives membership and election over a transport.

Theory of operation. Datagrams arrive sealed; the agent opens them (wrong key, tampering,
replays are dropped and counted by reason), decodes them (malformed ones likewise; see
``intake``), and routes the messages: membership news to the membership machine as one
batch, election messages to the election machine, anything else to a handler registered
for its type. Streams run the secure handshake first, then carry request/response
envelopes, one per frame (``links``). Nothing a peer sends can raise out of the receive
loops: every failure is a counted drop.

Both machines are sans-I/O. The agent executes their effects: a datagram goes to the
outbox (``outbox``; one sender task drains it), a stream request runs in its own task
and feeds the reply back, an event becomes a log line. After every call it feeds the
election the current membership view if that changed, and sets its alarm (``alarm``) to
the earliest deadline of either machine; when the alarm rings, both machines tick.
Leaving (``leaving``) and finding lost fellows again (``rejoin``) are parts of their own.
Services get the agent through small ports (``ports``), never as ``Agent``.

A transport that runs its own event loop (MemoryNetwork) may take over the plumbing:
``send_datagram_nowait`` sends where the agent posts, ``deliver_to`` hands each datagram
over where it lands, and ``call_at`` rings the alarm. Then the agent runs no sender,
receiver or timer task, and a simulated swarm costs a fraction of the task switches.

The agent is built from one value, its world (``AgentWorld``): transport, keys, config
(the machines' tunings among it), card source, random generator, an event sink, the
machines to build and how compute runs. Its clock is trio's, so a MockClock gives virtual
time: the same code runs on real sockets and in simulation, and a simulation variant is
another world, never a patched module.
"""

from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgpack
import trio

from p2pswarm import effects as fx
from p2pswarm import wire
from p2pswarm.agent.admission import (
    ISSUER_METADATA_KEY,
    Admission,
    issuer_addrs,
    legacy_join_refused,
    no_admission,
)
from p2pswarm.agent.alarm import Alarm, LoopLag
from p2pswarm.agent.card_news import CardNews
from p2pswarm.agent.compute import Compute
from p2pswarm.agent.counters import Counters
from p2pswarm.agent.event_ring import EventRing
from p2pswarm.agent.fellow_meta import FellowSays, MetadataViews
from p2pswarm.agent.intake import DatagramHandler, Intake
from p2pswarm.agent.leadership import Leadership
from p2pswarm.agent.leaving import Goodbye, Leaving
from p2pswarm.agent.links import Links, count_failed_handler
from p2pswarm.agent.outbox import OUTBOX_DATAGRAMS, Outbox
from p2pswarm.agent.planning import Planning
from p2pswarm.agent.ports import ControlHandler, StreamHandler
from p2pswarm.agent.rejoin import Rejoin
from p2pswarm.agent.self_watch import SelfWatch
from p2pswarm.agent.serving import Serving
from p2pswarm.agent.status_doc import LeaderDoc, StatusDoc
from p2pswarm.agent.status_report import StatusReport
from p2pswarm.agent.training import Training
from p2pswarm.agent.votes import VOTES_FILE, VoteRecord
from p2pswarm.agent.weights import WeightsCache
from p2pswarm.agent.world import AgentWorld, Services
from p2pswarm.cards import Card, Inventory
from p2pswarm.config import SwarmConfig
from p2pswarm.control.requests import typed_op
from p2pswarm.control.server import serve_control
from p2pswarm.disk_budget import sweep_leftovers
from p2pswarm.election import Election
from p2pswarm.errors import (
    AuthenticationError,
    ConfigError,
    ControlError,
    FellowRevoked,
    KeyRefused,
    NobodyListens,
    RemoteProtocolError,
    SwarmError,
    VersionRefused,
)
from p2pswarm.home import scratch_dir
from p2pswarm.inventory import CardSource
from p2pswarm.membership.machine import Membership
from p2pswarm.membership.member import LocalNode, Member
from p2pswarm.security import DatagramSealer, Identity, Keyring, node_id_of, verify
from p2pswarm.security.ballots import Signatures
from p2pswarm.transport.base import DeliversDatagrams, Transport
from p2pswarm.transport.secure import SecureStream
from p2pswarm.wire.base import Hello, HelloAck
from p2pswarm.wire.control import LeaveRequest, RevokeRequest, StatusRequest
from p2pswarm.wire.gossip import (
    ELECTION_TAGS,
    MEMBERSHIP_TAGS,
    AdmitAsk,
    Alive,
    MemberRecord,
    MetaPull,
    Ping,
    SyncDigest,
    SyncRecords,
)
from p2pswarm.wire.versions import THIS_RELEASE, Release

log = logging.getLogger("p2pswarm.agent")

STREAM_REQUEST_TIMEOUT_S = 5.0  # a membership stream request gives up after this long
LAG_LOGGED_S = 1.0  # a timer this late is worth a log line (at most one a minute)

_MEMBERSHIP_STREAM_TYPES = (Ping, SyncDigest, SyncRecords, MetaPull, Alive)


_LOGGED_EVENTS = {
    fx.JOINED: logging.INFO, fx.MEMBER_JOINED: logging.INFO, fx.SUSPECT: logging.INFO,
    fx.ALIVE: logging.INFO, fx.DEAD: logging.WARNING, fx.LEFT: logging.INFO,
    fx.REFUTED: logging.INFO, fx.LEADER: logging.INFO, fx.NO_LEADER: logging.WARNING,
    fx.ELECTED: logging.INFO, fx.STEPPED_DOWN: logging.WARNING, fx.REAPED: logging.DEBUG,
    fx.METADATA: logging.DEBUG, fx.UPDATED: logging.INFO, fx.JOIN_RETRY: logging.INFO,
}


def _tag(message: Any) -> int:
    return wire.tag_of(type(message))


def fellow_signed(node_id: bytes, public_key: bytes, signature: bytes, data: bytes) -> bool:
    """Whether ``node_id``'s key (the one its id is the hash of) signed ``data``: what the
    election checks votes, ballots, beats and step-downs with."""
    if node_id_of(public_key) != node_id:
        return False
    try:
        verify(public_key, signature, data)
    except AuthenticationError:
        return False
    return True


class Agent:
    def __init__(self, world: AgentWorld) -> None:
        self.world = world
        config, home = world.config, world.home
        self._scratch: dict[str, Path] = {}  # state_dir's directories when home is None
        # files older than this under the home were written by an earlier agent
        self._born_wall_s = time.time()
        # term, vote and electorate survive a restart (one vote per term, however
        # often we crash; never a majority of one)
        self.votes = world.votes if world.votes is not None else (
            VoteRecord.open(home / VOTES_FILE) if home is not None else VoteRecord())
        self.counters = Counters()
        self.sealer = DatagramSealer(world.keyring, world.identity.node_id, world.epoch,
                                     config.security.replay_window_datagrams)
        # what other services publish about us
        self.extra_metadata: dict[str, Any] = dict(world.metadata)
        self.card_news = CardNews(self, world.name, config.inventory, home, world.card_source,
                                  offered=self._offered_cards)
        self._metadata_views = MetadataViews(world.name, self.counters)
        self.membership: Membership | None = None
        self.election: Election | None = None
        self.events: list[fx.Event] = []  # recent events, newest last (for status)
        self.event_ring = EventRing()  # the same and load events, timed (the dashboard)
        self.started_s = 0.0
        self._seen_version = -1
        self.failure: SwarmError | None = None  # why the agent stopped itself, if it did
        self.links = Links(world.name, world.transport, world.keyring, world.identity, config,
                           self.counters, SelfWatch(world.name,
                                                    config.compute.loop_watch_interval_s,
                                                    config.compute.loop_lag_warn_s),
                           self.release_of)
        # the agent watches its own loop and what each fellow makes it hold
        self.links.watch.watch(self.links.held, self._fellow_name)
        self.links.on_stream(Hello, self._on_stream_hello)
        for t in _MEMBERSHIP_STREAM_TYPES:
            self.links.on_stream(t, self._on_membership_stream)
        # admission, where the home holds an admin key's admission file (None: off)
        self.admission = None if world.admission is None else Admission(
            world.name, world.identity, world.home, world.admission)
        if self.admission is not None:
            self.links.on_stream(AdmitAsk, self.admission.on_ask)
            self.links.barred = self.admission.barred
            self.admission.call = self.links.call
            self.admission.issuer_addrs = self._issuer_addrs
            if self.admission.issues(int(time.time())):  # seeds relay joiners' asks here
                self.extra_metadata[ISSUER_METADATA_KEY] = True
        else:  # a swarm made before invitations: nothing to say to an ask (not a drop)
            self.links.on_stream(AdmitAsk, no_admission)
        self.report = StatusReport(self)  # the status answer
        self.control_ops: dict[str, ControlHandler] = {
            "status": typed_op(StatusRequest, lambda _: StatusRequest(),
                               self.report.op_status),
            "leave": typed_op(LeaveRequest, lambda _: LeaveRequest(), self._op_leave),
            "revoke": typed_op(RevokeRequest, lambda _: RevokeRequest(b""), self._op_revoke),
        }
        self._nursery: trio.Nursery | None = None
        self.alarm = Alarm(world.transport, self._ring)
        self._lag_logged_at = -math.inf
        self.outbox = Outbox(world.transport, self.sealer, self.counters,
                             config.transport.max_datagram_bytes, OUTBOX_DATAGRAMS)
        self.intake = Intake(self.sealer, self.counters, config.transport.max_datagram_bytes,
                             self.outbox.post)
        # a transport that runs its own loop may deliver datagrams where they land
        transport = world.transport
        self._deliver_to: Callable[[Callable[[bytes, str], None] | None], None] | None = \
            transport.deliver_to if isinstance(transport, DeliversDatagrams) else None
        self.stopped = trio.Event()  # set once the agent has been asked to stop
        self.leaving = Leaving()
        self.rejoin = Rejoin(world.name, world.seeds, world.rng)
        self.leadership = Leadership(self)
        self.planning = Planning(self, self.leadership)
        self.serving = Serving(self, self.leadership, world.services.stage_runtime)
        services = world.services  # training's timings: the config's, as this world runs them
        self.training = Training(self, self.leadership, timings=config.training.simulating(
            services.training_step_s, step_timeout_s=services.training_step_timeout_s,
            retry_s=services.training_retry_s))
        self._set_up_services(world.services)
        # the dashboard's ring hears loads come and go, after serving's own listeners
        self.serving.events.on_loaded(self._note_loaded)
        self.serving.events.on_unloaded(self._note_unloaded)

    def _set_up_services(self, services: Services) -> None:
        """Hand serving and training what this world sets for them (see ``Services``)."""
        if services.weights_dir is not None:
            self.serving.cache = WeightsCache(services.weights_dir)

    # --- what the world says (the agent's own, read-only) --------------------------------

    @property
    def name(self) -> str:
        return self.world.name

    @property
    def transport(self) -> Transport:
        return self.world.transport

    @property
    def keyring(self) -> Keyring:
        return self.world.keyring

    @property
    def identity(self) -> Identity:
        return self.world.identity

    @property
    def config(self) -> SwarmConfig:
        return self.world.config

    @property
    def rng(self) -> random.Random:
        return self.world.rng

    @property
    def home(self) -> Path | None:
        return self.world.home

    @property
    def card_source(self) -> CardSource | None:
        return self.world.card_source

    @property
    def compute(self) -> Compute:
        """Where torch work runs: worker threads, or inline."""
        return self.world.compute

    # --- identity -------------------------------------------------------------------

    @property
    def node_id(self) -> bytes:
        return self.identity.node_id

    @property
    def addr(self) -> str:
        # the address fellows reach us at, if not the bound one
        return self.world.advertise or self.transport.local_addr

    @property
    def inventory(self) -> Inventory | None:
        """The cards as last read (as offered: less what our stages hold)."""
        return self.card_news.inventory

    @property
    def gossiped_inventory(self) -> Inventory | None:
        """The cards as last told the swarm."""
        return self.card_news.gossiped_inventory

    @property
    def left(self) -> bool:
        """Said goodbye (it may still be waiting for it to spread)."""
        return self.leaving.left

    @property
    def loop_lag(self) -> LoopLag:
        """How late the alarm rang: this fellow's own loop lag."""
        return self.alarm.lag

    def on_datagram(self, message_type: type, handler: DatagramHandler) -> None:
        """Hand datagram messages of ``message_type`` neither machine takes to ``handler``."""
        self.intake.on_datagram(message_type, handler)

    def on_stream(self, message_type: type, handler: StreamHandler) -> None:
        """Answer streams whose first envelope is ``message_type`` (see StreamHandler)."""
        self.links.on_stream(message_type, handler)

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the agent's nursery: a service's timer or reporter that
        ends with the agent. Ignored before the agent runs."""
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    # --- running --------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join the swarm and run until ``stop()`` or cancellation."""
        now = self.started_s = trio.current_time()
        self.card_news.start()
        priority, certificate, gated = self.world.leader_priority, b"", {}
        if self.admission is not None:  # our certificate first: asked of the seeds if new
            certificate = await self.admission.obtain(self.links.call, self.world.seeds)
            priority = self.admission.capped_priority(priority)
            gated = {"admission": self.admission.gate}
            now = trio.current_time()
        local = LocalNode(self.node_id, self.name, self.addr, self.identity.public_key,
                          priority, certificate)
        self.membership = self.world.membership(
            local, self.config.gossip, self.rng, sign=self.identity.sign, verify=verify,
            now=now, metadata=self._metadata(),
            datagram_budget_bytes=self.config.transport.max_datagram_bytes
            - self.sealer.overhead_bytes, epoch=self.sealer.epoch, **gated)
        if self.admission is not None:
            for data in self.admission.setup.revocations:  # kept across restarts
                self.membership.revoke(data, now)
            if self.admission.gate.revoked(self.node_id, self.name):
                raise FellowRevoked("this fellow was revoked by the swarm's admin "
                                    "(`p2pswarm revoke`); it is no member any more")
        self.election = self.world.election(self.node_id, self.name, self.config.election, self.rng,
                                 leader_priority=priority, now=now,
                                 term=self.votes.term, voted_for=self.votes.voted_for,
                                 voters=self.votes.electorate,
                                 signatures=Signatures(self.identity.sign, fellow_signed))
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.transport.serve_streams, self.links.serve)
                if self._deliver_to is not None:
                    self._deliver_to(self._arrived)
                else:
                    nursery.start_soon(self._receive_datagrams)
                if self.outbox.needs_sender:
                    nursery.start_soon(self.outbox.run)
                if self.alarm.needs_timer:  # real time: the loop can lag, watch it
                    nursery.start_soon(self.alarm.run)
                    nursery.start_soon(self.links.watch.run)
                nursery.start_soon(self._reconnect_loop)
                if self.admission is None and self.world.ask_seeds_about_admission:
                    nursery.start_soon(self._ask_seeds_about_admission)
                if self.card_source is not None:
                    nursery.start_soon(self.card_news.run)
                if self.home is not None:
                    await nursery.start(serve_control, self.home, self._answer_control)
                    self._sweep(self.home)
                log.info("%s listening on %s (id %s)", self.name, self.addr,
                         self.node_id.hex()[:8])
                self._apply(self.membership.join(self.world.seeds, now))
                task_status.started()
                await self.stopped.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._nursery = None  # what the transport still delivers or rings is dropped
            if self._deliver_to is not None:
                self._deliver_to(None)
            self.compute.close()  # its idle worker threads go (the nursery awaited the rest)

    def stop(self) -> None:
        self.stopped.set()

    async def leave(self) -> Goodbye:
        """Leave gracefully: fellows mark us ``left``, not dead; then stop. What
        ``goodbye`` says."""
        try:
            return await self.goodbye()
        finally:
            self.stop()

    async def goodbye(self) -> Goodbye:
        """Gossip our leave and wait, ``gossip.leave_timeout_s`` at most, until fellows
        have acknowledged it or it has spread (``Membership.leave_spread``) and the
        datagrams saying it have left the outbox. The agent keeps running: ``stop`` it.
        Returns how many fellows acknowledged, of how many asked, and whether it
        spread."""
        if self.membership is None or self.election is None:
            return Goodbye(0, 0, True)
        now = trio.current_time()
        if self.leaving.begin(now, self.config.gossip.leave_timeout_s):
            log.info("%s: leaving the swarm", self.name)
            self._apply(self.election.leave(now) + self.membership.leave(now))
        await self.leaving.wait(self.outbox.flush)
        acknowledged, asked = self.membership.leave_acknowledgements()
        spread = self.membership.leave_spread
        log.log(logging.INFO if spread else logging.WARNING,
                "%s: %d of %d fellows acknowledged the leave%s", self.name, acknowledged,
                asked, "" if spread else "; gossip carries it to the others")
        return Goodbye(acknowledged, asked, spread)

    # --- the machines ---------------------------------------------------------------

    def _apply(self, effects: list[Any]) -> None:
        """Execute effects; keep the election fed; wake the timer (deadlines moved)."""
        while effects:
            if self.election is not None:  # on disk before any vote or candidacy leaves
                try:
                    self.votes.keep(*self.election.persistent_state())
                except OSError as exc:  # out of descriptors or disk: send nothing now
                    if not self.counters.drops["votes-unsaved"]:
                        log.warning("%s: cannot save the election state (%s); holding its "
                                    "messages back", self.name, exc)
                    self.counters.drop("votes-unsaved")
                    break
            for effect in effects:
                t = type(effect)
                if t is fx.SendDatagram:
                    self.outbox.post(effect.addr, effect.messages)
                elif t is fx.StreamRequest:
                    if self._nursery is not None:
                        self._nursery.start_soon(self._stream_request, effect)
                elif t is fx.Event:
                    self._note(effect)
            effects = self._feed_election()
        if self.left and self.membership is not None and self.membership.leave_spread:
            self.leaving.spread()
        if self.admission is not None and self.membership is not None \
                and self.admission.revocations_changed():  # gossiped ones are kept too
            self.admission.keep_revocations(self.membership.revocations())
        self.alarm.set(self._next_deadline(), trio.current_time())

    def _feed_election(self) -> list[Any]:
        m, e = self.membership, self.election
        if m is None or e is None or m.roster_version == self._seen_version:
            return []
        self._seen_version = m.roster_version
        changed, gone = m.roster_changes()
        return e.update_changed(changed, gone, trio.current_time(), joined=m.joined)

    def _note(self, event: fx.Event) -> None:
        if self.world.on_event is not None:
            self.world.on_event(event)
        if event.kind == fx.REAPED and self.admission is not None \
                and self.membership is not None and "revoked" in event.detail:
            self.admission.keep_revocations(self.membership.revocations())
            if event.node_id == self.node_id:  # this fellow itself: out, and told why
                if self.failure is None:
                    self.failure = FellowRevoked("this fellow was revoked by the swarm's admin "
                                                 "(`p2pswarm revoke`); it is no member any more")
                self.stop()
            else:
                self.admission.barred.add(event.node_id)  # its streams close, none reopen
                self.links.close_fellow(event.node_id)
        if event.kind == fx.DEAD and self.membership is not None:
            member = self.membership.member(event.node_id)
            if member is not None:  # remember where it was: after a partition, call again
                self.rejoin.lost(event.node_id, member.addr)
        if event.kind == fx.ELECTED:
            self.training.elected()  # the jobs the last leader led go on here
            self.serving.elected()  # and so do its loads (failover, adoption)
        elif event.kind in (fx.STEPPED_DOWN, fx.LEADER):
            self.training.leader_changed()  # no longer leading: its drivers stop
        elif event.kind in (fx.MEMBER_JOINED, fx.ALIVE) and event.node_id:
            self.training.takeover.fellow_back(event.node_id)  # copies it may keep
            self.serving.fellow_back()  # ... and loads' orders
        elif event.kind == fx.METADATA and event.node_id:
            self.serving.metadata_changed(event.node_id)  # it may keep loads' orders now
        self.events.append(event)
        del self.events[:-100]
        self.event_ring.note(trio.current_time(), event.kind, event.node_id.hex(), event.name,
                             event.detail, event.term)
        level = _LOGGED_EVENTS.get(event.kind, logging.DEBUG)
        who = f"{event.name} ({event.node_id.hex()[:8]})" if event.node_id else ""
        log.log(level, "%s: %s %s%s", self.name, event.kind, who,
                f": {event.detail}" if event.detail else "")

    def _note_loaded(self) -> None:
        self.event_ring.note(trio.current_time(), "load-up", detail="a load came up")

    def _note_unloaded(self, plan_id: str) -> None:
        self.event_ring.note(trio.current_time(), "load-gone", detail=f"plan {plan_id}")

    def _ring(self, deadline: float) -> None:
        """The alarm set for ``deadline`` rings: tick both machines, unless it was moved."""
        if deadline != self.alarm.at or self._nursery is None or self.stopped.is_set():
            return
        self.alarm.take(deadline)  # _apply sets the next one
        if self.membership is not None and self.election is not None:
            now = trio.current_time()
            self._note_lag(self.alarm.lateness(deadline, now), now)
            self._apply(self.membership.tick(now) + self.election.tick(now))

    def _note_lag(self, lag_s: float, now: float) -> None:
        """The alarm rang ``lag_s`` after its deadline: this fellow's own loop was late
        (its CPU busy with other work). Both machines hear it before their tick, so that
        neither blames a fellow for beats or acks still waiting in the socket."""
        assert self.election is not None and self.membership is not None
        self.election.note_lag(lag_s, now)
        self.membership.note_lag(lag_s, now)
        self.alarm.lag = self.alarm.lag.noted(lag_s)
        if lag_s > LAG_LOGGED_S and now - self._lag_logged_at >= 60.0:
            self._lag_logged_at = now
            log.info("%s: this fellow's loop ran %.1f s late (its CPU is busy); it waits "
                     "%.1f s longer for the leader meanwhile", self.name, lag_s,
                     self.election.stretch())

    def _next_deadline(self) -> float:
        deadlines = [d for d in (self.membership.next_deadline() if self.membership else None,
                                 self.election.next_deadline() if self.election else None)
                     if d is not None]
        return min(deadlines, default=math.inf)

    async def _reconnect_loop(self) -> None:
        """Now and then, sync with a fellow we lost (or a seed, when alone): see
        ``rejoin``. Costs one stream per interval while something is lost."""
        while True:
            await trio.sleep(self.config.gossip.push_pull_interval_s
                             * (0.5 + self.rng.random()))
            if self.membership is None or self.left:
                continue
            addr = self.rejoin.pick({m.node_id for m in self.membership.members()
                                     if m.present})
            if addr is not None:
                self._apply(self.membership.join((addr,), trio.current_time()))

    async def _stream_request(self, request: fx.StreamRequest) -> None:
        try:
            with trio.fail_after(STREAM_REQUEST_TIMEOUT_S):
                reply = await self.call(request.addr, request.message)
        except (SwarmError, trio.TooSlowError) as exc:
            log.debug("stream request to %s failed: %s", request.addr, exc)
            if isinstance(exc, KeyRefused):  # bound to our hello: never a flood's doing
                self._refused_at_join(request.addr)
            elif isinstance(exc, VersionRefused):
                pass  # its one line is logged (links); no hint that the address is wrong
            elif self.membership is not None:
                self.rejoin.unreached(request.addr, self.membership.joined,
                                      str(exc) or f"no answer in {STREAM_REQUEST_TIMEOUT_S:g} s")
            if self.membership is not None:
                self._apply(self.membership.stream_failed(
                    request.request_id, trio.current_time(),
                    nobody_listens=isinstance(exc, NobodyListens)))
            return
        self.rejoin.let_in()
        if self.membership is not None:
            try:
                self._apply(self.membership.handle_reply(request.request_id, reply,
                                                         trio.current_time()))
            except Exception as exc:  # a hostile reply costs that reply, not the agent
                self._handler_failed("reply", request.addr, exc)

    async def _ask_seeds_about_admission(self) -> None:
        """A fellow without admission (a plain join token, or a home made before
        invitations) asks its seeds once: a swarm with an admin key answers that it admits
        by invitation only, and this fellow stops with that line instead of running unseen."""
        failure = await legacy_join_refused(self.links.call, self.world.seeds,
                                            self.identity.public_key, self.name)
        if failure is not None and self.failure is None:
            self.failure = failure
            self.stop()

    def _refused_at_join(self, addr: str) -> None:
        """A seed refused our handshake before any let us in: after a few, the token is
        not the seeds' swarm, and retrying forever would only hide it. Stop and say so."""
        if self.membership is None:
            return
        failure = self.rejoin.refused(addr, self.membership.joined)
        if failure is None or self.failure is not None:
            return
        self.failure = failure
        log.debug("%s: %s", self.name, self.failure)
        self.stop()

    async def _on_membership_stream(self, message: Any, stream: SecureStream) -> Any:
        if self.membership is None:
            return None
        reply, effects = self.membership.handle_stream(message, stream.peer_addr,
                                                       trio.current_time())
        self._apply(effects)
        return reply

    # --- metadata: what this fellow says about itself --------------------------------

    def _offered_cards(self, cards: tuple[Card, ...]) -> tuple[Card, ...]:
        """The cards as this fellow offers them: less what its own stages hold."""
        return self.serving.less_live_stages(cards)

    def _metadata(self) -> bytes:
        cards = self.gossiped_inventory
        return msgpack.packb(  # type: ignore[no-any-return]
            {"cards": [c.to_dict() for c in cards.cards] if cards else [],
             # the world's metadata may say another release (a test plays protocol 1)
             **THIS_RELEASE.to_doc(), **self.extra_metadata}, use_bin_type=True)

    def merge_records(self, records: list[MemberRecord], *, quiet: bool = False) -> None:
        """Take in fellows' membership records (``Membership.self_record``) as anti-entropy
        would; ``quiet``: as after a long calm, with no news to spread (a simulation that
        starts with its swarm formed)."""
        if self.membership is not None:
            self._apply(self.membership.merge_records(records, trio.current_time(),
                                                      quiet=quiet))

    def publish_metadata(self) -> None:
        """Gossip a new version of what this fellow says about itself."""
        if self.membership is not None:
            self._apply(self.membership.set_metadata(self._metadata(), trio.current_time()))

    def fellow_says(self, member: Member) -> FellowSays:
        """What a fellow says about itself, checked once per version it publishes
        (``fellow_meta``: bad entries dropped and counted): its cards, their speeds,
        whether it trains, the stages it serves, the loads whose orders it keeps."""
        return self._metadata_views.says(member, self.fellows)

    # --- datagrams ------------------------------------------------------------------

    async def send(self, addr: str, *messages: Any) -> None:
        """Seal and send messages to ``addr``, several to a datagram where they fit."""
        self.outbox.post_packed(addr, messages)
        await trio.lowlevel.checkpoint()

    def post(self, addr: str, messages: tuple[Any, ...]) -> None:
        """Seal ``messages`` into one datagram to ``addr`` (no packing, no waiting)."""
        self.outbox.post(addr, messages)

    async def _receive_datagrams(self) -> None:
        while True:
            data, addr = await self.transport.receive_datagram()
            self.handle_datagram(data, addr)

    def _arrived(self, data: bytes, addr: str) -> None:  # from deliver_to
        if self._nursery is not None and not self.stopped.is_set():
            self.handle_datagram(data, addr)

    def handle_datagram(self, data: bytes, addr: str) -> None:
        """Open, decode and route one datagram; every failure is a counted drop."""
        got = self.intake.open(data, addr)
        if got is None or self.membership is None or self.election is None:
            return
        opened, messages = got
        if not self.intake.proves_epoch(opened, messages, self.membership.alive_proven):
            self.counters.drop("stale-epoch")
            return
        try:
            self._route_datagram(messages, opened.sender, addr)
        except Exception as exc:  # one hostile message costs that message, never the agent
            self._handler_failed("datagram", addr, exc)

    def _handler_failed(self, where: str, addr: str, exc: Exception) -> None:
        """A handler raised on a peer's message: count it, log it once per kind, go on."""
        count_failed_handler(self.counters, self.name, where, addr, exc)

    def _route_datagram(self, messages: list[Any], sender: bytes, addr: str) -> None:
        assert self.membership is not None and self.election is not None
        now = trio.current_time()
        gossip = [m for m in messages if _tag(m) in MEMBERSHIP_TAGS]
        if self.left:  # only the acks of our goodbye matter now (the machine knows)
            if gossip:
                self._apply(self.membership.handle_datagram(gossip, addr, now))
            return
        effects: list[Any] = []
        try:
            if gossip:
                effects += self.membership.handle_datagram(gossip, addr, now)
            for msg in messages:
                tag = _tag(msg)
                if tag in ELECTION_TAGS:
                    effects += self.election.handle(msg, addr, now)
                elif tag not in MEMBERSHIP_TAGS:
                    self.intake.dispatch(msg, sender, addr)
        except RemoteProtocolError as exc:
            self.counters.drop(exc.reason)
        self._apply(effects)

    # --- streams (``links``) ----------------------------------------------------------

    async def call(self, addr: str, request: Any, *, timeout_s: float | None = None) -> Any:
        """Send one request over a fresh secure stream and return the reply message."""
        return await self.links.call(addr, request, timeout_s=timeout_s)

    async def open_secure(self, addr: str, *, timeout_s: float | None = None) -> SecureStream:
        return await self.links.open_secure(addr, timeout_s=timeout_s)

    async def request(self, stream: SecureStream, request: Any) -> Any:
        return await self.links.request(stream, request)

    async def _on_stream_hello(self, msg: Hello, stream: SecureStream) -> HelloAck:
        if msg.node_id != stream.peer_node_id:
            raise RemoteProtocolError("identity-mismatch", "hello names another node")
        return HelloAck(msg.seq, self.node_id, self.name, self.addr)

    # --- control API ----------------------------------------------------------------

    async def _answer_control(self, request: dict[str, Any]) -> Any:
        op = request.get("op")
        handler = self.control_ops.get(op) if isinstance(op, str) else None
        if handler is None:
            raise ControlError(f"unknown control op {op!r}; this agent knows "
                               f"{', '.join(sorted(self.control_ops))}")
        return await handler(request)

    def _sweep(self, home: Path) -> None:
        """What an agent killed mid-write left in the stores, gone (the control socket
        is ours by now: no other agent writes under this home)."""
        files, nbytes = sweep_leftovers(home, self._born_wall_s)
        if files:
            log.info("removed %d unfinished file(s), %d bytes, that a stopped agent left "
                     "under %s", files, nbytes, home)

    async def _op_revoke(self, request: RevokeRequest) -> dict[str, int | bool]:
        """Take in an admin-signed revocation from the CLI: kept, gossiped, applied."""
        if self.admission is None or self.membership is None:
            raise ConfigError("this fellow's swarm has no admin key: nothing to revoke "
                              "(run `p2pswarm init --upgrade` on the fellow that ran init)")
        before = len(self.membership.members())
        self._apply(self.membership.revoke(request.revocation, trio.current_time()))
        kept = request.revocation in self.membership.revocations()
        if not kept:
            raise ConfigError("the revocation is not signed by this swarm's admin key")
        self.admission.keep_revocations(self.membership.revocations())
        return {"kept": kept, "removed": before - len(self.membership.members())}

    async def _op_leave(self, request: LeaveRequest) -> dict[str, int | bool]:
        """Say goodbye, answer how it went, then stop. ``stop`` only sets an event: the
        nursery is cancelled by ``run``'s task, after this answer has been written."""
        outcome = await self.goodbye()
        self.stop()
        return outcome.to_dict()

    def members(self) -> list[Member]:
        """Every fellow this agent knows, itself included, as the membership lists them."""
        return list(self.membership.members()) if self.membership is not None else []

    def release_of(self, node_id: bytes) -> Release:
        """What ``node_id`` announced of its release (protocol 1 while unknown)."""
        member = self.membership.member(node_id) if self.membership is not None else None
        return Release() if member is None else self.fellow_says(member).release

    def fellows(self) -> list[Member]:
        """Every fellow this agent knows, itself excluded, by name."""
        if self.membership is None:
            return []
        return sorted((m for m in self.membership.members() if not m.is_self),
                      key=lambda m: (m.name, m.node_id))

    def state_dir(self, name: str) -> Path:
        """The directory ``name`` in this agent's state directory (made if missing); a
        fresh temporary one for an agent without a state directory (a bare simulation)."""
        if self.home is None:
            if name not in self._scratch:
                self._scratch[name] = scratch_dir(f"{name}-")
            return self._scratch[name]
        where = self.home / name
        where.mkdir(parents=True, exist_ok=True)
        return where

    def fellow(self, fellow_id: str) -> Member | None:
        """The fellow plans and records name by ``fellow_id`` (its node id in hex)."""
        if self.membership is None or not fellow_id:
            return None
        try:
            return self.membership.member(bytes.fromhex(fellow_id))
        except ValueError:
            return None

    def leader(self) -> LeaderDoc | None:
        """The leader this fellow follows, as ``status`` shows it; None: none."""
        return self.report.leader()

    def status(self) -> StatusDoc:
        return self.report.status()

    def _issuer_addrs(self) -> list[str]:
        return issuer_addrs(self.fellows())

    def _fellow_name(self, node_id: bytes) -> str:
        """How the self watch names a fellow in its log lines."""
        member = self.fellow(node_id.hex())
        return member.name if member is not None else node_id.hex()[:8]


__all__ = ["Agent", "Counters", "Goodbye"]
