"""Sealed streams: calling fellows, and answering the streams they open.

Every stream runs the secure handshake first, then carries request/response envelopes,
one per frame. An accepted stream is answered by the handler registered for the type of
its first message (``on_stream``); a request of a kind this release does not know is
answered with ``Unsupported`` and the stream goes on, and a request of a kind added
after protocol 1 goes only to a fellow that announced its capability (``request``); a
peer two protocols away gets a ``Refusal`` naming both versions, and the stream closes.
A fellow holds at most ``transport.max_streams_per_fellow`` of them open at once, and a
stream that falls silent for ``transport.stream_idle_timeout_s`` is closed. Nothing a
peer sends can raise out of here: every failure is a counted drop.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import trio

from p2pswarm import wire
from p2pswarm.agent.counters import Counters
from p2pswarm.agent.ports import StreamHandler
from p2pswarm.agent.self_watch import Held, SelfWatch
from p2pswarm.config import SwarmConfig
from p2pswarm.errors import (
    AuthenticationError,
    LocalProtocolError,
    RemoteProtocolError,
    SwarmError,
    TransportError,
    VersionMismatch,
    VersionRefused,
)
from p2pswarm.security import Identity, Keyring
from p2pswarm.transport.base import Stream, Transport
from p2pswarm.transport.secure import SecureStream, secure_accept, secure_connect
from p2pswarm.wire.base import Refusal, Unsupported
from p2pswarm.wire.codec import UnknownKind
from p2pswarm.wire.versions import Release

log = logging.getLogger("p2pswarm.agent")


def count_failed_handler(counters: Counters, name: str, where: str, addr: str,
                         exc: Exception) -> None:
    """A handler raised on a peer's message: count it, log it once per kind, go on."""
    reason = exc.reason if isinstance(exc, SwarmError) and hasattr(exc, "reason") \
        else type(exc).__name__
    key = f"handler-failed-{where}"
    if not counters.drops[key]:
        log.warning("%s: a %s from %s failed its handler (%s); dropped", name, where,
                    addr, reason, exc_info=not isinstance(exc, SwarmError))
    counters.drop(key)


