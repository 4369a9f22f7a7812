"""MemoryNetwork: many fellows in one process, on virtual time, over a modelled radio.

Theory of operation. Every packet's fate is decided when it is sent, from models that are
plain frozen values: the directed link's ``LinkModel`` (delay, loss, duplication,
reordering, bandwidth) and each node's radio (a loss model shared by all of that node's
links, as on WiFi, where one bad radio loses everything it sends and hears). A packet
that survives becomes an entry ``(deliver_at, src, dst, seq, ...)`` in ONE heap, and ONE
scheduler task, ``MemoryNetwork.run``, sleeps until the earliest entry is due and delivers
everything due at that instant in key order. The key holds no task-order information
(``seq`` counts per link), so two fellows sending at the same instant are delivered in
the same order on every run, whatever order trio woke them in. Partitions and downed
nodes are checked at send time and again at delivery, so they also catch packets in
flight.

The same heap holds alarms (``MemoryTransport.call_at``), and a transport may have its
datagrams handed to a function where they land (``deliver_to``) instead of queued: an
agent on it then needs no receive or timer task, and a swarm's packets and timers all run
in this one loop. Under the simulation's ``JumpClock`` the loop is woken by the clock
itself when nothing else can run (``JumpClock.wake_when_due``), with no cancel scope.

Run it under ``trio.testing.MockClock(autojump_threshold=0)`` and time costs nothing::

    net = MemoryNetwork(seed=7)
    net.set_default(LinkModel(delay=UniformDelay(0.002, 0.010), loss=Bernoulli(0.01)))
    a, b = net.transport("a:7946"), net.transport("b:7946")
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)  # the scheduler; packets move only while it runs
        ...

Loss in bursts (``GilbertElliott``) is a two-state chain in continuous time: the time in
the bad state is what a radio fade lasts, independent of how many packets try to cross
it. The chain is advanced lazily when a packet is sent; with exponential sojourns the
state at that instant is drawn exactly from the chain's transition law, so a node that
sent nothing for an hour costs one draw, not a walk through every fade it missed.

Streams are reliable, as TCP is: each frame (one segment) and each handshake packet
meets the same loss as a datagram (the link's model and both radios), and a lost one is
sent again after TCP's retransmission timer, 200 ms for data and 1 s for a handshake,
doubling each time (``DATA_RETRANSMISSION``, ``HANDSHAKE_RETRANSMISSION``). Frames
arrive in order, so one frame waiting out a radio fade holds back those sent after it.
A per-direction window gives backpressure. A partition or a downed node breaks the
streams across it at once: both ends raise TransportError.

The models (delays, losses, links, the retransmission timer) are pure values from
``p2pswarm.transport.netmodel``, which GossipLab uses too; they are re-exported here.
This module keeps their state per link and per node and moves packets in virtual time.

Randomness: each link and each radio has its own generator, seeded from the network seed
and the names with blake2b, so one link's draws never depend on another's traffic. The
generators are SplitMix64 in eight bytes of state rather than ``random.Random`` (2.5 KB
each): a thousand fellows have up to a million links.

One algorithm (one heap, one scheduler, the streams and datagrams it delivers) in two
files: this one is the network (links, radios, partitions, the heap and the fate of every
packet); ``transport.memory_endpoints`` holds what a fellow holds (``MemoryTransport``,
``MemoryStream`` and the state of a connection), whose underscored fields the network
reads and sets as it delivers. The pure network model it draws fates from is
``transport.netmodel``. Every name stays importable from here.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from p2pswarm.config import TransportConfig
from p2pswarm.errors import ConfigError, TransportError
from p2pswarm.transport.memory_endpoints import (
    MemoryStream,
    MemoryTransport,
    StreamConnection,
    StreamPipe,
)
from p2pswarm.transport.netmodel import (  # the models, re-exported: tests import them here
    DATA_RETRANSMISSION,
    HANDSHAKE_RETRANSMISSION,
    RTO_MAX_S,
    RTO_MIN_S,
    RTO_SYN_S,
    Bernoulli,
    BurstShape,
    DelayModel,
    FixedDelay,
    GilbertElliott,
    LinkModel,
    LognormalDelay,
    LossModel,
    LossState,
    ParetoDelay,
    SplitMixRng,
    UniformDelay,
    is_lost,
)

# Outcome of a datagram; also the keys of the loss counters.
DELIVERED = "delivered"
LOST_LINK = "lost_link"  # the link's loss model
LOST_RADIO = "lost_radio"  # the sender's or the receiver's radio
LOST_PARTITION = "lost_partition"
LOST_DOWN = "lost_down"
LOST_UNREACHABLE = "lost_unreachable"  # nobody (open) at that address
DROPPED_QUEUE_FULL = "dropped_queue_full"  # arrived, but the receiver's queue was full
OUTCOMES = (DELIVERED, LOST_LINK, LOST_RADIO, LOST_PARTITION, LOST_DOWN, LOST_UNREACHABLE,
            DROPPED_QUEUE_FULL)


@dataclass(frozen=True, slots=True)
class PacketRecord:
    """One datagram's fate, kept when the network records (``record=True``).

    ``seq`` numbers the sends on the link ``src -> dst``; a duplicate shares its
    original's ``seq`` with ``copy=1``. ``at_s`` is when the outcome happened: the delivery
    time, or the send time for a packet lost on the way out.
    """

    src: str
    dst: str
    seq: int
    copy: int
    size_bytes: int
    sent_at_s: float
    at_s: float
    outcome: str


# --- state behind the models -------------------------------------------------------------


class _Link(LossState):
    """One directed link: its generator, loss chain, sequence numbers and counters."""

    __slots__ = ("busy_until_s", "counts", "dst", "explicit", "rng", "sends", "seq", "src")

    def __init__(self, seed: int, src: str, dst: str) -> None:
        super().__init__()
        self.src = src
        self.dst = dst
        self.explicit: LinkModel | None = None
        self.rng = SplitMixRng(seed, "link", src, dst)
        self.sends = 0  # datagrams sent, numbering PacketRecord.seq
        self.seq = 0  # heap entries pushed: with (at, src, dst) a key unique and stable
        self.busy_until_s = -math.inf
        self.counts = [0] * (len(OUTCOMES) + 1)  # sent, then one per outcome


_SENT = len(OUTCOMES)
_OUTCOME_INDEX = {outcome: index for index, outcome in enumerate(OUTCOMES)}


class _Node(LossState):
    """One address: whether it is up, its radio, its partition group, its transport."""

    __slots__ = ("addr", "group", "radio", "rng", "transport", "up")

    def __init__(self, seed: int, addr: str) -> None:
        super().__init__()
        self.addr = addr
        self.up = True
        self.radio: LossModel | None = None
        self.rng = SplitMixRng(seed, "radio", addr)
        self.group: int | None = None
        self.transport: MemoryTransport | None = None


# --- the network -------------------------------------------------------------------------


class MemoryNetwork:
    """An in-memory network of MemoryTransports with modelled links; see the module doc.

    ``config`` applies to every transport on it (datagram size, receive queue, frame
    size, connect timeout). ``stream_window_bytes`` bounds what one stream direction
    holds unread before ``send_frame`` blocks. ``record=True`` keeps a ``PacketRecord``
    per datagram in ``trace``.
    """

    def __init__(self, seed: int = 0, *, config: TransportConfig | None = None,
                 stream_window_bytes: int = 1 << 20, record: bool = False) -> None:
        if stream_window_bytes <= 0:
            raise ConfigError(f"stream_window_bytes must be > 0, not {stream_window_bytes}")
        self.seed = seed
        self.config = config or TransportConfig()
        self.stream_window_bytes = stream_window_bytes
        self.trace: list[PacketRecord] | None = [] if record else None
        self.counters: dict[str, int] = dict.fromkeys(
            ("sent", *OUTCOMES, "duplicated", "reordered", "streams_opened", "streams_broken",
             "frames_sent", "retransmitted"), 0)
        self._default = LinkModel()
        self._links: dict[tuple[str, str], _Link] = {}
        self._nodes: dict[str, _Node] = {}
        self._connections: dict[int, StreamConnection] = {}
        self._next_connection_id = 0
        self._heap: list[tuple[Any, ...]] = []
        self._alarm = trio.CancelScope()  # the scheduler sleeps until its deadline
        self._calls = 0  # alarms set through MemoryTransport.call_at
        self._running = False

    # configuration ---------------------------------------------------------------------

    def transport(self, addr: str) -> MemoryTransport:
        """A transport at ``addr``; a closed one there is replaced (a restarted fellow)."""
        node = self._node(addr)
        if node.transport is not None and not node.transport._closed:
            raise TransportError(f"{addr} already has an open transport on this network")
        node.transport = MemoryTransport(self, addr)
        return node.transport

    def set_default(self, model: LinkModel) -> None:
        """The model of every link without one of its own."""
        self._default = model

    def set_link(self, src: str, dst: str, model: LinkModel | None) -> None:
        """The model of the directed link ``src -> dst``; None: back to the default."""
        self._link(src, dst).explicit = model

    def set_radio(self, addr: str, loss: LossModel | None) -> None:
        """A loss model for ``addr``'s radio, applied to every packet it sends or hears."""
        self._node(addr).radio = loss

    def watch_radio(self, addr: str, on_bad_stay: Callable[[float, float], None]) -> None:
        """Call ``on_bad_stay(start, end)`` for each bad stay of ``addr``'s radio, as it
        is drawn (when a packet first meets it)."""
        self._node(addr).on_bad_stay = on_bad_stay

    def partition(self, *groups: Iterable[str]) -> None:
        """Cut every link between nodes of different groups (this replaces any earlier
        partition). Nodes in no group keep all their links. Streams across a cut break."""
        for node in self._nodes.values():
            node.group = None
        seen: set[str] = set()
        for index, group in enumerate(groups):
            if isinstance(group, str):
                raise ConfigError(f"partition takes sets of addresses, not the string {group!r}")
            for addr in sorted(set(group)):
                if addr in seen:
                    self.heal()
                    raise ConfigError(f"{addr} is in more than one partition group")
                seen.add(addr)
                self._node(addr).group = index
        self._break_connections(lambda c: not self._grouped_together(c.client, c.server),
                                "partitioned")

    def heal(self) -> None:
        """Undo the partition: every link carries packets again (broken streams stay so)."""
        for node in self._nodes.values():
            node.group = None

    def down(self, addr: str) -> None:
        """Take ``addr`` off the network: it sends and hears nothing, its streams break."""
        self._node(addr).up = False
        self._break_connections(lambda c: addr in (c.client, c.server), f"{addr} went down")

    def up(self, addr: str) -> None:
        self._node(addr).up = True

    def is_up(self, addr: str) -> bool:
        node = self._nodes.get(addr)
        return node is None or node.up

    def reachable(self, src: str, dst: str) -> bool:
        """Whether packets from ``src`` can reach ``dst`` now (up, same side of any cut)."""
        return self.is_up(src) and self.is_up(dst) and self._grouped_together(src, dst)

    def link_counters(self, src: str, dst: str) -> dict[str, int]:
        """Datagram counts on the directed link ``src -> dst``: sent, and per outcome."""
        link = self._links.get((src, dst))
        counts = link.counts if link is not None else [0] * (len(OUTCOMES) + 1)
        return {"sent": counts[_SENT], **dict(zip(OUTCOMES, counts))}

    # the scheduler ---------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Deliver packets until cancelled. Start it with ``await nursery.start(net.run)``;
        sends made while it is not running wait in the heap."""
        if self._running:
            raise TransportError("this MemoryNetwork is already running")
        self._running = True
        heap = self._heap
        clock = trio.lowlevel.current_clock()
        wake_when_due = getattr(clock, "wake_when_due", None)  # a JumpClock's fast path

        def next_s() -> float:
            return heap[0][0] if heap else math.inf

        def forget(_: Any) -> trio.lowlevel.Abort:
            clock.forget_waiter()
            return trio.lowlevel.Abort.SUCCEEDED

        try:
            task_status.started()
            while True:
                now = trio.current_time()
                while heap and heap[0][0] <= now:
                    entry = heapq.heappop(heap)
                    entry[4](*entry[5:])
                if wake_when_due is not None:
                    wake_when_due(next_s, trio.lowlevel.current_task())
                    await trio.lowlevel.wait_task_rescheduled(forget)
                    continue
                # a sooner entry moves this deadline (see _enqueue): no wakeup to recompute
                self._alarm = trio.CancelScope(deadline=next_s())
                with self._alarm:
                    await trio.sleep_forever()
        finally:
            self._running = False

    def _push(self, at: float, link: _Link, action: Callable[..., None], *args: Any) -> None:
        link.seq += 1
        self._enqueue((at, link.src, link.dst, link.seq, action, *args))

    def _call_at(self, at: float, transport: MemoryTransport, fn: Callable[[], None]) -> None:
        self._calls += 1  # ("" sorts before any peer: a fellow's alarm, then its packets)
        self._enqueue((at, transport._addr, "", self._calls, self._ring, transport, fn))

    def _enqueue(self, entry: tuple[Any, ...]) -> None:
        if entry[0] < self._alarm.deadline:  # the loop sleeps past it: move its deadline
            self._alarm.deadline = entry[0]
        heapq.heappush(self._heap, entry)

    @staticmethod
    def _ring(transport: MemoryTransport, fn: Callable[[], None]) -> None:
        if transport._held is not None:
            transport._held.append(fn)  # frozen: it rings, late, at the thaw
        elif not transport._closed:
            fn()

    # datagrams -------------------------------------------------------------------------

    def _send_datagram(self, src: str, dst: str, data: bytes) -> None:
        now = trio.current_time()
        link = self._link(src, dst)
        model = link.explicit or self._default
        link.counts[_SENT] += 1
        self.counters["sent"] += 1
        link.sends += 1
        seq = link.sends
        src_node = self._nodes[src]
        dst_node = self._nodes.get(dst)
        outcome = None
        if not src_node.up or (dst_node is not None and not dst_node.up):
            outcome = LOST_DOWN
        elif dst_node is None or dst_node.transport is None or dst_node.transport._closed:
            outcome = LOST_UNREACHABLE
        elif not self._grouped_together(src, dst):
            outcome = LOST_PARTITION
        else:
            outcome = self._loss_on_the_way(link, model, src_node, dst_node, now)
        if outcome is not None:
            self._count(link, outcome, seq, 0, len(data), now, now)
            return
        rng = link.rng
        departs = now
        if model.bandwidth_bytes_per_s is not None:
            departs = max(now, link.busy_until_s) + len(data) / model.bandwidth_bytes_per_s
            link.busy_until_s = departs
        delay_s = model.delay.sample_s(rng)
        if rng.chance(model.reorder_probability):
            delay_s += model.reorder_extra_s
            self.counters["reordered"] += 1
        self._push(departs + delay_s, link, self._deliver_datagram, link, seq, 0, data, now)
        if rng.chance(model.duplicate_probability):
            self.counters["duplicated"] += 1
            self._push(departs + model.delay.sample_s(rng), link, self._deliver_datagram,
                       link, seq, 1, data, now)

    def _deliver_datagram(self, link: _Link, seq: int, copy: int, data: bytes,
                          sent_at_s: float) -> None:
        dst = self._nodes[link.dst]
        transport = dst.transport
        sink = None
        if transport is not None and transport._held is not None and dst.up:
            # frozen: it waits, as in a socket's buffer, for the thaw
            transport._held.append(partial(self._deliver_datagram, link, seq, copy, data,
                                           sent_at_s))
            return
        if not dst.up:
            outcome = LOST_DOWN
        elif not self._grouped_together(link.src, link.dst):
            outcome = LOST_PARTITION
        elif transport is None or transport._closed:
            outcome = LOST_UNREACHABLE
        elif transport._sink is not None:  # handed over where it lands (deliver_to)
            sink = transport._sink
            transport.counters["datagrams_received"] += 1
            outcome = DELIVERED
        else:
            try:
                transport._datagram_in.send_nowait((data, link.src))
            except trio.WouldBlock:
                transport.counters["datagrams_dropped_queue_full"] += 1
                outcome = DROPPED_QUEUE_FULL
            else:
                transport.counters["datagrams_received"] += 1
                outcome = DELIVERED
        self._count(link, outcome, seq, copy, len(data), sent_at_s, trio.current_time())
        if sink is not None:
            sink(data, link.src)

    def _count(self, link: _Link, outcome: str, seq: int, copy: int, size: int,
               sent_at_s: float, at_s: float) -> None:
        link.counts[_OUTCOME_INDEX[outcome]] += 1
        self.counters[outcome] += 1
        if self.trace is not None:
            self.trace.append(PacketRecord(link.src, link.dst, seq, copy, size, sent_at_s,
                                           at_s, outcome))

    # streams ---------------------------------------------------------------------------

    async def _open_stream(self, src: str, dst: str) -> MemoryStream:
        """TCP's handshake in virtual time: one way to reach the listener, one way back;
        silence (partition, down, nobody there) runs into the connect timeout."""
        timeout_s = self.config.stream_connect_timeout_s
        give_up_at = trio.current_time() + timeout_s
        if not self.is_up(src):
            await trio.lowlevel.checkpoint()
            raise TransportError(f"cannot connect to {dst}: {src} is down")
        arrived = await self._handshake_leg(src, dst, give_up_at)
        dst_node = self._nodes.get(dst)
        transport = dst_node.transport if dst_node is not None else None
        if (not arrived or not self.reachable(src, dst)
                or transport is None or transport._closed):
            await trio.sleep_until(give_up_at)
            raise TransportError(f"connecting to {dst} timed out after {timeout_s} s")
        listener = transport._listener
        connection = None
        if listener is not None:
            connection = self._new_connection(src, dst)
            if transport._held is not None:  # frozen: its kernel accepts, it reads nothing
                transport._held.append(partial(self._accept, listener, connection))
            elif not self._accept(listener, connection):
                connection = None
        try:
            arrived = await self._handshake_leg(dst, src, give_up_at)
        except BaseException:
            if connection is not None:
                connection.client_end._close_now()
            raise
        if not arrived:
            if connection is not None:
                connection.client_end._close_now()
            raise TransportError(f"connecting to {dst} timed out after {timeout_s} s")
        if connection is None:
            raise TransportError(f"connection refused by {dst}: it does not serve streams")
        if connection.broken is not None:
            raise TransportError(f"connection to {dst} broke: {connection.broken}")
        self.counters["streams_opened"] += 1
        return connection.client_end

    @staticmethod
    def _accept(listener: trio.MemorySendChannel[MemoryStream],
                connection: StreamConnection) -> bool:
        """Hand the server's end to the listener; False (both ends closed) if its backlog
        is full or it has closed."""
        try:
            listener.send_nowait(connection.server_end)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            connection.server_end._close_now()
            connection.client_end._close_now()
            return False
        return True

    def _new_connection(self, client: str, server: str) -> StreamConnection:
        self._next_connection_id += 1
        connection = StreamConnection(self, self._next_connection_id, client, server)
        self._connections[connection.id] = connection
        return connection

    async def _handshake_leg(self, src: str, dst: str, give_up_at: float) -> bool:
        """One handshake packet from ``src`` to ``dst``, sent again after 1 s, 2 s, ...
        while it is lost. False if it has not arrived by ``give_up_at``."""
        timer = HANDSHAKE_RETRANSMISSION
        rto = timer.first_rto_s
        while self._segment_lost(src, dst):
            self.counters["retransmitted"] += 1
            again = timer.retry(trio.current_time(), rto, give_up_at)
            if again is None:
                await trio.sleep_until(give_up_at)
                return False
            again_at, rto = again
            await trio.sleep_until(again_at)
        arrival = self._stream_arrival(src, dst, 0)
        await trio.sleep_until(min(give_up_at, arrival))
        return arrival < give_up_at

    def _segment_lost(self, src: str, dst: str) -> bool:
        """Does one stream packet sent now fall to the link's loss or either radio?"""
        link = self._link(src, dst)
        return self._loss_on_the_way(link, link.explicit or self._default,
                                     self._nodes.get(src), self._nodes.get(dst),
                                     trio.current_time()) is not None

    @staticmethod
    def _loss_on_the_way(link: _Link, model: LinkModel, src: _Node | None, dst: _Node | None,
                         now: float) -> str | None:
        """LOST_LINK or LOST_RADIO for a packet sent now that the link's loss or either
        end's radio takes (drawn in that order), None if it gets through."""
        if model.loss is not None and is_lost(link, model.loss, link.rng, now):
            return LOST_LINK
        for node in (src, dst):
            if node is not None and node.radio is not None and is_lost(node, node.radio,
                                                                       node.rng, now):
                return LOST_RADIO
        return None

    def _stream_arrival(self, src: str, dst: str, size: int) -> float:
        """When ``size`` bytes sent now on ``src -> dst`` arrive (bandwidth, then delay)."""
        link = self._link(src, dst)
        model = link.explicit or self._default
        departs = trio.current_time()
        if model.bandwidth_bytes_per_s is not None and size:
            departs = max(departs, link.busy_until_s) + size / model.bandwidth_bytes_per_s
            link.busy_until_s = departs
        return departs + model.delay.sample_s(link.rng)

    def _send_on_pipe(self, pipe: StreamPipe, frame: bytes | None) -> None:
        """Schedule a frame (None: the end of the stream) after those already on ``pipe``."""
        if pipe.stalled is not None:  # an earlier frame waits to be sent again: in order
            pipe.stalled.append(frame)
        else:
            self._transmit(pipe, frame, DATA_RETRANSMISSION.first_rto_s)

    def _transmit(self, pipe: StreamPipe, frame: bytes | None, rto: float) -> bool:
        """Send ``frame`` now; if it is lost, send it again after ``rto`` and hold back
        what comes after it (``pipe.stalled``). True if it got through."""
        link = self._link(pipe.src, pipe.dst)
        if self._segment_lost(pipe.src, pipe.dst):
            self.counters["retransmitted"] += 1
            if pipe.stalled is None:
                pipe.stalled = deque()
            again = DATA_RETRANSMISSION.retry(trio.current_time(), rto)
            assert again is not None  # no give-up: a stream breaks instead (partition, down)
            self._push(again[0], link, self._retransmit, pipe, frame, again[1])
            return False
        at = max(self._stream_arrival(pipe.src, pipe.dst, len(frame or b"")), pipe.last_at)
        pipe.last_at = at
        self._push(at, link, pipe.arrive, frame)
        return True

    def _retransmit(self, pipe: StreamPipe, frame: bytes | None, rto: float) -> None:
        if pipe.connection.broken is not None:
            return
        waiting, pipe.stalled = pipe.stalled, None
        if not self._transmit(pipe, frame, rto):
            pipe.stalled = waiting
            return
        while waiting:
            if not self._transmit(pipe, waiting.popleft(), DATA_RETRANSMISSION.first_rto_s):
                pipe.stalled.extend(waiting)  # type: ignore[union-attr]
                return

    def _break_connections(self, which: Callable[[StreamConnection], bool], reason: str) -> None:
        for connection in list(self._connections.values()):  # insertion order
            if connection.broken is None and which(connection):
                self.counters["streams_broken"] += 1
                connection.break_(reason)

    # lookups ---------------------------------------------------------------------------

    def _node(self, addr: str) -> _Node:
        node = self._nodes.get(addr)
        if node is None:
            node = self._nodes[addr] = _Node(self.seed, addr)
        return node

    def _link(self, src: str, dst: str) -> _Link:
        link = self._links.get((src, dst))
        if link is None:
            link = self._links[(src, dst)] = _Link(self.seed, src, dst)
        return link

    def _grouped_together(self, a: str, b: str) -> bool:
        node_a, node_b = self._nodes.get(a), self._nodes.get(b)
        group_a = node_a.group if node_a is not None else None
        group_b = node_b.group if node_b is not None else None
        return group_a is None or group_b is None or group_a == group_b


__all__ = [
    "DATA_RETRANSMISSION",
    "HANDSHAKE_RETRANSMISSION",
    "OUTCOMES",
    "RTO_MAX_S",
    "RTO_MIN_S",
    "RTO_SYN_S",
    "Bernoulli",
    "BurstShape",
    "DelayModel",
    "FixedDelay",
    "GilbertElliott",
    "LinkModel",
    "LognormalDelay",
    "LossModel",
    "MemoryNetwork",
    "MemoryStream",
    "MemoryTransport",
    "PacketRecord",
    "ParetoDelay",
    "UniformDelay",
]
