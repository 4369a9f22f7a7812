"""Typed calls and orders: failures keep their kind end to end; bad documents are refused."""

from __future__ import annotations

import pytest

from p2pswarm import wire
from p2pswarm.agent.leadership import call_failed, expect_reply
from p2pswarm.errors import PlacementError, PlanChanged, RemoteProtocolError
from p2pswarm.wire.orders import CallFailed, PlanAsk, PlanShown, pack_doc, unpack_doc


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
