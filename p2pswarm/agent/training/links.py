"""Streams of a training job: reading a stage's (or a holder's) answer, and the driver's
link to one stage.

A ``TrainError`` in place of the answer is the far side's refusal; it becomes a
``TransportError`` naming the stage and fellow that failed, so the driver pauses the
replica as it would for a dropped link. Anything else unexpected is a protocol error.

A message with a ``blob`` (or a ``TrainTensor``'s ``tensor``) and a ``more`` field
(tensors, parameters, deltas, updates, the tied weight) longer than one part goes as its
first ``SHARD_CHUNK_BYTES`` with ``more`` saying
how many bytes follow as ``StatePart`` frames (``send_long``); ``receive_answer`` reads
them back into one blob, checking each part's place and the total against
``MAX_LONG_BYTES`` as they arrive, so no frame cap limits a stage's size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from p2pswarm.agent.streams import receive_message, send_message
from p2pswarm.errors import RemoteProtocolError, ReplicaLost, TransportError
from p2pswarm.transport.secure import SecureStream
from p2pswarm.wire.training import SHARD_CHUNK_BYTES, StatePart, TrainError, TrainTensor

M = TypeVar("M")
MAX_LONG_BYTES = 1 << 40  # the longest blob a stage or driver reads back from parts


def _refusal(msg: object, name_stage: bool) -> None:
    if isinstance(msg, TrainError):
        where = f"stage {msg.stage} on {msg.fellow}" if name_stage else msg.fellow
        raise TransportError(f"{where}: {msg.reason}")


async def receive_answer(stream: SecureStream, expected: type[M], who: str, *,
                         name_stage: bool = True) -> M:
    """The next message as ``expected`` (a long blob read whole); a ``TrainError``
    raised as a TransportError."""
    msg = await receive_message(stream, object, who)
    _refusal(msg, name_stage)
    if not isinstance(msg, expected):
        raise RemoteProtocolError("unexpected-message",
                                  f"{who} sent {type(msg).__name__}, not {expected.__name__}")
    more = getattr(msg, "more", 0)
    if more:
        msg = await _rest_of(stream, msg, more, who, name_stage)
    return msg


def _field(msg: Any) -> str:
    """The name of the long bytes field of ``msg``."""
    return "tensor" if isinstance(msg, TrainTensor) else "blob"


async def _rest_of(stream: SecureStream, msg: Any, more: int, who: str,
                   name_stage: bool) -> Any:
    field = _field(msg)
    first: bytes = getattr(msg, field)
    if more > MAX_LONG_BYTES or len(first) != SHARD_CHUNK_BYTES:
        raise RemoteProtocolError("bad-part", f"{who} announced {more:,} more bytes after "
                                  f"a first part of {len(first):,}")
    parts, have, end = [first], len(first), len(first) + more
    while have < end:
        part = await receive_message(stream, object, who)
        _refusal(part, name_stage)
        if (not isinstance(part, StatePart) or part.offset != have or not part.data
                or have + len(part.data) > end):
            raise RemoteProtocolError("bad-part", f"{who}: a part out of place at {have:,} "
                                      f"of {end:,} bytes")
        parts.append(part.data)
        have += len(part.data)
    return dataclasses.replace(msg, **{field: b"".join(parts), "more": 0})


async def send_long(stream: SecureStream, msg: Any) -> None:
    """``msg``; a ``blob`` longer than one part goes as its first part and the rest as
    ``StatePart`` frames."""
    field = _field(msg)
    blob = getattr(msg, field, None)
    if blob is None or not hasattr(msg, "more") or len(blob) <= SHARD_CHUNK_BYTES:
        await send_message(stream, msg)
        return
    view = memoryview(blob)
    await send_message(stream, dataclasses.replace(
        msg, **{field: bytes(view[:SHARD_CHUNK_BYTES]), "more": len(blob) - SHARD_CHUNK_BYTES}))
    for offset in range(SHARD_CHUNK_BYTES, len(blob), SHARD_CHUNK_BYTES):
        await send_message(stream, StatePart(offset,
                                             bytes(view[offset:offset + SHARD_CHUNK_BYTES])))


@dataclass
class Link:
    """The driver's control stream to one stage of a replica."""

    stage: int
    fellow: str
    addr: str
    stream: SecureStream | None = None

    async def send(self, msg: object) -> None:
        await send_long(self._open_stream(), msg)

    async def receive(self, expected: type[M]) -> M:
        return await receive_answer(self._open_stream(), expected,
                                    f"stage {self.stage} on {self.fellow}")

    def _open_stream(self) -> SecureStream:
        """The stream, or ReplicaLost: a paused replica's links are closed, and an order
        to one of its stages is the loss of that replica, never a crash of the agent."""
        if self.stream is None:
            raise ReplicaLost(f"stage {self.stage} on {self.fellow}: its replica is paused")
        return self.stream

    async def ask(self, msg: object, expected: type[M]) -> M:
        """Send ``msg`` and return the stage's answer."""
        await self.send(msg)
        return await self.receive(expected)


__all__ = ["MAX_LONG_BYTES", "Link", "receive_answer", "send_long"]
