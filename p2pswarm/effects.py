"""What the membership and election machines ask their driver to do: plain values.

One module both pure machines import, so the trio agent (or a simulation lab) executes
one vocabulary of effects; the machines never touch a socket.

- ``SendDatagram(addr, messages)``: encode ``messages`` as ONE envelope (the machine has
  already made them fit its datagram budget), seal it and send it to ``addr``.
- ``StreamRequest(addr, message, request_id)``: open a secure stream to ``addr``, send
  ``message``, read one reply and feed it back with ``handle(reply, addr, now)``; if the
  stream cannot be opened or no reply comes, call ``stream_failed(request_id, now)``.
- ``Event(kind, node_id, name, detail)``: something a person or a log should see.
  ``kind`` is an ``EventKind``: one of the strings below, checked by mypy, so a new kind
  is added here or nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

EventKind = Literal[
    # membership
    "joined", "join-retry", "member-joined", "suspect", "alive", "dead", "left", "reaped",
    "metadata", "updated", "refuted",
    # election
    "leader", "no-leader", "elected", "stepped-down",
]
EVENT_KINDS: Final[tuple[EventKind, ...]] = get_args(EventKind)

# Event kinds (membership)
JOINED: Final = "joined"  # this node joined the swarm (a seed answered) or founded it
JOIN_RETRY: Final = "join-retry"  # no seed answered; trying again later
MEMBER_JOINED: Final = "member-joined"  # a fellow we did not know is alive
SUSPECT: Final = "suspect"  # a fellow is suspected (detail says by whom)
ALIVE: Final = "alive"  # a suspected or dead fellow proved alive (refuted / came back)
DEAD: Final = "dead"
LEFT: Final = "left"  # a fellow left gracefully (or this node left)
REAPED: Final = "reaped"  # a dead or left fellow's tombstone was dropped
METADATA: Final = "metadata"  # a fellow's metadata changed (we hold the new version)
UPDATED: Final = "updated"  # a fellow's address, name or priority changed
REFUTED: Final = "refuted"  # this node was suspected or declared dead and refuted it
# Event kinds (election)
LEADER: Final = "leader"  # a fellow (maybe this node) is the leader of a term
NO_LEADER: Final = "no-leader"  # the leader is gone and none is known yet (detail: why)
ELECTED: Final = "elected"  # this node won an election
STEPPED_DOWN: Final = "stepped-down"


@dataclass(frozen=True, slots=True)
class SendDatagram:
    addr: str
    messages: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class StreamRequest:
    addr: str
    message: Any
    request_id: int


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    node_id: bytes
    name: str
    detail: str = ""
    incarnation: int = 0
    by: bytes = b""  # who reported it (a suspicion's accuser; this node's id if first-hand)
    term: int = 0  # election events: the term


Effect = SendDatagram | StreamRequest | Event

__all__ = [
    "ALIVE",
    "DEAD",
    "ELECTED",
    "EVENT_KINDS",
    "JOINED",
    "JOIN_RETRY",
    "LEADER",
    "LEFT",
    "MEMBER_JOINED",
    "METADATA",
    "NO_LEADER",
    "REAPED",
    "REFUTED",
    "STEPPED_DOWN",
    "SUSPECT",
    "UPDATED",
    "Effect",
    "Event",
    "EventKind",
    "SendDatagram",
    "StreamRequest",
]
