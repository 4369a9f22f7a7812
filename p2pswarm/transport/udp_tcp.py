"""Real sockets: UDP datagrams for gossip, length-prefixed TCP frames for streams.

One transport owns one port number on both protocols, so a fellow's single address
``host:port`` reaches both its datagrams and its stream listener. Open it with::

    async with open_udp_tcp_transport("0.0.0.0:7782", config) as transport:
        ...

which binds both sockets, runs the datagram receive loop in its own nursery and closes
everything on exit. Datagrams land in a bounded queue; when the agent falls behind, new
ones are dropped and counted (gossip tolerates loss, an unbounded queue does not tolerate
a flood). A TCP frame is a 4-byte big-endian length and then that many bytes; a length
above the stream's limit ends the connection, so a stray client can cost a connection but
never the listener.

Nothing before authentication costs more than it must. A stream starts with a 1 KiB
buffer; while its handshake runs (``handshake_started``) a frame may be at most the
handshake's size, and only ``authenticated`` raises the limit to ``max_frame_bytes`` and
the buffer to its working size. A large frame is held in chunks allocated as its bytes
arrive (never copied while it grows), never at the length the peer announced, and it is only
started once the announced size fits in the budget of bytes held in unfinished frames
of its source host and its fellow (``held_bytes``). Accepted connections
are capped in total and per source host; over a cap a new connection is closed at once and
counted. Handshake slots (accepted connections not yet authenticated) are shared fairly
by source host: when a host holds its share, or all slots are taken, the oldest pending
handshake of the busiest host is closed to make room, so a new source is never refused
because others hold the slots (a stranger on 64 addresses cannot keep a joiner out).
Out of file descriptors, accepting pauses for ``accept_pause_s`` (logged once per
episode) and resumes.
"""

from __future__ import annotations

import errno
import logging
import socket as stdlib_socket
import struct
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from p2pswarm.config import DEFAULT_PORT, TransportConfig
from p2pswarm.errors import NobodyListens, TransportError
from p2pswarm.transport.base import StreamHandler, run_stream_handler
from p2pswarm.transport.held_bytes import HeldBytes, Key

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
_RECEIVE_BUFFER_BYTES = 64 * 1024  # once authenticated, a frame below this is assembled
# in the stream's buffer; a larger one reserves its size in the held-bytes budget
_FIRST_BUFFER_BYTES = 1024  # before that: enough for any handshake frame
_CHUNK_BYTES = 2 * 1024 * 1024  # a large frame arrives in chunks of this, joined at the end
_COALESCE_MAX_BYTES = 64 * 1024  # below this, header and frame go out in one send
_DATAGRAM_BUFFER_BYTES = 65536  # largest UDP payload; anything above max is dropped anyway
_ACCEPT_BACKLOG = 128
_PORT_ZERO_ATTEMPTS = 64  # port 0: tries to find a number free for both UDP and TCP

