"""UdpTcpTransport on real loopback sockets.

Nothing here sleeps to wait: each test waits for the event it expects (a datagram, a
frame, a handler's report) under a generous ``fail_after``.
"""

from __future__ import annotations

import random
import socket as stdlib_socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from p2pswarm.config import TransportConfig
from p2pswarm.errors import NobodyListens, TransportError
from p2pswarm.transport import Stream, StreamHandler, Transport
from p2pswarm.transport.udp_tcp import (
    TcpStream,
    UdpTcpTransport,
    open_udp_tcp_transport,
    parse_addr,
)

LOOPBACK = "127.0.0.1:0"
DEADLINE_S = 20


async def echo(stream: Stream) -> None:
    while True:
        await stream.send_frame(await stream.receive_frame())


@asynccontextmanager
async def serving(handler: StreamHandler, config: TransportConfig | None = None
                  ) -> AsyncIterator[tuple[UdpTcpTransport, UdpTcpTransport]]:
    """Two transports on loopback, the second serving streams with ``handler``."""
    async with open_udp_tcp_transport(LOOPBACK, config) as a, \
            open_udp_tcp_transport(LOOPBACK, config) as b, trio.open_nursery() as nursery:
        await nursery.start(b.serve_streams, handler)
        yield a, b
        nursery.cancel_scope.cancel()


async def test_datagrams_both_ways() -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_udp_tcp_transport(LOOPBACK) as a, open_udp_tcp_transport(LOOPBACK) as b:
            assert isinstance(a, Transport)
            assert a.local_addr.startswith("127.0.0.1:") and a.local_addr != b.local_addr
            await a.send_datagram(b.local_addr, b"ping")
            assert await b.receive_datagram() == (b"ping", a.local_addr)
            await b.send_datagram(a.local_addr, b"pong" * 350)  # exactly max_datagram_bytes
            assert await a.receive_datagram() == (b"pong" * 350, b.local_addr)
            with pytest.raises(TransportError, match="max_datagram_bytes"):
                await a.send_datagram(b.local_addr, bytes(1401))
            with pytest.raises(TransportError, match="bad address"):
                await a.send_datagram("no-port", b"x")
            assert a.counters["datagrams_sent"] == 1 and b.counters["datagrams_received"] == 1


async def test_full_queue_drops_and_counts() -> None:
    config = TransportConfig(receive_queue_datagrams=4)
    with trio.fail_after(DEADLINE_S):
        async with open_udp_tcp_transport(LOOPBACK) as a, \
                open_udp_tcp_transport(LOOPBACK, config) as b:
            for i in range(20):
                await a.send_datagram(b.local_addr, bytes([i]))
            # Wait for the receive loop to have taken all 20 off the socket.
            while (b.counters["datagrams_received"]
                   + b.counters["datagrams_dropped_queue_full"] < 20):
                await trio.testing.wait_all_tasks_blocked()
            assert b.counters["datagrams_dropped_queue_full"] == 16
            assert ([(await b.receive_datagram())[0] for _ in range(4)]
                    == [bytes([i]) for i in range(4)])


@pytest.mark.parametrize("size", [0, 1, 1000, 65_535, 65_536, 65_537, 262_145, 1 << 20])
async def test_frames_of_many_sizes_round_trip(size: int) -> None:
    frame = random.Random(size).randbytes(size)
    with trio.fail_after(DEADLINE_S):
        async with serving(echo) as (a, b):
            stream = await a.open_stream(b.local_addr)
            assert stream.peer_addr == b.local_addr and isinstance(stream, Stream)
            for _ in range(3):
                await stream.send_frame(frame)
            for _ in range(3):
                assert await stream.receive_frame() == frame
            await stream.aclose()


async def test_many_small_frames_in_order_both_ways() -> None:
    frames = [i.to_bytes(4, "big") * (i % 50) for i in range(2000)]
    with trio.fail_after(DEADLINE_S):
        async with serving(echo) as (a, b), trio.open_nursery() as nursery:
            stream = await a.open_stream(b.local_addr)

            async def send_all() -> None:
                for frame in frames:
                    await stream.send_frame(frame)

            nursery.start_soon(send_all)
            assert [await stream.receive_frame() for _ in frames] == frames


async def test_port_in_use_gives_a_clear_error() -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_udp_tcp_transport(LOOPBACK) as a:
            with pytest.raises(TransportError) as info:
                async with open_udp_tcp_transport(a.local_addr):
                    pass
            message = str(info.value)
            assert message == (f"cannot listen on {a.local_addr}: address already in use "
                               f"(is another agent running? choose another --listen port)")
            assert isinstance(info.value.__cause__, OSError)

        # Only the TCP port taken (UDP free): the same error.
        listener = stdlib_socket.socket(stdlib_socket.AF_INET, stdlib_socket.SOCK_STREAM)
        with listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            addr = f"127.0.0.1:{listener.getsockname()[1]}"
            with pytest.raises(TransportError, match="address already in use"):
                async with open_udp_tcp_transport(addr):
                    pass


