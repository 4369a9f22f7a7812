"""What a fellow holds on a MemoryNetwork: its transport and the ends of its streams.

``MemoryTransport`` is one fellow's Transport: datagrams out through the network, in
through a queue or a sink (``deliver_to``), alarms (``call_at``), freezing as SIGSTOP
does. A stream is a ``StreamConnection`` of two ``StreamPipe``s, one per direction, and a
``MemoryStream`` at each end: ordered frames, a window, breakable. The network
(``transport.memory``, whose module doc says how packets move) decides when frames and
datagrams arrive and reads and sets the underscored fields here as it delivers; these
classes keep what waits and wake who waits for it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from p2pswarm.errors import TransportError
from p2pswarm.transport.base import StreamHandler, run_stream_handler

if TYPE_CHECKING:
    from p2pswarm.transport.memory import MemoryNetwork

ACCEPT_BACKLOG = 128  # connections a listener holds before it refuses more


class MemoryTransport:
    """One fellow's Transport on a MemoryNetwork; get it from ``MemoryNetwork.transport``."""

    def __init__(self, network: MemoryNetwork, addr: str) -> None:
        self._network = network
        self._addr = addr
        self._closed = False
        self._listener: trio.MemorySendChannel[MemoryStream] | None = None
        self._streams: dict[MemoryStream, None] = {}
        self._sink: Callable[[bytes, str], None] | None = None
        self._held: list[Callable[[], None]] | None = None  # frozen: what waits for the thaw
        self._datagram_in: trio.MemorySendChannel[tuple[bytes, str]]
        self._datagram_out: trio.MemoryReceiveChannel[tuple[bytes, str]]
        self._datagram_in, self._datagram_out = trio.open_memory_channel(
            network.config.receive_queue_datagrams)
        self.counters: dict[str, int] = {
            "datagrams_sent": 0,
            "datagrams_received": 0,
            "datagrams_dropped_queue_full": 0,
            "streams_opened": 0,
            "streams_accepted": 0,
        }

    @property
    def local_addr(self) -> str:
        return self._addr

    async def send_datagram(self, addr: str, data: bytes) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self.send_datagram_nowait(addr, data)
        await trio.lowlevel.cancel_shielded_checkpoint()

    def send_datagram_nowait(self, addr: str, data: bytes) -> None:
        """``send_datagram`` without waiting: the network takes a datagram at once."""
        self._check_open()
        limit = self._network.config.max_datagram_bytes
        if len(data) > limit:
            raise TransportError(
                f"datagram of {len(data)} bytes exceeds max_datagram_bytes ({limit})")
        if self._held is not None:  # frozen: sent at the thaw
            self._held.append(partial(self.send_datagram_nowait, addr, data))
            return
        self.counters["datagrams_sent"] += 1
        self._network._send_datagram(self._addr, addr, bytes(data))

    def freeze(self) -> None:
        """Stop the fellow behind this transport as SIGSTOP stops a process: datagrams
        that arrive wait (as in its socket's buffer), and so do its alarms and the
        datagrams it would send, until ``thaw``. (Its streams go on.)"""
        if self._held is None and not self._closed:
            self._held = []

    def thaw(self) -> None:
        """Go on after ``freeze``: what waited happens now, in the order it came."""
        held, self._held = self._held, None
        for fn in held or ():
            if self._held is not None:  # frozen again by what it ran
                self._held.append(fn)
            elif not self._closed:
                fn()

    def deliver_to(self, sink: Callable[[bytes, str], None] | None) -> None:
        """Have the network's scheduler call ``sink(data, addr)`` as each datagram arrives,
        instead of queueing it for ``receive_datagram`` (None: queue again)."""
        self._sink = sink

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        """Have the network's scheduler call ``fn()`` at virtual time ``at``, unless this
        transport is closed by then. Several may be pending; none can be withdrawn."""
        self._check_open()
        self._network._call_at(at, self, fn)

    async def receive_datagram(self) -> tuple[bytes, str]:
        try:
            return await self._datagram_out.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError) as exc:
            raise TransportError(f"transport {self._addr} is closed") from exc

    async def open_stream(self, addr: str) -> MemoryStream:
        self._check_open()
        stream = await self._network._open_stream(self._addr, addr)
        if self._closed:  # closed while connecting
            stream._close_now()
            raise TransportError(f"transport {self._addr} is closed")
        self._adopt(stream)
        self.counters["streams_opened"] += 1
        return stream

    async def serve_streams(self, handler: StreamHandler, *,
                            task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._check_open()
        if self._listener is not None:
            raise TransportError(f"{self._addr} is already serving streams")
        send: trio.MemorySendChannel[MemoryStream]
        receive: trio.MemoryReceiveChannel[MemoryStream]
        send, receive = trio.open_memory_channel(ACCEPT_BACKLOG)
        self._listener = send
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                async for stream in receive:
                    self._adopt(stream)
                    self.counters["streams_accepted"] += 1
                    nursery.start_soon(run_stream_handler, handler, stream)
                # The transport closed: its handlers go with it.
                nursery.cancel_scope.cancel()
        finally:
            if self._listener is send:
                self._listener = None
            send.close()
            # Connections that reached the backlog but no handler: refuse them visibly.
            while True:
                try:
                    receive.receive_nowait()._close_now()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            receive.close()

    async def aclose(self) -> None:
        self.close_now()
        await trio.lowlevel.checkpoint()

    def close_now(self) -> None:
        """``aclose`` without waiting, as when a process dies: nothing more arrives."""
        if not self._closed:
            self._closed = True
            self._sink = None
            self._held = None
            self._datagram_in.close()
            if self._listener is not None:
                self._listener.close()
            for stream in list(self._streams):
                stream._close_now()

    def _adopt(self, stream: MemoryStream) -> None:
        if self._closed:
            stream._close_now()
        else:
            self._streams[stream] = None
            stream._owner = self

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self._addr} is closed")