# sendto failures that mean "the peer or the path is gone", which datagrams must not report.
# EPERM: a firewall rule dropping on output (the namespace simulations use nftables).
_SILENT_SEND_ERRNOS = frozenset(
    getattr(errno, name) for name in (
        "ECONNREFUSED", "EHOSTUNREACH", "ENETUNREACH", "EHOSTDOWN", "ENETDOWN", "EPERM",
    ) if hasattr(errno, name)
)
_ACCEPT_SKIP_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ECONNABORTED", "EPROTO", "ECONNRESET")
    if hasattr(errno, name)
)
_ACCEPT_PAUSE_ERRNOS = frozenset(
    getattr(errno, name) for name in ("EMFILE", "ENFILE", "ENOMEM", "ENOBUFS")
    if hasattr(errno, name)
)


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) as (host, port); TransportError if malformed."""
    host, sep, port_text = addr.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise TransportError(f"bad address {addr!r}: expected host:port, "
                             f"e.g. 10.0.0.5:{DEFAULT_PORT}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise TransportError(f"bad address {addr!r}: write IPv6 hosts in brackets, "
                             f"[::1]:{DEFAULT_PORT}")
    return host, int(port_text)


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


class TcpStream:
    """A Stream over one TCP connection, framed as length prefix + bytes.

    Cancel-safe on receive: every byte read is kept in the stream's own state, so a
    ``move_on_after`` around ``receive_frame`` never loses part of a frame. A send
    cancelled halfway through a frame closes the stream, since the peer would otherwise
    read the next frame's bytes as the rest of this one.
    """

    def __init__(self, sock: trio.socket.SocketType, peer_addr: str, max_frame_bytes: int,
                 on_close: Callable[[TcpStream], None] | None = None,
                 on_authenticated: Callable[[TcpStream], None] | None = None, *,
                 held: HeldBytes | None = None, host: str = "") -> None:
        self._sock = sock
        self._peer_addr = peer_addr
        self._max_frame_bytes = max_frame_bytes
        self._limit = max_frame_bytes  # the largest frame accepted now
        self._on_close = on_close
        self._on_authenticated = on_authenticated
        self.is_authenticated = False
        self._closed = False
        self._send_lock = trio.Lock()
        self._receive_lock = trio.Lock()
        self._buf = bytearray(_FIRST_BUFFER_BYTES)
        self._start = 0  # first unread byte in _buf
        self._end = 0  # one past the last received byte in _buf
        self._want: int | None = None  # length of the frame being read, header consumed
        self._big: list[bytearray] | None = None  # a frame too large for _buf: its chunks
        self._big_got = 0  # bytes of it received
        self._chunk_got = 0  # ... of them in its last chunk
        self._held = held
        self._held_keys: tuple[Key, ...] = (("host", host),)  # + the fellow, once known
        self._reserved: tuple[tuple[Key, ...], int] | None = None  # what _big holds of it

    @property
    def peer_addr(self) -> str:
        return self._peer_addr

    @property
    def held_frame_bytes(self) -> int:
        """Bytes allocated for the large frame now arriving (0: none)."""
        return sum(len(chunk) for chunk in self._big) if self._big is not None else 0

    def held_bytes(self) -> int:
        """Memory this stream's receive buffers hold now (the agent watches it per fellow)."""
        return len(self._buf) + self.held_frame_bytes

    def handshake_started(self, max_frame_bytes: int) -> None:
        """Until ``authenticated``, accept frames of at most ``max_frame_bytes``."""
        self._limit = min(self._limit, max_frame_bytes)

    def authenticated(self, peer_id: bytes | None = None) -> None:
        """The handshake succeeded: frames up to ``max_frame_bytes``, a full buffer; large
        frames count against ``peer_id``'s budget too."""
        if self.is_authenticated:
            return
        self.is_authenticated = True
        if peer_id is not None:
            self._held_keys += (("fellow", peer_id.hex()),)
        self._limit = self._max_frame_bytes
        if len(self._buf) < _RECEIVE_BUFFER_BYTES:
            pending = self._buf[self._start:self._end]
            self._buf = bytearray(_RECEIVE_BUFFER_BYTES)
            self._buf[:len(pending)] = pending
            self._start, self._end = 0, len(pending)
        if self._on_authenticated is not None:
            self._on_authenticated(self)

    async def send_frame(self, frame: bytes) -> None:
        size = len(frame)
        if size > self._max_frame_bytes:
            raise TransportError(
                f"frame of {size} bytes to {self._peer_addr} exceeds max_frame_bytes "
                f"({self._max_frame_bytes})"
            )
        header = _HEADER.pack(size)
        chunks = [header + frame] if size <= _COALESCE_MAX_BYTES else [header, frame]
        async with self._send_lock:
            self._check_open()
            started = False
            try:
                for chunk in chunks:
                    view = memoryview(chunk)
                    while view:
                        sent = await self._sock.send(view)
                        started = True
                        view = view[sent:]
            except (OSError, trio.ClosedResourceError) as exc:
                self._close_now()
                raise TransportError(
                    f"sending to {self._peer_addr} failed: {_reason(exc)}") from exc
            except BaseException:
                if started:
                    self._close_now()
                raise

    async def receive_frame(self) -> bytes:
        async with self._receive_lock:
            self._check_open()
            try:
                return await self._read_frame()
            except (OSError, trio.ClosedResourceError) as exc:
                self._close_now()
                raise TransportError(
                    f"receiving from {self._peer_addr} failed: {_reason(exc)}") from exc
            except TransportError:
                self._close_now()
                raise

    async def aclose(self) -> None:
        self._close_now()
        await trio.lowlevel.checkpoint()

    def _close_now(self) -> None:
        if not self._closed:
            self._closed = True
            self._big = None
            self._release()
            self._sock.close()
            if self._on_close is not None:
                self._on_close(self)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"stream to {self._peer_addr} is closed")

    async def _read_frame(self) -> bytes:
        if self._want is None:
            await self._fill(_HEADER.size)
            (size,) = _HEADER.unpack_from(self._buf, self._start)
            if size > self._limit:
                what = "max_frame_bytes" if self._limit == self._max_frame_bytes \
                    else "the limit before authentication"
                raise TransportError(
                    f"{self._peer_addr} announced a frame of {size} bytes, above "
                    f"{what} ({self._limit})"
                )
            self._start += _HEADER.size
            self._want = size
        size = self._want
        if size <= len(self._buf):
            await self._fill(size)
            frame = bytes(memoryview(self._buf)[self._start:self._start + size])
            self._start += size
            self._want = None
            return frame
        if self._big is None:
            if self._held is not None and self._reserved is None:
                # Wait for room in the host's and the fellow's budget before reading on.
                await self._held.reserve(self._held_keys, size)
                self._reserved = (self._held_keys, size)
            # The announced size is only a claim: chunks come as the bytes do.
            buffered = self._end - self._start
            first = bytearray(min(size, _CHUNK_BYTES))
            first[:buffered] = memoryview(self._buf)[self._start:self._end]
            self._big = [first]
            self._big_got = self._chunk_got = buffered
            self._start = self._end = 0
        while self._big_got < size:
            chunk = self._big[-1]
            if self._chunk_got == len(chunk):
                chunk = bytearray(min(size - self._big_got, _CHUNK_BYTES))
                self._big.append(chunk)
                self._chunk_got = 0
            with memoryview(chunk) as view:
                got = await self._sock.recv_into(view[self._chunk_got:])
            if self._closed:  # closed (its chunks freed) while the receive returned
                raise TransportError(f"stream to {self._peer_addr} is closed")
            if got == 0:
                raise TransportError(f"{self._peer_addr} closed the stream mid-frame")
            self._big_got += got
            self._chunk_got += got
        frame = b"".join(self._big)
        self._big = None
        self._want = None
        self._release()
        return frame

    def _release(self) -> None:
        if self._reserved is not None and self._held is not None:
            keys, size = self._reserved
            self._reserved = None
            self._held.release(keys, size)

    async def _fill(self, count: int) -> None:
        """Have at least ``count`` unread bytes in ``_buf``."""
        if self._end - self._start >= count:
            return
        if self._start + count > len(self._buf):
            pending = self._end - self._start
            self._buf[:pending] = self._buf[self._start:self._end]
            self._start, self._end = 0, pending
        view = memoryview(self._buf)
        while self._end - self._start < count:
            got = await self._sock.recv_into(view[self._end:])
            if got == 0:
                if self._end == self._start and self._want is None:
                    raise TransportError(f"{self._peer_addr} closed the stream")
                raise TransportError(f"{self._peer_addr} closed the stream mid-frame")
            self._end += got


