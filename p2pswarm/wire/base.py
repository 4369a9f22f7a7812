"""Messages every version understands (refusal, ping and ack), and the answer to a kind
this release does not know (``Unsupported``, from protocol 2).

Tag ranges (append-only, never reused): 0-9 here; 10-49 membership; 50-69 election;
70-99 planning and loading; 100-149 serving; 150-199 training.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pswarm.wire.codec import message
from p2pswarm.wire.schema import U16, U32, Addr, Name, NodeId, Reason
from p2pswarm.wire.versions import UNSUPPORTED_REPLY


@message(0)
@dataclass(frozen=True, slots=True)
class Refusal:
    """'I will not talk to you, and here is why': layout frozen across protocol versions."""

    major: U16
    minor: U16
    reason: Reason


@message(1)
@dataclass(frozen=True, slots=True)
class Hello:
    """A fellow's plain liveness probe (before membership proper takes over)."""

    seq: U32
    node_id: NodeId
    name: Name
    addr: Addr


@message(2)
@dataclass(frozen=True, slots=True)
class HelloAck:
    seq: U32
    node_id: NodeId
    name: Name
    addr: Addr


@message(3, needs=UNSUPPORTED_REPLY)
@dataclass(frozen=True, slots=True)
class Unsupported:
    """'I do not speak that kind': the answer, on a stream, to a message whose tag this
    release does not know. It closes nothing; the stream takes the next request. Protocol
    2 and later (capability ``unsupported-reply``): protocol 1 closes the stream instead,
    so a sender never sends a new kind to a fellow that lacks its capability. It goes
    only to a fellow that sent a kind this one does not know: a newer one, which speaks
    it."""

    tag: U16
    reason: Reason = ""
