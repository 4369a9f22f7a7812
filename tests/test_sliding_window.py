"""Decoding across a sliding window's edge equals transformers, token by token.

A sliding layer's query sees the last ``window`` keys, itself included (transformers'
``kv_idx > q_idx - sliding_window`` for Gemma 2, Gemma 3 and Mistral alike); Gemma 2 caps
the scaled scores of every layer, sliding or full, with ``tanh`` before the mask. The edge
is where the KV cache of a sliding layer turns into a ring: a prompt shorter than the
window crosses it while decoding, one as long as the window at the first decode step, a
longer one while it is prefilled. Each family's tiny random model is made and saved by
transformers, split into 2 and 3 stages, and every step's float32 logits are compared with
transformers' forward over the same tokens (1e-5), single sessions and two sessions of
different lengths in one decode batch. A model that saw one key more or one fewer gives
other logits, so the comparison does tell the rule apart.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import trio

from p2pswarm.agent.serving.batching import DecodeBatcher
from p2pswarm.models import Checkpoint
from p2pswarm.models.llama import Attention
from p2pswarm.runtime import LocalPipeline, Sampler, Stage, StageSpec
from p2pswarm.shapes.model_config import ModelConfig

transformers = pytest.importorskip("transformers", reason="transformers is a test extra")

from tests.reference_models import random_reference  # noqa: E402 (needs transformers)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 16
VOCAB = 96
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
         # a head of its own and no end token: greedy runs wander through the vocabulary
         # for all their tokens instead of repeating the last one or stopping
         "tie_word_embeddings": False, "eos_token_id": None}
ALTERNATING = ["sliding_attention", "full_attention"] * 2
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "sliding_window": WINDOW, "layer_types": ALTERNATING, "query_pre_attn_scalar": 32,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "sliding_window": WINDOW, "layer_types": ALTERNATING, "query_pre_attn_scalar": 32,
        "rope_local_base_freq": 1000.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
}
# logits of a few units: float32's rounding stays well inside the tolerance (Mistral,
# without Gemma's norms after each half-layer, grows its hidden states faster)
WEIGHT_STD = {"gemma2": 0.15, "gemma3": 0.15, "mistral": 0.1}
SPLITS = {2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}
PROMPTS = {"shorter": 7, "equal": WINDOW, "longer": 2 * WINDOW + 3}  # prompt tokens
END = 2 * WINDOW + 10  # tokens in each sequence: the shorter prompts decode across the edge
TOLERANCE = 1e-5
STEP_S = 0.01  # what a stage's step takes, in virtual time (the batcher waits by it)


def reference_model(family: str, window: int = WINDOW) -> Any:
    config_name, model_name, extra = FAMILIES[family]
    return random_reference(config_name, model_name,
                            {**SHAPE, **extra, "sliding_window": window},
                            gemma=family.startswith("gemma"), weight_std=WEIGHT_STD[family])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Checkpoint]:
    name = request.param
    model = reference_model(name)
    directory = tmp_path_factory.mktemp(name)
    model.save_pretrained(directory)  # as a user would have it: transformers' own files
    return name, model, Checkpoint(directory)


def sequence(length: int, seed: int) -> list[int]:
    ids = torch.randint(1, VOCAB, (length,),
                        generator=torch.Generator().manual_seed(seed))
    return [int(i) for i in ids]


def expected_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' logits (T, vocab) at every position of ``ids``, one forward."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # type: ignore[no-any-return]


def stages(checkpoint: Checkpoint, n: int, **spec: Any) -> list[Stage]:
    return [Stage.load(checkpoint, StageSpec(a, b, max_context_tokens=64, **spec))
            for a, b in SPLITS[n]]


def step_logits(chain: list[Stage], session: str, ids: list[int], prompt: int) -> torch.Tensor:
    """Prefill ``ids[:prompt]``, then decode the rest one token at a time: the logits
    (len(ids) - prompt + 1, vocab) of the prompt's last token and of every decoded one."""
    x: Any = ids[:prompt]
    for stage in chain:
        x = stage.prefill(session, x)
    rows = [x[-1]]
    for token in ids[prompt:]:
        x = [token]
        for stage in chain:
            x = stage.decode(session, x)
        rows.append(x[-1])
    for stage in chain:
        stage.end_session(session)
    return torch.stack(rows)


