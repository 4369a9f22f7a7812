"""SecureStream over a tiny in-test frame stream pair, in virtual time."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

from p2pswarm.errors import (
    AuthenticationError,
    HandshakeRefused,
    KeyRefused,
    SwarmError,
    TransportError,
)
from p2pswarm.security import (
    SUITE_CHACHA20POLY1305,
    ClientHandshake,
    Identity,
    Keyring,
    SwarmSecret,
)
from p2pswarm.security.handshake import KEY_REFUSAL_BYTES, key_refusal
from p2pswarm.transport.base import Stream
from p2pswarm.transport.secure import SecureStream, secure_accept, secure_connect

SECRET = SwarmSecret(bytes(range(32)))
OTHER_SECRET = SwarmSecret(bytes(range(100, 132)))
TIMEOUT_S = 5.0

# Called with (index of the frame on this direction, frame); returns the frames delivered.
Tap = Callable[[int, bytes], list[bytes]]


class ChannelStream:
    """One end of a frame stream built on two trio memory channels."""

    def __init__(
        self,
        send: trio.MemorySendChannel[bytes],
        receive: trio.MemoryReceiveChannel[bytes],
        peer_addr: str,
        tap: Tap | None = None,
    ) -> None:
        self._send = send
        self._receive = receive
        self._peer_addr = peer_addr
        self._tap = tap
        self._sent = 0
        self.closed = False

    @property
    def peer_addr(self) -> str:
        return self._peer_addr

    async def send_frame(self, frame: bytes) -> None:
        if self.closed:
            raise TransportError("stream closed")
        frames = self._tap(self._sent, frame) if self._tap else [frame]
        self._sent += 1
        try:
            for f in frames:
                await self._send.send(f)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise TransportError("peer closed the stream") from exc

    async def receive_frame(self) -> bytes:
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError) as exc:
            raise TransportError("peer closed the stream") from exc

    async def aclose(self) -> None:
        self.closed = True
        await self._send.aclose()
        await self._receive.aclose()


def stream_pair(
    client_tap: Tap | None = None, server_tap: Tap | None = None
) -> tuple[ChannelStream, ChannelStream]:
    up_send, up_receive = trio.open_memory_channel[bytes](16)
    down_send, down_receive = trio.open_memory_channel[bytes](16)
    client = ChannelStream(up_send, down_receive, "10.0.0.2:7946", client_tap)
    server = ChannelStream(down_send, up_receive, "10.0.0.1:50000", server_tap)
    return client, server


def test_channel_stream_is_a_stream() -> None:
    client, _ = stream_pair()
    assert isinstance(client, Stream)


async def connect_pair(
    client_keyring: Keyring,
    server_keyring: Keyring,
    client_identity: Identity,
    server_identity: Identity,
    client_tap: Tap | None = None,
    server_tap: Tap | None = None,
    **connect_options: object,
) -> tuple[SecureStream | BaseException, SecureStream | BaseException]:
    raw_client, raw_server = stream_pair(client_tap, server_tap)
    results: dict[str, SecureStream | BaseException] = {}

    async def run(name: str, coro_fn: Callable[[], object]) -> None:
        try:
            results[name] = await coro_fn()  # type: ignore[misc]
        except SwarmError as exc:
            results[name] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            run,
            "client",
            lambda: secure_connect(
                raw_client, client_keyring, client_identity, TIMEOUT_S, **connect_options
            ),
        )
        nursery.start_soon(
            run,
            "server",
            lambda: secure_accept(raw_server, server_keyring, server_identity, TIMEOUT_S),
        )
    return results["client"], results["server"]


async def connect_fellows(
    client_tap: Tap | None = None, server_tap: Tap | None = None, **connect_options: object
) -> tuple[SecureStream | BaseException, SecureStream | BaseException]:
    """Two new fellows of the one swarm (``SECRET``), connected."""
    return await connect_pair(
        Keyring([SECRET]),
        Keyring([SECRET]),
        Identity.generate(),
        Identity.generate(),
        client_tap,
        server_tap,
        **connect_options,
    )


async def test_handshake_and_frames_both_ways(autojump_clock: trio.abc.Clock) -> None:
    client_id, server_id = Identity.generate(), Identity.generate()
    client, server = await connect_pair(Keyring([SECRET]), Keyring([SECRET]), client_id, server_id)
    assert isinstance(client, SecureStream) and isinstance(server, SecureStream)
    assert isinstance(client, Stream)
    assert (client.peer_node_id, client.peer_public_key) == (
        server_id.node_id,
        server_id.public_key,
    )
    assert (server.peer_node_id, server.peer_public_key) == (
        client_id.node_id,
        client_id.public_key,
    )
    assert client.peer_addr == "10.0.0.2:7946"
    big = bytes(range(256)) * 4096  # 1 MiB
    for frame in (b"hello", b"", big):
        await client.send_frame(frame)
        assert await server.receive_frame() == frame
        await server.send_frame(frame[::-1])
        assert await client.receive_frame() == frame[::-1]
    await client.aclose()
    with pytest.raises(TransportError):
        await server.receive_frame()
    assert trio.current_time() == 0  # nothing waited on the clock


async def test_chacha_suite_works_too(autojump_clock: trio.abc.Clock) -> None:
    client, server = await connect_fellows(suite=SUITE_CHACHA20POLY1305)
    assert isinstance(client, SecureStream) and isinstance(server, SecureStream)
    await server.send_frame(b"tensor bytes")
    assert await client.receive_frame() == b"tensor bytes"


async def test_frames_on_the_wire_are_sealed(autojump_clock: trio.abc.Clock) -> None:
    seen: list[bytes] = []

    def record(_: int, frame: bytes) -> list[bytes]:
        seen.append(frame)
        return [frame]

    client, server = await connect_fellows(client_tap=record)
    assert isinstance(client, SecureStream) and isinstance(server, SecureStream)
    await client.send_frame(b"plain words here")
    assert await server.receive_frame() == b"plain words here"
    assert len(seen) == 3  # client hello, client finish, one data frame
    assert b"plain words" not in seen[-1]
    assert len(seen[-1]) == len(b"plain words here") + client.overhead_bytes


async def test_another_swarm_secret_cannot_connect(autojump_clock: trio.abc.Clock) -> None:
    client, server = await connect_pair(
        Keyring([OTHER_SECRET]), Keyring([SECRET]), Identity.generate(), Identity.generate()
    )
    assert isinstance(server, AuthenticationError) and server.reason == "unknown-key"
    # The server answers with a key refusal bound to the client's hello, then hangs up.
    assert isinstance(client, KeyRefused)


async def test_a_close_at_the_hello_is_no_key_refusal(autojump_clock: trio.abc.Clock) -> None:
    """A listener that closes at our hello (busy, flooded, stopping) says nothing of our
    token: HandshakeRefused, never KeyRefused."""
    raw_client, raw_server = stream_pair()

    async def close_at_hello() -> None:
        await raw_server.receive_frame()
        await raw_server.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(close_at_hello)
        with pytest.raises(HandshakeRefused) as info:
            await secure_connect(raw_client, Keyring([SECRET]), Identity.generate(), TIMEOUT_S)
    assert not isinstance(info.value, KeyRefused)


async def test_a_key_refusal_must_answer_our_own_hello(autojump_clock: trio.abc.Clock) -> None:
    """A refusal of another hello (replayed, or made up without reading ours) is no
    verdict on the token: the handshake just fails."""
    stale = key_refusal(ClientHandshake(Keyring([SECRET]), Identity.generate()).hello())
    assert stale is not None and len(stale) == KEY_REFUSAL_BYTES
    raw_client, raw_server = stream_pair()

    async def answer_with(frame: bytes) -> None:
        await raw_server.receive_frame()
        await raw_server.send_frame(frame)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_with, stale)
        with pytest.raises(SwarmError) as info:
            await secure_connect(raw_client, Keyring([SECRET]), Identity.generate(), TIMEOUT_S)
    assert not isinstance(info.value, HandshakeRefused)


async def test_tampered_hello_fails_the_handshake(autojump_clock: trio.abc.Clock) -> None:
    def tamper_hello(index: int, frame: bytes) -> list[bytes]:
        if index == 0:
            return [frame[:40] + bytes([frame[40] ^ 1]) + frame[41:]]
        return [frame]

    client, server = await connect_fellows(client_tap=tamper_hello)
    assert isinstance(server, AuthenticationError) and server.reason == "bad-seal"
    assert isinstance(client, TransportError)


async def test_tampered_server_hello_fails_the_client(autojump_clock: trio.abc.Clock) -> None:
    def tamper(index: int, frame: bytes) -> list[bytes]:
        return [frame[:-1] + bytes([frame[-1] ^ 1])] if index == 0 else [frame]

    client, server = await connect_fellows(server_tap=tamper)
    assert isinstance(client, AuthenticationError) and client.reason == "bad-seal"
    assert isinstance(server, TransportError)


async def test_wrong_peer_is_refused(autojump_clock: trio.abc.Clock) -> None:
    client, _ = await connect_fellows(expected_node_id=b"x" * 16)
    assert isinstance(client, AuthenticationError) and client.reason == "wrong-peer"


async def test_handshake_times_out_in_virtual_time(autojump_clock: trio.abc.Clock) -> None:
    raw_client, _ = stream_pair()  # a server that never answers
    start = trio.current_time()
    with pytest.raises(TransportError, match="handshake timed out"):
        await secure_connect(raw_client, Keyring([SECRET]), Identity.generate(), TIMEOUT_S)
    assert trio.current_time() - start == pytest.approx(TIMEOUT_S)
    assert raw_client.closed
    _, raw_server = stream_pair()  # a client that connects and then says nothing
    with pytest.raises(TransportError, match="handshake timed out"):
        await secure_accept(raw_server, Keyring([SECRET]), Identity.generate(), TIMEOUT_S)
    assert trio.current_time() - start == pytest.approx(2 * TIMEOUT_S)


@pytest.mark.parametrize("attack", ["tamper", "replay", "drop", "reorder"])
async def test_bad_frames_are_refused_and_break_the_stream(
    attack: str, autojump_clock: trio.abc.Clock
) -> None:
    held: list[bytes] = []

    def middlebox(index: int, frame: bytes) -> list[bytes]:
        # Frames 0 and 1 are the hello and the finish; data starts at 2.
        if index != 3:
            if attack == "reorder" and index == 4:
                return [frame, *held]
            return [frame]
        if attack == "tamper":
            return [frame[:5] + bytes([frame[5] ^ 0x80]) + frame[6:]]
        if attack == "replay":
            return [frame, frame]
        if attack == "reorder":
            held.append(frame)
        return []  # dropped (or held back)

    client, server = await connect_fellows(client_tap=middlebox)
    assert isinstance(client, SecureStream) and isinstance(server, SecureStream)
    for i in range(3):
        await client.send_frame(b"frame %d" % i)
    assert await server.receive_frame() == b"frame 0"
    if attack == "replay":
        assert await server.receive_frame() == b"frame 1"
    with pytest.raises(AuthenticationError) as info:
        await server.receive_frame()
    assert info.value.reason == "bad-seal"
    with pytest.raises(TransportError):
        await server.receive_frame()  # broken for good
    with pytest.raises(TransportError):
        await client.send_frame(b"after")  # the server hung up