class UdpTcpTransport:
    """UDP + TCP on one port. Build it with ``open_udp_tcp_transport``, not directly.

    ``counters`` counts what the agent may want to report: datagrams sent, received,
    dropped because the queue was full or they were too large, sends the network
    refused (silently, as datagrams are best effort), streams opened and accepted.
    """

    def __init__(self, udp: trio.socket.SocketType, tcp: trio.socket.SocketType,
                 local_addr: str, config: TransportConfig) -> None:
        self._udp = udp
        self._tcp = tcp
        self._local_addr = local_addr
        self._config = config
        self._closed = False
        self._serving = False
        self._streams: dict[TcpStream, None] = {}  # opened by us, closed with the transport
        self._datagram_in: trio.MemorySendChannel[tuple[bytes, str]]
        self._datagram_out: trio.MemoryReceiveChannel[tuple[bytes, str]]
        self._datagram_in, self._datagram_out = trio.open_memory_channel(
            config.receive_queue_datagrams)
        self.counters: dict[str, int] = {
            "datagrams_sent": 0,
            "datagrams_received": 0,
            "datagrams_dropped_queue_full": 0,
            "datagrams_dropped_oversize": 0,
            "datagrams_send_refused": 0,
            "streams_opened": 0,
            "streams_accepted": 0,
            "streams_refused_busy": 0,  # over a cap on accepted connections: closed at once
            "handshakes_evicted": 0,  # a pending handshake closed to make room for a new one
            "accept_paused": 0,  # out of file descriptors (or memory): accepting paused
        }
        # accepted streams still open -> source host; what the caps count
        self._accepted: dict[TcpStream, str] = {}
        self._per_host: Counter[str] = Counter()
        # accepted streams still in their handshake, per source host, oldest first
        self._pending: dict[str, dict[TcpStream, int]] = {}
        self._pending_total = 0
        self._accept_seq = 0  # orders pending handshakes across hosts (oldest first)
        self._busy_logged = False
        # bytes held in unfinished frames, per source host and fellow (never below a frame)
        self.held_bytes = HeldBytes(
            max(config.max_held_frame_bytes_per_host, config.max_frame_bytes),
            max(config.max_held_frame_bytes_per_fellow, config.max_frame_bytes), self.counters)

    @property
    def local_addr(self) -> str:
        return self._local_addr

    async def send_datagram(self, addr: str, data: bytes) -> None:
        self._check_open()
        if len(data) > self._config.max_datagram_bytes:
            raise TransportError(
                f"datagram of {len(data)} bytes exceeds max_datagram_bytes "
                f"({self._config.max_datagram_bytes})"
            )
        host, port = parse_addr(addr)
        try:
            await self._udp.sendto(data, (host, port))
        except trio.ClosedResourceError as exc:
            raise TransportError("transport is closed") from exc
        except (stdlib_socket.gaierror, UnicodeError) as exc:  # idna refuses some names
            raise TransportError(f"cannot resolve {addr}: {_reason(exc)}") from exc
        except OSError as exc:
            if exc.errno in _SILENT_SEND_ERRNOS:
                self.counters["datagrams_send_refused"] += 1
                return
            raise TransportError(f"sending a datagram to {addr} failed: {_reason(exc)}") from exc
        self.counters["datagrams_sent"] += 1

    async def receive_datagram(self) -> tuple[bytes, str]:
        try:
            return await self._datagram_out.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError) as exc:
            raise TransportError("transport is closed") from exc

    async def open_stream(self, addr: str) -> TcpStream:
        self._check_open()
        host, port = parse_addr(addr)
        timeout_s = self._config.stream_connect_timeout_s
        try:
            with trio.fail_after(timeout_s):
                sock = await self._connect(addr, host, port)
        except trio.TooSlowError as exc:
            raise TransportError(f"connecting to {addr} timed out after {timeout_s} s") from exc
        stream = TcpStream(sock, addr, self._config.max_frame_bytes, self._forget_stream,
                           held=self.held_bytes, host=host)
        self._streams[stream] = None
        self.counters["streams_opened"] += 1
        return stream

    def _refuse_accept(self, host: str) -> bool:
        """Whether a new connection from ``host`` is over a cap (docs/security.md).
        Handshake slots never refuse: ``_make_room`` evicts instead."""
        c = self._config
        return (len(self._accepted) >= c.max_streams
                or self._per_host[host] >= c.max_streams_per_host)

    def _make_room(self, host: str) -> None:
        """Free a handshake slot for a new connection from ``host`` if none is free: close
        the oldest pending handshake of ``host`` when it holds its share, else of the
        busiest host (ties: the one whose oldest is oldest)."""
        c = self._config
        mine = self._pending.get(host, {})
        if len(mine) >= c.max_unauthenticated_per_host:
            victim = next(iter(mine))
        elif self._pending_total >= c.max_unauthenticated_streams:
            busiest = max(self._pending.values(),
                          key=lambda held: (len(held), -next(iter(held.values()))))
            victim = next(iter(busiest))
        else:
            return
        self.counters["handshakes_evicted"] += 1
        victim._close_now()  # its handler's receive ends; _accepted_closed frees the slot

    def _track_accepted(self, stream: TcpStream, host: str) -> None:
        self._accepted[stream] = host
        self._per_host[host] += 1
        self._accept_seq += 1
        self._pending.setdefault(host, {})[stream] = self._accept_seq
        self._pending_total += 1

    def _unpend(self, stream: TcpStream, host: str) -> None:
        held = self._pending.get(host)
        if held is not None and held.pop(stream, None) is not None:
            self._pending_total -= 1
            if not held:
                del self._pending[host]

    def _accepted_authenticated(self, stream: TcpStream) -> None:
        host = self._accepted.get(stream)
        if host is not None:
            self._unpend(stream, host)

    def _accepted_closed(self, stream: TcpStream) -> None:
        host = self._accepted.pop(stream, None)
        if host is None:
            return
        self._uncount(self._per_host, host)
        self._unpend(stream, host)

    @staticmethod
    def _uncount(counter: Counter[str], host: str) -> None:
        counter[host] -= 1
        if counter[host] <= 0:
            del counter[host]

    async def _connect(self, addr: str, host: str, port: int) -> trio.socket.SocketType:
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=stdlib_socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise TransportError(f"cannot resolve {addr}: {_reason(exc)}") from exc
        failure: OSError | None = None
        for family, type_, proto, _, sockaddr in infos:
            try:
                sock = trio.socket.socket(family, type_, proto)
            except OSError as exc:  # out of file descriptors: this stream fails, not us
                failure = exc
                continue
            try:
                sock.setsockopt(stdlib_socket.IPPROTO_TCP, stdlib_socket.TCP_NODELAY, 1)
                await sock.connect(sockaddr)
            except OSError as exc:
                sock.close()
                failure = exc
                continue
            except BaseException:
                sock.close()
                raise
            return sock
        reason = _reason(failure) if failure is not None else "no usable address"
        if isinstance(failure, ConnectionRefusedError):
            raise NobodyListens(f"cannot connect to {addr}: {reason}") from failure
        raise TransportError(f"cannot connect to {addr}: {reason}") from failure

    async def serve_streams(self, handler: StreamHandler, *,
                            task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._check_open()
        if self._serving:
            raise TransportError(f"{self._local_addr} is already serving streams")
        self._serving = True
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                await self._accept_loop(handler, nursery)
                # The listener is closed: the transport is shutting down, handlers too.
                nursery.cancel_scope.cancel()
        finally:
            self._serving = False
            # Nothing accepts any more (the agent is stopping: its process may take a while
            # to exit, waiting for a computation): connecting is refused from now, instead
            # of landing in the kernel's backlog and being reset unanswered, which reads
            # as a fellow refusing our swarm's key.
            self._tcp.close()

    async def _accept_loop(self, handler: StreamHandler, nursery: trio.Nursery) -> None:
        paused = False  # in an episode of running out of descriptors: logged once
        while True:
            try:
                sock, sockaddr = await self._tcp.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:
                if exc.errno in _ACCEPT_SKIP_ERRNOS:
                    continue
                if exc.errno in _ACCEPT_PAUSE_ERRNOS:
                    self.counters["accept_paused"] += 1
                    if not paused:
                        log.warning("accepting on %s: %s; pausing %g s, then again until "
                                    "descriptors free up", self._local_addr, _reason(exc),
                                    self._config.accept_pause_s)
                        paused = True
                    await trio.sleep(self._config.accept_pause_s)
                    continue
                raise TransportError(
                    f"accepting streams on {self._local_addr} failed: {_reason(exc)}") from exc
            if paused:
                log.info("accepting on %s again", self._local_addr)
                paused = False
            host = str(sockaddr[0])
            if self._refuse_accept(host):
                sock.close()
                self.counters["streams_refused_busy"] += 1
                if not self._busy_logged:
                    self._busy_logged = True
                    log.warning("%s: too many connections (from %s, among others); new ones "
                                "are closed at once while that lasts", self._local_addr, host)
                continue
            self._busy_logged = False
            try:
                sock.setsockopt(stdlib_socket.IPPROTO_TCP, stdlib_socket.TCP_NODELAY, 1)
            except OSError:
                sock.close()  # reset before we got to it
                continue
            self._make_room(host)
            peer = format_addr(sockaddr[0], sockaddr[1])
            stream = TcpStream(sock, peer, self._config.max_frame_bytes,
                               self._accepted_closed, self._accepted_authenticated,
                               held=self.held_bytes, host=host)
            self._track_accepted(stream, host)
            self.counters["streams_accepted"] += 1
            nursery.start_soon(run_stream_handler, handler, stream)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            # Closing wakes every task blocked on these sockets with ClosedResourceError:
            # the receive loop ends (closing the queue), serve_streams cancels its handlers.
            self._udp.close()
            self._tcp.close()
            for stream in list(self._streams):
                stream._close_now()
        await trio.lowlevel.checkpoint()

    async def _receive_datagrams(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        buf = bytearray(_DATAGRAM_BUFFER_BYTES)
        view = memoryview(buf)
        limit = self._config.max_datagram_bytes
        async with self._datagram_in:
            task_status.started()
            while True:
                try:
                    size, sender = await self._udp.recvfrom_into(buf)
                except trio.ClosedResourceError:
                    return
                except OSError as exc:
                    if self._closed:
                        return
                    # e.g. an ICMP error reported on some platforms: the socket is fine.
                    log.debug("datagram receive on %s: %s", self._local_addr, _reason(exc))
                    continue
                if size > limit:
                    self.counters["datagrams_dropped_oversize"] += 1
                    continue
                item = (bytes(view[:size]), format_addr(sender[0], sender[1]))
                try:
                    self._datagram_in.send_nowait(item)
                except trio.WouldBlock:
                    self.counters["datagrams_dropped_queue_full"] += 1
                else:
                    self.counters["datagrams_received"] += 1

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self._local_addr} is closed")

    def _forget_stream(self, stream: TcpStream) -> None:
        self._streams.pop(stream, None)


async def _bind_pair(listen_addr: str, host: str, port: int
                     ) -> tuple[trio.socket.SocketType, trio.socket.SocketType]:
    """A UDP socket and a listening TCP socket on the same port number."""
    try:
        infos = await trio.socket.getaddrinfo(
            host or None, port, type=stdlib_socket.SOCK_DGRAM, flags=stdlib_socket.AI_PASSIVE)
    except OSError as exc:
        raise TransportError(f"cannot listen on {listen_addr}: {_reason(exc)}") from exc
    family, _, _, _, sockaddr = infos[0]
    attempts = _PORT_ZERO_ATTEMPTS if port == 0 else 1
    for _ in range(attempts):
        udp = trio.socket.socket(family, stdlib_socket.SOCK_DGRAM)
        tcp = trio.socket.socket(family, stdlib_socket.SOCK_STREAM)
        try:
            await udp.bind(sockaddr)
            bound_port = udp.getsockname()[1]
            if sys.platform != "win32":
                # Restarting an agent must not wait for old connections in TIME_WAIT.
                tcp.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEADDR, 1)
            await tcp.bind((sockaddr[0], bound_port, *sockaddr[2:]))
            tcp.listen(_ACCEPT_BACKLOG)
        except OSError as exc:
            udp.close()
            tcp.close()
            if exc.errno == errno.EADDRINUSE:
                if port == 0:
                    continue  # the UDP port's number is taken for TCP: pick another
                raise TransportError(
                    f"cannot listen on {listen_addr}: address already in use (is another "
                    f"agent running? choose another --listen port)"
                ) from exc
            raise TransportError(f"cannot listen on {listen_addr}: {_reason(exc)}") from exc
        except BaseException:
            udp.close()
            tcp.close()
            raise
        return udp, tcp
    raise TransportError(
        f"cannot listen on {listen_addr}: found no port free for both UDP and TCP "
        f"in {_PORT_ZERO_ATTEMPTS} tries"
    )