class StreamPipe:
    """One direction of a connection: frames on the way and frames waiting to be read."""

    __slots__ = (
        "connection",
        "dst",
        "fin",
        "frames",
        "last_at",
        "readable",
        "reader",
        "reader_gone",
        "src",
        "stalled",
        "unread_bytes",
        "writable",
    )

    def __init__(self, connection: StreamConnection, src: str, dst: str) -> None:
        self.connection = connection
        self.src = src
        self.dst = dst
        self.reader: MemoryStream | None = None  # the end that reads: set by StreamConnection
        self.frames: deque[bytes] = deque()  # arrived, not read
        self.unread_bytes = 0  # sent and not yet read (on the way or arrived): the window
        self.last_at = -math.inf  # arrival of the last thing sent: frames stay in order
        self.stalled: deque[bytes | None] | None = None  # sent after a frame now being resent
        self.fin = False  # the writer closed and that has arrived
        self.reader_gone = False  # the reader closed and the writer has heard
        self.readable = trio.lowlevel.ParkingLot()
        self.writable = trio.lowlevel.ParkingLot()

    def arrive(self, frame: bytes | None) -> None:
        connection = self.connection
        if connection.broken is not None:
            return
        if frame is None:
            self.fin = True
            connection.reverse(self).reader_gone = True
            connection.reverse(self).writable.unpark_all()
            connection.maybe_forget()
        elif self.reader is not None and not self.reader._closed:
            self.frames.append(frame)
        self.readable.unpark_all()

    def wake_all(self) -> None:
        self.readable.unpark_all()
        self.writable.unpark_all()


class StreamConnection:
    __slots__ = (
        "broken",
        "client",
        "client_end",
        "id",
        "network",
        "server",
        "server_end",
        "to_client",
        "to_server",
    )

    def __init__(self, network: MemoryNetwork, connection_id: int, client: str,
                 server: str) -> None:
        self.network = network
        self.id = connection_id
        self.client = client
        self.server = server
        self.to_server = StreamPipe(self, client, server)
        self.to_client = StreamPipe(self, server, client)
        self.client_end = MemoryStream(self, server, inbound=self.to_client,
                                       outbound=self.to_server)
        self.server_end = MemoryStream(self, client, inbound=self.to_server,
                                       outbound=self.to_client)
        self.to_server.reader = self.server_end
        self.to_client.reader = self.client_end
        self.broken: str | None = None

    def reverse(self, pipe: StreamPipe) -> StreamPipe:
        return self.to_client if pipe is self.to_server else self.to_server

    def break_(self, reason: str) -> None:
        self.broken = reason
        self.to_server.wake_all()
        self.to_client.wake_all()
        self.network._connections.pop(self.id, None)

    def maybe_forget(self) -> None:
        # Both sides closed and both ends of the stream have arrived: nothing left to track.
        if self.to_server.fin and self.to_client.fin:
            self.network._connections.pop(self.id, None)


class MemoryStream:
    """One end of an in-memory stream: ordered frames, a window, breakable."""

    def __init__(self, connection: StreamConnection, peer_addr: str, *, inbound: StreamPipe,
                 outbound: StreamPipe) -> None:
        self._connection = connection
        self._peer_addr = peer_addr
        self._in = inbound
        self._out = outbound
        self._closed = False
        self._owner: MemoryTransport | None = None

    @property
    def peer_addr(self) -> str:
        return self._peer_addr

    async def send_frame(self, frame: bytes) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        network = self._connection.network
        size = len(frame)
        limit = network.config.max_frame_bytes
        if size > limit:
            raise TransportError(
                f"frame of {size} bytes to {self._peer_addr} exceeds max_frame_bytes ({limit})")
        out = self._out
        self._check_sendable()
        # A frame larger than the whole window still goes, alone.
        while out.unread_bytes and out.unread_bytes + size > network.stream_window_bytes:
            await out.writable.park()
            self._check_sendable()
        out.unread_bytes += size
        network.counters["frames_sent"] += 1
        network._send_on_pipe(out, bytes(frame))
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive_frame(self) -> bytes:
        await trio.lowlevel.checkpoint_if_cancelled()
        inbound = self._in
        while True:
            self._check_usable()
            if inbound.frames:
                break
            if inbound.fin:
                raise TransportError(f"{self._peer_addr} closed the stream")
            await inbound.readable.park()
        frame = inbound.frames.popleft()
        inbound.unread_bytes -= len(frame)
        inbound.writable.unpark_all()
        await trio.lowlevel.cancel_shielded_checkpoint()
        return frame

    async def aclose(self) -> None:
        self._close_now()
        await trio.lowlevel.checkpoint()

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owner is not None:
            self._owner._streams.pop(self, None)
        connection = self._connection
        self._in.frames.clear()
        self._in.wake_all()
        self._out.wake_all()
        if connection.broken is None:
            connection.network._send_on_pipe(self._out, None)

    def _check_usable(self) -> None:
        if self._closed:
            raise TransportError(f"stream to {self._peer_addr} is closed")
        if self._connection.broken is not None:
            raise TransportError(
                f"stream to {self._peer_addr} broke: {self._connection.broken}")

    def _check_sendable(self) -> None:
        self._check_usable()
        if self._out.reader_gone:
            raise TransportError(f"{self._peer_addr} closed the stream")


__all__ = ["ACCEPT_BACKLOG", "MemoryStream", "MemoryTransport", "StreamConnection",
           "StreamPipe"]