class Links:
    """This fellow's sealed streams, both ways."""

    def __init__(self, name: str, transport: Transport, keyring: Keyring, identity: Identity,
                 config: SwarmConfig, counters: Counters, watch: SelfWatch,
                 release_of: Callable[[bytes], Release]) -> None:
        self._name = name
        self._transport = transport
        self._keyring = keyring
        self._identity = identity
        self._config = config
        self._counters = counters
        self._handlers: dict[type, StreamHandler] = {}
        self._streams_of: Counter[bytes] = Counter()  # accepted streams open, per fellow
        # accepted streams per fellow: the watch reads them, a revocation cancels them
        self._open: dict[bytes, dict[SecureStream, trio.CancelScope]] = {}
        self.watch = watch
        self.barred: set[bytes] = set()  # revoked fellows: no stream of theirs is answered
        self._refusals_logged: set[tuple[str, str]] = set()
        self._release_of = release_of  # what a fellow announced (wire.versions)

    def on_stream(self, message_type: type, handler: StreamHandler) -> None:
        """Answer streams whose first envelope is ``message_type`` (see StreamHandler)."""
        self._handlers[message_type] = handler

    # --- calling --------------------------------------------------------------------

    async def call(self, addr: str, request: Any, *, timeout_s: float | None = None) -> Any:
        """Send one request over a fresh secure stream and return the reply message."""
        async with await self.open_secure(addr, timeout_s=timeout_s) as stream:
            return await self.request(stream, request)

    async def open_secure(self, addr: str, *, timeout_s: float | None = None) -> SecureStream:
        timeout_s = timeout_s or self._config.security.handshake_timeout_s
        raw = await self._transport.open_stream(addr)
        try:
            stream = await secure_connect(raw, self._keyring, self._identity, timeout_s)
        except BaseException:
            await raw.aclose()
            raise
        self._counters.streams_out += 1
        return stream

    async def request(self, stream: SecureStream, request: Any) -> Any:
        need = wire.needs(type(request))
        if need is not None and need not in self._release_of(stream.peer_node_id).speaks:
            raise LocalProtocolError("unspoken", f"{stream.peer_addr} has not announced "
                                     f"{need!r}, which a {type(request).__name__} needs")
        await stream.send_frame(wire.encode(request))
        self._counters.frames_out += 1
        frame = await stream.receive_frame()
        self._counters.frames_in += 1
        (reply,) = wire.decode(frame, max_bytes=self._config.transport.max_frame_bytes)
        if isinstance(reply, Refusal):
            self._log_refusal_once(stream.peer_addr, reply.reason)
            raise VersionRefused(f"{stream.peer_addr} refused: {reply.reason}")
        if isinstance(reply, Unsupported):
            raise RemoteProtocolError("unsupported", f"{stream.peer_addr} does not speak "
                                      f"{type(request).__name__} (tag {reply.tag})")
        return reply

    def _log_refusal_once(self, addr: str, reason: str, *, ours: bool = False,
                          fellow: bytes = b"") -> None:
        """A peer refused us, or we it (``ours``; another protocol): one line per peer
        and reason (``fellow``: its node id, as its streams come from changing ports)."""
        key = (fellow.hex() or addr, reason)
        if key in self._refusals_logged or len(self._refusals_logged) >= 1024:
            return
        self._refusals_logged.add(key)
        if ours:
            log.warning("%s: refusing %s: %s", self._name, addr, reason)
        else:
            log.warning("%s: %s refused this fellow: %s", self._name, addr, reason)

    # --- answering ------------------------------------------------------------------

    async def serve(self, raw: Stream) -> None:
        """Handshake on a stream a peer opened, then answer it (the transport's
        ``serve_streams`` runs this per stream)."""
        self._counters.streams_in += 1
        try:
            stream = await secure_accept(raw, self._keyring, self._identity,
                                         self._config.security.handshake_timeout_s)
        except (AuthenticationError, RemoteProtocolError) as exc:
            self._counters.drop("stream-" + exc.reason)
            await raw.aclose()
            return
        except TransportError:
            self._counters.drop("stream-handshake")
            await raw.aclose()
            return
        fellow = stream.peer_node_id
        if fellow in self.barred:
            self._counters.drop("stream-revoked")
            await stream.aclose()
            return
        if self._streams_of[fellow] >= self._config.transport.max_streams_per_fellow:
            self._counters.drop("stream-fellow-cap")  # a token holder's streams are bounded
            await stream.aclose()
            return
        self._streams_of[fellow] += 1
        scope = trio.CancelScope()
        self._open.setdefault(fellow, {})[stream] = scope
        try:
            with scope:
                await self._answer(stream)
        finally:
            self._streams_of[fellow] -= 1
            if not self._streams_of[fellow]:
                del self._streams_of[fellow]
            open_now = self._open.get(fellow)
            if open_now is not None:
                open_now.pop(stream, None)
                if not open_now:
                    del self._open[fellow]
            await stream.aclose()

    def held(self) -> dict[bytes, Held]:
        """What each fellow's streams into this agent hold now (for the self watch)."""
        return {fellow: Held(len(streams), sum(s.held_bytes() for s in streams))
                for fellow, streams in self._open.items()}

    def close_fellow(self, fellow: bytes) -> None:
        """Close every stream ``fellow`` opened to us (revoked)."""
        for scope in self._open.get(fellow, {}).values():
            scope.cancel()

    async def _answer(self, stream: SecureStream) -> None:
        """Answer request envelopes until the peer closes, misbehaves or falls silent for
        ``stream_idle_timeout_s`` (a handler that keeps the stream bounds its own waits)."""
        idle_s = self._config.transport.stream_idle_timeout_s
        while True:
            try:
                with trio.move_on_after(idle_s) as waiting:
                    frame = await stream.receive_frame()
                if waiting.cancelled_caught:
                    self._counters.drop("stream-idle")
                    return
                self._counters.frames_in += 1
                started = time.perf_counter()
                try:
                    # only the types answered here are unpacked at all
                    messages = wire.decode(frame,
                                           max_bytes=self._config.transport.max_frame_bytes,
                                           kinds=self._handlers)
                finally:  # what the decode cost the loop, charged to the sender
                    self.watch.charge(stream.peer_node_id, "frame",
                                      time.perf_counter() - started, trio.current_time())
            except TransportError:
                return  # peer closed
            except UnknownKind as exc:  # a newer fellow's kind: say so, keep the stream
                self._counters.drop("frame-unknown-tag")
                if not await self._send(stream, Unsupported(exc.tag, "unknown kind")):
                    return
                continue
            except VersionMismatch as exc:  # two protocols away: one line, then close
                self._counters.drop("frame-version")
                self._log_refusal_once(stream.peer_addr, exc.detail, ours=True,
                                       fellow=stream.peer_node_id)
                await self._send(stream, Refusal(wire.PROTOCOL_MAJOR, wire.PROTOCOL_MINOR,
                                                 exc.detail))
                return
            except (AuthenticationError, RemoteProtocolError) as exc:
                self._counters.drop("frame-" + exc.reason)
                return
            if len(messages) != 1 or type(messages[0]) not in self._handlers:
                self._counters.drop("frame-unexpected-message")
                return
            try:
                reply = await self._handlers[type(messages[0])](messages[0], stream)
            except RemoteProtocolError as exc:
                self._counters.drop("frame-" + exc.reason)
                return
            if reply is None or not await self._send(stream, reply):
                return

    async def _send(self, stream: SecureStream, reply: Any) -> bool:
        """Send one reply; False: the stream is done (it failed, or the reply would not
        encode, which costs this stream)."""
        try:
            frame = wire.encode(reply)
        except SwarmError as exc:
            count_failed_handler(self._counters, self._name, "stream", stream.peer_addr, exc)
            return False
        try:
            await stream.send_frame(frame)
            self._counters.frames_out += 1
        except TransportError:
            return False
        return True


__all__ = ["Links", "count_failed_handler"]
