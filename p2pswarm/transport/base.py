"""The Transport protocol: unreliable datagrams for gossip, framed streams for the rest.

Two implementations ship in the package: ``UdpTcpTransport`` (real sockets, trio) and
``MemoryNetwork`` (in-memory, virtual time, with loss, delay, partitions). The agent only
sees this protocol, so the same agent runs on a real network and in simulation.

Addresses are strings ``"host:port"``. Streams carry whole frames (bytes objects), not a
byte stream: the TCP implementation adds a 4-byte length prefix, the memory one passes
frames through a bounded channel. Security (sealing, handshakes) sits above this layer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

import trio

from p2pswarm.errors import SwarmError

log = logging.getLogger(__name__)


@runtime_checkable
class Stream(Protocol):
    """One bidirectional, ordered, reliable connection carrying frames."""

    @property
    def peer_addr(self) -> str: ...

    async def send_frame(self, frame: bytes) -> None:
        """Send one frame; blocks while the peer is not reading (backpressure).

        Raises TransportError if the stream is closed or broken, or the frame is larger
        than the transport's ``max_frame_bytes``.
        """

    async def receive_frame(self) -> bytes:
        """The next frame. Raises TransportError when the peer closed or the stream broke."""

    async def aclose(self) -> None:
        """Close; idempotent. A blocked receive_frame on the other end raises TransportError."""


StreamHandler = Callable[[Stream], Awaitable[None]]


@runtime_checkable
class Transport(Protocol):
    @property
    def local_addr(self) -> str:
        """The address fellows reach this node at (bound port resolved)."""

    async def send_datagram(self, addr: str, data: bytes) -> None:
        """Best effort: may be lost, duplicated or reordered; never blocks for long.

        Raises TransportError only for a local problem (closed transport, datagram too
        large); an unreachable peer is silent.
        """

    # Optional capabilities (the protocols below, checked with isinstance): a transport
    # whose sends never wait may be ``SendsNowait``; one that runs its own event loop
    # (MemoryNetwork) may also be ``DeliversDatagrams`` and ``RingsAlarms``.

    async def receive_datagram(self) -> tuple[bytes, str]:
        """The next datagram and the address it came from."""

    async def open_stream(self, addr: str) -> Stream:
        """Connect to a fellow's stream listener; TransportError if it cannot."""

    async def serve_streams(self, handler: StreamHandler, *, task_status=...) -> None:  # type: ignore[no-untyped-def]
        """Accept streams forever, running ``handler(stream)`` for each in its own task.

        Calls ``task_status.started()`` once listening. A handler's exception is logged and
        closes that stream only. The handler owns the stream and should close it.
        """

    async def aclose(self) -> None:
        """Stop receiving and sending; idempotent."""


@runtime_checkable
class Authenticates(Protocol):
    """A stream that holds frames to a handshake's size until its peer is authenticated
    (nothing before authentication costs more than it must)."""

    def handshake_started(self, max_frame_bytes: int) -> None:
        """Until ``authenticated``, a larger frame ends the stream."""

    def authenticated(self, peer_id: bytes | None = None) -> None:
        """The handshake succeeded (with the fellow ``peer_id``): the transport's
        ``max_frame_bytes`` applies again, and the fellow's budgets."""


@runtime_checkable
class SendsNowait(Protocol):
    """A transport whose sends never wait: the agent sends from where it posts, with no
    sender task in between."""

    def send_datagram_nowait(self, addr: str, data: bytes) -> None:
        """``send_datagram``'s contract, synchronous."""


@runtime_checkable
class DeliversDatagrams(Protocol):
    """A transport that runs its own event loop and hands datagrams over as they land:
    the agent runs no receive task."""

    def deliver_to(self, sink: Callable[[bytes, str], None] | None) -> None:
        """Call ``sink(data, addr)`` as each datagram lands; None: stop delivering."""


@runtime_checkable
class RingsAlarms(Protocol):
    """A transport that runs its own clock: the agent runs no timer task."""

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        """Call ``fn()`` at time ``at``, unless the transport is closed by then."""


def _only_swarm_errors(exc: BaseException) -> bool:
    """True for a SwarmError, or a group (from a handler's nursery) holding only those."""
    inner = getattr(exc, "exceptions", None)
    if isinstance(exc, SwarmError):
        return True
    return inner is not None and all(_only_swarm_errors(e) for e in inner)


async def run_stream_handler(handler: StreamHandler, stream: Stream) -> None:
    """Run ``handler`` on one accepted stream; whatever it raises ends that stream only.

    Shared by the transports' ``serve_streams``. A peer that sends garbage makes the
    handler raise a SwarmError, which is routine (debug); anything else is a bug in the
    handler and is logged with its traceback. Cancellation passes through.
    """
    try:
        await handler(stream)
    except Exception as exc:
        if _only_swarm_errors(exc):
            log.debug("stream from %s ended: %s", stream.peer_addr, exc)
        else:
            log.warning("stream handler for %s failed", stream.peer_addr, exc_info=True)
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()