def test_the_window_rule_is_transformers_for_every_family() -> None:
    """The families' configs read as the rule above: which layers slide, how far, and
    Gemma 2's caps and score scale."""
    for name, (config_name, _, extra) in FAMILIES.items():
        hf = getattr(transformers, config_name)(**SHAPE, **extra).to_dict()
        c = ModelConfig.from_hf(json.loads(json.dumps(hf)))
        assert c.sliding_window == WINDOW
        slides = (True,) * 4 if name == "mistral" else (True, False, True, False)
        assert c.sliding_layers == slides, name
        if name == "gemma2":
            assert (c.attn_softcap, c.final_softcap) == (50.0, 30.0)
            assert c.attn_scale == pytest.approx(32 ** -0.5)


def test_a_sliding_layers_mask_is_transformers_mask_at_and_past_the_edge() -> None:
    """Which keys each query sees, for the views a sliding layer's cache hands over: the
    whole sequence, a decode step as the cache fills, and the ring's views past the edge
    (keys counted back from the end), against transformers' mask at the same absolute
    positions. Gemma 2 takes it as booleans (its capped scores), the others as 0 / -inf."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    rule = sliding_window_causal_mask_function(WINDOW)
    # (new tokens T, keys in the view L, absolute position after the last key)
    views = [(40, 40, 40), *((1, n, n) for n in range(1, WINDOW + 3)),
             (1, WINDOW, 40), (5, WINDOW - 1 + 5, 40), (WINDOW + 3, 2 * WINDOW + 2, 40)]
    for name, (config_name, _, extra) in FAMILIES.items():
        config = ModelConfig.from_hf(getattr(transformers, config_name)(**SHAPE, **extra)
                                     .to_dict())
        attention = Attention(config, 0)
        assert attention.window == WINDOW and (attention.softcap is not None) == (
            name == "gemma2")
        for T, L, end in views:
            mask = attention._mask(T, L, torch.zeros(1, 1, T, 8), None)
            seen = mask if mask.dtype == torch.bool else mask == 0
            query_pos = torch.arange(end - T, end)[:, None]
            key_pos = torch.arange(end - L, end)[None, :]
            assert torch.equal(seen, rule(0, 0, query_pos, key_pos)), (name, T, L, end)


@pytest.mark.parametrize("n_stages", sorted(SPLITS))
def test_decoding_across_the_window_equals_transformers_at_every_step(
        family: tuple[str, Any, Checkpoint], n_stages: int) -> None:
    name, model, checkpoint = family
    chain = stages(checkpoint, n_stages, prefill_chunk_tokens=5)  # chunks cross the edge too
    worst = 0.0
    for seed, (case, prompt) in enumerate(PROMPTS.items()):
        ids = sequence(END, seed)
        want = expected_logits(model, ids)[prompt - 1:]
        got = step_logits(chain, case, ids, prompt)
        assert got.shape == want.shape
        diff = (got - want).abs().amax(dim=-1)
        assert diff.max().item() <= TOLERANCE, (
            name, n_stages, case, f"first step off: position {prompt - 1 + int(diff.argmax())}",
            diff.max().item())
        worst = max(worst, diff.max().item())
    print(f"{name} over {n_stages} stages: max |logit difference| {worst:.2e}")


def test_the_comparison_tells_a_window_one_key_wider_or_narrower_apart(
        family: tuple[str, Any, Checkpoint]) -> None:
    """The same weights with a window of 15 or 17 give logits well past the tolerance
    once a query has more than 15 keys behind it: the tests above would see an edge
    off by one."""
    name, model, _ = family
    ids = sequence(END, 0)
    exact = expected_logits(model, ids)
    for window in (WINDOW - 1, WINDOW + 1):
        other = reference_model(name, window)
        other.load_state_dict(model.state_dict())
        moved = (expected_logits(other, ids) - exact).abs().amax(dim=-1)
        inside, past = min(window, WINDOW), max(window, WINDOW)
        assert moved[:inside].max().item() <= TOLERANCE  # inside both windows: the same
        assert moved[past:].min().item() > 100 * TOLERANCE, (name, window)


@pytest.mark.parametrize("n_stages", sorted(SPLITS))
async def test_two_sessions_in_one_decode_batch_equal_transformers(
        family: tuple[str, Any, Checkpoint], n_stages: int, autojump_clock: object) -> None:
    """The batched decode path: serving's batcher at each stage, running
    ``Stage.decode_batch`` over the steps that meet there. A session inside the window and
    one past it decode together, each at its own position, across the edge."""
    name, model, checkpoint = family
    chain = stages(checkpoint, n_stages, max_sessions=2)
    Step = tuple[str, torch.Tensor, int]  # session, its input row, its position

    def batcher(stage: Stage) -> DecodeBatcher[Step, torch.Tensor]:
        async def one(step: Step) -> torch.Tensor:
            await trio.sleep(STEP_S)
            return stage.decode(step[0], step[1], step[2])[0]

        async def many(steps: Sequence[Step]) -> list[torch.Tensor]:
            await trio.sleep(STEP_S)
            out = stage.decode_batch([s for s, _, _ in steps],
                                     torch.cat([x for _, x, _ in steps]), [p for _, _, p in steps])
            return list(out)

        return DecodeBatcher(one, many)

    batchers = [batcher(stage) for stage in chain]
    prompts = {"short": PROMPTS["shorter"], "long": PROMPTS["equal"] + 4}
    ids = {s: sequence(END, 10 + i) for i, s in enumerate(prompts)}
    steps = END - max(prompts.values())
    got: dict[str, list[torch.Tensor]] = {}

    async def session(s: str) -> None:
        x: Any = ids[s][:prompts[s]]
        for stage in chain:
            x = stage.prefill(s, x)
        got[s] = [x[-1]]
        for position in range(prompts[s], prompts[s] + steps):
            row = torch.tensor([ids[s][position]])
            for b in batchers:
                row = (await b.step((s, row, position), s)).unsqueeze(0)
            got[s].append(row[0])

    async with trio.open_nursery() as nursery:
        for s in prompts:
            nursery.start_soon(session, s)
    for b in batchers:  # the two sessions stepped together: the batcher merged most steps
        paired = b.steps - b.batches  # batches that held both sessions' steps
        assert b.steps == 2 * steps and paired >= steps // 2, (b.batches, b.steps)
    worst = 0.0
    for s, prompt in prompts.items():
        rows = torch.stack(got[s])
        want = expected_logits(model, ids[s])[prompt - 1:prompt + steps]
        diff = (rows - want).abs().amax(dim=-1)
        assert diff.max().item() <= TOLERANCE, (name, n_stages, s, diff.max().item())
        worst = max(worst, diff.max().item())
    print(f"{name} batched over {n_stages} stages: max |logit difference| {worst:.2e}")


def test_greedy_generation_equals_transformers_generate(
        family: tuple[str, Any, Checkpoint]) -> None:
    """The issue's walk: an 8-token prompt, 24 greedy tokens over 2 stages, against
    transformers' own cached ``generate``."""
    _, model, checkpoint = family
    prompt = sequence(8, 7)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    run = LocalPipeline(stages(checkpoint, 2)).generate(
        prompt, 24, Sampler.greedy(), stop_token_ids=(), keep_logits=True)
    assert list(run.token_ids) == out.sequences[0, len(prompt):].tolist()
    theirs = torch.stack([step[0] for step in out.logits]).float()
    ours = torch.stack([logits.reshape(-1) for logits in run.logits])
    assert (ours - theirs).abs().max().item() <= TOLERANCE



