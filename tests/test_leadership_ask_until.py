"""``Leadership.ask_until`` in virtual time, against a fake agent whose leader changes: a
leader that cannot be reached, that says it does not lead, or that stops leading while
it is asked is waited out and the next one asked; the refusal of the leader of the moment
ends the ask at once; past the deadline the last failure is named."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Awaitable, Callable

import pytest
import trio

from p2pswarm import wire
from p2pswarm.agent.leadership import Leadership, call_failed, expect_reply
from p2pswarm.errors import NobodyListens, NotLeader, PlacementError, TransportError
from p2pswarm.wire.orders import PlanAsk, PlanShown

A, B, HERE = b"a" * 16, b"b" * 16, b"h" * 16
Answer = Callable[[PlanAsk], Awaitable[Any]]


@dataclass
class FakeAgent:
    """The little of an agent ``Leadership`` asks the leader with: a leader that the test
    changes, and each fellow's answer to a call."""

    leader_id: bytes | None = None
    answers: dict[bytes, Answer] = field(default_factory=dict)
    asked: list[tuple[bytes, int]] = field(default_factory=list)  # (fellow, term stamped)
    term: int = 1
    node_id: bytes = HERE

    @property
    def election(self) -> Any:
        return SimpleNamespace(term=self.term, status=lambda: SimpleNamespace(
            leader_id=self.leader_id, leader_name="f-a" if self.leader_id == A else None,
            sentence="an election is under way"))

    def on_stream(self, msg_type: type, handler: object) -> None:
        pass

    name = "here"

    def fellow(self, fid: str) -> Any:
        return SimpleNamespace(addr=fid) if bytes.fromhex(fid) in self.answers else None

    async def call(self, addr: str, call: PlanAsk) -> Any:
        who = bytes.fromhex(addr)
        self.asked.append((who, call.term))
        return await self.answers[who](call)


def shown(text: bytes) -> Answer:
    async def answer(call: PlanAsk) -> PlanShown:
        return PlanShown(text)
    return answer


def refused(exc: PlacementError) -> Answer:
    async def answer(call: PlanAsk) -> Any:
        return call_failed(exc)
    return answer


async def gone(call: PlanAsk) -> Any:
    raise NobodyListens("nothing listens there")


async def hangs(call: PlanAsk) -> Any:
    await trio.sleep_forever()


async def _new_leader_after(agent: FakeAgent, seconds: float, leader: bytes | None,
                            term: int = 2) -> None:
    await trio.sleep(seconds)
    agent.leader_id, agent.term = leader, term


async def _ask(agent: FakeAgent, deadline_s: float = 60.0) -> PlanShown:
    leadership = Leadership(agent)  # type: ignore[arg-type]
    return await leadership.ask_until(PlanAsk(b"{}"), PlanShown,
                                      trio.current_time() + deadline_s)


@pytest.mark.parametrize("first", [gone, hangs, refused(NotLeader("it lost the election"))])
async def test_a_leader_that_is_gone_or_silent_or_does_not_lead_gives_way_to_the_next(
        autojump_clock, first: Answer) -> None:
    agent = FakeAgent(leader_id=A, answers={A: first, B: shown(b"from b")})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_new_leader_after, agent, 3.0, None)  # an election ...
        nursery.start_soon(_new_leader_after, agent, 4.5, B, 3)  # ... and its winner
        began = trio.current_time()
        assert await _ask(agent) == PlanShown(b"from b")
        assert 4.5 <= trio.current_time() - began < 5.0  # asked soon after it won
    assert agent.asked[-1] == (B, 3) and {who for who, _ in agent.asked} == {A, B}
    if first is hangs:
        assert agent.asked == [(A, 1), (B, 3)]  # the silent one asked once, then left


async def test_the_refusal_of_the_leader_of_the_moment_ends_the_ask_at_once(
        autojump_clock) -> None:
    agent = FakeAgent(leader_id=A, answers={A: refused(PlacementError("no card holds it"))})
    began = trio.current_time()
    with pytest.raises(PlacementError, match="no card holds it"):
        await _ask(agent)
    assert trio.current_time() == began and agent.asked == [(A, 1)]