async def test_port_zero_is_free_for_both_and_advertise_is_used() -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_udp_tcp_transport(LOOPBACK, advertise_addr="fellow.lan:7946") as a:
            assert a.local_addr == "fellow.lan:7946"
        async with open_udp_tcp_transport(LOOPBACK) as a:
            host, port = parse_addr(a.local_addr)
            # Both protocols hold the port: a plain socket can take neither.
            for kind in (stdlib_socket.SOCK_DGRAM, stdlib_socket.SOCK_STREAM):
                with stdlib_socket.socket(stdlib_socket.AF_INET, kind) as other, \
                        pytest.raises(OSError):
                    other.bind((host, port))


async def test_garbage_connections_never_break_the_listener() -> None:
    config = TransportConfig(max_frame_bytes=1 << 20)
    reports_in, reports_out = trio.open_memory_channel[str](100)

    async def handler(stream: Stream) -> None:
        try:
            while True:
                frame = await stream.receive_frame()
                await stream.send_frame(frame)
        except TransportError as exc:
            reports_in.send_nowait(str(exc))
            raise

    async def raw_client(addr: str, payload: bytes) -> bytes:
        """Send payload, half-close, return what comes back until the server closes."""
        host, port = parse_addr(addr)
        sock = trio.socket.socket()
        with sock:
            await sock.connect((host, port))
            if payload:
                await sock.send(payload)
            sock.shutdown(stdlib_socket.SHUT_WR)
            received = b""
            try:
                while chunk := await sock.recv(65536):
                    received += chunk
            except ConnectionResetError:  # closed with our noise unread: a reset, fine
                pass
            return received

    rng = random.Random(7)
    garbage = [
        b"",  # connect and close
        b"\xff\xff\xff\xff" + rng.randbytes(100),  # a 4 GiB frame announced
        ((1 << 20) + 1).to_bytes(4, "big"),  # just above max_frame_bytes
        b"\x00\x00\x10\x00" + rng.randbytes(10),  # a frame cut short
        b"\x00\x00",  # half a header
        rng.randbytes(5000),  # noise
    ]
    with trio.fail_after(DEADLINE_S):
        async with serving(handler, config) as (a, b):
            for payload in garbage:
                await raw_client(b.local_addr, payload)
                report = await reports_out.receive()
                assert "closed the stream" in report or "max_frame_bytes" in report, report
            # A good client is served as before.
            stream = await a.open_stream(b.local_addr)
            await stream.send_frame(b"hello")
            assert await stream.receive_frame() == b"hello"
            with pytest.raises(TransportError, match="max_frame_bytes"):
                await stream.send_frame(bytes((1 << 20) + 1))  # refused before sending
            await stream.send_frame(b"still fine")
            assert await stream.receive_frame() == b"still fine"
            assert b.counters["streams_accepted"] == len(garbage) + 1


async def test_a_failing_handler_closes_only_its_stream() -> None:
    async def handler(stream: Stream) -> None:
        if await stream.receive_frame() == b"boom":
            raise ValueError("a bug in the handler")
        await stream.send_frame(b"ok")

    with trio.fail_after(DEADLINE_S):
        async with serving(handler) as (a, b):
            bad = await a.open_stream(b.local_addr)
            await bad.send_frame(b"boom")
            with pytest.raises(TransportError, match="closed the stream"):
                await bad.receive_frame()
            good = await a.open_stream(b.local_addr)
            await good.send_frame(b"fine")
            assert await good.receive_frame() == b"ok"


async def test_connect_refused_is_a_transport_error() -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_udp_tcp_transport(LOOPBACK) as gone:
            addr = gone.local_addr
        async with open_udp_tcp_transport(LOOPBACK) as a:
            with pytest.raises(TransportError, match="cannot connect"):
                await a.open_stream(addr)
            await a.send_datagram(addr, b"to nobody")  # silent


