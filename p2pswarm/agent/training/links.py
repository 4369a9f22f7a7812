"""Streams of a training job: reading a stage's (or a holder's) answer, and the driver's
link to one stage.

A ``TrainError`` in place of the answer is the far side's refusal; it becomes a
``TransportError`` naming the stage and fellow that failed, so the driver pauses the
replica as it would for a dropped link. Anything else unexpected is a protocol error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from p2pswarm.agent.streams import receive_message, send_message
from p2pswarm.errors import RemoteProtocolError, TransportError
from p2pswarm.transport.secure import SecureStream
from p2pswarm.wire.training import TrainError

M = TypeVar("M")


async def receive_answer(stream: SecureStream, expected: type[M], who: str, *,
                         name_stage: bool = True) -> M:
    """The next message as ``expected``; a ``TrainError`` raised as a TransportError."""
    msg = await receive_message(stream, object, who)
    if isinstance(msg, TrainError):
        where = f"stage {msg.stage} on {msg.fellow}" if name_stage else msg.fellow
        raise TransportError(f"{where}: {msg.reason}")
    if not isinstance(msg, expected):
        raise RemoteProtocolError("unexpected-message",
                                  f"{who} sent {type(msg).__name__}, not {expected.__name__}")
    return msg


@dataclass
class Link:
    """The driver's control stream to one stage of a replica."""

    stage: int
    fellow: str
    addr: str
    stream: SecureStream | None = None

    async def send(self, msg: object) -> None:
        assert self.stream is not None
        await send_message(self.stream, msg)

    async def receive(self, expected: type[M]) -> M:
        assert self.stream is not None
        return await receive_answer(self.stream, expected,
                                    f"stage {self.stage} on {self.fellow}")

    async def ask(self, msg: object, expected: type[M]) -> M:
        """Send ``msg`` and return the stage's answer."""
        await self.send(msg)
        return await self.receive(expected)


__all__ = ["Link", "receive_answer"]