async def test_a_refusal_from_a_leader_that_stopped_leading_meanwhile_is_asked_again(
        autojump_clock) -> None:
    agent = FakeAgent(leader_id=A, answers={B: shown(b"from b")})

    async def refuses_as_it_falls(call: PlanAsk) -> Any:
        agent.leader_id = B  # its orders were refused: another fellow leads now
        return call_failed(PlacementError("StageStart of term 1 refused"))

    agent.answers[A] = refuses_as_it_falls
    assert await _ask(agent) == PlanShown(b"from b")


async def test_the_deadline_names_the_last_failure(autojump_clock) -> None:
    agent = FakeAgent(leader_id=None, answers={})
    began = trio.current_time()
    with pytest.raises(TransportError, match="no leader answered in time; the last try: "
                                             "no leader to ask: an election is under way"):
        await _ask(agent, deadline_s=7.0)
    assert trio.current_time() - began == pytest.approx(7.0)
    agent = FakeAgent(leader_id=A, answers={A: gone})
    with pytest.raises(TransportError, match="the last try: nothing listens there"):
        await _ask(agent, deadline_s=7.0)
    assert 3 <= len(agent.asked) <= 5  # asked again every little while, not in a loop
    agent = FakeAgent(leader_id=A, answers={A: hangs})
    with pytest.raises(TransportError, match=f"the last try: the leader {A.hex()[:8]} did "
                                             "not answer"):
        await _ask(agent, deadline_s=7.0)


async def test_a_fellow_that_does_not_lead_answers_not_leader_across_the_wire() -> None:
    leadership = Leadership(FakeAgent(leader_id=A))  # type: ignore[arg-type]
    leadership.serve(PlanAsk, shown(b"never"))
    failed = await leadership._on_call(PlanAsk(b"{}"), SimpleNamespace(peer_node_id=B))
    (back,) = wire.decode(wire.encode(failed), max_bytes=1 << 20)
    with pytest.raises(NotLeader, match="here is not the leader \\(the leader is f-a\\)"):
        expect_reply(back, PlanShown, "the leader")


def test_http_answers_no_leader_with_503_for_the_error_and_for_its_words() -> None:
    from p2pswarm.http.problems import STATUS_CODES, from_swarm_error

    for exc in (NotLeader("no leader to ask: electing"),
                PlacementError("fellow-2 is not the leader (no leader yet); try again")):
        answer = from_swarm_error(exc)
        assert answer.code == "no-leader" and STATUS_CODES[answer.code] == 503, answer
    assert from_swarm_error(PlacementError("no card holds it")).code == "refused"


async def test_no_leader_for_the_leaderless_bound_ends_the_ask_before_its_deadline(
        autojump_clock) -> None:
    """A side of the swarm that cannot elect a leader: the ask gives up after
    ``leaderless_s`` with no leader answering, not at its far deadline; a leader that
    answers in between starts the count again."""
    leadership = Leadership(FakeAgent(leader_id=None))  # type: ignore[arg-type]
    began = trio.current_time()
    with pytest.raises(NotLeader, match="no leader answered for 30 s; the last try: no leader "
                                        "to ask: an election is under way"):
        await leadership.ask_until(PlanAsk(b"{}"), PlanShown, began + 900.0, 30.0)
    assert 30.0 <= trio.current_time() - began < 33.0
    agent = FakeAgent(leader_id=None, answers={B: shown(b"from b")})

    async def answers_as_it_falls(call: PlanAsk) -> Any:
        agent.leader_id = None  # it answered (a leader was reached), then stepped down
        return call_failed(PlacementError("StageStart of term 2 refused"))

    agent.answers[A] = answers_as_it_falls
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_new_leader_after, agent, 20.0, A)
        nursery.start_soon(_new_leader_after, agent, 45.0, B, 4)  # 25 s after A answered
        leadership = Leadership(agent)  # type: ignore[arg-type]
        reply = await leadership.ask_until(PlanAsk(b"{}"), PlanShown,
                                           trio.current_time() + 900.0, 30.0)
    assert reply == PlanShown(b"from b")