async def test_aclose_is_clean() -> None:
    handler_cancelled = trio.Event()
    handler_started = trio.Event()
    serve_returned = trio.Event()

    async def handler(stream: Stream) -> None:
        handler_started.set()
        try:
            await stream.receive_frame()
        except trio.Cancelled:
            handler_cancelled.set()
            raise

    with trio.fail_after(DEADLINE_S):
        async with open_udp_tcp_transport(LOOPBACK) as a, trio.open_nursery() as outer:
            async with open_udp_tcp_transport(LOOPBACK) as b:

                async def serve() -> None:
                    await b.serve_streams(handler)
                    serve_returned.set()

                async def receive_until_closed() -> None:
                    with pytest.raises(TransportError, match="closed"):
                        await b.receive_datagram()

                outer.start_soon(serve)
                outer.start_soon(receive_until_closed)
                await trio.testing.wait_all_tasks_blocked()
                stream = await a.open_stream(b.local_addr)
                await handler_started.wait()
                outgoing = await b.open_stream(a.local_addr)  # completes in a's backlog
            # b is closed now: serve_streams returned, its handler was cancelled.
            await serve_returned.wait()
            assert handler_cancelled.is_set()
            with pytest.raises(TransportError, match="closed"):
                await stream.receive_frame()
            with pytest.raises(TransportError, match="closed"):
                await outgoing.send_frame(b"x")
            with pytest.raises(TransportError, match="closed"):
                await b.send_datagram(a.local_addr, b"x")
            await b.aclose()  # idempotent


async def test_errors_from_the_body_pass_through_unwrapped() -> None:
    with pytest.raises(KeyError):  # as itself, not in an ExceptionGroup
        async with open_udp_tcp_transport(LOOPBACK):
            raise KeyError("mine")
    with trio.move_on_after(0) as scope:
        async with open_udp_tcp_transport(LOOPBACK):
            await trio.sleep_forever()
    assert scope.cancelled_caught


async def test_ipv6_loopback() -> None:
    if not stdlib_socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        async with open_udp_tcp_transport("[::1]:0") as a, open_udp_tcp_transport("[::1]:0") as b:
            assert a.local_addr.startswith("[::1]:")
            with trio.fail_after(DEADLINE_S):
                await a.send_datagram(b.local_addr, b"v6")
                assert await b.receive_datagram() == (b"v6", a.local_addr)
    except TransportError as exc:
        if "cannot listen" in str(exc):
            pytest.skip(f"no IPv6 loopback here: {exc}")
        raise


async def test_a_frame_buffer_grows_with_bytes_received_not_the_announced_size() -> None:
    seen: list[int] = []
    got_some = trio.Event()

    async def handler(stream: Stream) -> None:
        assert isinstance(stream, TcpStream)
        stream.authenticated()  # past the handshake: frames up to max_frame_bytes
        with trio.move_on_after(DEADLINE_S):
            while stream._big_got < (2 << 20):
                with trio.move_on_after(0.05):
                    await stream.receive_frame()
            seen.append(stream.held_frame_bytes)
            got_some.set()

    with trio.fail_after(DEADLINE_S):
        async with serving(handler) as (a, b):
            host, port = parse_addr(b.local_addr)
            sock = trio.socket.socket()
            with sock:
                await sock.connect((host, port))
                await sock.send((64 << 20).to_bytes(4, "big"))  # 64 MiB announced...
                for _ in range(32):  # ...2 MiB sent
                    await sock.send(bytes(64 * 1024))
                await got_some.wait()
    (allocated,) = seen
    assert allocated <= 4 << 20  # about what came, never the 64 MiB announced


async def test_before_authentication_a_frame_is_handshake_sized() -> None:
    reports: list[str] = []

    async def handler(stream: Stream) -> None:
        assert isinstance(stream, TcpStream)
        stream.handshake_started(512)
        try:
            await stream.receive_frame()
        except TransportError as exc:
            reports.append(str(exc))

    with trio.fail_after(DEADLINE_S):
        async with serving(handler) as (a, b):
            stream = await a.open_stream(b.local_addr)
            await stream.send_frame(bytes(513))
            with pytest.raises(TransportError):
                await stream.receive_frame()  # the other end hung up
    assert reports and "before authentication" in reports[0]


async def test_a_transport_that_stopped_serving_streams_refuses_connections() -> None:
    """An agent that stops (its serving cancelled) while its process lives on a while,
    waiting for a computation: a fellow connecting is refused at once, not accepted into
    the kernel's backlog and reset unanswered (which read as "it does not hold this
    swarm's key")."""
    with trio.fail_after(DEADLINE_S):
        async with open_udp_tcp_transport(LOOPBACK) as a, open_udp_tcp_transport(LOOPBACK) as b:
            async with trio.open_nursery() as nursery:
                await nursery.start(b.serve_streams, echo)
                nursery.cancel_scope.cancel()
            with pytest.raises(NobodyListens):
                await a.open_stream(b.local_addr)


async def connect_from(source_host: str, addr: str) -> trio.socket.SocketType:
    """A raw connection from a given loopback source address (127.0.0.x)."""
    host, port = parse_addr(addr)
    sock = trio.socket.socket()
    await sock.bind((source_host, 0))
    await sock.connect((host, port))
    return sock


