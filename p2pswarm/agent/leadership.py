"""Asking the leader, and taking the leader's orders, over sealed streams.

Any fellow's CLI talks to its own agent; what only the leader may decide (a plan, a load,
a job) is a *call*: a typed message (``PlanAsk``, ...) that this agent runs itself when it
leads, or sends to the leader it knows, which dispatches on the message's type and answers
with the call's reply type or ``CallFailed``. The leader's *orders* to fellows (take a
stage, release it, ...) are typed messages too. Every call and order carries ``term`` as
the last of its first fields, stamped here: a fellow refuses an order from a stale term. Errors keep
their SwarmError kind end to end, so a refused pin is still ``plan-changed`` (409) at the
CLI of whichever fellow asked.

A feature registers its calls with ``serve`` and its orders with ``obey``; callers use
``ask(call, ReplyType)`` and ``order(addr, order, ReplyType)``.

Orders are obeyed only from the leader this fellow follows, in its current term: the
secure stream's ``peer_node_id`` (proved by the handshake) must be the elected leader's
id (elected with a proof, see ``election``), and the order's ``term`` this fellow's term.
Streams that act for the leader without being an order type (a checkpoint shard push,
a stage's control stream, a job copy) ask ``from_leader`` first. Every refusal is
counted (``Counters.refuse``; ``status --json`` shows ``refused``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, TypeVar

from p2pswarm.control.protocol import error_response, raise_error
from p2pswarm.errors import PlacementError, RemoteProtocolError, SwarmError
from p2pswarm.wire.orders import CallFailed, pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.agent import Agent
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.agent")

M = TypeVar("M")
R = TypeVar("R")
TypedHandler = Callable[[Any], Awaitable[Any]]  # a call or order -> its reply message
# a call and who asked (a fellow's id; None: this agent itself) -> its reply message
CallHandler = Callable[[Any, "bytes | None"], Awaitable[Any]]


def call_failed(exc: SwarmError) -> CallFailed:
    """A SwarmError as the reply that carries it to the caller."""
    error = error_response(exc)["error"]
    data = pack_doc(error["data"]) if error["data"] else b""
    return CallFailed(error["kind"][:64], error["message"][:4096], data)


def raise_failure(failed: CallFailed) -> None:
    """Re-raise the SwarmError a ``CallFailed`` carries, as the class it was."""
    data: dict[str, Any] = {}
    if failed.data:
        try:
            data = unpack_doc(failed.data)
        except RemoteProtocolError:
            data = {}
    raise_error({"kind": failed.kind, "message": failed.text, "data": data})


def expect_reply(reply: Any, reply_type: type[R], who: str) -> R:
    """``reply`` if it is a ``reply_type``; the error a ``CallFailed`` carries; else a
    protocol error naming what ``who`` sent instead."""
    if isinstance(reply, reply_type):
        return reply
    if isinstance(reply, CallFailed):
        raise_failure(reply)
    raise RemoteProtocolError("unexpected-message", f"{who} answered "
                              f"{type(reply).__name__}, not {reply_type.__name__}")


class Leadership:
    """Calls the leader serves (when this agent leads) and orders every fellow obeys."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._calls: dict[type, CallHandler] = {}
        self._orders: dict[type, TypedHandler] = {}

    # --- registering ------------------------------------------------------------------

    def serve(self, call_type: type[M], handler: Callable[[M], Awaitable[Any]]) -> None:
        """The leader answers ``call_type`` with ``handler`` (its reply message)."""
        self.serve_from(call_type, lambda call, origin: handler(call))

    def serve_from(self, call_type: type[M],
                   handler: Callable[[M, bytes | None], Awaitable[Any]]) -> None:
        """As ``serve``, and ``handler`` learns who asked: the fellow whose stream carried
        the call (its id, proved by the handshake), or None when this agent asked itself
        (it leads, and its own control socket or HTTP API asked: the local user)."""
        self._calls[call_type] = handler
        self.agent.on_stream(call_type, self._on_call)

    def obey(self, order_type: type[M], handler: Callable[[M], Awaitable[Any]]) -> None:
        """This fellow carries out ``order_type`` with ``handler`` (its reply message)."""
        self._orders[order_type] = handler
        self.agent.on_stream(order_type, self._on_order)

    # --- asking the leader ---------------------------------------------------------

    def is_leader(self) -> bool:
        e = self.agent.election
        return e is not None and e.status().leader_id == self.agent.node_id

    def term(self) -> int:
        e = self.agent.election
        return e.term if e is not None else 0

    async def ask(self, call: Any, reply_type: type[R]) -> R:
        """Run ``call`` on the leader (here, if this agent leads) and return its reply."""
        call = dataclasses.replace(call, term=self.term())
        if self.is_leader():
            return expect_reply(await self._calls[type(call)](call, None), reply_type,
                                "the leader")
        reply = await self.agent.call(self._leader_addr(), call)
        return expect_reply(reply, reply_type, "the leader")

    def _leader_addr(self) -> str:
        leader = self.agent.leader()
        if leader is None:
            note = self.agent.status()["leader_note"]
            raise PlacementError(f"no leader to ask: {note}; wait for one to be elected")
        member = self.agent.fellow(leader["id"])
        if member is None:
            raise PlacementError("the leader is not in this fellow's view yet; try again")
        return member.addr

    async def _on_call(self, msg: Any, stream: SecureStream) -> Any:
        try:
            if not self.is_leader():
                leader = self.agent.leader()
                where = f"the leader is {leader['name']}" if leader else "no leader yet"
                raise PlacementError(f"{self.agent.name} is not the leader ({where}); "
                                     "try again")
            return await self._calls[type(msg)](msg, stream.peer_node_id)
        except RemoteProtocolError:
            raise  # a malformed body: the agent drops and counts it like any bad frame
        except SwarmError as exc:
            return call_failed(exc)

    # --- the leader's orders -------------------------------------------------------

    async def order(self, addr: str, order: Any, reply_type: type[R]) -> R:
        """Send ``order`` to the fellow at ``addr`` (or run it here); return its reply."""
        order = dataclasses.replace(order, term=self.term())
        if addr == self.agent.addr:
            return expect_reply(await self._run_order(order), reply_type, addr)
        return expect_reply(await self.agent.call(addr, order), reply_type, addr)

    async def _on_order(self, msg: Any, stream: SecureStream) -> Any:
        try:
            return await self._run_order(msg, stream.peer_node_id)
        except RemoteProtocolError:
            raise
        except SwarmError as exc:
            return call_failed(exc)

    async def _run_order(self, order: Any, sender: bytes | None = None) -> Any:
        self._check_order(order, self.agent.node_id if sender is None else sender)
        return await self._orders[type(order)](order)

    def _check_order(self, order: Any, sender: bytes) -> None:
        """Refuse (and count) an order that is not from our leader, in our term."""
        what = type(order).__name__
        self.from_leader(sender, what)
        e = self.agent.election
        assert e is not None  # from_leader found a leader
        if order.term != e.term:
            self.agent.counters.refuse("order-stale-term")
            raise PlacementError(f"{what} of term {order.term} refused: this fellow is at "
                                 f"term {e.term}")

    def from_leader(self, sender: bytes | None, what: str) -> None:
        """Raise (and count) unless ``sender`` is the leader this fellow follows."""
        e = self.agent.election
        leader = e.status().leader_id if e is not None else None
        if leader is None or sender != leader:
            self.agent.counters.refuse("order-not-from-leader")
            who = sender.hex()[:8] if sender else "a fellow"
            where = "it follows no leader" if leader is None else \
                f"the leader is {leader.hex()[:8]}"
            raise PlacementError(f"{what} from {who} refused: only the leader gives orders "
                                 f"({where})")
