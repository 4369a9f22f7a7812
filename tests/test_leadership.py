"""Typed calls and orders: failures keep their kind end to end; bad documents are refused."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import trio
import trio.testing

from p2pswarm import wire
from p2pswarm.agent.leadership import (
    ORDER_RETRY_EVERY_S,
    ORDER_RETRY_S,
    call_failed,
    expect_reply,
)
from p2pswarm.election import ElectionStatus
from p2pswarm.errors import NotFollowingYet, PlacementError, PlanChanged, RemoteProtocolError
from p2pswarm.wire.jobs import TrainRelease, TrainReleased
from p2pswarm.wire.orders import CallFailed, PlanAsk, PlanShown, pack_doc, unpack_doc
from tests.cpu_swarm import start_cpu_swarm


def test_a_refused_pin_crosses_the_wire_as_plan_changed() -> None:
    refused = PlanChanged("aaaa", "bbbb", ["fellow x left"], {"plan_id": "bbbb"})
    (failed,) = wire.decode(wire.encode(call_failed(refused)), max_bytes=1 << 20)
    with pytest.raises(PlanChanged) as caught:
        expect_reply(failed, PlanShown, "the leader")
    assert caught.value.new_plan_id == "bbbb"
    assert caught.value.changes == ["fellow x left"]


def test_other_failures_keep_their_class_and_text() -> None:
    failed = call_failed(PlacementError("no card holds a stage"))
    with pytest.raises(PlacementError, match="no card holds a stage"):
        expect_reply(failed, PlanShown, "the leader")


def test_a_reply_of_another_type_is_a_protocol_error() -> None:
    with pytest.raises(RemoteProtocolError, match="PlanAsk, not PlanShown"):
        expect_reply(PlanAsk(b""), PlanShown, "the leader")


@pytest.mark.parametrize("data", [b"\xc1", pack_doc([1, 2]), pack_doc("plan"), b""])
def test_a_document_that_is_not_a_map_is_refused(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        unpack_doc(data)


def test_calls_carry_their_term_last_with_a_default() -> None:
    call = PlanAsk(pack_doc({"model": "tiny-llama"}))
    assert call.term == 0
    (back,) = wire.decode(wire.encode(PlanAsk(call.request, 7)), max_bytes=1 << 20)
    assert back == PlanAsk(call.request, 7)
    assert isinstance(call_failed(PlacementError("x")), CallFailed)


# --- an order to a fellow that has not heard of the leader yet -------------------------


async def test_an_order_to_a_fellow_that_has_not_heard_of_the_leader_is_offered_again(
        autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fellow just restarted follows no leader for a moment: the leader's order is
    offered again until it does (it used to fail at once, and a placement counted the
    fellow as lost); a refusal that lasts is still final after ``ORDER_RETRY_S``."""
    async with trio.open_nursery() as nursery:
        swarm = await start_cpu_swarm(nursery, 3, 5)
        leader = next(a for a in swarm.live() if a.leadership.is_leader())
        fellow = next(a for a in swarm.live() if a is not leader)
        election = fellow.election
        status = type(election).status
        deaf_until = trio.current_time() + 2.0

        def deaf(self: Any) -> ElectionStatus:  # no leader heard of yet, for a while
            now = status(self)
            if self is election and trio.current_time() < deaf_until:
                return dataclasses.replace(now, leader_id=None, leader_name=None)
            return now

        monkeypatch.setattr(type(election), "status", deaf)
        release = TrainRelease("job-00000001", None, None)
        began = trio.current_time()
        await leader.leadership.order(fellow.addr, release, TrainReleased)
        assert 2.0 <= trio.current_time() - began <= 2.0 + ORDER_RETRY_EVERY_S + 0.5
        deaf_until = math.inf  # it never hears of the leader: refused after a while
        began = trio.current_time()
        with pytest.raises(NotFollowingYet, match="it follows no leader"):
            await leader.leadership.order(fellow.addr, release, TrainReleased)
        assert ORDER_RETRY_S <= trio.current_time() - began <= ORDER_RETRY_S + 1.0
        # an order refused for good (from a stale term) is not offered again
        stale = dataclasses.replace(release, term=leader.leadership.term() - 1)
        monkeypatch.setattr(type(election), "status", status)
        reply = await leader.call(fellow.addr, stale)
        assert isinstance(reply, CallFailed) and reply.kind == "PlacementError"
        nursery.cancel_scope.cancel()
