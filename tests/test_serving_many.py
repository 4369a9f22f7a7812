"""Many sessions on one load, in virtual time: decode steps of concurrent sessions run in
batches at each stage and each session's greedy output equals its run alone; a chat that
resends its conversation has stage 0 prefill only the tokens its kept cache lacks; a
kept cache evicted for a new session is rebuilt, with the same output."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from p2pswarm.models.chat_template import plain_prompt
from p2pswarm.runtime import Sampler
from p2pswarm.sim.virtual import wait_until
from tests.serving_swarm import MODEL, PROMPT, reference, request, start_swarm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

SLOTS = 4


async def test_batched_sessions_and_a_chat_that_remembers(autojump_clock: object,
                                                          tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, tmp_path, seed=31)
        driver = swarm.live()[1]
        ask = request(sequences=SLOTS, context=256)
        plan = await driver.planning.ask_plan(ask)
        await driver.serving.load(ask, plan_id=plan["plan_id"])
        await wait_until(lambda: all(
            len(a.serving.loads_view()) == 1 and a.serving.loads_view()[0].complete
            for a in swarm.live()), timeout_s=10)
        one_process = reference(plan, MODEL)

        def alone(ids: list[int], n: int) -> tuple[int, ...]:
            return one_process.generate(ids, n, Sampler.greedy(), stop_token_ids=()).token_ids

        # a chat of five turns: each resends the conversation; stage 0 prefills the new
        # tokens only (the last answer's final token, which was never fed, and the turn)
        first = next(a for a in swarm.live() if (plan["plan_id"], 0) in a.serving.hosted)
        ids = list(PROMPT[:30])
        cached = 0
        for turn in range(5):
            before = first.serving.sessions.prefill_tokens
            result = await driver.serving.generate(prompt_ids=ids, max_tokens=6,
                                                   stop_token_ids=(), remember=True)
            assert first.serving.sessions.prefill_tokens - before == len(ids) - cached
            assert result.cached_tokens == cached
            assert result.token_ids == alone(ids, 6)
            cached = len(ids) + len(result.token_ids) - 1
            ids = ids + list(result.token_ids) + list(PROMPT[40 + 9 * turn:48 + 9 * turn])
        assert cached > 0 and len(driver.serving.driver.kept.kept(plan["plan_id"])) == 1
        # sampled: a turn continued from the kept cache draws what the whole prompt draws
        sampled_turn = {"temperature": 0.9, "top_k": 50, "seed": 3}
        result = await driver.serving.generate(prompt_ids=ids, max_tokens=6,
                                               stop_token_ids=(), remember=True,
                                               **sampled_turn)
        assert result.cached_tokens == cached
        assert result.token_ids == one_process.generate(
            ids, 6, Sampler(0.9, top_k=50, seed=3), stop_token_ids=()).token_ids

        # the same through text, as `chat` and /v1 clients resend it: the answers' bytes
        # need not encode back to the ids drawn, yet the cache covers all but the new turn
        messages: list[dict[str, str]] = []
        held: list[int] = []  # what the kept cache holds after each turn
        for turn in range(3):
            messages.append({"role": "user", "content": f"Turn {turn}: say more."})
            before = first.serving.sessions.prefill_tokens
            result = await driver.serving.generate(plain_prompt(messages), max_tokens=6,
                                                   stop_token_ids=(), remember=True)
            said = list(result.prompt_ids)
            if not held:  # sharing only its bos, it leaves the chat above its kept cache
                assert result.cached_tokens == 0
                assert len(driver.serving.driver.kept.kept(plan["plan_id"])) == 2
            else:
                assert said[:len(held)] == held and result.cached_tokens == len(held)
                assert (first.serving.sessions.prefill_tokens - before
                        == len(said) - len(held))
            assert result.token_ids == alone(said, 6)
            held = said + list(result.token_ids)[:-1]
            messages.append({"role": "assistant", "content": result.text})

        # four sessions at once (every slot): each session's output equals its run alone
        # (greedy, and the last one sampled with its own seed), and their decode steps
        # ran in batches
        prompts = [list(PROMPT[7 * i:7 * i + 12 + 5 * i]) for i in range(SLOTS)]
        sampled = {"temperature": 0.9, "top_k": 50, "seed": 7}
        results: dict[int, tuple[int, ...]] = {}

        async def run(i: int) -> None:
            r = await driver.serving.generate(prompt_ids=prompts[i], max_tokens=10,
                                              stop_token_ids=(),
                                              **(sampled if i == SLOTS - 1 else {}))
            results[i] = r.token_ids

        async with trio.open_nursery() as sessions:
            for i in range(SLOTS):
                sessions.start_soon(run, i)
        expected = [alone(p, 10) for p in prompts[:-1]] + [one_process.generate(
            prompts[-1], 10, Sampler(0.9, top_k=50, seed=7), stop_token_ids=()).token_ids]
        assert [results[i] for i in range(SLOTS)] == expected
        batchers = [b for a in swarm.live() for _, b in a.serving.sessions._batchers.values()]
        assert any(b.steps > b.batches for b in batchers)  # a batch held several sessions

        # they took every slot, so the chat's kept cache was evicted: its next turn
        # prefills the whole conversation again, and answers the same
        before = first.serving.sessions.prefill_tokens
        result = await driver.serving.generate(prompt_ids=ids, max_tokens=6,
                                               stop_token_ids=(), remember=True)
        assert result.cached_tokens == 0
        assert first.serving.sessions.prefill_tokens - before == len(ids)
        assert result.token_ids == alone(ids, 6)
        nursery.cancel_scope.cancel()


def test_a_batch_of_sessions_equals_each_alone_in_every_family(tmp_path: Path) -> None:
    """Stage.decode_batch over sessions at different positions gives each session what it
    gets alone: batched for plain and q/k-normed layers (Qwen3), one by one for sliding
    windows and capped scores (Gemma 2)."""
    pytest.importorskip("transformers", reason="transformers is a test extra")
    import torch

    from p2pswarm.models import Checkpoint, save_checkpoint
    from p2pswarm.runtime import Stage, StageSpec
    from p2pswarm.runtime.batch import batchable
    from tests.test_families import reference_model

    for name, batched in (("qwen3", True), ("gemma2", False)):
        model = reference_model(name)
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        save_checkpoint(model.config.to_dict(), list(state.items()), tmp_path / name)
        checkpoint = Checkpoint(tmp_path / name)
        layers = checkpoint.config.num_layers
        together = Stage.load(checkpoint, StageSpec(0, layers, max_sessions=3,
                                                    max_context_tokens=64))
        alone = Stage.load(checkpoint, StageSpec(0, layers, max_context_tokens=64))
        assert batchable(together._loaded()[0]) is batched
        prompts = [[1, *range(3, 20)], [5, 6, 7], list(range(3, 30))]
        want = []
        for prompt in prompts:
            alone.end_session("x")
            rows = [alone.prefill("x", prompt)[-1]]
            for _ in range(6):
                rows.append(alone.decode("x", int(rows[-1].argmax()))[-1])
            want.append(rows)
        got = [[together.prefill(f"s{i}", p)[-1]] for i, p in enumerate(prompts)]
        for _ in range(6):
            out = together.decode_batch(
                [f"s{i}" for i in range(3)], torch.tensor([int(g[-1].argmax()) for g in got]),
                [len(p) + len(g) - 1 for p, g in zip(prompts, got)])
            for i, g in enumerate(got):
                g.append(out[i])
        for rows, expected in zip(got, want):
            assert [int(r.argmax()) for r in rows] == [int(r.argmax()) for r in expected]
            assert max(float((r - e).abs().max()) for r, e in zip(rows, expected)) <= 1e-4
