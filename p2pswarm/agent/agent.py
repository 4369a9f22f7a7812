"""The agent: one trio nursery that drives membership and election over a transport.

Theory of operation. Datagrams arrive sealed; the agent opens them (wrong key, tampering,
replays are dropped and counted by reason), decodes them (malformed ones likewise), and
routes the messages: membership news to the membership machine as one batch, election
messages to the election machine, anything else to a handler registered for its type.
Streams run the secure handshake first, then carry request/response envelopes, one per
frame. Nothing a peer sends can raise out of the receive loops: every failure is a
counted drop.

Both machines are sans-I/O. The agent executes their effects: a datagram goes to the
outbox (one sender task drains it), a stream request runs in its own task and feeds the
reply back, an event becomes a log line. After every call it feeds the election the
current membership view if that changed, and sets its alarm to the earliest deadline of
either machine; when the alarm rings, both machines tick.

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
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgpack
import trio

from p2pswarm import effects as fx
from p2pswarm import wire
from p2pswarm.agent.card_news import CardNews
from p2pswarm.agent.counters import Counters
from p2pswarm.agent.fellow_meta import clean_metadata
from p2pswarm.agent.leadership import Leadership
from p2pswarm.agent.planning import Planning
from p2pswarm.agent.serving import Serving
from p2pswarm.agent.training import Training
from p2pswarm.agent.votes import VOTES_FILE, VoteRecord
from p2pswarm.agent.weights import WeightsCache
from p2pswarm.agent.world import AgentWorld, Services
from p2pswarm.cards import Inventory
from p2pswarm.control.server import serve_control
from p2pswarm.election import Election
from p2pswarm.home import scratch_dir
from p2pswarm.errors import (
    AuthenticationError,
    ControlError,
    HandshakeRefused,
    NobodyListens,
    RemoteProtocolError,
    SwarmError,
    TokenRefused,
    TransportError,
    VersionMismatch,
)
from p2pswarm.membership.machine import Membership
from p2pswarm.membership.member import LocalNode, Member
from p2pswarm.security import DatagramSealer, OpenedDatagram, node_id_of, verify
from p2pswarm.security.ballots import Signatures
from p2pswarm.transport.base import DeliversDatagrams, RingsAlarms, SendsNowait, Stream
from p2pswarm.transport.secure import SecureStream, secure_accept, secure_connect
from p2pswarm.wire.base import Hello, HelloAck, Refusal
from p2pswarm.wire.gossip import ELECTION_TAGS, MEMBERSHIP_TAGS, Alive, MemberRecord, MetaPull
from p2pswarm.wire.gossip import Ping, SyncDigest, SyncRecords

log = logging.getLogger("p2pswarm.agent")

DatagramHandler = Callable[[Any, bytes, str], None]  # (message, sender node id, sender addr)
# Returns the reply message, or None to end the stream. A handler may instead keep the
# stream for itself (raw frames, e.g. tensors) and return None when it is done with it.
StreamHandler = Callable[[Any, SecureStream], Awaitable[Any]]
ControlHandler = Callable[[dict[str, Any]], Awaitable[Any]]

OUTBOX_DATAGRAMS = 4096  # datagrams waiting for the sender task before new ones are dropped
STREAM_REQUEST_TIMEOUT_S = 5.0  # a membership stream request gives up after this long
LAG_LOGGED_S = 1.0  # a timer this late is worth a log line (at most one a minute)
JOIN_REFUSALS = 3  # handshakes seeds refuse, none let in, before joining gives up

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
        self.name = world.name
        self.transport = world.transport
        self.keyring = world.keyring
        self.identity = world.identity
        self.config = config = world.config
        self.rng = world.rng
        self.seeds = world.seeds
        self.home = home = world.home
        self._scratch: dict[str, Path] = {}  # state_dir's directories when home is None
        self.advertise = world.advertise  # the address fellows reach us at, if not the bound one
        self.leader_priority = world.leader_priority
        self.card_source = world.card_source
        self.compute = world.compute  # where torch work runs: worker threads, or inline
        # term, vote and electorate survive a restart (one vote per term, however
        # often we crash; never a majority of one)
        self.votes = world.votes if world.votes is not None else (
            VoteRecord.open(home / VOTES_FILE) if home is not None else VoteRecord())
        self.counters = Counters()
        self.sealer = DatagramSealer(world.keyring, world.identity.node_id, world.epoch,
                                     config.security.replay_window_datagrams)
        self.inventory: Inventory | None = None  # the cards as last read
        self.gossiped_inventory: Inventory | None = None  # ... as last told the swarm
        self.card_news = CardNews(self)
        # what other services publish about us
        self.extra_metadata: dict[str, Any] = dict(world.metadata)
        # each fellow's metadata as last checked: (its bytes, the clean view of them)
        self._metadata_views: dict[bytes, tuple[bytes, dict[str, Any]]] = {}
        self.membership: Membership | None = None
        self.election: Election | None = None
        self.events: list[fx.Event] = []  # recent events, newest last (for status)
        self.started_s = 0.0
        self._seen_version = -1
        self._lost: dict[bytes, str] = {}  # fellows declared dead -> their last address
        self._refused_addrs: set[str] = set()
        self._join_refusals = 0  # seeds' refused handshakes in a row, before we are in
        self._streams_of: Counter[bytes] = Counter()  # accepted streams open, per fellow
        self.failure: SwarmError | None = None  # why the agent stopped itself, if it did
        self._datagram_handlers: dict[type, DatagramHandler] = {Refusal: self._on_refusal}
        self._stream_handlers: dict[type, StreamHandler] = {Hello: self._on_stream_hello}
        for t in _MEMBERSHIP_STREAM_TYPES:
            self._stream_handlers[t] = self._on_membership_stream
        self.control_ops: dict[str, ControlHandler] = {
            "status": self._op_status, "leave": self._op_leave,
        }
        self._nursery: trio.Nursery | None = None
        self._alarm_at = math.inf  # when both machines tick next
        self._alarm_set_at = 0.0  # when it was set: a deadline already past then is no lag
        # how late the alarm rang (this fellow's own loop lag): max, counts, last logged
        self.loop_lag = {"max_s": 0.0, "over_0_1_s": 0, "over_1_s": 0}
        self._lag_logged_at = -math.inf
        self._alarm = trio.CancelScope()  # the timer task sleeps in it until _alarm_at
        self._outbox_in, self._outbox_out = trio.open_memory_channel[tuple[str, bytes]](
            OUTBOX_DATAGRAMS)
        # a transport that takes a datagram without waiting (in memory) is sent to directly
        transport = world.transport
        self._send_now: Callable[[str, bytes], None] | None = \
            transport.send_datagram_nowait if isinstance(transport, SendsNowait) else None
        # ... one that runs its own loop may also deliver datagrams and ring the alarm
        self._deliver_to: Callable[[Callable[[bytes, str], None] | None], None] | None = \
            transport.deliver_to if isinstance(transport, DeliversDatagrams) else None
        self._call_at: Callable[[float, Callable[[], None]], None] | None = \
            transport.call_at if isinstance(transport, RingsAlarms) else None
        self.stopped = trio.Event()  # set once the agent has been asked to stop
        self.left = False  # said goodbye (it may still be waiting for it to spread)
        self._goodbye_spread = trio.Event()
        self._leave_deadline = math.inf
        self._outbox_posted = 0  # datagrams queued in the outbox, and handed on from it:
        self._outbox_handled = 0  # equal when it is empty (a leaver waits for that)
        self._outbox_progress: trio.Event | None = None
        self.leadership = Leadership(self)
        self.planning = Planning(self, self.leadership)
        self.serving = Serving(self, self.leadership, world.services.stage_runtime)
        services = world.services  # training's timings: the config's, as this world runs them
        self.training = Training(self, self.leadership, timings=config.training.simulating(
            services.training_step_s, step_timeout_s=services.training_step_timeout_s,
            retry_s=services.training_retry_s))
        self._set_up_services(world.services)

    def _set_up_services(self, services: Services) -> None:
        """Hand serving and training what this world sets for them (see ``Services``)."""
        if services.weights_dir is not None:
            self.serving.cache = WeightsCache(services.weights_dir)

    # --- identity -------------------------------------------------------------------

    @property
    def node_id(self) -> bytes:
        return self.identity.node_id

    @property
    def addr(self) -> str:
        return self.advertise or self.transport.local_addr

    def on_datagram(self, message_type: type, handler: DatagramHandler) -> None:
        self._datagram_handlers[message_type] = handler

    def on_stream(self, message_type: type, handler: StreamHandler) -> None:
        """Answer streams whose first envelope is ``message_type`` (see StreamHandler)."""
        self._stream_handlers[message_type] = handler

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
        local = LocalNode(self.node_id, self.name, self.addr, self.identity.public_key,
                          self.leader_priority)
        self.membership = self.world.membership(
            local, self.config.gossip, self.rng, sign=self.identity.sign, verify=verify,
            now=now, metadata=self._metadata(),
            datagram_budget_bytes=self.config.transport.max_datagram_bytes
            - self.sealer.overhead_bytes, epoch=self.sealer.epoch)
        self.election = self.world.election(self.node_id, self.name, self.config.election, self.rng,
                                 leader_priority=self.leader_priority, now=now,
                                 term=self.votes.term, voted_for=self.votes.voted_for,
                                 voters=self.votes.electorate,
                                 signatures=Signatures(self.identity.sign, fellow_signed))
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.transport.serve_streams, self._serve_stream)
                if self._deliver_to is not None:
                    self._deliver_to(self._arrived)
                else:
                    nursery.start_soon(self._receive_datagrams)
                if self._send_now is None:
                    nursery.start_soon(self._send_datagrams)
                if self._call_at is None:
                    nursery.start_soon(self._timer_loop)
                nursery.start_soon(self._reconnect_loop)
                if self.card_source is not None:
                    nursery.start_soon(self.card_news.run)
                if self.home is not None:
                    await nursery.start(serve_control, self.home, self._answer_control)
                log.info("%s listening on %s (id %s)", self.name, self.addr,
                         self.node_id.hex()[:8])
                self._apply(self.membership.join(self.seeds, now))
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

    async def leave(self) -> dict[str, Any]:
        """Leave gracefully: fellows mark us ``left``, not dead; then stop. What
        ``say_goodbye`` says."""
        try:
            return await self.say_goodbye()
        finally:
            self.stop()

    async def say_goodbye(self) -> dict[str, Any]:
        """Gossip our leave and wait, ``gossip.leave_timeout_s`` at most, until fellows
        have acknowledged it or it has spread (``Membership.leave_spread``) and the
        datagrams saying it have left the outbox. The agent keeps running: ``stop`` it.
        Returns how many fellows acknowledged, of how many asked, and whether it spread."""
        if self.membership is None or self.election is None:
            return {"acknowledged": 0, "fellows": 0, "spread": True}
        if not self.left:
            self.left = True
            now = trio.current_time()
            self._leave_deadline = now + self.config.gossip.leave_timeout_s
            log.info("%s: leaving the swarm", self.name)
            self._apply(self.election.leave(now) + self.membership.leave(now))
        with trio.move_on_at(self._leave_deadline):
            await self._goodbye_spread.wait()
            await self._flush_outbox()
        acknowledged, asked = self.membership.leave_acknowledgements()
        spread = self.membership.leave_spread
        log.log(logging.INFO if spread else logging.WARNING,
                "%s: %d of %d fellows acknowledged the leave%s", self.name, acknowledged,
                asked, "" if spread else "; gossip carries it to the others")
        return {"acknowledged": acknowledged, "fellows": asked, "spread": spread}

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
                    self._post(effect.addr, effect.messages)
                elif t is fx.StreamRequest:
                    if self._nursery is not None:
                        self._nursery.start_soon(self._stream_request, effect)
                elif t is fx.Event:
                    self._note(effect)
            effects = self._feed_election()
        if self.left and self.membership is not None and self.membership.leave_spread:
            self._goodbye_spread.set()
        deadline = self._next_deadline()
        if deadline < self._alarm_at:  # the alarm would ring too late for new work
            self._alarm_at = deadline
            self._alarm_set_at = trio.current_time()
            if self._call_at is not None:
                self._call_at(deadline, lambda: self._ring(deadline))
            else:
                self._alarm.deadline = deadline

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
        if event.kind == fx.DEAD and self.membership is not None:
            member = self.membership.member(event.node_id)
            if member is not None:  # remember where it was: after a partition, call again
                self._lost[event.node_id] = member.addr
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
        level = _LOGGED_EVENTS.get(event.kind, logging.DEBUG)
        who = f"{event.name} ({event.node_id.hex()[:8]})" if event.node_id else ""
        log.log(level, "%s: %s %s%s", self.name, event.kind, who,
                f": {event.detail}" if event.detail else "")

    async def _timer_loop(self) -> None:
        while True:
            self._alarm = trio.CancelScope(deadline=self._alarm_at)
            with self._alarm:  # _apply moves its deadline sooner: no wakeup to recompute
                await trio.sleep_forever()
            self._ring(self._alarm_at)

    def _ring(self, deadline: float) -> None:
        """The alarm set for ``deadline`` rings: tick both machines, unless it was moved."""
        if deadline != self._alarm_at or self._nursery is None or self.stopped.is_set():
            return
        self._alarm_at = math.inf  # _apply sets the next one
        if self.membership is not None and self.election is not None:
            now = trio.current_time()
            # late past the deadline, or past the moment it was set if that came after
            # (work a machine asks for now is due at once): the loop's own lateness
            self._note_lag(now - max(deadline, self._alarm_set_at), now)
            self._apply(self.membership.tick(now) + self.election.tick(now))

    def _note_lag(self, lag_s: float, now: float) -> None:
        """The alarm rang ``lag_s`` after its deadline: this fellow's own loop was late
        (its CPU busy with other work). Both machines hear it before their tick, so that
        neither blames a fellow for beats or acks still waiting in the socket."""
        assert self.election is not None and self.membership is not None
        self.election.note_lag(lag_s, now)
        self.membership.note_lag(lag_s, now)
        lag = self.loop_lag
        lag["max_s"] = round(max(lag["max_s"], lag_s), 3)
        lag["over_0_1_s"] += lag_s > 0.1
        lag["over_1_s"] += lag_s > 1.0
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
        """Now and then, sync with a fellow we lost (or a seed, when alone).

        A partition longer than the tombstone time leaves each side with no trace of the
        other, so gossip alone would never mend it; calling a lost address again does
        (like Serf's reconnect). Costs one stream per interval while something is lost.
        """
        while True:
            await trio.sleep(self.config.gossip.push_pull_interval_s
                             * (0.5 + self.rng.random()))
            if self.membership is None or self.left:
                continue
            present = {m.node_id for m in self.membership.members() if m.present}
            for node_id in [n for n in self._lost if n in present]:
                del self._lost[node_id]
            candidates = sorted(set(self._lost.values()))
            if len(present) <= 1:
                candidates = sorted(set(candidates) | set(self.seeds))
            if candidates:
                addr = self.rng.choice(candidates)
                self._apply(self.membership.join((addr,), trio.current_time()))

    async def _stream_request(self, request: fx.StreamRequest) -> None:
        try:
            with trio.fail_after(STREAM_REQUEST_TIMEOUT_S):
                reply = await self.call(request.addr, request.message)
        except (SwarmError, trio.TooSlowError) as exc:
            log.debug("stream request to %s failed: %s", request.addr, exc)
            if isinstance(exc, HandshakeRefused):
                self._refused_at_join(request.addr)
            if self.membership is not None:
                self._apply(self.membership.stream_failed(
                    request.request_id, trio.current_time(),
                    nobody_listens=isinstance(exc, NobodyListens)))
            return
        self._join_refusals = 0
        if self.membership is not None:
            try:
                self._apply(self.membership.handle_reply(request.request_id, reply,
                                                         trio.current_time()))
            except Exception as exc:  # a hostile reply costs that reply, not the agent
                self._handler_failed("reply", request.addr, exc)

    def _refused_at_join(self, addr: str) -> None:
        """A seed refused our handshake before any let us in: after a few, the token is
        not the seeds' swarm, and retrying forever would only hide it. Stop and say so."""
        if self.membership is None or self.membership.joined or addr not in self.seeds:
            return
        self._join_refusals += 1
        if self._join_refusals < JOIN_REFUSALS:
            log.warning("%s: the seed %s refused our handshake (%d of %d): is the join token "
                        "this swarm's?", self.name, addr, self._join_refusals, JOIN_REFUSALS)
            return
        if self.failure is not None:
            return
        self.failure = TokenRefused(
            f"the seed {addr} refused this fellow's handshake {self._join_refusals} times: "
            "the join token is not its swarm's. Use the token `p2pswarm init` printed for "
            "that swarm: p2pswarm join SEED --token TOKEN")
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

    def _metadata(self) -> bytes:
        cards = self.gossiped_inventory
        meta: dict[str, Any] = {"cards": cards.to_dict()["cards"] if cards else []}
        meta.update(self.extra_metadata)
        return msgpack.packb(meta, use_bin_type=True)  # type: ignore[no-any-return]

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

    def member_metadata(self, member: Member) -> dict[str, Any]:
        """A fellow's metadata as a dict ({} if not pulled yet or unreadable), every entry
        the views read checked (``fellow_meta``): bad ones dropped and counted once per
        version the fellow published."""
        if not member.metadata:
            return {}
        known = self._metadata_views.get(member.node_id)
        if known is not None and known[0] == member.metadata:
            return known[1]
        try:
            meta = msgpack.unpackb(member.metadata, raw=False, strict_map_key=False)
        except Exception:  # signed by the fellow, but still only bytes to us
            meta = None
        if isinstance(meta, dict):
            meta, dropped = clean_metadata(meta)
        else:
            meta, dropped = {}, 1
        if dropped:
            self.counters.drops["bad-metadata"] += dropped
            log.info("%s: dropped %d malformed metadata entries of %s", self.name, dropped,
                     member.name)
        views = self._metadata_views
        if len(views) >= 64 and len(views) > 2 * len(self.fellows()):  # fellows long gone
            known = {m.node_id for m in self.fellows()}
            for node_id in [n for n in views if n not in known]:
                del views[node_id]
        views[member.node_id] = (member.metadata, meta)
        return meta

    # --- datagrams ------------------------------------------------------------------

    async def send(self, addr: str, *messages: Any) -> None:
        """Seal and send messages to ``addr``, several to a datagram where they fit."""
        budget = self.config.transport.max_datagram_bytes - self.sealer.overhead_bytes
        packets, too_large = wire.pack_compound(messages, budget)
        for msg in too_large:
            log.warning("not sent to %s: %s does not fit in a datagram", addr, type(msg).__name__)
        for plaintext in packets:
            self._post_sealed(addr, self.sealer.seal(plaintext))
        await trio.lowlevel.checkpoint()

    def _post(self, addr: str, messages: tuple[Any, ...]) -> None:
        try:
            plaintext = wire.encode(*messages)
        except SwarmError as exc:
            log.warning("not sent to %s: %s", addr, exc)
            self.counters.drop("encode-failed")
            return
        self._post_sealed(addr, self.sealer.seal(plaintext))

    def _post_sealed(self, addr: str, packet: bytes) -> None:
        if self._send_now is not None:  # a transport that never waits: no sender task
            try:
                self._send_now(addr, packet)
            except TransportError as exc:
                self._send_failed(addr, exc)
            else:
                self._sent(packet)
            return
        try:
            self._outbox_in.send_nowait((addr, packet))
        except trio.WouldBlock:
            self.counters.drop("outbox-full")
        else:
            self._outbox_posted += 1

    async def _send_datagrams(self) -> None:
        async for addr, packet in self._outbox_out:
            try:
                await self.transport.send_datagram(addr, packet)
            except TransportError as exc:
                self._send_failed(addr, exc)
            else:
                self._sent(packet)
            self._outbox_handled += 1
            if self._outbox_progress is not None:
                self._outbox_progress.set()

    async def _flush_outbox(self) -> None:
        """Until every datagram posted so far has been handed to the transport."""
        posted = self._outbox_posted
        while self._outbox_handled < posted:
            self._outbox_progress = trio.Event()
            await self._outbox_progress.wait()

    def _sent(self, packet: bytes) -> None:
        self.counters.datagrams_out += 1
        self.counters.bytes_out += len(packet)

    def _send_failed(self, addr: str, exc: TransportError) -> None:
        log.debug("send to %s failed: %s", addr, exc)
        self.counters.drop("send-failed")

    async def _receive_datagrams(self) -> None:
        while True:
            data, addr = await self.transport.receive_datagram()
            self.handle_datagram(data, addr)

    def _arrived(self, data: bytes, addr: str) -> None:  # from deliver_to
        if self._nursery is not None and not self.stopped.is_set():
            self.handle_datagram(data, addr)

    def handle_datagram(self, data: bytes, addr: str) -> None:
        """Open, decode and route one datagram; every failure is a counted drop."""
        self.counters.datagrams_in += 1
        self.counters.bytes_in += len(data)
        try:
            opened = self.sealer.open_datagram(data)
            messages = wire.decode(opened.plaintext,
                                   max_bytes=self.config.transport.max_datagram_bytes)
        except VersionMismatch as exc:
            self.counters.drop("version")
            self._refuse(addr, exc)
            return
        except (AuthenticationError, RemoteProtocolError) as exc:
            self.counters.drop(exc.reason)
            return
        if self.membership is None or self.election is None:
            return
        if not self._prove_epoch(opened, messages):
            self.counters.drop("stale-epoch")
            return
        try:
            self._route_datagram(messages, opened.sender, addr)
        except Exception as exc:  # one hostile message costs that message, never the agent
            self._handler_failed("datagram", addr, exc)

    def _prove_epoch(self, opened: OpenedDatagram, messages: list[Any]) -> bool:
        """Let the sender's own signed Alive, naming this datagram's epoch, prove that
        epoch to the sealer (see ``security.datagrams``). False: a stale datagram that
        proves nothing, to drop."""
        assert self.membership is not None
        for msg in messages:
            if type(msg) is Alive and msg.node == opened.sender and msg.epoch == opened.epoch \
                    and self.membership.alive_proven(msg):
                return self.sealer.confirm(opened.sender, opened.epoch, msg.incarnation,
                                           opened.seq if opened.stale else None) \
                    or not opened.stale
        return not opened.stale

    def _handler_failed(self, where: str, addr: str, exc: Exception) -> None:
        """A handler raised on a peer's message: count it, log it once per kind, go on."""
        reason = exc.reason if isinstance(exc, SwarmError) and hasattr(exc, "reason") \
            else type(exc).__name__
        key = f"handler-failed-{where}"
        if not self.counters.drops[key]:
            log.warning("%s: a %s from %s failed its handler (%s); dropped", self.name, where,
                        addr, reason, exc_info=not isinstance(exc, SwarmError))
        self.counters.drop(key)

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
                    handler = self._datagram_handlers.get(type(msg))
                    if handler is None:
                        self.counters.drop("unexpected-message")
                    else:
                        handler(msg, sender, addr)
        except RemoteProtocolError as exc:
            self.counters.drop(exc.reason)
        self._apply(effects)

    def _refuse(self, addr: str, exc: VersionMismatch) -> None:
        if addr not in self._refused_addrs:  # say it once per address, not per packet
            self._refused_addrs.add(addr)
            log.warning("refusing %s: %s", addr, exc.detail)
        self._post(addr, (Refusal(wire.PROTOCOL_MAJOR, wire.PROTOCOL_MINOR, exc.detail),))

    def _on_refusal(self, msg: Refusal, sender: bytes, addr: str) -> None:
        log.warning("%s refused us: %s", addr, msg.reason)

    # --- streams --------------------------------------------------------------------

    async def call(self, addr: str, request: Any, *, timeout_s: float | None = None) -> Any:
        """Send one request over a fresh secure stream and return the reply message."""
        async with await self.open_secure(addr, timeout_s=timeout_s) as stream:
            return await self.request(stream, request)

    async def open_secure(self, addr: str, *, timeout_s: float | None = None) -> SecureStream:
        timeout_s = timeout_s or self.config.security.handshake_timeout_s
        raw = await self.transport.open_stream(addr)
        try:
            stream = await secure_connect(raw, self.keyring, self.identity, timeout_s)
        except BaseException:
            await raw.aclose()
            raise
        self.counters.streams_out += 1
        return stream

    async def request(self, stream: SecureStream, request: Any) -> Any:
        await stream.send_frame(wire.encode(request))
        self.counters.frames_out += 1
        frame = await stream.receive_frame()
        self.counters.frames_in += 1
        (reply,) = wire.decode(frame, max_bytes=self.config.transport.max_frame_bytes)
        if isinstance(reply, Refusal):
            raise TransportError(f"{stream.peer_addr} refused: {reply.reason}")
        return reply

    async def _serve_stream(self, raw: Stream) -> None:
        self.counters.streams_in += 1
        try:
            stream = await secure_accept(raw, self.keyring, self.identity,
                                         self.config.security.handshake_timeout_s)
        except (AuthenticationError, RemoteProtocolError) as exc:
            self.counters.drop("stream-" + exc.reason)
            await raw.aclose()
            return
        except TransportError:
            self.counters.drop("stream-handshake")
            await raw.aclose()
            return
        fellow = stream.peer_node_id
        if self._streams_of[fellow] >= self.config.transport.max_streams_per_fellow:
            self.counters.drop("stream-fellow-cap")  # a token holder's streams are bounded
            await stream.aclose()
            return
        self._streams_of[fellow] += 1
        try:
            await self._answer_stream(stream)
        finally:
            self._streams_of[fellow] -= 1
            if not self._streams_of[fellow]:
                del self._streams_of[fellow]
            await stream.aclose()

    async def _answer_stream(self, stream: SecureStream) -> None:
        """Answer request envelopes until the peer closes, misbehaves or falls silent for
        ``stream_idle_timeout_s`` (a handler that keeps the stream bounds its own waits)."""
        idle_s = self.config.transport.stream_idle_timeout_s
        while True:
            try:
                with trio.move_on_after(idle_s) as waiting:
                    frame = await stream.receive_frame()
                if waiting.cancelled_caught:
                    self.counters.drop("stream-idle")
                    return
                self.counters.frames_in += 1
                messages = wire.decode(frame, max_bytes=self.config.transport.max_frame_bytes)
            except TransportError:
                return  # peer closed
            except (AuthenticationError, RemoteProtocolError) as exc:
                self.counters.drop("frame-" + exc.reason)
                return
            if len(messages) != 1 or type(messages[0]) not in self._stream_handlers:
                self.counters.drop("frame-unexpected-message")
                return
            try:
                reply = await self._stream_handlers[type(messages[0])](messages[0], stream)
            except RemoteProtocolError as exc:
                self.counters.drop("frame-" + exc.reason)
                return
            if reply is None:
                return
            try:
                frame = wire.encode(reply)
            except SwarmError as exc:  # a reply that cannot be encoded costs this stream
                self._handler_failed("stream", stream.peer_addr, exc)
                return
            try:
                await stream.send_frame(frame)
                self.counters.frames_out += 1
            except TransportError:
                return

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

    async def _op_status(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.status()

    async def _op_leave(self, request: dict[str, Any]) -> dict[str, Any]:
        """Say goodbye, answer how it went, then stop. ``stop`` only sets an event: the
        nursery is cancelled by ``run``'s task, after this answer has been written."""
        outcome = await self.say_goodbye()
        self.stop()
        return outcome

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

    def leader(self) -> dict[str, Any] | None:
        if self.election is None:
            return None
        s = self.election.status()
        if s.leader_id is None:
            return None
        return {"id": s.leader_id.hex(), "name": s.leader_name, "term": s.term}

    def _counters(self) -> dict[str, Any]:
        """The traffic counters; ``refused`` adds what the election refused (forged or
        unsigned votes, leaders without a proof, terms too far ahead)."""
        counters = self.counters.to_dict()
        if self.election is not None and self.election.refused:
            refused = dict(counters["refused"])
            for reason, n in self.election.refused.items():
                refused[f"election-{reason}"] = n
            counters["refused"] = dict(sorted(refused.items()))
        return counters

    def status(self) -> dict[str, Any]:
        now = trio.current_time()

        def row(m: Member) -> dict[str, Any]:
            heard = None if m.last_heard_s is None else round(now - m.last_heard_s, 3)
            return {"id": m.node_id.hex(), "name": m.name, "addr": m.addr, "state": m.state,
                    "incarnation": m.incarnation,
                    "cards": self.member_metadata(m).get("cards", []),
                    "last_heard_s": heard, "in_state_s": round(now - m.state_since_s, 3),
                    "self": m.is_self}

        members = sorted(self.membership.members(), key=lambda m: (m.name, m.node_id)) \
            if self.membership is not None else []
        election = self.election.status() if self.election is not None else None
        return {
            "self": {"id": self.node_id.hex(), "name": self.name, "addr": self.addr,
                     "listen": self.transport.local_addr},
            "preset": self.config.preset,
            "uptime_s": round(now - self.started_s, 3),
            "health": self.membership.health_score if self.membership else 0,
            "members": [row(m) for m in members],
            "leader": self.leader(),
            "leader_note": election.sentence if election is not None else "starting",
            "stages_held": self.serving.held_stages(),
            "role": election.role if election is not None else "follower",
            "counters": self._counters(),
            "transport": dict(getattr(self.transport, "counters", {})),
            "membership": self.membership.counters() if self.membership else {},
            "loop_lag": {**self.loop_lag, "stretch_s": round(
                self.election.stretch(), 3) if self.election is not None else 0.0},
        }


__all__ = ["Agent", "Counters"]
