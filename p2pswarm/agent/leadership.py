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
``ask(call, ReplyType)`` and ``order(addr, order, ReplyType)``. A caller that must outlive
the leader itself (a driver asking to heal a load the crashed leader hosted a stage of)
uses ``ask_until(call, ReplyType, deadline)``: a leader that cannot be reached, or that
stops leading while it is asked, is waited out and the next one asked; only an answer
from the leader of the moment, its reply or its refusal, ends the ask before the deadline.

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

import trio

from p2pswarm.control.protocol import error_data, raise_error
from p2pswarm.errors import (
    NotFollowingYet,
    NotLeader,
    PlacementError,
    RemoteProtocolError,
    SwarmError,
    TransportError,
)
from p2pswarm.wire.orders import CallFailed, pack_doc, unpack_doc

if TYPE_CHECKING:
    from p2pswarm.agent.ports import LeadershipPort
    from p2pswarm.transport.secure import SecureStream

log = logging.getLogger("p2pswarm.agent")

M = TypeVar("M")
R = TypeVar("R")
TypedHandler = Callable[[Any], Awaitable[Any]]  # a call or order -> its reply message
# a call and who asked (a fellow's id; None: this agent itself) -> its reply message
CallHandler = Callable[[Any, "bytes | None"], Awaitable[Any]]

LEADER_POLL_S = 0.25  # how often an ask waiting for the next leader looks for one
# how long, and how often, an order is offered again to a fellow that has not heard of
# this leader or its term yet (it has just restarted: news of the leader reaches it within
# a few gossip rounds); a refusal for any other reason is final at once
ORDER_RETRY_S = 5.0
ORDER_RETRY_EVERY_S = 0.5
SAME_LEADER_AGAIN_S = 2.0  # an unreachable leader still in office is asked again this late


def call_failed(exc: SwarmError) -> CallFailed:
    """A SwarmError as the reply that carries it to the caller: its class, its text and
    its details, as the control API's error response says them."""
    data = error_data(exc)
    return CallFailed(type(exc).__name__[:64], str(exc)[:4096],
                      pack_doc(data) if data else b"")


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


class _Unreached(Exception):
    """The leader asked could not be reached: ``why``."""

    def __init__(self, why: SwarmError) -> None:
        super().__init__(str(why))
        self.why = why


@dataclasses.dataclass(frozen=True)
class _Answer:
    """What the leader asked gave: its reply, or the error its call raised."""

    reply: Any
    error: SwarmError | _Unreached | None = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.reply


