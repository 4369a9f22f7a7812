"""The stage host: pipelines equal one process, KV cache, memory claims, frames, sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.errors import ConfigError, PlacementError, RemoteProtocolError
from p2pswarm.models import Checkpoint, ModelConfig, hf_tensor_map, save_checkpoint
from p2pswarm.models.llama import hf_tensor_shape
from p2pswarm.runtime import (
    LocalPipeline,
    Sampler,
    Stage,
    StageSpec,
    decode_tensor,
    encode_tensor,
    stage_memory,
)
from p2pswarm.runtime.frame import DTYPE_CODES
from p2pswarm.runtime.sampler import position_seed

# untied, grouped-query, 6 layers: big enough for three stages of two
HF = {"model_type": "llama", "vocab_size": 120, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
      "bos_token_id": 1, "eos_token_id": 2}
SPLIT = [(0, 2), (2, 4), (4, 6)]
CHUNK = 16
PROMPT = [1, *range(10, 50)]  # 41 tokens: three prefill chunks of 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    config = ModelConfig.from_hf(HF)
    generator = torch.Generator().manual_seed(3)
    tensors = []
    for name in hf_tensor_map(config, 0, config.num_layers):
        shape = hf_tensor_shape(config, name)
        noise = torch.randn(shape, generator=generator)
        tensors.append((name, 1 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise))
    return Checkpoint(save_checkpoint(HF, tensors, tmp_path_factory.mktemp("model"),
                                      max_shard_bytes=100_000))


def stages(source: object, split: list[tuple[int, int]], **spec: object) -> list[Stage]:
    options = {"max_context_tokens": 128, "prefill_chunk_tokens": CHUNK, **spec}
    return [Stage.load(source, StageSpec(a, b, **options)) for a, b in split]  # type: ignore


# --- the pipeline equals one process -------------------------------------------------------


@pytest.mark.parametrize("model", ["checkpoint", "tiny-llama"])
def test_three_stages_equal_one(model: str, checkpoint: Checkpoint) -> None:
    source: object = checkpoint if model == "checkpoint" else model
    n = checkpoint.config.num_layers if model == "checkpoint" else 8
    split = SPLIT if model == "checkpoint" else [(0, 3), (3, 5), (5, 8)]
    one = LocalPipeline(stages(source, [(0, n)]))
    three = LocalPipeline(stages(source, split))
    a = one.generate(PROMPT, 24, Sampler.greedy(), stop_token_ids=(), keep_logits=True)
    b = three.generate(PROMPT, 24, Sampler.greedy(), stop_token_ids=(), keep_logits=True)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    if model == "checkpoint":
        assert len(set(a.token_ids)) > 3  # the model says something, not one token over
    for x, y in zip(a.logits, b.logits):
        assert (x - y).abs().max().item() <= 1e-5
    assert len(b.stage_s) == 3


def test_decode_with_cache_equals_recomputing_everything(checkpoint: Checkpoint) -> None:
    pipeline = LocalPipeline(stages(checkpoint, SPLIT))
    generation = pipeline.generate(PROMPT, 12, Sampler.greedy(), stop_token_ids=(),
                                   keep_logits=True)
    sequence = PROMPT + list(generation.token_ids[:-1])
    # no cache at all: the whole sequence in one forward pass of a one-stage model
    whole = stages(checkpoint, [(0, 6)], prefill_chunk_tokens=1024)[0]
    full = whole.prefill("fresh", sequence, all_logits=True)
    # a different order of float32 sums, so equal up to rounding: 1e-5 absolute + relative
    for step, logits in enumerate(generation.logits):
        torch.testing.assert_close(full[len(PROMPT) - 1 + step], logits, atol=1e-5, rtol=1e-5)


def test_chunk_size_does_not_change_logits(checkpoint: Checkpoint) -> None:
    reference = stages(checkpoint, [(0, 6)], prefill_chunk_tokens=1024)[0]
    expected = reference.prefill("s", PROMPT, all_logits=True)
    for chunk in (1, 7, 40):
        stage = stages(checkpoint, [(0, 6)], prefill_chunk_tokens=chunk)[0]
        got = stage.prefill("s", PROMPT, all_logits=True)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        last = stages(checkpoint, [(0, 6)], prefill_chunk_tokens=chunk)[0].prefill("s", PROMPT)
        assert last.shape == (1, 120)
        torch.testing.assert_close(last[0], expected[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype,tolerance", [("float16", 0.01), ("bfloat16", 0.05),
                                                ("int8", 0.05)])
def test_reduced_precision_kv_cache_stays_close(checkpoint: Checkpoint, kv_dtype: str,
                                                tolerance: float) -> None:
    exact = stages(checkpoint, [(0, 6)])[0]
    lossy = stages(checkpoint, [(0, 6)], kv_dtype=kv_dtype)[0]
    exact.prefill("s", PROMPT)
    lossy.prefill("s", PROMPT)
    for token in (5, 6, 7):
        a, b = exact.decode("s", token), lossy.decode("s", token)
        assert (a - b).norm() / a.norm() < tolerance


def test_sessions_are_separate(checkpoint: Checkpoint) -> None:
    [stage] = stages(checkpoint, [(0, 6)], max_sessions=2)
    alone = stages(checkpoint, [(0, 6)])[0].prefill("x", PROMPT, all_logits=True)
    stage.prefill("a", [1, 99, 98, 97])
    interleaved = torch.cat([stage.prefill("b", PROMPT[:20], all_logits=True),
                             stage.prefill("b", PROMPT[20:], all_logits=True)])
    stage.decode("a", 3)
    torch.testing.assert_close(interleaved, alone, atol=1e-5, rtol=1e-5)
    assert stage.session_length("a") == 5 and stage.session_length("b") == len(PROMPT)


# --- what a stage refuses ------------------------------------------------------------------


def test_stage_refuses_out_of_order_or_misshapen_input(checkpoint: Checkpoint) -> None:
    first, middle, _ = stages(checkpoint, SPLIT)
    hidden = first.prefill("s", PROMPT[:5])
    assert hidden.shape == (5, 64)
    with pytest.raises(RemoteProtocolError, match="position"):
        first.prefill("s", [3], positions=4)  # the session continues at 5
    with pytest.raises(RemoteProtocolError, match="position"):
        first.decode("s", 3, position=torch.tensor([6]))
    with pytest.raises(RemoteProtocolError, match="position"):
        middle.prefill("new", hidden, positions=2)
    first.decode("s", 3, position=5)
    with pytest.raises(RemoteProtocolError):
        first.prefill("s", torch.zeros(2, 64))  # hidden states to the first stage
    with pytest.raises(RemoteProtocolError):
        first.prefill("s", [500])  # outside the vocabulary
    with pytest.raises(RemoteProtocolError):
        middle.prefill("s", torch.zeros(2, 65))
    with pytest.raises(RemoteProtocolError):
        middle.decode("s", torch.zeros(2, 64))


def test_stage_capacity(checkpoint: Checkpoint) -> None:
    [stage] = stages(checkpoint, [(0, 6)], max_sessions=1, max_context_tokens=48)
    stage.prefill("a", PROMPT)
    with pytest.raises(PlacementError, match="session slots"):
        stage.prefill("b", [1])
    with pytest.raises(PlacementError, match="48"):
        stage.prefill("a", list(range(10)))
    stage.end_session("a")
    stage.prefill("b", [1, 2])  # the slot is free again
    pipeline = LocalPipeline([stages(checkpoint, [(0, 6)], max_context_tokens=48)[0]])
    with pytest.raises(PlacementError, match="context"):
        pipeline.generate(PROMPT, 20, Sampler.greedy())
    with pytest.raises(PlacementError):
        Stage.load(checkpoint, StageSpec(0, 6, max_context_tokens=10_000))


def test_pipeline_refuses_stages_that_do_not_chain(checkpoint: Checkpoint) -> None:
    a, b, c = stages(checkpoint, SPLIT)
    with pytest.raises(ConfigError):
        LocalPipeline([a, c])
    with pytest.raises(ConfigError):
        LocalPipeline([b, c])
    with pytest.raises(ConfigError):
        LocalPipeline([])


def test_stops_at_a_stop_token_and_frees_the_session(checkpoint: Checkpoint) -> None:
    pipeline = LocalPipeline(stages(checkpoint, SPLIT))
    free_run = pipeline.generate(PROMPT, 10, Sampler.greedy(), stop_token_ids=())
    stop = free_run.token_ids[3]
    stopped = pipeline.generate(PROMPT, 10, Sampler.greedy(), stop_token_ids=[stop])
    assert stopped.token_ids == free_run.token_ids[:free_run.token_ids.index(stop) + 1]
    assert stopped.stop_reason == "stop_token" and free_run.stop_reason == "max_tokens"
    assert all(not s.sessions for s in pipeline.stages)
    seen: list[int] = []
    pipeline.generate(PROMPT, 5, Sampler.greedy(), stop_token_ids=(), on_token=seen.append)
    assert tuple(seen) == free_run.token_ids[:5]


# --- memory: what a stage holds is what the plan claims ------------------------------------

SPECS = [
    {},
    {"dtype": "bfloat16", "kv_dtype": "bfloat16", "max_sessions": 3},
    {"quant": "int8", "kv_dtype": "int8", "max_context_tokens": 100},
    {"quant": "int4", "quant_group_size": 32, "dtype": "float16", "kv_dtype": "float16"},
    {"quant": "int4", "quant_group_size": 64, "max_sessions": 2},
]


@pytest.mark.parametrize("spec", range(len(SPECS)))
@pytest.mark.parametrize("model", ["tiny-llama", "checkpoint"])
def test_allocated_bytes_match_the_accounting(spec: int, model: str,
                                              checkpoint: Checkpoint) -> None:
    source: object = checkpoint if model == "checkpoint" else model
    split = SPLIT + [(0, 6)] if model == "checkpoint" else [(0, 3), (3, 5), (5, 8), (0, 8)]
    for stage in stages(source, split, **SPECS[spec]):
        claim = stage_memory(stage.config, stage.spec)
        assert stage.allocated_bytes() == claim.total_bytes, (stage.start_layer, SPECS[spec])
        assert claim.kv_cache_bytes > 0 and claim.weights_bytes > 0
        stage.unload()
        assert stage.allocated_bytes() == 0 and not stage.loaded
        with pytest.raises(PlacementError, match="unloaded"):
            stage.prefill("s", [1])


def test_accounting_formula_by_hand() -> None:
    [stage] = stages("tiny-llama", [(5, 8)], kv_dtype="int8", max_context_tokens=64,
                     quant="int8")
    claim = stage_memory(stage.config, stage.spec)
    h, q, kv, i, v = 256, 256, 128, 768, 259
    # fbgemm's packed int8: inputs round up to 512 (768 to 1024), then 12 bytes a row
    linears = (512 * (q + 2 * kv + h + 2 * i) + 1024 * h) + 12 * (q + 2 * kv + h + 2 * i + h)
    assert claim.weights_bytes == 3 * (linears + 2 * h * 4)
    # final norm, the tied head's own copy of the embedding, RoPE, the dequant workspace
    assert claim.embeddings_head_buffers_bytes == h * 4 + v * h * 4 + 32 * 4 + i * h * 4
    assert claim.kv_cache_bytes == 2 * 3 * 1 * 2 * 64 * (64 + 4)


# --- tensor frames -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5), (1, 3, 4), (2, 0, 3)])
def test_frames_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.randn(shape) * 50).to(dtype)
    back = decode_tensor(bytes(encode_tensor(t)))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_frames_from_non_contiguous_tensors_and_zero_copy_decode() -> None:
    t = torch.arange(24, dtype=torch.float32).view(4, 6).t()
    frame = encode_tensor(t)
    assert len(frame) % 8 == 0
    back = decode_tensor(frame)  # a bytearray: shared, not copied
    assert torch.equal(back, t)
    frame[-4:] = torch.tensor([-1.0]).view(torch.uint8).tolist()
    assert back[-1, -1].item() == -1.0
    copied = decode_tensor(bytes(frame))  # immutable bytes: copied once
    assert torch.equal(copied, back)


def test_frames_reject_malformed_input() -> None:
    good = bytes(encode_tensor(torch.ones(2, 3)))
    bad = {
        "empty": b"",
        "short header": good[:3],
        "version": bytes([2]) + good[1:],
        "dtype": good[:1] + bytes([99]) + good[2:],
        "ndim": good[:2] + bytes([9]) + good[3:],
        "reserved": good[:3] + bytes([1]) + good[4:],
        "padding": good[:12] + bytes([1]) + good[13:],
        "truncated": good[:-1],
        "trailing": good + b"\x00",
        "shape": good[:4] + (7).to_bytes(4, "little") + good[8:],
    }
    for name, frame in bad.items():
        with pytest.raises(RemoteProtocolError):
            decode_tensor(frame)
        assert name


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_frames_decode_or_refuse_any_bytes(data: bytes) -> None:
    try:
        decode_tensor(data)
    except RemoteProtocolError:
        pass


def test_frames_refuse_unsendable_tensors() -> None:
    from p2pswarm.errors import LocalProtocolError

    with pytest.raises(LocalProtocolError):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))


# --- sampling ------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 3.0, -1.0])
    assert Sampler.greedy().sample(logits) == 1
    assert Sampler(temperature=1.0, top_k=1, seed=9).sample(logits.unsqueeze(0)) == 1
    assert Sampler(temperature=1.0, top_p=1e-6, seed=9).sample(torch.tensor([0.0, 2.0])) == 1


def test_sampling_is_deterministic_for_a_seed() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))

    def draw(sampler: Sampler) -> list[int]:
        return [sampler.sample(logits) for _ in range(40)]

    first = draw(Sampler(temperature=0.8, top_k=20, top_p=0.9, seed=7))
    assert first == draw(Sampler(temperature=0.8, top_k=20, top_p=0.9, seed=7))
    assert first != draw(Sampler(temperature=0.8, top_k=20, top_p=0.9, seed=8))
    again = Sampler(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    draw(again)
    again.reset()
    assert draw(again) == first
    assert len(set(first)) > 3


def test_a_draw_at_a_position_depends_on_the_seed_and_the_position_only() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(temperature=1.0, seed=7)
    along = [sampler.sample(logits, position) for position in range(100, 140)]
    # drawn again in another order, after other draws, by another sampler: the same
    fresh = Sampler(temperature=1.0, seed=7)
    fresh.sample(logits)
    assert [fresh.sample(logits, p) for p in reversed(range(100, 140))] == along[::-1]
    assert len(set(along)) > 3
    assert along != [Sampler(temperature=1.0, seed=8).sample(logits, p)
                     for p in range(100, 140)]
    assert position_seed(7, 100) != position_seed(7, 101) != position_seed(8, 100)
    with pytest.raises(ValueError):
        position_seed(7, -1)


def test_a_sampled_generation_resumed_from_its_tokens_draws_what_it_would_have(
        checkpoint: Checkpoint) -> None:
    """What a failover does: a new session replays the prompt and the tokens drawn so far,
    and a new sampler at the last stage draws the rest."""
    pipeline = LocalPipeline(stages(checkpoint, SPLIT))

    def sampled() -> Sampler:
        return Sampler(temperature=1.0, top_k=40, seed=11)

    whole = pipeline.generate(PROMPT, 12, sampled(), stop_token_ids=()).token_ids
    assert len(set(whole)) > 3
    for cut in (1, 9):
        rest = pipeline.generate(PROMPT + list(whole[:cut]), 12 - cut, sampled(),
                                 stop_token_ids=()).token_ids
        assert whole[:cut] + rest == whole


def test_top_k_and_top_p_bound_the_choices() -> None:
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0, -2.0])
    top_k = Sampler(temperature=2.0, top_k=3, seed=1)
    assert {top_k.sample(logits) for _ in range(300)} == {0, 1, 2}
    # softmax mass: 0.66, 0.24, 0.09, ...: top_p 0.8 keeps exactly the first two
    top_p = Sampler(temperature=1.0, top_p=0.8, seed=1)
    assert {top_p.sample(logits) for _ in range(300)} == {0, 1}


def test_sampler_refuses_bad_settings() -> None:
    for bad in ({"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ConfigError):
            Sampler(**bad)  # type: ignore[arg-type]


def test_pipeline_sampling_is_deterministic(checkpoint: Checkpoint) -> None:
    pipeline = LocalPipeline(stages(checkpoint, SPLIT))

    def run(seed: int) -> tuple[int, ...]:
        sampler = Sampler(temperature=1.0, top_p=0.95, seed=seed)
        return pipeline.generate(PROMPT, 12, sampler, stop_token_ids=()).token_ids

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_stage_spec_refuses_bad_values() -> None:
    for bad in ({"dtype": "float64"}, {"kv_dtype": "int4"}, {"quant": "int2"},
                {"max_sessions": 0}, {"prefill_chunk_tokens": 0}):
        with pytest.raises(ConfigError):
            StageSpec(0, 1, **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        StageSpec(3, 1)


def test_stage_loads_from_a_directory_path(checkpoint: Checkpoint, tmp_path: Path) -> None:
    by_path = Stage.from_checkpoint(checkpoint.model_dir, StageSpec(0, 2, max_context_tokens=64))
    by_source = Stage.load(checkpoint, StageSpec(0, 2, max_context_tokens=64))
    assert torch.equal(by_path.prefill("s", PROMPT), by_source.prefill("s", PROMPT))
    builtin = Stage.from_builtin("tiny-llama", StageSpec(0, 8, max_context_tokens=64))
    assert builtin.is_first and builtin.is_last
    assert builtin.prefill("s", [256, 72, 105]).shape == (1, 259)


@pytest.mark.parametrize("quant,group", [("int8", 32), ("int4", 32)])
def test_quantized_three_stages_equal_one_quantized_process(quant: str, group: int,
                                                            checkpoint: Checkpoint) -> None:
    """The packed kernels see the same rows whether a stage holds 2 layers or 6: the same
    greedy tokens and logits (prefill in chunks of 16 unpacks 4-bit weights; decode runs
    the packed kernels), and in the batched decode a pipeline runs."""
    options = {"quant": quant, "quant_group_size": group}
    one = LocalPipeline(stages(checkpoint, [(0, 6)], **options))
    three = LocalPipeline(stages(checkpoint, SPLIT, **options))
    a = one.generate(PROMPT, 24, Sampler.greedy(), stop_token_ids=(), keep_logits=True)
    b = three.generate(PROMPT, 24, Sampler.greedy(), stop_token_ids=(), keep_logits=True)
    assert a.token_ids == b.token_ids and len(set(a.token_ids)) > 3
    for x, y in zip(a.logits, b.logits):
        assert (x - y).abs().max().item() <= 1e-4
    # two sessions decoded in one batch (the pipeline's batched decode) equal each alone
    spec = StageSpec(0, 6, max_context_tokens=128, prefill_chunk_tokens=CHUNK,
                     max_sessions=2, quant=quant, quant_group_size=group)
    both, alone = Stage.load(checkpoint, spec), Stage.load(checkpoint, spec)
    prompts = {"a": PROMPT[:20], "b": PROMPT[5:30]}
    first = [int(both.prefill(s, p).argmax()) for s, p in prompts.items()]
    batched = both.decode_batch(list(prompts), torch.tensor(first), [20, 25])
    for i, (s, p) in enumerate(prompts.items()):
        alone.prefill(s, p)
        single = alone.decode(s, torch.tensor([first[i]]))
        assert (single[-1] - batched[i]).abs().max().item() <= 1e-4
