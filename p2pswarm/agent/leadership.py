"""Asking the leader, and taking the leader's orders, over sealed streams.

Any fellow's CLI talks to its own agent; what only the leader may decide (a plan, a load)
is forwarded with ``LeaderCall`` to the leader this agent knows, which runs the handler
registered for the op and answers ``LeaderReply``. The leader's orders to fellows
(``Order``) carry its term: a fellow refuses an order from a stale term. Results and
errors travel as msgpack documents; errors keep their SwarmError kind end to end, so a
refused pin is still ``plan-changed`` (409) at the CLI of whichever fellow asked.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import msgpack

from p2pswarm.control.protocol import error_response, raise_error
from p2pswarm.errors import ControlError, PlacementError, SwarmError
from p2pswarm.wire.orders import LeaderCall, LeaderReply, Order, OrderReply

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.agent")

Handler = Callable[[dict[str, Any]], Awaitable[Any]]


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def unpack_body(body: bytes) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # any msgpack failure: the body is not a document
        raise ControlError(f"malformed request body ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise ControlError("malformed request body (not a map)")
    return obj


def _result(reply: Any, expected: type, who: str) -> Any:
    """The result a LeaderReply/OrderReply carries, or the SwarmError it reports."""
    if not isinstance(reply, expected):
        raise ControlError(f"{who} answered {type(reply).__name__}, not {expected.__name__}")
    result = msgpack.unpackb(reply.body, raw=False, strict_map_key=False)
    if not reply.ok:
        raise_error(result if isinstance(result, dict) else {})
    return result


def _answer(result: Any) -> tuple[bool, bytes]:
    return True, pack(result)


def _failure(exc: BaseException) -> tuple[bool, bytes]:
    return False, pack(error_response(exc)["error"])


class Leadership:
    """Leader ops (served when this agent leads) and orders (served on every fellow)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.leader_ops: dict[str, Handler] = {}
        self.order_ops: dict[str, Handler] = {}
        agent.on_stream(LeaderCall, self._on_leader_call)
        agent.on_stream(Order, self._on_order)

    # --- asking the leader ---------------------------------------------------------

    def is_leader(self) -> bool:
        e = self.agent.election
        return e is not None and e.status().leader_id == self.agent.node_id

    def term(self) -> int:
        e = self.agent.election
        return e.term if e is not None else 0

    async def ask(self, op: str, body: dict[str, Any]) -> Any:
        """Run leader op ``op``: here if this agent leads, else on the leader."""
        if self.is_leader():
            return await self.leader_ops[op](body)
        leader = self.agent.leader()
        if leader is None:
            note = self.agent.status()["leader_note"]
            raise PlacementError(f"no leader to ask: {note}; wait for one to be elected")
        member = self.agent.membership.member(bytes.fromhex(leader["id"])) \
            if self.agent.membership else None
        if member is None:
            raise PlacementError("the leader is not in this fellow's view yet; try again")
        reply = await self.agent.call(member.addr, LeaderCall(self.term(), op, pack(body)))
        return _result(reply, LeaderReply, "the leader")

    async def _on_leader_call(self, msg: LeaderCall, stream: SecureStream) -> LeaderReply:
        try:
            if not self.is_leader():
                leader = self.agent.leader()
                where = f"the leader is {leader['name']}" if leader else "no leader yet"
                raise PlacementError(f"{self.agent.name} is not the leader ({where}); "
                                     "try again")
            handler = self.leader_ops.get(msg.op)
            if handler is None:
                raise ControlError(f"the leader does not know op {msg.op!r}")
            ok, body = _answer(await handler(unpack_body(msg.body)))
        except SwarmError as exc:
            ok, body = _failure(exc)
        return LeaderReply(ok, body)

    # --- the leader's orders -------------------------------------------------------

    async def order(self, addr: str, op: str, body: dict[str, Any]) -> Any:
        """Send an order to the fellow at ``addr`` (or run it here) and return its result."""
        if addr == self.agent.addr:
            return await self._run_order(self.term(), op, body)
        reply = await self.agent.call(addr, Order(self.term(), op, pack(body)))
        return _result(reply, OrderReply, addr)

    async def _on_order(self, msg: Order, stream: SecureStream) -> OrderReply:
        try:
            ok, body = _answer(await self._run_order(msg.term, msg.op, unpack_body(msg.body)))
        except SwarmError as exc:
            ok, body = _failure(exc)
        return OrderReply(ok, body)

    async def _run_order(self, term: int, op: str, body: dict[str, Any]) -> Any:
        e = self.agent.election
        if e is not None and not e.accepts_term(term):
            raise PlacementError(f"order from stale term {term} refused (this fellow is at "
                                 f"term {e.term})")
        handler = self.order_ops.get(op)
        if handler is None:
            raise ControlError(f"this fellow does not know order {op!r}")
        return await handler(body)