class Leadership:
    """Calls the leader serves (when this agent leads) and orders every fellow obeys."""

    def __init__(self, agent: LeadershipPort) -> None:
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

    async def ask_until(self, call: Any, reply_type: type[R], deadline: float,
                        leaderless_s: float | None = None) -> R:
        """As ``ask``, until trio time ``deadline``. No leader yet, a leader that cannot be
        reached (its stream fails or times out), one that answers that it does not lead,
        and one that stops leading while it is asked: each is waited out (the leader
        polled, never a busy loop) and the next leader asked. The reply, or the refusal of
        the leader that answered while it still leads, ends the ask; past the deadline,
        TransportError with the last thing that went wrong. ``leaderless_s``: no leader
        reached for that long (none known, or the one known not answering: a fellow cut
        off from the rest cannot tell a dead leader from its own silence) ends the ask
        sooner, with NotLeader: a side of the swarm that cannot elect a leader should not
        keep its user waiting."""
        last: SwarmError = PlacementError("no leader was asked")
        unreached_since: float | None = None  # since when no leader has answered
        while trio.current_time() < deadline:
            now = trio.current_time()
            if leaderless_s is not None and unreached_since is not None \
                    and now - unreached_since >= leaderless_s:
                raise NotLeader(f"no leader answered for {leaderless_s:.0f} s; the last "
                                f"try: {last}")
            asked = self._leader_id()
            answered = False
            if asked is None:
                last = NotLeader(f"no leader to ask: {self._leader_note()}")
            else:
                last = TransportError(f"the leader {asked.hex()[:8]} did not answer")
                with trio.move_on_at(deadline):
                    answer = await self._ask_while_leading(call, asked)
                    if answer is None:  # it stopped leading before it answered
                        continue
                    try:
                        return expect_reply(answer.result(), reply_type, "the leader")
                    except _Unreached as exc:
                        last = exc.why
                    except NotLeader as exc:
                        last = exc
                    except SwarmError as exc:
                        if self._leader_id() == asked:
                            raise  # the leader of the moment refused
                        last = exc  # it stopped leading while it refused: ask the next
                        answered = True
            if answered:
                unreached_since = None
            elif unreached_since is None:
                unreached_since = now
            await self._next_leader(asked, deadline)
        raise TransportError(f"no leader answered in time; the last try: {last}")

    async def _ask_while_leading(self, call: Any, asked: bytes) -> _Answer | None:
        """Ask leader ``asked`` (here, if this agent leads): the outcome of its call
        (its reply; its refusal raised; ``_Unreached`` when it could not be reached), or
        None when it stopped leading before it answered (the call is then abandoned)."""
        answers: list[_Answer] = []

        async def watch(scope: trio.CancelScope) -> None:
            while self._leader_id() == asked:
                await trio.sleep(LEADER_POLL_S)
            scope.cancel()

        async def one() -> Any:
            stamped = dataclasses.replace(call, term=self.term())
            if asked == self.agent.node_id:
                return await self._calls[type(call)](stamped, None)
            member = self.agent.fellow(asked.hex())
            if member is None:
                raise _Unreached(NotLeader("the leader is not in this fellow's view yet"))
            try:
                return await self.agent.call(member.addr, stamped)
            except TransportError as exc:
                raise _Unreached(exc) from exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            try:
                answers.append(_Answer(await one()))
            except (SwarmError, _Unreached) as exc:
                answers.append(_Answer(None, exc))
            nursery.cancel_scope.cancel()
        return answers[0] if answers else None

    async def _next_leader(self, asked: bytes | None, deadline: float) -> None:
        """Wait until another leader than ``asked`` is known, or (``asked`` still leads)
        a while has passed to ask it again, or the deadline."""
        until = min(deadline, trio.current_time() + SAME_LEADER_AGAIN_S)
        while trio.current_time() < until:
            now = self._leader_id()
            if now is not None and now != asked:
                return
            await trio.sleep(min(LEADER_POLL_S, until - trio.current_time()))

    def _leader_id(self) -> bytes | None:
        e = self.agent.election
        return e.status().leader_id if e is not None else None

    def _leader_note(self) -> str:
        """Why there is no leader to ask, as ``status`` says it (``leader_note``)."""
        e = self.agent.election
        sentence = e.status().sentence if e is not None else "starting"
        if sentence.startswith("no leader: this side sees"):  # what waits, and for what
            sentence += (" (a leader needs the votes of a majority of the electorate; "
                         "`p2pswarm status` says when that changes and what helps)")
        return sentence

    def _leader_addr(self) -> str:
        leader = self._leader_id()
        if leader is None:
            note = self._leader_note()
            raise NotLeader(f"no leader to ask: {note}; wait for one to be elected")
        member = self.agent.fellow(leader.hex())
        if member is None:
            raise NotLeader("the leader is not in this fellow's view yet; try again")
        return member.addr

    async def _on_call(self, msg: Any, stream: SecureStream) -> Any:
        try:
            if not self.is_leader():
                e = self.agent.election
                leader = e.status() if e is not None else None
                where = f"the leader is {leader.leader_name}" \
                    if leader is not None and leader.leader_id is not None else "no leader yet"
                raise NotLeader(f"{self.agent.name} is not the leader ({where}); "
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
        give_up = trio.current_time() + ORDER_RETRY_S
        while True:
            reply = await self.agent.call(addr, order)
            if not (isinstance(reply, CallFailed) and reply.kind == NotFollowingYet.__name__) \
                    or trio.current_time() >= give_up or not self.is_leader() \
                    or self.term() != order.term:
                return expect_reply(reply, reply_type, addr)
            await trio.sleep(ORDER_RETRY_EVERY_S)

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
        e = self.agent.election
        # refused because this fellow is behind (it follows no leader yet, or an older
        # term's): not for long, the ordering leader may offer it again
        behind = e is None or e.status().leader_id is None or order.term > e.term
        try:
            self.from_leader(sender, what)
        except PlacementError as exc:
            raise (NotFollowingYet(str(exc)) if behind else exc) from None
        assert e is not None  # from_leader found a leader
        if order.term != e.term:
            self.agent.counters.refuse("order-stale-term")
            raise (NotFollowingYet if behind else PlacementError)(
                f"{what} of term {order.term} refused: this fellow is at term {e.term}")

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