@asynccontextmanager
async def open_udp_tcp_transport(listen_addr: str, config: TransportConfig | None = None, *,
                                 advertise_addr: str | None = None
                                 ) -> AsyncIterator[UdpTcpTransport]:
    """Bind UDP and TCP on ``listen_addr`` (port 0: a free one) and run the transport.

    ``local_addr`` is the bound address (numeric host, resolved port) unless
    ``advertise_addr`` says how fellows reach us, e.g. when listening on 0.0.0.0.
    Raises TransportError when the address cannot be bound.
    """
    config = config or TransportConfig()
    host, port = parse_addr(listen_addr)
    udp, tcp = await _bind_pair(listen_addr, host, port)
    bound = udp.getsockname()
    local_addr = advertise_addr or format_addr(bound[0], bound[1])
    transport = UdpTcpTransport(udp, tcp, local_addr, config)
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(transport._receive_datagrams)
            try:
                yield transport
            finally:
                with trio.CancelScope(shield=True):
                    await transport.aclose()
    except BaseException as group:
        # The receive loop never raises, so a group holds just what the body raised:
        # hand that on as itself, as a plain resource would, not wrapped by our nursery.
        inner = getattr(group, "exceptions", ())
        if len(inner) != 1:
            raise
        body_error = inner[0]
    finally:
        udp.close()
        tcp.close()
    if body_error is not None:
        raise body_error


__all__ = ["TcpStream", "UdpTcpTransport", "format_addr", "open_udp_tcp_transport",
           "parse_addr"]
