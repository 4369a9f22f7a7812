"""Encrypted, authenticated streams on top of any frame-oriented ``Stream``.

``secure_connect`` and ``secure_accept`` run the handshake of ``p2pswarm.security`` over
three frames (client hello, server hello, client finish) and return a ``SecureStream``
that seals every frame it sends and opens every frame it receives. The handshake
proves both ends hold a swarm key and authenticates each end's Ed25519 identity, so
``peer_node_id`` can be trusted. On any handshake failure the underlying stream is
closed: it carries nothing usable any more.

Until the handshake completes a frame may be at most ``HANDSHAKE_FRAME_BYTES`` (on a
stream that ``Authenticates``): a stranger announcing a 64 MiB frame is cut off after
four bytes.
"""

from __future__ import annotations

import trio

from p2pswarm.errors import AuthenticationError, HandshakeRefused, KeyRefused, TransportError
from p2pswarm.security import (
    SUITE_AES256GCM,
    ClientHandshake,
    Identity,
    Keyring,
    ServerHandshake,
    StreamCipher,
)
from p2pswarm.security.handshake import is_key_refusal, key_refusal
from p2pswarm.transport.base import Authenticates, Stream

__all__ = ["HANDSHAKE_FRAME_BYTES", "SecureStream", "secure_accept", "secure_connect"]

HANDSHAKE_FRAME_BYTES = 512  # the largest handshake message (server hello) is 166 bytes


def _handshake_started(stream: Stream) -> None:
    if isinstance(stream, Authenticates):
        stream.handshake_started(HANDSHAKE_FRAME_BYTES)


def _authenticated(stream: Stream, peer_id: bytes) -> None:
    if isinstance(stream, Authenticates):
        stream.authenticated(peer_id)


class SecureStream:
    """A ``Stream`` whose frames are sealed; the peer is an authenticated fellow."""

    def __init__(
        self, stream: Stream, cipher: StreamCipher, peer_public_key: bytes, peer_node_id: bytes
    ) -> None:
        self._stream = stream
        self._cipher = cipher
        self._peer_public_key = peer_public_key
        self._peer_node_id = peer_node_id
        # The frame counters are the nonces: sealing and sending (opening and receiving)
        # must happen in the same order, so each direction runs one frame at a time.
        self._send_lock = trio.StrictFIFOLock()
        self._receive_lock = trio.StrictFIFOLock()
        self._broken = False

    async def __aenter__(self) -> SecureStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def peer_addr(self) -> str:
        return self._stream.peer_addr

    @property
    def peer_node_id(self) -> bytes:
        return self._peer_node_id

    def held_bytes(self) -> int:
        """Bytes the stream below holds in its receive buffers (0 where it cannot say)."""
        held = getattr(self._stream, "held_bytes", None)
        return int(held()) if callable(held) else 0

    @property
    def peer_public_key(self) -> bytes:
        return self._peer_public_key

    @property
    def overhead_bytes(self) -> int:
        """Bytes each frame grows by on the underlying stream."""
        return self._cipher.overhead_bytes

    async def send_frame(self, frame: bytes) -> None:
        async with self._send_lock:
            if self._broken:
                raise TransportError("secure stream is broken")
            try:
                await self._stream.send_frame(self._cipher.seal_frame(frame))
            except BaseException:
                # The counter moved but the frame may not have: the peer would reject
                # every later frame, so refuse to go on.
                self._broken = True
                raise

    async def receive_frame(self) -> bytes:
        async with self._receive_lock:
            if self._broken:
                raise TransportError("secure stream is broken")
            frame = await self._stream.receive_frame()
            try:
                return self._cipher.open_frame(frame)
            except AuthenticationError:
                self._broken = True
                await _close_quietly(self._stream)
                raise

    async def aclose(self) -> None:
        self._broken = True
        await self._stream.aclose()


async def _close_quietly(stream: Stream) -> None:
    with trio.CancelScope(shield=True):
        try:
            await stream.aclose()
        except TransportError:
            pass


async def secure_connect(
    stream: Stream,
    keyring: Keyring,
    identity: Identity,
    timeout_s: float,
    *,
    expected_node_id: bytes | None = None,
    suite: int = SUITE_AES256GCM,
) -> SecureStream:
    """Run the client side of the handshake on ``stream``.

    ``expected_node_id``, when given, is the fellow we meant to reach; another
    (authenticated) fellow answering raises AuthenticationError("wrong-peer").
    Raises AuthenticationError for a failed handshake, KeyRefused when the peer answers
    our hello with a key refusal bound to it (a fellow of another swarm: our token is not
    its), HandshakeRefused when the peer closes the stream at our hello (an older fellow of
    another swarm, or a listener too busy to take us: no verdict on the token),
    TransportError when it times out or the stream breaks; either way ``stream`` is closed.
    """
    handshake = ClientHandshake(keyring, identity, suite=suite)
    _handshake_started(stream)
    try:
        with trio.fail_after(timeout_s):
            await stream.send_frame(handshake.hello())
            try:
                server_hello = await stream.receive_frame()
            except TransportError as exc:
                raise HandshakeRefused(
                    f"{stream.peer_addr} closed the stream at our hello: it was busy or "
                    "stopping, or it is an older fellow that does not hold this swarm's key"
                ) from exc
            if is_key_refusal(handshake.hello(), server_hello):
                raise KeyRefused(
                    f"{stream.peer_addr} read our hello and refused its key: it does not "
                    "hold this swarm's key")
            client_finish, cipher = handshake.finish(server_hello)
            await stream.send_frame(client_finish)
    except trio.TooSlowError as exc:
        await _close_quietly(stream)
        raise TransportError(f"handshake timed out after {timeout_s} s") from exc
    except BaseException:
        await _close_quietly(stream)
        raise
    assert handshake.peer_public_key is not None and handshake.peer_node_id is not None
    if expected_node_id is not None and handshake.peer_node_id != expected_node_id:
        await _close_quietly(stream)
        raise AuthenticationError(
            "wrong-peer",
            f"expected fellow {expected_node_id.hex()}, {handshake.peer_node_id.hex()} answered",
        )
    _authenticated(stream, handshake.peer_node_id)
    return SecureStream(stream, cipher, handshake.peer_public_key, handshake.peer_node_id)


async def secure_accept(
    stream: Stream, keyring: Keyring, identity: Identity, timeout_s: float
) -> SecureStream:
    """Run the server side of the handshake on ``stream`` (see ``secure_connect``)."""
    handshake = ServerHandshake(keyring, identity)
    _handshake_started(stream)
    try:
        with trio.fail_after(timeout_s):
            client_hello = await stream.receive_frame()
            try:
                server_hello = handshake.respond(client_hello)
            except AuthenticationError as exc:
                refusal = key_refusal(client_hello) if exc.reason == "unknown-key" else None
                if refusal is not None:  # say so, bound to the hello, then close
                    await stream.send_frame(refusal)
                raise
            await stream.send_frame(server_hello)
            cipher = handshake.finish(await stream.receive_frame())
    except trio.TooSlowError as exc:
        await _close_quietly(stream)
        raise TransportError(f"handshake timed out after {timeout_s} s") from exc
    except BaseException:
        await _close_quietly(stream)
        raise
    assert handshake.peer_public_key is not None and handshake.peer_node_id is not None
    _authenticated(stream, handshake.peer_node_id)
    return SecureStream(stream, cipher, handshake.peer_public_key, handshake.peer_node_id)
