"""A resumed generation reuses a stage's kept cache only when it is exactly the session's
(virtual time): the same session id and at least the positions resumed from; a cache of
another session, one too short, or one whose grace ran out is never used, and the stages
replay instead. A run still waiting on a silent neighbour's open stream is ended by the
resumed session. Greedy output equals the undisturbed run in every case."""

from __future__ import annotations

from typing import Any

import trio

from p2pswarm import wire
from p2pswarm.agent.serving.generation import GenerationRun, ReturnSlot
from p2pswarm.agent.serving.stage_session import open_hop
from p2pswarm.runtime import Sampler
from p2pswarm.sim.virtual import wait_until
from p2pswarm.wire.serving import SessionOpen, StepInput, StepOutput
from tests.serving_swarm import MODEL, PROMPT, reference, request, start_swarm

IDS = PROMPT[:30]
N = 14


async def _resume(driver: Any, session: str, tokens: tuple[int, ...]) -> Any:
    """Resume a generation of ``IDS`` that had drawn ``tokens``, as after a failover, with
    the session id ``session``."""
    gen = driver.serving.driver
    record = await gen.find_load()
    tokenizer = await gen.tokenizer(record)
    run = GenerationRun(list(IDS), [0.0] * len(record.stages), 0.0, tokens=list(tokens),
               session=session)
    return await gen._run(record, run, N, set(), SessionOpen("-", record.plan_id, 0,
                                                            driver.addr), tokenizer, None)


async def _kept(driver: Any, plan_id: str) -> str:
    """A chat turn's session, kept on every stage: the prompt and 11 of its 12 tokens."""
    await driver.serving.generate(prompt_ids=IDS, max_tokens=12, stop_token_ids=(),
                                  remember=True)
    (kept,) = driver.serving.driver.kept.kept(plan_id)
    assert len(kept.tokens) == 30 + 11
    driver.serving.driver.kept.forget(plan_id)
    return kept.session


async def _stalled(driver: Any, session: str) -> tuple[int, ReturnSlot]:
    """A session that prefilled ``IDS`` on every stage and drew its first token, then fell
    silent with its streams open (as behind a frozen fellow): that token, and the slot
    holding its stream back open (``done`` closes it)."""
    gen = driver.serving.driver
    record = await gen.find_load()
    route = record.stages
    slot = ReturnSlot(bytes.fromhex(route[-1].fellow_id))
    gen._returns[session] = slot
    upstream = await open_hop(driver, route[0])
    await upstream.send_frame(wire.encode(SessionOpen(session, record.plan_id, 0,
                                                      driver.addr)))
    await upstream.send_frame(wire.encode(StepInput(0, 0, True, (),
                                                    gen.runtime.token_frame(IDS))))
    await slot.arrived.wait()
    assert slot.stream is not None
    (out,) = wire.decode(await slot.stream.receive_frame())
    assert isinstance(out, StepOutput)
    gen._returns.pop(session)
    return out.token, slot


async def test_only_the_sessions_own_cache_of_enough_positions_is_reused(
        autojump_clock, tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=47)
        ((leader_id, _),) = swarm.leaders()
        driver = next(a for a in swarm.live() if a.node_id == leader_id)
        plan = await driver.planning.ask_plan(request(sequences=2))
        await driver.serving.load(request(sequences=2), plan_id=plan["plan_id"])
        ref = reference(plan, MODEL).generate(IDS, N, Sampler.greedy(),
                                              stop_token_ids=()).token_ids

        # another session's cache, of the same prompt and length, is not used (the load
        # has two slots: the kept one stays)
        session = await _kept(driver, plan["plan_id"])
        result = await _resume(driver, "0123456789abcdef", ref[:12])
        assert result.token_ids == ref and result.replayed_stages == (3,)
        # its own, holding exactly the 41 positions resumed from: nobody replays
        result = await _resume(driver, session, ref[:12])
        assert result.token_ids == ref and result.replayed_stages == (0,)
        # one position more than the caches hold: every stage starts afresh and replays
        session = await _kept(driver, plan["plan_id"])
        result = await _resume(driver, session, ref[:13])
        assert result.token_ids == ref and result.replayed_stages == (3,)

        # a session whose driver fell silent with its stream to stage 0 still open: its
        # resumption ends the run still waiting there and continues from its cache
        first, stalled = await _stalled(driver, "00000000000000aa")
        assert first == ref[0]
        taken = [a.serving.sessions.interrupted.taken_over for a in swarm.live()]
        result = await _resume(driver, "00000000000000aa", (first,))
        assert result.token_ids == ref and result.replayed_stages == (0,)
        assert sum(a.serving.sessions.interrupted.taken_over for a in swarm.live()) > sum(taken)
        stalled.done.set()

        # a stage cut off mid-generation for 5 s, while the caches that streams broke
        # left are kept only 1 s: they are gone by the time the generation resumes
        for agent in swarm.live():
            agent.serving.sessions.interrupted.keep_s = 1.0
        victim = next(i for i, f in enumerate(swarm.fellows)
                      if f.identity.node_id != leader_id)
        cut = swarm.fellows[victim].addr
        heard: list[int] = []

        def cut_after_five(token: int, text: str) -> None:
            heard.append(token)
            if len(heard) == 5:
                swarm.net.partition([cut], [f.addr for f in swarm.fellows if f.addr != cut])

        async def heal_after_five_seconds() -> None:
            await wait_until(lambda: len(heard) >= 5, timeout_s=60)
            await trio.sleep(5.0)
            swarm.net.heal()

        nursery.start_soon(heal_after_five_seconds)
        result = await driver.serving.generate(prompt_ids=IDS, max_tokens=N,
                                               stop_token_ids=(), on_token=cut_after_five)
        assert result.token_ids == ref and result.resumes == 1
        assert result.replayed_stages == (3,)
        assert sum(a.serving.sessions.interrupted.dropped for a in swarm.live()) >= 2
        nursery.cancel_scope.cancel()
