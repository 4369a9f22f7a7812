"""Qwen3, Gemma 2, Gemma 3, Phi-3 and sliding-window Mistral equal transformers.

Each family: a small random model made by transformers itself, saved as a checkpoint,
loaded as three stages, and compared logit for logit (1e-5), once as a whole forward
pass and once through the stage host's KV cache (chunked prefill, then decode) over a
prompt several times longer than the sliding window, which is where a window's mask and
its ring of cached keys matter. What each stage allocates is what the accounting claims.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from p2pswarm.models import Checkpoint, ModelConfig, load_stage_model, save_checkpoint
from p2pswarm.runtime import LocalPipeline, Sampler, Stage, StageSpec, stage_memory

transformers = pytest.importorskip("transformers", reason="transformers is a test extra")

from tests.reference_models import random_reference  # noqa: E402 (needs transformers)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 7,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
WINDOW = 6
SPLIT = [(0, 2), (2, 5), (5, 7)]
PROMPT = [1, *range(3, 40)]  # 38 tokens: six windows

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "sliding_window": WINDOW, "query_pre_attn_scalar": 12, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "sliding_window": WINDOW, "query_pre_attn_scalar": 8, "rope_theta": 50000.0,
        "rope_local_base_freq": 1000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": WINDOW, "pad_token_id": 0,
                                               "eos_token_id": 2, "bos_token_id": 1}),
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
}


def reference_model(family: str) -> Any:
    config_name, model_name, extra = FAMILIES[family]
    return random_reference(config_name, model_name, {**SHAPE, **extra},
                            gemma=family.startswith("gemma"), weight_std=0.2)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Checkpoint]:
    name = request.param
    model = reference_model(name)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    directory = tmp_path_factory.mktemp(name)
    save_checkpoint(model.config.to_dict(), list(state.items()), directory,
                    max_shard_bytes=40_000)
    return name, model, Checkpoint(directory)


def test_the_config_reads_as_its_family(family: tuple[str, Any, Checkpoint]) -> None:
    name, _, checkpoint = family
    c = checkpoint.config
    sliding = sum(c.sliding_layers)
    assert sliding == {"qwen3": 0, "gemma2": 4, "gemma3": 6, "phi3": 7,
                       "mistral-sliding": 7}[name]
    assert c.qk_norm == (name in ("qwen3", "gemma3"))
    assert c.sandwich_norms == name.startswith("gemma")
    assert ModelConfig.from_hf(c.to_hf()) == c


def test_stages_equal_transformers_over_a_whole_sequence(
        family: tuple[str, Any, Checkpoint]) -> None:
    _, reference, checkpoint = family
    stages = [load_stage_model(checkpoint, a, b) for a, b in SPLIT]
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 30),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        h = ids
        for stage in stages:
            h = stage(h)
    assert h.shape == expected.shape
    assert (h - expected).abs().max().item() <= 1e-5


def test_cached_decoding_equals_transformers(family: tuple[str, Any, Checkpoint]) -> None:
    _, reference, checkpoint = family
    spec = {"max_context_tokens": 64, "prefill_chunk_tokens": 5}
    pipeline = LocalPipeline([Stage.load(checkpoint, StageSpec(a, b, **spec))  # type: ignore[arg-type]
                              for a, b in SPLIT])
    run = pipeline.generate(PROMPT, 8, Sampler.greedy(), stop_token_ids=(), keep_logits=True)
    sequence = torch.tensor([PROMPT + list(run.token_ids[:-1])])
    with torch.no_grad():
        expected = reference(sequence).logits[0, len(PROMPT) - 1:]
    got = torch.stack([logits.reshape(-1) for logits in run.logits])
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5


def test_allocated_bytes_match_the_accounting(family: tuple[str, Any, Checkpoint]) -> None:
    name, _, checkpoint = family
    # int8 weights and cache, two sessions, a context ten windows long
    options = {"max_context_tokens": 64, "kv_dtype": "int8", "quant": "int8",
               "max_sessions": 2}
    for a, b in SPLIT:
        stage = Stage.load(checkpoint, StageSpec(a, b, **options))  # type: ignore[arg-type]
        claim = stage_memory(stage.config, stage.spec)
        assert stage.allocated_bytes() == claim.total_bytes, (name, a, b)
    if name in ("phi3", "mistral-sliding"):  # every layer keeps just the window
        full = stage_memory(checkpoint.config, StageSpec(0, 7, max_context_tokens=64))
        assert full.kv_cache_bytes == 7 * 2 * 2 * WINDOW * 8 * 4
        short = stage_memory(checkpoint.config, StageSpec(0, 7, max_context_tokens=4))
        assert short.kv_cache_bytes == 7 * 2 * 2 * 4 * 8 * 4  # a context inside the window


def test_an_exported_model_reads_back_the_same(family: tuple[str, Any, Checkpoint],
                                               tmp_path: Path) -> None:
    from p2pswarm.training.export import export_hf

    _, _, checkpoint = family
    stages = [load_stage_model(checkpoint, a, b) for a, b in SPLIT]
    export_hf(stages, checkpoint.hf_config, tmp_path)  # Phi-3's linears fused again
    again = Checkpoint(tmp_path)
    assert set(again.tensor_names()) == set(checkpoint.tensor_names())
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        h = ids
        for stage in stages:
            h = stage(h)
        assert torch.equal(load_stage_model(again, 0, 7)(ids), h)