def _as_stored(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """What a cache of ``kv_dtype`` gives back for ``x``: rounded to its dtype, or int8 with
    one scale per vector."""
    if kv_dtype != "int8":
        return x.to(getattr(torch, kv_dtype)).float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-30)
    return torch.round(x / scale).clamp(-127, 127) * scale


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "int8"])
def test_a_ring_rounds_new_keys_through_storage_as_the_in_place_path_does(kv_dtype: str) -> None:
    # Before the window's edge a step reads its own key back from the cache (rounded to
    # the cache's dtype); past the edge it used the unrounded one: a step at the edge
    # then saw itself at another precision than the step before.
    from p2pswarm.runtime.kv_cache import KVCache

    torch.manual_seed(0)
    window, steps = 4, 10
    cache = KVCache(num_layers=1, num_kv_heads=2, head_dim=8, max_context_tokens=64,
                    max_sessions=1, kv_dtype=kv_dtype, compute_dtype=torch.float32,
                    layer_windows=[window])
    cache.open("s")
    view = cache.view("s")
    keys = torch.randn(1, 2, steps, 8)
    values = torch.randn(1, 2, steps, 8)
    for pos in range(steps):
        seen_k, seen_v = view.update(0, keys[:, :, pos:pos + 1], values[:, :, pos:pos + 1], pos)
        first = max(0, pos - window + 1)
        want_k = _as_stored(keys[:, :, first:pos + 1], kv_dtype)
        want_v = _as_stored(values[:, :, first:pos + 1], kv_dtype)
        torch.testing.assert_close(seen_k, want_k, rtol=0, atol=1e-6, msg=f"keys at {pos}")
        torch.testing.assert_close(seen_v, want_v, rtol=0, atol=1e-6, msg=f"values at {pos}")
