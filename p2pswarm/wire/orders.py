"""Messages between a fellow and the leader, and the leader's orders (tags 70-99).

Requests and results are nested documents (plan requests, plans, stage orders) that the
planner and the runtime validate themselves, so they travel as msgpack bytes inside a
strictly checked envelope: the codec bounds their size, the receiver their meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from p2pswarm.wire.codec import message
from p2pswarm.wire.schema import U64, Size

Body = Annotated[bytes, Size(0, 16 * 1024 * 1024)]
Op = Annotated[str, Size(1, 32)]


@message(70)
@dataclass(frozen=True, slots=True)
class LeaderCall:
    """A fellow asks the leader to do ``op`` (plan, load, ...) with a msgpack body."""

    term: U64  # the term the caller believes current; the leader refuses a newer one
    op: Op
    body: Body


@message(71)
@dataclass(frozen=True, slots=True)
class LeaderReply:
    """The leader's answer: ``ok`` and a msgpack result, or an error document."""

    ok: bool
    body: Body


@message(72)
@dataclass(frozen=True, slots=True)
class Order:
    """The leader orders a fellow to do ``op`` (e.g. take a stage); fenced by ``term``."""

    term: U64
    op: Op
    body: Body


@message(73)
@dataclass(frozen=True, slots=True)
class OrderReply:
    ok: bool
    body: Body
