"""Glue for the agent's typed streams: one message out, best effort, or one expected in."""

from __future__ import annotations

from typing import Any, TypeVar

import trio

from p2pswarm import wire
from p2pswarm.errors import RemoteProtocolError, SwarmError
from p2pswarm.transport.secure import SecureStream

M = TypeVar("M")
BEST_EFFORT_SEND_S = 5.0  # a best-effort message gives up after this long


async def send_message(stream: SecureStream, msg: Any) -> None:
    await stream.send_frame(wire.encode(msg))


async def send_best_effort(stream: SecureStream, msg: Any) -> None:
    """Send ``msg`` if the stream still carries it; the stream may already be gone, which
    is often what is being reported."""
    try:
        with trio.move_on_after(BEST_EFFORT_SEND_S):
            await send_message(stream, msg)
    except (SwarmError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def receive_message(stream: SecureStream, expected: type[M], who: str) -> M:
    """The next frame as one ``expected`` message; anything else is ``who``'s protocol
    error. (The frame's size is already bounded by the stream.)"""
    frame = await stream.receive_frame()
    (msg,) = wire.decode(frame, max_bytes=len(frame) + 1)
    if not isinstance(msg, expected):
        raise RemoteProtocolError("unexpected-message",
                                  f"{who} sent {type(msg).__name__}, not {expected.__name__}")
    return msg
