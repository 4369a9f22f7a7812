"""The agent: one trio nursery that owns the transport, the keys and the control API.

Theory of operation. Datagrams arrive sealed; the agent opens them (wrong key, tampering,
replays are dropped and counted by reason), decodes them (malformed ones likewise), and
hands each message to the handler registered for its type. Streams run the secure
handshake first, then carry request/response envelopes, one per frame. Nothing a peer
sends can raise out of the receive loops: every failure is a counted drop.

The agent takes its transport, clock (trio's, so a MockClock gives virtual time), keys and
random generator as arguments, so the same code runs on real sockets and in simulation.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from p2pswarm import wire
from p2pswarm.agent.counters import Counters
from p2pswarm.config import SwarmConfig
from p2pswarm.control.server import serve_control
from p2pswarm.errors import (
    AuthenticationError,
    ControlError,
    RemoteProtocolError,
    SwarmError,
    TransportError,
    VersionMismatch,
)
from p2pswarm.security import DatagramSealer, Identity, Keyring
from p2pswarm.transport.base import Stream, Transport
from p2pswarm.transport.secure import SecureStream, secure_accept, secure_connect
from p2pswarm.wire.base import Hello, HelloAck, Refusal

log = logging.getLogger("p2pswarm.agent")

DatagramHandler = Callable[[Any, bytes, str], None]  # (message, sender node id, sender addr)
StreamHandler = Callable[[Any, SecureStream], Awaitable[Any]]  # returns the reply message
ControlHandler = Callable[[dict[str, Any]], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Fellow:
    """A fellow this agent has heard from (membership proper refines this)."""

    node_id: bytes
    name: str
    addr: str
    last_heard_s: float


class Agent:
    def __init__(
        self,
        *,
        name: str,
        transport: Transport,
        keyring: Keyring,
        identity: Identity,
        config: SwarmConfig,
        epoch: int,
        rng: random.Random,
        seeds: tuple[str, ...] = (),
        home: Path | None = None,
        advertise: str | None = None,
    ) -> None:
        self.name = name
        self.transport = transport
        self.keyring = keyring
        self.identity = identity
        self.config = config
        self.rng = rng
        self.seeds = seeds
        self.home = home
        self.advertise = advertise  # the address fellows reach us at, if not the bound one
        self.counters = Counters()
        self.sealer = DatagramSealer(keyring, identity.node_id, epoch,
                                     config.security.replay_window_datagrams)
        self.fellows: dict[bytes, Fellow] = {}
        self.started_s = 0.0
        self._hello_seq = 0
        self._refused_addrs: set[str] = set()
        self._datagram_handlers: dict[type, DatagramHandler] = {
            Hello: self._on_hello, HelloAck: self._on_hello_ack, Refusal: self._on_refusal,
        }
        self._stream_handlers: dict[type, StreamHandler] = {Hello: self._on_stream_hello}
        self.control_ops: dict[str, ControlHandler] = {"status": self._op_status}
        self._nursery: trio.Nursery | None = None
        self.stopped = trio.Event()  # set once the agent has been asked to stop

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
        self._stream_handlers[message_type] = handler

    # --- running --------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until ``stop()`` or cancellation."""
        self.started_s = trio.current_time()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.transport.serve_streams, self._serve_stream)
            nursery.start_soon(self._receive_datagrams)
            nursery.start_soon(self._greet_loop)
            if self.home is not None:
                await nursery.start(serve_control, self.home, self._answer_control)
            log.info("%s listening on %s (id %s)", self.name, self.addr, self.node_id.hex()[:8])
            task_status.started()
            await self.stopped.wait()
            nursery.cancel_scope.cancel()

    def stop(self) -> None:
        self.stopped.set()

    # --- datagrams ------------------------------------------------------------------

    async def send(self, addr: str, *messages: Any) -> None:
        """Seal and send messages to ``addr``, several to a datagram where they fit."""
        budget = self.config.transport.max_datagram_bytes - self.sealer.overhead_bytes
        packets, too_large = wire.pack_compound(messages, budget)
        for msg in too_large:
            log.warning("not sent to %s: %s does not fit in a datagram", addr, type(msg).__name__)
        for plaintext in packets:
            packet = self.sealer.seal(plaintext)
            try:
                await self.transport.send_datagram(addr, packet)
            except TransportError as exc:
                log.debug("send to %s failed: %s", addr, exc)
                self.counters.drop("send-failed")
                continue
            self.counters.datagrams_out += 1
            self.counters.bytes_out += len(packet)

    async def _receive_datagrams(self) -> None:
        while True:
            data, addr = await self.transport.receive_datagram()
            self.handle_datagram(data, addr)

    def handle_datagram(self, data: bytes, addr: str) -> None:
        """Open, decode and dispatch one datagram; every failure is a counted drop."""
        self.counters.datagrams_in += 1
        self.counters.bytes_in += len(data)
        try:
            sender, plaintext = self.sealer.open(data)
            messages = wire.decode(plaintext, max_bytes=self.config.transport.max_datagram_bytes)
        except VersionMismatch as exc:
            self.counters.drop("version")
            self._refuse(addr, exc)
            return
        except (AuthenticationError, RemoteProtocolError) as exc:
            self.counters.drop(exc.reason)
            return
        for msg in messages:
            handler = self._datagram_handlers.get(type(msg))
            if handler is None:
                self.counters.drop("unexpected-message")
                continue
            try:
                handler(msg, sender, addr)
            except RemoteProtocolError as exc:
                self.counters.drop(exc.reason)

    def _refuse(self, addr: str, exc: VersionMismatch) -> None:
        if addr not in self._refused_addrs:  # say it once per address, not per packet
            self._refused_addrs.add(addr)
            log.warning("refusing %s: %s", addr, exc.detail)
        if self._nursery is not None:
            refusal = Refusal(wire.PROTOCOL_MAJOR, wire.PROTOCOL_MINOR, exc.detail)
            self._nursery.start_soon(self.send, addr, refusal)

    def _on_refusal(self, msg: Refusal, sender: bytes, addr: str) -> None:
        log.warning("%s refused us: %s", addr, msg.reason)

    # --- hello: liveness until membership proper runs -------------------------------

    def _hello(self, cls: type = Hello) -> Any:
        self._hello_seq = (self._hello_seq + 1) % 2**32
        return cls(self._hello_seq, self.node_id, self.name, self.addr)

    async def _greet_loop(self) -> None:
        interval_s = self.config.gossip.probe_interval_s
        while True:
            targets = sorted(set(self.seeds) | {f.addr for f in self.fellows.values()})
            for addr in targets:
                if addr != self.addr:
                    await self.send(addr, self._hello())
            await trio.sleep(interval_s * (0.9 + 0.2 * self.rng.random()))

    def _heard(self, node_id: bytes, name: str, addr: str) -> None:
        if node_id == self.node_id:
            return
        if node_id not in self.fellows:
            log.info("heard from fellow %s (%s) at %s", name, node_id.hex()[:8], addr)
        self.fellows[node_id] = Fellow(node_id, name, addr, trio.current_time())

    def _on_hello(self, msg: Hello, sender: bytes, addr: str) -> None:
        if msg.node_id != sender:
            raise RemoteProtocolError("identity-mismatch", "hello names another node")
        self._heard(sender, msg.name, msg.addr)
        if self._nursery is not None:
            ack = HelloAck(msg.seq, self.node_id, self.name, self.addr)
            self._nursery.start_soon(self.send, addr, ack)  # where it came from: works via NAT

    def _on_hello_ack(self, msg: HelloAck, sender: bytes, addr: str) -> None:
        if msg.node_id != sender:
            raise RemoteProtocolError("identity-mismatch", "ack names another node")
        self._heard(sender, msg.name, msg.addr)

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
        try:
            await self._answer_stream(stream)
        finally:
            await stream.aclose()

    async def _answer_stream(self, stream: SecureStream) -> None:
        """Answer request envelopes until the peer closes or misbehaves."""
        while True:
            try:
                frame = await stream.receive_frame()
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
                continue
            try:
                await stream.send_frame(wire.encode(reply))
                self.counters.frames_out += 1
            except TransportError:
                return

    async def _on_stream_hello(self, msg: Hello, stream: SecureStream) -> HelloAck:
        if msg.node_id != stream.peer_node_id:
            raise RemoteProtocolError("identity-mismatch", "hello names another node")
        self._heard(msg.node_id, msg.name, msg.addr)
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

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        members = [
            {"id": f.node_id.hex(), "name": f.name, "addr": f.addr, "state": "alive",
             "incarnation": 0, "cards": [], "last_heard_s": round(now - f.last_heard_s, 3)}
            for f in sorted(self.fellows.values(), key=lambda f: (f.name, f.node_id))
        ]
        return {
            "self": {"id": self.node_id.hex(), "name": self.name, "addr": self.addr},
            "preset": self.config.preset,
            "uptime_s": round(now - self.started_s, 3),
            "members": members,
            "leader": None,
            "counters": self.counters.to_dict(),
        }


__all__ = ["Agent", "Counters", "Fellow", "SwarmError"]
