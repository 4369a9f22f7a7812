"""The decode batcher in virtual time: a lone session never waits; a group of sessions
that lacks the first of the stage's decoding sessions waits (bounded) for it, so groups
that drifted apart merge into one batch; a session that ended is not waited for."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import trio

from p2pswarm.agent.serving.batching import DecodeBatcher

STEP_S = 0.04  # what a batch takes, in virtual seconds


def batcher(log: list[tuple[float, tuple[str, ...]]]) -> DecodeBatcher[str, str]:
    async def one(item: str) -> str:
        await trio.sleep(STEP_S)
        log.append((trio.current_time(), (item,)))
        return item

    async def many(items: Sequence[str]) -> list[str]:
        await trio.sleep(STEP_S)
        log.append((trio.current_time(), tuple(items)))
        return list(items)

    return DecodeBatcher(one, many)


async def test_a_lone_session_never_waits(autojump_clock: object) -> None:
    log: list[tuple[float, tuple[str, ...]]] = []
    b = batcher(log)
    began = trio.current_time()
    for _ in range(3):
        assert await b.step("a", "a") == "a"
    assert trio.current_time() - began == pytest.approx(3 * STEP_S)
    assert [items for _, items in log] == [("a",)] * 3


async def test_a_group_waits_for_the_first_session_and_merges(autojump_clock: object) -> None:
    log: list[tuple[float, tuple[str, ...]]] = []
    b = batcher(log)
    await b.step("warm", "a")  # the stage knows how long a batch takes
    b.members.add("b")
    results: list[str] = []

    async def late(session: str, after: float) -> None:
        await trio.sleep(after)
        results.append(await b.step(session, session))

    log.clear()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(late, "b", 0.0)  # b's group lacks a: it waits for a ...
        nursery.start_soon(late, "a", 0.03)  # ... which comes within one batch's time
    assert [items for _, items in log] == [("b", "a")]
    assert sorted(results) == ["a", "b"]

    # a's group never waits for b; b, alone behind, waits at most one batch's time
    log.clear()
    began = trio.current_time()
    await b.step("a", "a")
    assert trio.current_time() - began == pytest.approx(STEP_S)
    await b.step("b", "b")
    assert trio.current_time() - began == pytest.approx(2 * STEP_S + STEP_S)
    # a ended: b no longer waits for it
    b.leave("a")
    began = trio.current_time()
    await b.step("b", "b")
    assert trio.current_time() - began == pytest.approx(STEP_S)