async def test_handshake_slots_are_shared_by_source_and_a_new_source_gets_one() -> None:
    """All slots held by strangers on many source addresses: a new source still gets
    in, and the slot it takes is the oldest pending one of the busiest source."""
    config = TransportConfig(max_unauthenticated_streams=8, max_unauthenticated_per_host=3)
    accepted: list[str] = []
    closed: list[str] = []
    everyone_waits = trio.Event()

    async def handler(stream: Stream) -> None:
        accepted.append(stream.peer_addr)
        try:
            frame = await stream.receive_frame()  # a pending handshake, until evicted
            await stream.send_frame(frame)
        except TransportError:
            closed.append(stream.peer_addr)
            raise
        await everyone_waits.wait()

    socks: list[trio.socket.SocketType] = []
    with trio.fail_after(DEADLINE_S):
        async with serving(handler, config) as (_, b):
            try:
                # 127.0.0.2 takes three slots (its share), then 127.0.0.3..7 one each
                for source in ["127.0.0.2"] * 3 + [f"127.0.0.{i}" for i in range(3, 8)]:
                    socks.append(await connect_from(source, b.local_addr))
                    count = len(socks)
                    while len(accepted) < count:
                        await trio.sleep(0.01)
                oldest_of_busiest = accepted[0]
                # the slots are full: a joiner from a new source is let in, and answered
                joiner = await connect_from("127.0.0.1", b.local_addr)
                socks.append(joiner)
                await joiner.send((5).to_bytes(4, "big") + b"hello")
                assert await joiner.recv(64) == (5).to_bytes(4, "big") + b"hello"
                assert closed == [oldest_of_busiest]
                assert b.counters["handshakes_evicted"] == 1
                assert b.counters["streams_refused_busy"] == 0
                # a source over its own share makes room from its own oldest
                socks.append(await connect_from("127.0.0.3", b.local_addr))
                socks.append(await connect_from("127.0.0.3", b.local_addr))
                socks.append(await connect_from("127.0.0.3", b.local_addr))
                while b.counters["handshakes_evicted"] < 4:
                    await trio.sleep(0.01)
                assert sum(1 for addr in closed if addr.startswith("127.0.0.3:")) >= 1
                everyone_waits.set()
            finally:
                for sock in socks:
                    sock.close()


@pytest.mark.parametrize("sources", [["127.0.0.1"] * 6, [f"127.0.0.{i}" for i in range(2, 8)]],
                         ids=["one-host", "one-fellow-on-six-hosts"])
async def test_frames_held_back_by_one_byte_cost_one_budget_not_one_frame_a_stream(
        sources: list[str]) -> None:
    """Six streams each send a 3 MiB frame but its last byte: the victim holds at most
    its 4 MiB budget of the host (or, across hosts, of the fellow), not 18 MiB; the rest
    wait unread, and every frame is delivered once its last byte comes."""
    mib = 1 << 20
    config = TransportConfig(max_frame_bytes=4 * mib, max_held_frame_bytes_per_host=4 * mib,
                             max_held_frame_bytes_per_fellow=4 * mib)
    frame_bytes = 3 * mib
    delivered: list[int] = []

    async def handler(stream: Stream) -> None:
        assert isinstance(stream, TcpStream)
        stream.authenticated(b"f" * 16)  # the same fellow on every stream
        delivered.append(len(await stream.receive_frame()))

    def allocated(b: UdpTcpTransport) -> int:
        return sum(s.held_frame_bytes for s in b._accepted)

    with trio.fail_after(DEADLINE_S):
        async with serving(handler, config) as (_, b), trio.open_nursery() as senders:
            socks = [await connect_from(source, b.local_addr) for source in sources]

            async def send_all_but_the_last_byte(sock: trio.socket.SocketType) -> None:
                data = frame_bytes.to_bytes(4, "big") + bytes(frame_bytes - 1)
                view = memoryview(data)
                while view:
                    view = view[await sock.send(view):]

            for sock in socks:
                senders.start_soon(send_all_but_the_last_byte, sock)
            peak = 0
            while b.counters["frame_budget_waits"] < len(socks) - 1 \
                    or b.held_bytes.total() < frame_bytes:
                peak = max(peak, allocated(b))
                await trio.sleep(0.01)
            for _ in range(20):  # a while longer: nothing more is taken
                peak = max(peak, allocated(b))
                await trio.sleep(0.01)
            assert peak <= 4 * mib
            assert b.held_bytes.held(("fellow", (b"f" * 16).hex())) <= 4 * mib
            for sock in socks:
                await sock.send(b"\x00")
            while len(delivered) < len(socks):
                peak = max(peak, allocated(b))
                await trio.sleep(0.01)
            assert delivered == [frame_bytes] * len(socks)
            assert peak <= 4 * mib and b.held_bytes.total() == 0
            for sock in socks:
                sock.close()
