"""Messages between a fellow and the leader, and the leader's orders (tags 70-99).

Every operation is its own message type, and the leader and the fellows dispatch on the
type (``p2pswarm.agent.leadership``). A call or an order carries ``term`` as its last
field: the term the sender believes current, stamped by the leadership layer, so a fellow
refuses an order from a stale term and the leader a call from a newer one. A call is
answered by its own reply type or by ``CallFailed``, which carries the SwarmError's kind,
so a refused pin is still ``plan-changed`` (409) at the CLI of whichever fellow asked.

Planner documents (plan requests, plans) are nested maps that the planner validates
itself, so they travel as ``Doc``: msgpack bytes whose size the codec bounds and whose
meaning the receiver checks (``unpack_doc`` refuses anything but a map).

Tags 70-73 (the untyped ``LeaderCall`` / ``LeaderReply`` / ``Order`` / ``OrderReply`` of
protocol 1, an ``op`` string with a msgpack body) are retired and never reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgpack

from p2pswarm.errors import RemoteProtocolError
from p2pswarm.wire.codec import message
from p2pswarm.wire.schema import U64, Size

DOC_BYTES = 16 * 1024 * 1024
Doc = Annotated[bytes, Size(0, DOC_BYTES)]  # a msgpack map the receiver validates
ErrorKind = Annotated[str, Size(1, 64)]
ErrorText = Annotated[str, Size(0, 4096)]


def pack_doc(obj: Any) -> bytes:
    """A planner document (a map of plain values) as ``Doc`` bytes."""
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def unpack_doc(data: bytes) -> dict[str, Any]:
    """``Doc`` bytes back as a map; anything else is the sender's protocol error."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # any msgpack failure: the bytes are not a document
        raise RemoteProtocolError("malformed-doc", f"not a document ({type(exc).__name__})") \
            from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError("malformed-doc", "a document must be a map")
    return obj


@message(74)
@dataclass(frozen=True, slots=True)
class CallFailed:
    """A call or an order was refused: the SwarmError's class name, text and details."""

    kind: ErrorKind
    text: ErrorText
    data: Doc = b""  # e.g. plan-changed's expected and new plan ids, changes, new plan


@message(75)
@dataclass(frozen=True, slots=True)
class PlanAsk:
    """Plan ``request`` (a plan request document) on the leader's current view."""

    request: Doc
    term: U64 = 0


@message(76)
@dataclass(frozen=True, slots=True)
class PlanShown:
    """The plan the leader made (and remembers, so a pin on it can say what changed)."""

    plan: Doc


__all__ = ["DOC_BYTES", "CallFailed", "Doc", "PlanAsk", "PlanShown", "pack_doc", "unpack_doc"]
